"""The plan file: what to run, as chosen by ``gpipe plan`` and run by ``gpipe train``.

A versioned JSON document. It is validated when loaded, so a hand-edited plan fails with one line
naming the bad field before any process starts. ``precision`` (:mod:`sim.precision`) is what the
prediction assumed and what ``gpipe train --plan`` trains at; plans without one are fp32.

Example::

    {"version": 1,
     "model": {"name": "transformer", "options": {"layers": 4, "d_model": 64},
               "num_layers": 6, "parameter_count": 123456},
     "partition": [3, 3], "batch_size": 32, "microbatches": 8,
     "checkpoint": "except_last", "schedule": "gpipe", "optimizer": "adamw", "precision": "bf16",
     "hardware": {"system": "cpu", "nodes": 1},
     "predicted": {"step_time_s": 0.12, "bubble_fraction": 0.11}}
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from sim.errors import GpipeInputError, require_positive
from sim.optimizers import DEFAULT_OPTIMIZER, check_optimizer, optimizer_slots
from sim.placement import DEFAULT_PLACEMENT, check_placement
from sim.precision import DEFAULT_PRECISION, check_precision
from sim.schedule import check_checkpoint_policy, check_schedule_name
from sim.timeline import read_json, write_json_atomic

PLAN_VERSION = 1


@dataclass(frozen=True)
class ModelRef:
    """Which model: a built-in name (``mlp``, ``transformer``...) or ``package.module:factory``."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    num_layers: int = 0
    parameter_count: int = 0


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    partition: tuple[int, ...]  # layers per (virtual) stage, in model order: V*K entries
    batch_size: int  # rows per mini-batch (one optimizer step)
    microbatches: int
    checkpoint: str = "except_last"
    schedule: str = "gpipe"
    optimizer: str = DEFAULT_OPTIMIZER  # what gpipe train trains with; its state is in the memory
    hardware: dict[str, Any] = field(default_factory=lambda: {"system": "cpu", "nodes": 1})
    predicted: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    precision: str = DEFAULT_PRECISION
    replicas: int = 1  # D data-parallel copies of the pipeline; batch_size is the global batch
    virtual_stages: int = 1  # V chunks per device (the interleaved schedule); 1 otherwise
    zero: int = 0  # 1: optimizer state sharded over each stage's data-parallel group
    placement: str = DEFAULT_PLACEMENT  # sim.placement: which device runs which replica's stage
    tensor_parallel: int = 1  # T devices of one node per stage (sim.tensor_parallel)
    sequence_parallel: bool = False  # with T > 1: norms and dropout split along the sequence
    context_parallel: int = 1  # C more devices of the node per stage, each sequence split over them
    dp_overlap: bool = False  # timed with the data-parallel reduction inside the last backward (Megatron's)

    @property
    def stages(self) -> int:
        """K, devices in one pipeline: the partition has V chunks per device."""
        return len(self.partition) // self.virtual_stages

    def __post_init__(self) -> None:
        validate_partition(self.partition, self.model.num_layers)
        require_positive("replicas (D)", self.replicas, "use --replicas 1 or more")
        require_positive("virtual stages (V)", self.virtual_stages, "use --virtual-stages 1 or more")
        require_positive("tensor_parallel (T)", self.tensor_parallel, "use --tensor-parallel 1 or more")
        require_positive("context_parallel (C)", self.context_parallel, "use --context-parallel 1 or more")
        if not isinstance(self.dp_overlap, bool):
            raise GpipeInputError(f"dp_overlap must be true or false, got {self.dp_overlap!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise GpipeInputError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if len(self.partition) % self.virtual_stages:
            raise GpipeInputError(f"partition has {len(self.partition)} entries, not a multiple of "
                                  f"--virtual-stages {self.virtual_stages}; give V x K entries")
        if self.zero not in (0, 1):
            raise GpipeInputError(f"zero must be 0 or 1, got {self.zero!r}")
        check_placement(self.placement)
        require_positive("batch size", self.batch_size, "use --batch 1 or more")
        require_positive("micro-batches (M)", self.microbatches, "use --microbatches 1 or more")
        check_checkpoint_policy(self.checkpoint)
        check_schedule_name(self.schedule)
        check_optimizer(self.optimizer)
        check_precision(self.precision)
        slots = self.model.options.get("optimizer_slots")
        if slots is not None and slots != optimizer_slots(self.optimizer):
            raise GpipeInputError(
                f"plan's optimizer {self.optimizer} keeps {optimizer_slots(self.optimizer)} state tensors per "
                f"parameter but its model options say optimizer_slots={slots}; re-create it with gpipe plan "
                f"--optimizer {self.optimizer} --out")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["partition"] = list(self.partition)
        return data


def validate_partition(partition: tuple[int, ...] | list[int], num_layers: int) -> tuple[int, ...]:
    """Check that ``partition`` gives every stage at least one layer and covers ``num_layers``."""
    parts = tuple(partition)
    if not parts:
        raise GpipeInputError("partition is empty; give layers per stage, e.g. --partition 3,5")
    if any(isinstance(p, bool) or not isinstance(p, int) or p <= 0 for p in parts):
        raise GpipeInputError(f"partition {list(parts)} has a stage with no layers; every entry must be >= 1")
    if num_layers and sum(parts) != num_layers:
        raise GpipeInputError(
            f"partition {','.join(map(str, parts))} sums to {sum(parts)} layers but the model has "
            f"{num_layers}; make the entries add up to {num_layers}"
        )
    return parts


def parse_partition(text: str) -> tuple[int, ...]:
    """Parse ``"3,5"`` into ``(3, 5)`` with a one-line error for anything else."""
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise GpipeInputError(f"bad partition {text!r}; expected layers per stage like 3,5") from None


def plan_from_dict(data: Any) -> Plan:
    if not isinstance(data, dict):
        raise GpipeInputError("plan must be a JSON object; write one with gpipe plan --out plan.json")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise GpipeInputError(f"plan version {version!r} is not supported; this gpipe reads version "
                              f"{PLAN_VERSION} (re-create it with gpipe plan --out)")
    missing = [k for k in ("model", "partition", "batch_size", "microbatches") if k not in data]
    if missing:
        raise GpipeInputError(f"plan is missing {', '.join(missing)}; re-create it with gpipe plan --out")
    model = data["model"]
    if not isinstance(model, dict) or not isinstance(model.get("name"), str):
        raise GpipeInputError("plan's model must be an object with a 'name'")
    try:
        return Plan(
            model=ModelRef(name=model["name"], options=dict(model.get("options", {})),
                           num_layers=int(model.get("num_layers", 0)),
                           parameter_count=int(model.get("parameter_count", 0))),
            partition=tuple(data["partition"]),
            batch_size=data["batch_size"],
            microbatches=data["microbatches"],
            checkpoint=data.get("checkpoint", "except_last"),
            schedule=data.get("schedule", "gpipe"),
            optimizer=data.get("optimizer", DEFAULT_OPTIMIZER),
            hardware=dict(data.get("hardware", {"system": "cpu", "nodes": 1})),
            predicted=dict(data.get("predicted", {})),
            version=version,
            precision=data.get("precision", DEFAULT_PRECISION),
            replicas=data.get("replicas", 1),
            virtual_stages=data.get("virtual_stages", 1),
            zero=data.get("zero", 0),
            placement=data.get("placement", DEFAULT_PLACEMENT),
            tensor_parallel=data.get("tensor_parallel", 1),
            sequence_parallel=data.get("sequence_parallel", False),
            context_parallel=data.get("context_parallel", 1),
            dp_overlap=data.get("dp_overlap", False),
        )
    except TypeError as exc:
        raise GpipeInputError(f"plan has a field of the wrong type ({exc})") from None


def load_plan(path: str | os.PathLike[str]) -> Plan:
    return plan_from_dict(read_json(path, "plan file", "write one with gpipe plan --out"))


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    write_json_atomic(path, plan.to_dict())
