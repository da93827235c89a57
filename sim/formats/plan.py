"""The plan file: what to run, as chosen by ``gpipe plan`` and run by ``gpipe train``.

A versioned JSON document. It is validated when loaded, so a hand-edited plan fails with one line
naming the bad field before any process starts. ``precision`` (:mod:`sim.workloads.precision`) is what the
prediction assumed and what ``gpipe train --plan`` trains at; plans without one are fp32.

A plan priced with measured costs (``gpipe plan --costs FILE``) records that file (``costs``: the
path as given, its absolute path, the sha256 of its bytes), so ``gpipe simulate --plan`` prices it
with the same numbers or says in one line that the file is missing or changed; plans without
``costs`` were priced with the catalog. ``hardware`` holds the system, its nodes and any efficiency
the plan was priced at (``--efficiency``, ``--efficiency-from``). Both are optional fields of
version 1, so older plan files load as before.

Example::

    {"version": 1,
     "model": {"name": "transformer", "options": {"layers": 4, "d_model": 64},
               "num_layers": 6, "parameter_count": 123456},
     "partition": [3, 3], "batch_size": 32, "microbatches": 8,
     "checkpoint": "except_last", "schedule": "gpipe", "optimizer": "adamw", "precision": "bf16",
     "hardware": {"system": "cpu", "nodes": 1},
     "costs": {"path": "out/costs.json", "absolute_path": "/home/me/out/costs.json", "sha256": "9f2c..."},
     "predicted": {"step_time_s": 0.12, "bubble_fraction": 0.11}}
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import asdict, dataclass, field
from collections.abc import Sequence
from typing import Any

from sim.errors import GpipeInputError, require_positive
from sim.formats.layout import LAYOUT_KEYS, ParallelLayout, check_chunked_partition, flat_layout
from sim.formats.timeline import read_json, write_json_atomic
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, check_optimizer, optimizer_slots
from sim.workloads.precision import DEFAULT_PRECISION, check_precision

PLAN_VERSION = 1  # its optional fields (costs, hardware's efficiencies) keep it 1: files without them load


@dataclass(frozen=True)
class CostsRef:
    """The costs file a plan was priced with: without it, the plan cannot be re-predicted."""

    path: str  # as given to gpipe plan --costs
    absolute_path: str
    sha256: str  # of the file's bytes


def costs_ref(path: str | os.PathLike[str]) -> CostsRef:
    return CostsRef(path=str(path), absolute_path=os.path.abspath(path), sha256=file_sha256(path))


def file_sha256(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def recorded_costs_path(ref: CostsRef, what: str, fix: str) -> str:
    """Where the costs file ``ref`` names is now, with the bytes it was priced with: its absolute
    path, else its path as given (from the current directory, for a plan moved with its costs).
    Missing or changed, one line naming it, then ``fix`` with ``{path}`` filled in."""
    found = [p for p in dict.fromkeys((ref.absolute_path, ref.path)) if os.path.isfile(p)]
    for path in found:
        if file_sha256(path) == ref.sha256:
            return path
    if not found:
        raise GpipeInputError(f"{what} was priced with costs file {ref.path} ({ref.absolute_path}), which is "
                              f"missing; {fix.replace('{path}', 'FILE')}")
    now = file_sha256(found[0])
    raise GpipeInputError(f"costs file {found[0]} changed since {what} was priced with it (sha256 "
                          f"{ref.sha256[:12]}..., now {now[:12]}...); {fix.replace('{path}', ref.path)}")


@dataclass(frozen=True)
class ModelRef:
    """Which model: a built-in name (``mlp``, ``transformer``...) or ``package.module:factory``."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    num_layers: int = 0
    parameter_count: int = 0


