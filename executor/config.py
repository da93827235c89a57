"""What one training run needs, in one JSON-serialisable dataclass shared by the CLI and workers.

``gpipe train`` turns its flags (or a plan file) into a :class:`RunConfig`, validates it, writes it
to a file and passes the path to every torchrun worker, so all ranks read identical settings.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from sim.engine.placement import DEFAULT_PLACEMENT
from sim.errors import GpipeInputError, require_positive
from sim.formats.layout import ParallelLayout
from sim.formats.plan import ModelRef, Plan
from sim.schedules.microbatch import split_rows
from sim.workloads.optimizers import DEFAULT_OPTIMIZER
from sim.workloads.precision import DEFAULT_PRECISION, check_precision
from sim.schedules.schedule import (MULTI_CHUNK_SCHEDULES, check_interleaving, check_split_backward, check_v_schedule,
                                    check_virtual_stages)
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
    microbatches: int = 4
    schedule: str = "gpipe"
    checkpoint: str = "except_last"
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
    replicas: int = 1  # D data-parallel copies of the pipeline; batch_size is the global batch
    virtual_stages: int = 1  # V chunks per device (interleaved schedule); partition has V*K entries
    zero: int = 0  # sharded over each stage's data-parallel group: 1 optimizer state, 2 and gradients, 3 and parameters
    shard_group: int | None = None  # ZeRO-2/3 within groups of this many replicas (HSDP); None: all of them
    gradient_sync: str | None = None  # ZeRO-2/3: "step" or "microbatch" reduce-scatter; None: the trainers' default
    placement: str = DEFAULT_PLACEMENT  # sim.engine.placement: which rank runs which replica's stage
    tensor_parallel: int = 1  # T ranks per stage, each layer split over them (executor.parallel.tensor_parallel)
    sequence_parallel: bool = False  # with T > 1: norms and the residual stream split along the sequence
    expert_parallel: int = 1  # E: each stage's routed experts sharded over E of its replicas (expert_parallel.py)
    expert_tensor_parallel: int | None = None  # each expert's own T; None: T (the only value trained)
    transport: str = "auto"  # stage messages: auto (shared memory between CPU ranks of one host), or dist (gloo/NCCL)
    progress: bool = False  # set by gpipe train: the reporting rank draws a bar over the steps (a terminal watches)
    quiet: bool = False  # no per-step loss lines; the final line only

    @property
    def stages(self) -> int:
        """K, processes in one pipeline."""
        return len(self.partition) // max(1, self.virtual_stages)

    @property
    def layout(self) -> ParallelLayout:
        """The run's parallel layout, the record the planner and the simulator take (its partition
        beside it); refused in one line where a degree is bad."""
        return ParallelLayout(self.stages, self.microbatches, self.checkpoint, self.schedule, self.replicas,
                              self.virtual_stages, self.zero, self.placement, self.tensor_parallel,
                              self.sequence_parallel, shard_group=self.shard_group,
                              gradient_sync=self.gradient_sync, expert_parallel=self.expert_parallel,
                              expert_tensor_parallel=self.expert_tensor_parallel)

    @property
    def world_size(self) -> int:
        """D x K x T ranks."""
        return self.replicas * self.stages * self.tensor_parallel

    def validate(self) -> "RunConfig":
        require_positive("steps", self.steps, "use --steps 1 or more")
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
        if self.checkpoint == "selective" and self.model != "transformer":
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
        check_tensor_parallel(self.tensor_parallel, self.zero, self.sequence_parallel)
        from executor.parallel.expert_checks import check_expert_parallel

        check_expert_parallel(self)
        return self

    def check_virtual_stages(self) -> None:
        """The multi-chunk schedules' needs, in one line each: V only with them (2 in a V), V*K chunks
        at most one per layer, and M as executed (``torch.chunk`` may make fewer micro-batches than
        asked) a multiple of K under the interleaved schedule, at least 2K under dualpipev."""
        check_virtual_stages(self.schedule, self.virtual_stages)
        check_split_backward(self.schedule, self.checkpoint)
        if self.schedule not in MULTI_CHUNK_SCHEDULES or not self.partition:
            return
        if len(self.partition) % self.virtual_stages:
            raise GpipeInputError(f"partition has {len(self.partition)} entries, not a multiple of "
                                  f"--virtual-stages {self.virtual_stages}; give V x K entries")
        stages = self.stages
        if self.schedule != "interleaved":
            for executed in self.executed_microbatches:
                check_v_schedule(self.schedule, stages, executed)
            return
        for rows, executed in zip(split_rows(self.batch_size, self.replicas), self.executed_microbatches):
            if executed != self.microbatches and executed % stages and self.microbatches % stages == 0:
                size = -(-rows // self.microbatches)
                share = f"--batch {self.batch_size}" if self.replicas == 1 else f"a replica's {rows} rows"
                raise GpipeInputError(f"{share} splits into {executed} micro-batches of up to {size} rows, not the "
                                      f"{self.microbatches} asked, and the interleaved schedule needs a multiple of "
                                      f"K={stages}; use --batch {self.replicas * self.microbatches * size}")
            check_interleaving(stages, executed, self.virtual_stages, sum(self.partition))

    @property
    def executed_microbatches(self) -> list[int]:
        """M as run by each replica: ``torch.chunk`` makes fewer micro-batches than asked when a
        replica's share of the batch is small."""
        return [len(split_rows(rows, self.microbatches)) for rows in split_rows(self.batch_size, self.replicas)]

    def optim_settings(self) -> "OptimSettings":
        from executor.runtime.optim import OptimSettings

        return OptimSettings(optimizer=self.optimizer, lr=self.lr, weight_decay=self.weight_decay,
                             clip_grad_norm=self.clip_grad_norm, lr_schedule=self.lr_schedule,
                             lr_warmup_steps=self.lr_warmup_steps, total_steps=self.steps)

    def plan(self, model_ref: ModelRef) -> Plan:
        return Plan(model=model_ref, partition=tuple(self.partition), batch_size=self.batch_size,
                    microbatches=self.microbatches, checkpoint=self.checkpoint, schedule=self.schedule,
                    hardware=self.hardware, predicted=self.predicted, optimizer=self.optimizer,
                    precision=self.precision, replicas=self.replicas, virtual_stages=self.virtual_stages,
                    zero=self.zero, placement=self.placement, tensor_parallel=self.tensor_parallel,
                    sequence_parallel=self.sequence_parallel, shard_group=self.shard_group,
                    gradient_sync=self.gradient_sync, expert_parallel=self.expert_parallel,
                    expert_tensor_parallel=self.expert_tensor_parallel)

    @classmethod
    def from_plan(cls, plan: Plan, **overrides: Any) -> "RunConfig":
        """The plan's run (its optimizer too) with ``overrides``; the options that only told the
        simulator how to analyse the model (its dtype, optimizer state, sample shape) are not the
        model's and are dropped; the precision is the plan's own field."""
        if plan.context_parallel > 1:
            raise GpipeInputError(f"the plan splits each sequence over {plan.context_parallel} devices "
                                  "(context_parallel), which gpipe train does not run; plan again without "
                                  "--context-parallel for a plan it trains")
        options = dict(plan.model.options)
        for name in ANALYSIS_OPTIONS:
            options.pop(name, None)
        settings: dict[str, Any] = dict(optimizer=plan.optimizer)
        settings.update(overrides)
        return cls(model=plan.model.name, options=options, partition=tuple(plan.partition),
                   batch_size=plan.batch_size, microbatches=plan.microbatches, schedule=plan.schedule,
                   checkpoint=plan.checkpoint, hardware=dict(plan.hardware),
                   predicted=dict(plan.predicted),
                   **{"precision": plan.precision, "replicas": plan.replicas,
                      "virtual_stages": plan.virtual_stages, "zero": plan.zero, "shard_group": plan.shard_group,
                      "gradient_sync": plan.gradient_sync, "expert_parallel": plan.expert_parallel,
                      "expert_tensor_parallel": plan.expert_tensor_parallel,
                      "placement": plan.placement,
                      "tensor_parallel": plan.tensor_parallel,
                      "sequence_parallel": plan.sequence_parallel and plan.tensor_parallel > 1,
                      **settings})

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["partition"] = list(self.partition)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in data.items() if k in known})
        config.partition = tuple(config.partition)
        return config

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
