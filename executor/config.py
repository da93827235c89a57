"""What one training run needs, in one JSON-serialisable dataclass shared by the CLI and workers.

``gpipe train`` turns its flags (or a plan file) into a :class:`RunConfig`, validates it, writes it
to a file and passes the path to every torchrun worker, so all ranks read identical settings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from sim.engine.placement import DEFAULT_PLACEMENT
from sim.errors import GpipeInputError, require_positive
from sim.formats.layout import LAYOUT_KEYS, ParallelLayout, flat_layout
from sim.formats.plan import ModelRef, Plan
from sim.schedules.microbatch import split_rows
from sim.workloads.optimizers import DEFAULT_OPTIMIZER
from sim.workloads.precision import DEFAULT_PRECISION, check_precision
from sim.schedules.schedule import (MULTI_CHUNK_SCHEDULES, PRICED_ONLY_POLICIES, check_interleaving,
                                    check_split_backward, check_v_schedule, check_virtual_stages)
from sim.formats.timeline import write_json_atomic

# options a plan's model may carry that describe the simulator's analysis, not the torch model
ANALYSIS_OPTIONS = ("dtype", "precision", "optimizer_slots", "optimizer", "input_shape")

if TYPE_CHECKING:
    from executor.runtime.optim import OptimSettings

DEVICES = ("cpu", "cuda")


TRANSPORTS = ("auto", "dist")


@dataclass
class RunConfig:
    model: str
    options: dict[str, Any] = field(default_factory=dict)
    partition: tuple[int, ...] = ()
    batch_size: int = 32
    seed: int = 0
    loss: str = ""  # "" = the model's default
    optimizer: str = DEFAULT_OPTIMIZER  # sgd | adam | adamw (torch.optim); see executor.runtime.optim
    lr: float = 0.01  # peak learning rate
    weight_decay: float = 0.0  # torch.optim's: L2 for sgd and adam, decoupled for adamw
    clip_grad_norm: float | None = None  # max L2 norm over all stages' gradients; None: no clipping
    lr_schedule: str = "constant"  # constant | cosine (to 0 over ``steps``)
    lr_warmup_steps: int = 0  # linear warm-up steps before the schedule
    data: str = ""  # "" synthetic; "text" or "text:PATH" byte-level text; package.module:function
    init: str = "factory"  # first values: factory (factory()'s, after manual_seed(seed)) or meta (seeded per layer)
    init_from: str = ""  # state dict, safetensors file or model folder to start from (overrides init)
    factory_weights: str = ""  # set by gpipe train: the folder it wrote factory()'s values to on this node
    steps: int = 10
    warmup_steps: int = 1  # steps left out of step_time_s
    report: str = ""
    trace: str = ""
    save_every: int = 0
    checkpoint_dir: str = ""
    resume: bool = False
    device: str = "cpu"
    threads: int = 0  # torch threads per worker; 0 = cores / processes on this node
    timeout_s: float = 300.0  # process-group timeout: a stuck receive fails after this
    hardware: dict[str, Any] = field(default_factory=lambda: {"system": "cpu", "nodes": 1})
    predicted: dict[str, Any] = field(default_factory=dict)
    precision: str = DEFAULT_PRECISION  # fp32, or bf16: autocast compute, fp32 weights (executor.runtime.precision)
    # D, K, V, T, E, M, schedule, policy, ZeRO, placement: the record the planner and the simulator take; its K
    # is the partition's length over V (:meth:`of` builds both from flat keys, as the run's file spells them)
    layout: ParallelLayout = field(default_factory=lambda: ParallelLayout(1, 4))
    transport: str = "auto"  # stage messages: auto (shared memory between CPU ranks of one host), or dist (gloo/NCCL)
    progress: bool = False  # set by gpipe train: the reporting rank draws a bar over the steps (a terminal watches)
    quiet: bool = False  # no per-step loss lines; the final line only

    @classmethod
    def of(cls, model: str, partition: Sequence[int] = (), **settings: Any) -> "RunConfig":
        """A run from flat keys, the layout's (:data:`sim.formats.layout.LAYOUT_KEYS`: ``microbatches``,
        ``replicas``, ``zero``...) among the others, as ``gpipe train``'s flags and the run's file spell
        them; its K is ``partition``'s length over V. A bad degree is one line."""
        degrees = {key: settings.pop(key) for key in LAYOUT_KEYS if key in settings}
        degrees.setdefault("microbatches", 4)
        layout = ParallelLayout.for_partition(tuple(partition), **degrees)
        return cls(model=model, partition=tuple(partition), layout=layout, **settings)

    @property
    def stages(self) -> int:
        """K, processes in one pipeline."""
        return self.layout.stages

    @property
    def world_size(self) -> int:
        """D x K x T ranks."""
        return self.layout.replicas * self.stages * self.layout.tensor_parallel

    def validate(self) -> "RunConfig":
        require_positive("steps", self.steps, "use --steps 1 or more")
        if self.partition and self.layout.virtual_stage_count != len(self.partition):
            raise GpipeInputError(f"partition has {len(self.partition)} entries but the layout has K={self.stages} x "
                                  f"V={self.layout.virtual_stages} chunks; give V x K entries")
        self.optim_settings().validate()
        if self.device not in DEVICES:
            raise GpipeInputError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.save_every < 0:
            raise GpipeInputError(f"--save-every must be 0 (off) or positive, got {self.save_every}")
        if (self.save_every or self.resume) and not self.checkpoint_dir:
            raise GpipeInputError("--save-every and --resume need --checkpoint-dir DIR")
        check_precision(self.precision, trained=True)
        if self.transport not in TRANSPORTS:
            raise GpipeInputError(f"unknown --transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")
        from executor.models.initial_weights import check_init

        check_init(self.init)
        if self.layout.checkpoint in PRICED_ONLY_POLICIES:
            raise GpipeInputError(f"--checkpoint {self.layout.checkpoint} (torchtitan's op-level policy) is priced by "
                                  "gpipe simulate for planning, not trained here; use selective, full or never")
        if self.layout.checkpoint == "selective" and self.model != "transformer":
            raise GpipeInputError(f"--checkpoint selective recomputes the attention core of the built-in transformer "
                                  f"only, not {self.model}; use full (every layer recomputed) or never")
        if self.model == "transformer" and self.options.get("attention") == "fused":
            raise GpipeInputError("attention=fused is Megatron-LM's fused softmax kernel, a planning option: the "
                                  "executor trains attention=eager (the same arithmetic) or attention=flash")
        if self.model == "transformer" and self.options.get("compile"):
            raise GpipeInputError("compile=true prices torch.compile's fused elementwise regions, a planning option: "
                                  "the executor trains eager kernels (drop compile)")
        from executor.parallel.replicas import check_data_parallel

        check_data_parallel(self)
        self.check_virtual_stages()
        check_tensor_parallel(self.layout.tensor_parallel, self.layout.zero, self.layout.sequence_parallel)
        from executor.parallel.expert_checks import check_expert_parallel

        check_expert_parallel(self)
        return self

    def check_virtual_stages(self) -> None:
        """The multi-chunk schedules' needs, in one line each: V only with them (2 in a V), V*K chunks
        at most one per layer, and M as executed (``torch.chunk`` may make fewer micro-batches than
        asked) a multiple of K under the interleaved schedule, at least 2K under dualpipev."""
        check_virtual_stages(self.layout.schedule, self.layout.virtual_stages)
        check_split_backward(self.layout.schedule, self.layout.checkpoint)
        if self.layout.schedule not in MULTI_CHUNK_SCHEDULES or not self.partition:
            return
        if len(self.partition) % self.layout.virtual_stages:
            raise GpipeInputError(f"partition has {len(self.partition)} entries, not a multiple of "
                                  f"--virtual-stages {self.layout.virtual_stages}; give V x K entries")
        stages = self.stages
        if self.layout.schedule != "interleaved":
            for executed in self.executed_microbatches:
                check_v_schedule(self.layout.schedule, stages, executed)
            return
        for rows, executed in zip(split_rows(self.batch_size, self.layout.replicas), self.executed_microbatches):
            if executed != self.layout.microbatches and executed % stages and self.layout.microbatches % stages == 0:
                size = -(-rows // self.layout.microbatches)
                share = f"--batch {self.batch_size}" if self.layout.replicas == 1 else f"a replica's {rows} rows"
                raise GpipeInputError(f"{share} splits into {executed} micro-batches of up to {size} rows, not the "
                                      f"{self.layout.microbatches} asked, and the interleaved schedule needs a multiple of "
                                      f"K={stages}; use --batch {self.layout.replicas * self.layout.microbatches * size}")
            check_interleaving(stages, executed, self.layout.virtual_stages, sum(self.partition))

    @property
    def executed_microbatches(self) -> list[int]:
        """M as run by each replica: ``torch.chunk`` makes fewer micro-batches than asked when a
        replica's share of the batch is small."""
        return [len(split_rows(rows, self.layout.microbatches)) for rows in split_rows(self.batch_size, self.layout.replicas)]

    def optim_settings(self) -> "OptimSettings":
        from executor.runtime.optim import OptimSettings

        return OptimSettings(optimizer=self.optimizer, lr=self.lr, weight_decay=self.weight_decay,
                             clip_grad_norm=self.clip_grad_norm, lr_schedule=self.lr_schedule,
                             lr_warmup_steps=self.lr_warmup_steps, total_steps=self.steps)

    def plan(self, model_ref: ModelRef) -> Plan:
        return Plan(model=model_ref, partition=tuple(self.partition), batch_size=self.batch_size, layout=self.layout,
                    hardware=self.hardware, predicted=self.predicted, optimizer=self.optimizer,
                    precision=self.precision)

    @classmethod
    def from_plan(cls, plan: Plan, **overrides: Any) -> "RunConfig":
        """The plan's run (its optimizer too) with ``overrides``; the options that only told the
        simulator how to analyse the model (its dtype, optimizer state, sample shape) are not the
        model's and are dropped; the precision is the plan's own field."""
        if plan.layout.context_parallel > 1:
            raise GpipeInputError(f"the plan splits each sequence over {plan.layout.context_parallel} devices "
                                  "(context_parallel), which gpipe train does not run; plan again without "
                                  "--context-parallel for a plan it trains")
        options = dict(plan.model.options)
        for name in ANALYSIS_OPTIONS:
            options.pop(name, None)
        settings: dict[str, Any] = dict(optimizer=plan.optimizer)
        settings.update(overrides)
        layout = plan.layout
        if layout.tensor_parallel == 1 and layout.sequence_parallel:
            layout = replace(layout, sequence_parallel=False)
        return cls(model=plan.model.name, options=options, partition=tuple(plan.partition),
                   batch_size=plan.batch_size, layout=layout, hardware=dict(plan.hardware),
                   predicted=dict(plan.predicted), **{"precision": plan.precision, **settings})

    def to_dict(self) -> dict[str, Any]:
        """The run's file: flat keys, the layout's beside the others (:meth:`from_dict` reads them back)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "layout"}
        data["partition"] = list(self.partition)
        data.update(flat_layout(self.layout))
        return json.loads(json.dumps(data))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in fields(cls)} | set(LAYOUT_KEYS)
        return cls.of(**{k: v for k, v in data.items() if k in known and k != "layout"})

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "RunConfig":
        with open(path) as handle:
            return cls.from_dict(json.load(handle))


def check_tensor_parallel(parts: int, zero: int, sequence_parallel: bool = False) -> None:
    """What a run with T = ``parts`` needs of its settings, before any work; one line each."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise GpipeInputError(f"--tensor-parallel {parts!r} is not a positive integer; use 1 (none) or more")
    if sequence_parallel and parts == 1:
        raise GpipeInputError("--sequence-parallel splits the sequence over a stage's tensor-parallel ranks; add "
                              "--tensor-parallel 2 or more, or drop --sequence-parallel")
    if parts == 1:
        return
    if zero == 1:
        raise GpipeInputError(f"--tensor-parallel {parts} with --zero 1 is not supported yet; use --zero 2 or 3 "
                              "(FSDP over the replicas of each tensor-parallel rank), drop --zero or use "
                              "--tensor-parallel 1")