@dataclass(frozen=True)
class Plan:
    """What to run: the model, its partition, the batch and the parallel layout, with what it was priced on.

    The layout is the one record every part takes (:class:`sim.formats.layout.ParallelLayout`); the file
    spells its degrees as flat keys beside the partition (:data:`sim.formats.layout.LAYOUT_KEYS`), as
    plans have always been written."""

    model: ModelRef
    partition: tuple[int, ...]  # layers per (virtual) stage, in model order: V*K entries
    batch_size: int  # rows per mini-batch (one optimizer step); with D replicas, the global batch
    layout: ParallelLayout  # D, K, V, T, C, E, M, schedule, policy, ZeRO, placement; its K is the partition's over V
    optimizer: str = DEFAULT_OPTIMIZER  # what gpipe train trains with; its state is in the memory
    # system, nodes; efficiency, bandwidth_efficiency and efficiency_from (a CostsRef's fields) where given
    hardware: dict[str, Any] = field(default_factory=lambda: {"system": "cpu", "nodes": 1})
    predicted: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    precision: str = DEFAULT_PRECISION
    dp_overlap: bool = False  # timed with the data-parallel reduction inside the last backward (Megatron's)
    costs: CostsRef | None = None  # the measured costs it was priced with; None: the catalog's models

    @classmethod
    def of(cls, model: ModelRef, partition: Sequence[int], batch_size: int, **settings: Any) -> Plan:
        """A plan from flat keys as its file spells them, the layout's (:data:`sim.formats.layout.LAYOUT_KEYS`)
        among the others; the layout's K is ``partition``'s length over V. A bad value is one line."""
        partition = validate_partition(tuple(partition), model.num_layers)
        degrees = {key: settings.pop(key) for key in LAYOUT_KEYS if key in settings}
        return cls(model, partition, batch_size, ParallelLayout.for_partition(partition, **degrees), **settings)

    def __post_init__(self) -> None:
        validate_partition(self.partition, self.model.num_layers)
        if not isinstance(self.layout, ParallelLayout):
            raise GpipeInputError(f"plan's layout must be a ParallelLayout, got {type(self.layout).__name__}")
        check_chunked_partition(self.partition, self.layout.virtual_stages)
        if self.layout.virtual_stage_count != len(self.partition):
            raise GpipeInputError(f"partition has {len(self.partition)} entries but the layout has K={self.layout.stages} "
                                  f"x V={self.layout.virtual_stages} chunks; give V x K entries")
        if not isinstance(self.dp_overlap, bool):
            raise GpipeInputError(f"dp_overlap must be true or false, got {self.dp_overlap!r}")
        check_hardware(self.hardware)
        require_positive("batch size", self.batch_size, "use --batch 1 or more")
        check_optimizer(self.optimizer)
        check_precision(self.precision)
        slots = self.model.options.get("optimizer_slots")
        if slots is not None and slots != optimizer_slots(self.optimizer):
            raise GpipeInputError(
                f"plan's optimizer {self.optimizer} keeps {optimizer_slots(self.optimizer)} state tensors per "
                f"parameter but its model options say optimizer_slots={slots}; re-create it with gpipe plan "
                f"--optimizer {self.optimizer} --out")

    def to_dict(self) -> dict[str, Any]:
        """The file's keys, in the order plans have always been written; the optional ones (HSDP's shard
        group, the gradient sync, E, ETP) only where set, so plans without them read as before."""
        layout = flat_layout(self.layout)
        data: dict[str, Any] = {"model": asdict(self.model), "partition": list(self.partition),
                                "batch_size": self.batch_size}
        data.update({k: layout.pop(k) for k in ("microbatches", "checkpoint", "schedule")})
        data.update(optimizer=self.optimizer, hardware=self.hardware, predicted=self.predicted, version=self.version,
                    precision=self.precision)
        data.update({k: layout.pop(k) for k in ("replicas", "virtual_stages", "zero", "placement", "tensor_parallel",
                                                "sequence_parallel", "context_parallel")})
        data.update(dp_overlap=self.dp_overlap, costs=asdict(self.costs) if self.costs is not None else None)
        optional_defaults = {"shard_group": None, "gradient_sync": None, "expert_parallel": 1,
                             "expert_tensor_parallel": None}
        data.update({k: v for k, v in layout.items() if v != optional_defaults[k]})
        return data


def check_hardware(hardware: dict[str, Any]) -> None:
    """One line for a plan's hardware whose nodes or efficiencies could not be what it was priced at."""
    nodes = hardware.get("nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise GpipeInputError(f"plan's hardware nodes {nodes!r} is not a count of nodes; re-create it with "
                              "gpipe plan --out")
    for name in ("efficiency", "bandwidth_efficiency"):
        value = hardware.get(name)
        # up to 1.5 as sim.planner.whatif.with_efficiency: a roofline fit may put a CPU above its nominal peak
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not (math.isfinite(value) and 0.0 < value <= 1.5)):
            raise GpipeInputError(f"plan's hardware {name} {value!r} is not a fraction of peak; re-create it "
                                  "with gpipe plan --out")
    costs_ref_from_dict(hardware.get("efficiency_from"), "hardware efficiency_from")


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
        model_ref = ModelRef(name=model["name"], options=dict(model.get("options", {})),
                             num_layers=int(model.get("num_layers", 0)),
                             parameter_count=int(model.get("parameter_count", 0)))
        return Plan.of(
            model_ref, tuple(data["partition"]), data["batch_size"],
            **{key: data[key] for key in LAYOUT_KEYS if key in data},
            optimizer=data.get("optimizer", DEFAULT_OPTIMIZER),
            hardware=dict(data.get("hardware", {"system": "cpu", "nodes": 1})),
            predicted=dict(data.get("predicted", {})),
            version=version,
            precision=data.get("precision", DEFAULT_PRECISION),
            dp_overlap=data.get("dp_overlap", False),
            costs=costs_ref_from_dict(data.get("costs"), "costs"),
        )
    except TypeError as exc:
        raise GpipeInputError(f"plan has a field of the wrong type ({exc})") from None


def costs_ref_from_dict(data: Any, field_name: str) -> CostsRef | None:
    """A plan's recorded costs file (None: priced without one), checked field by field."""
    if data is None:
        return None
    keys = ("path", "absolute_path", "sha256")
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) and data[k] for k in keys):
        raise GpipeInputError(f"plan's {field_name} must be an object with path, absolute_path and sha256; "
                              "re-create it with gpipe plan --out")
    return CostsRef(**{k: data[k] for k in keys})


def load_plan(path: str | os.PathLike[str]) -> Plan:
    return plan_from_dict(read_json(path, "plan file", "write one with gpipe plan --out"))


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    write_json_atomic(path, plan.to_dict())
