"""The parallel layout: how one training step is spread over devices, named once.

Every part that decides, prices or runs a layout reads the same record: the planner's candidates
(:mod:`sim.planner.search`), the engine's :func:`sim.engine.engine.simulate`, and the plan file
(:class:`sim.formats.plan.Plan.layout`). Like torchtitan's ``ParallelDims``, it names the degrees
once and refuses a bad one where it is built, in one line (:class:`sim.errors.GpipeInputError`).

The degrees: D replicas (data parallel), K stages (pipeline), V chunks per device (virtual stages),
T devices per stage splitting each layer (tensor parallel, with or without sequence parallelism) and
C more per stage splitting each sequence (context parallel). M is the micro-batches asked for (a
batch torch.chunk splits into fewer runs fewer). The partition (layers per virtual stage) is not part
of it: it depends on the model, and sits beside the layout where a record has one.

Limits: the record checks each degree and the pairs that are always wrong (ZeRO without replicas, V
against the schedule); whether the layout fits a system, a model or a batch is checked where those
are known (:func:`sim.engine.engine.check_layout`, the partitioners).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from sim.engine.placement import DEFAULT_PLACEMENT, check_placement
from sim.errors import GpipeInputError, require_positive
from sim.schedules.schedule import check_checkpoint_policy, check_schedule_name, check_virtual_stages


def _require_count(name: str, value: object, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GpipeInputError(f"{name} must be a positive integer, got {value!r}; {hint}")


@dataclass(frozen=True)
class ParallelLayout:
    """D replicas of a K-stage pipeline, V chunks per device, T x C devices per stage; M micro-batches
    on one schedule and checkpoint policy; ZeRO and where the replicas' devices sit."""

    stages: int  # K: devices of one pipeline (of T x C devices each)
    microbatches: int  # M as asked (torch.chunk may make fewer)
    checkpoint: str = "except_last"
    schedule: str = "gpipe"
    replicas: int = 1  # D
    virtual_stages: int = 1  # V chunks per device (the multi-chunk schedules); 1 otherwise
    zero: int = 0  # sharded over each stage's data-parallel group: 1 optimizer state, 2 and gradients, 3 and parameters
    placement: str = DEFAULT_PLACEMENT  # sim.engine.placement: which device runs which replica's stage
    tensor_parallel: int = 1  # T devices of one node per stage (sim.workloads.tensor_parallel)
    sequence_parallel: bool = False  # with T > 1: norms and dropout split along the sequence
    context_parallel: int = 1  # C more devices of the node per stage, each sequence split over them
    shard_group: int | None = None  # ZeRO-2/3 over groups of this many replicas, replicated across them (HSDP)
    gradient_sync: str | None = None  # ZeRO-2/3: "step" or "microbatch" reduce-scatter; None: the trainers' default
    expert_parallel: int = 1  # E: each MoE layer's routed experts split over E ranks of the T x C x D group
    expert_tensor_parallel: int | None = None  # ETP: the experts' own TP degree; None: T (Megatron-Core's default)

    def __post_init__(self) -> None:
        require_positive("stages (K)", self.stages, "use --stages 1 or more")
        require_positive("micro-batches (M)", self.microbatches, "use --microbatches 1 or more")
        check_checkpoint_policy(self.checkpoint)
        check_schedule_name(self.schedule)
        _require_count("replicas (D)", self.replicas, "use --replicas 1 or more")
        require_positive("virtual stages (V)", self.virtual_stages, "use --virtual-stages 1 or more")
        check_virtual_stages(self.schedule, self.virtual_stages)
        check_sharding(self.zero, self.replicas, self.shard_group)
        check_gradient_sync(self.gradient_sync, self.zero)
        check_placement(self.placement)
        require_positive("tensor_parallel (T)", self.tensor_parallel, "use --tensor-parallel 1 or more")
        if not isinstance(self.sequence_parallel, bool):
            raise GpipeInputError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        require_positive("context_parallel (C)", self.context_parallel, "use --context-parallel 1 or more")
        check_expert_grid(self.expert_parallel, self.expert_tensor_parallel, self.tensor_parallel,
                          self.context_parallel, self.replicas)
        check_expert_sharding(self.zero, self.expert_parallel, self.shard_group, self.replicas)

    @classmethod
    def for_partition(cls, partition: Sequence[int], microbatches: int, checkpoint: str = "except_last",
                      schedule: str = "gpipe", **degrees: object) -> ParallelLayout:
        """The layout whose K is what ``partition`` (V x K entries) spreads over: its length over V."""
        virtual_stages = degrees.get("virtual_stages", 1)
        require_positive("virtual stages (V)", virtual_stages, "use --virtual-stages 1 or more")
        check_chunked_partition(partition, virtual_stages)
        return cls(max(len(partition) // virtual_stages, 1), microbatches, checkpoint, schedule, **degrees)

    @property
    def shard_ranks(self) -> int:
        """The data-parallel ranks one stage's sharded state is split over: the shard group (HSDP),
        else all D replicas; 1 without ZeRO."""
        if not self.zero:
            return 1
        return self.shard_group or self.replicas

    @property
    def resolved_gradient_sync(self) -> str:
        """When ZeRO-2/3 reduce-scatters the gradients (:data:`GRADIENT_SYNCS`): as given, else the
        trainers' default, ``microbatch`` without a pipeline (FSDP2, DeepSpeed) and ``step`` with one
        (torch's pipeline schedules, torchtitan). Below ZeRO-2 ``step``: whole replicas and ZeRO-1
        reduce their gradients once per step, after the last backward."""
        if self.gradient_sync is not None:
            return self.gradient_sync
        return default_gradient_sync(self.stages) if self.zero >= 2 else "step"

    @property
    def expert_tensor_degree(self) -> int:
        """ETP as priced: the given degree, else T."""
        return self.tensor_parallel if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    @property
    def expert_data_parallel(self) -> int:
        """The ranks holding the same expert shard, over which its gradients are reduced: T x C x D / (E x ETP)."""
        return self.devices_per_stage * self.replicas // (self.expert_parallel * self.expert_tensor_degree)

    @property
    def devices_per_stage(self) -> int:
        """T x C: the devices one pipeline stage runs on."""
        return self.tensor_parallel * self.context_parallel

    @property
    def devices_per_replica(self) -> int:
        """K x T x C: the devices of one pipeline."""
        return self.stages * self.devices_per_stage

    @property
    def total_devices(self) -> int:
        """D x K x T x C: every device the layout uses."""
        return self.replicas * self.devices_per_replica

    @property
    def processes(self) -> int:
        """D x K: the processes the executor starts (one per stage of each replica)."""
        return self.replicas * self.stages

    @property
    def virtual_stage_count(self) -> int:
        """V x K: the chunks the partition splits the model into."""
        return self.stages * self.virtual_stages


# The keys a layout is written with where it sits flat beside a partition (the plan file, a run's config):
# every degree but K, which is the partition's length over V
LAYOUT_KEYS = tuple(f.name for f in fields(ParallelLayout) if f.name != "stages")


def flat_layout(layout: ParallelLayout) -> dict[str, Any]:
    """``layout`` as the flat keys of :data:`LAYOUT_KEYS` (its K left to the partition beside it)."""
    return {key: getattr(layout, key) for key in LAYOUT_KEYS}


ZERO_STAGES = (0, 1, 2, 3)
SHARDED_STATE = {1: "optimizer state", 2: "optimizer state and gradients",
                 3: "parameters, gradients and optimizer state"}  # what each ZeRO stage splits over the replicas


def check_sharding(zero: object, replicas: int | None = None, shard_group: object = None) -> None:
    """ZeRO 0-3, sharding only over two replicas or more (where ``replicas`` is known), and a shard
    group (HSDP) only with ZeRO-2/3, dividing D; one line each."""
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise GpipeInputError(f"--zero must be 0, 1, 2 or 3, got {zero!r}")
    if zero and replicas == 1:
        raise GpipeInputError(f"--zero {zero} shards {SHARDED_STATE[zero]} over the data-parallel group, which needs --replicas 2 "
                              "or more; use --zero 0 with one replica")
    if shard_group is None:
        return
    if isinstance(shard_group, bool) or not isinstance(shard_group, int) or shard_group < 1:
        raise GpipeInputError(f"--shard-group must be a positive integer, got {shard_group!r}")
    if zero < 2:
        raise GpipeInputError(f"--shard-group {shard_group} shards parameters and gradients within groups of "
                              f"replicas, which needs --zero 2 or 3 (got --zero {zero})")
    if replicas is not None and replicas % shard_group:
        raise GpipeInputError(f"--shard-group {shard_group} does not divide --replicas {replicas}; give a divisor "
                              "of D (D itself shards over all replicas)")


# When ZeRO-2/3 reduce-scatters a stage's gradients: once per step after the last micro-batch's backward,
# the micro-batches' gradients accumulated unsharded ("step"), or after every micro-batch's backward,
# accumulated into the sharded gradient ("microbatch")
GRADIENT_SYNCS = ("step", "microbatch")


def default_gradient_sync(stages: int) -> str:
    """The trainers' default: ``microbatch`` on one stage (FSDP2's gradient accumulation, DeepSpeed's
    ZeRO-2/3), ``step`` under a pipeline (torch's pipeline schedules sync on the last micro-batch)."""
    return "microbatch" if stages == 1 else "step"


def check_gradient_sync(gradient_sync: object, zero: int) -> None:
    """``step``, ``microbatch`` or None; a value given only with ZeRO-2/3, which shard the gradients."""
    if gradient_sync is None:
        return
    if gradient_sync not in GRADIENT_SYNCS:
        raise GpipeInputError(f"--gradient-sync must be step or microbatch, got {gradient_sync!r}")
    if zero < 2:
        raise GpipeInputError(f"--gradient-sync {gradient_sync} says when sharded gradients are reduce-scattered, "
                              f"which needs --zero 2 or 3 (got --zero {zero}); drop --gradient-sync or use "
                              "--zero 2 or 3")


def check_expert_sharding(zero: int, expert_parallel: int, shard_group: int | None = None,
                          replicas: int | None = None) -> None:
    """ZeRO-2/3 with E > 1 shards the routed experts over their expert-data-parallel group
    (:mod:`sim.engine.fsdp`); HSDP (a shard group smaller than D) with E > 1 is not modelled: one line.
    Every place a layout's ZeRO stage, shard group and E meet calls this (the layout, the replay), so
    none prices it silently."""
    if expert_parallel > 1 and zero >= 2 and shard_group is not None and shard_group != replicas:
        raise GpipeInputError(f"--shard-group {shard_group} with --expert-parallel {expert_parallel}: HSDP of the "
                              "routed experts over their expert-data-parallel group is not modelled; leave "
                              "--shard-group out (experts and the rest sharded over their whole groups)")


def check_expert_grid(expert_parallel: object, expert_tensor_parallel: object, tensor_parallel: int,
                      context_parallel: int, replicas: int) -> None:
    """E and ETP positive, and E x ETP dividing T x C x D: Megatron-Core folds the expert grid (ETP x E x
    expert-DP) over the same ranks as one pipeline stage's T x C x D; one line otherwise. Whether the model
    has experts, and E divides them, is checked where the model is known
    (:func:`sim.workloads.moe.expert_parallel.check_expert_parallel`)."""
    _require_count("expert_parallel (E)", expert_parallel, "use --expert-parallel 1 or more")
    if expert_tensor_parallel is not None:
        _require_count("expert_tensor_parallel (ETP)", expert_tensor_parallel,
                       "use --expert-tensor-parallel 1 or more, or leave it out for T")
    etp = tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
    group = tensor_parallel * context_parallel * replicas
    grid = expert_parallel * etp  # type: ignore[operator]
    if group % grid:
        raise GpipeInputError(f"--expert-parallel {expert_parallel} x --expert-tensor-parallel {etp} = {grid} does "
                              f"not divide T x C x D = {tensor_parallel} x {context_parallel} x {replicas} = {group}, "
                              "the ranks of one pipeline stage the expert grid is folded over; give E x ETP dividing it")


def check_chunked_partition(partition: Sequence[int], virtual_stages: int, name: str = "partition") -> None:
    """A partition lists V x K entries (V chunks on each of K devices): one line, naming ``name``,
    when its length is not a multiple of V."""
    if len(partition) % virtual_stages:
        raise GpipeInputError(f"{name} has {len(partition)} entries, not a multiple of --virtual-stages "
                              f"{virtual_stages}; give V x K entries")
