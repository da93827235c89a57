"""D data-parallel replicas of a K-stage pipeline: the mesh, the groups, the gradient average, ZeRO-1.

The D x K ranks form a ``torch.distributed`` :class:`~torch.distributed.device_mesh.DeviceMesh` with
the named dimensions ``"dp"`` (the D ranks that hold one stage in different replicas) and ``"pp"``
(the K ranks of one replica). Which global rank runs which (replica, stage) comes from
:func:`sim.engine.placement.device_of`, as in the simulator. Each replica has its own boundary groups, so
pipeline sends and receives go to the neighbours in the same replica over the transport and tags of
a single pipeline; shared (tied) parameters are summed among the owning stages of the same replica.

How the global batch splits: replica d takes ``torch.chunk(batch, D)[d]`` (its ``rows_d`` of the B
rows), which its stages split into micro-batches with ``torch.chunk`` as one pipeline does; the
last stage's loss is the mean over the replica's rows. A global batch that gives fewer than D chunks
(fewer rows than D, or B=5 with D=4: chunks 2, 2, 1) is refused in one line.

What is averaged, and when: after the last backward action of its step, each rank launches an
asynchronous all-reduce of its gradients over its stage's dp group, in buckets of at most
:data:`BUCKET_BYTES` (DDP's default of 25 MiB), and waits for it at the start of the end of the
step, before the shared-parameter reduction, the gradient norm and the optimizer step; where the
dp group's ranks share a host and each has a core (the ranks the pipeline's messages reach through
shared memory), the sum goes through shared memory instead (:mod:`executor.transport.shm_allreduce`:
several times faster than gloo over loopback TCP, docs/notes/2026-11-25-executor-overhead.md),
each rank writing its gradients at the launch and summing its share of them in the wait. Each rank
scales its gradients by ``rows_d / B`` before the sum, so the result is the gradient of the mean
loss over the whole global batch, exactly what one process training B rows computes, even and
uneven splits alike (for an even split the weight is 1/D: the plain average). Why not inside the
last backward: it is 1/M of the stage's backward work, so overlapping with it saves little, while
launching after it leaves accumulation and recompute untouched and is what the simulator models;
the overlap that matters is with the rest of the drain (stage k finishes before stage k-1 does).
The reported loss is the same weighted sum of the replicas' losses: the global mean.

The gradient norm for clipping is taken after the average: each stage's share over its own
gradients, summed over the replica's pipeline group; every replica then holds the same norm, that
of ``clip_grad_norm_`` on the unpipelined model.

ZeRO-1 (``--zero 1``): each stage's optimizer is a
:class:`~torch.distributed.optim.ZeroRedundancyOptimizer` over its dp group with the configured
torch.optim class and settings; it keeps 1/D of the optimizer state per rank, steps its part of the
parameters and broadcasts them. Gradients are all-reduced in full as without ZeRO, so clipping,
weight decay and the learning-rate schedule act as without it. With expert parallelism the routed experts' state is
sharded over their own ``edp`` replicas instead (:mod:`executor.parallel.expert_zero`).

ZeRO-2 and ZeRO-3 (``--zero 2|3``, ``--shard-group N``): each stage's layers are sharded over its dp
group by FSDP2 when they are made, and their gradients reduce-scattered by it instead of the
all-reduce here (:mod:`executor.parallel.fully_sharded`: once per step, or after every micro-batch's
backward with ``--gradient-sync microbatch``, one stage's default); with a shard group below D the mesh's dp
dimension is made of two, ``dp_replicate`` x ``dp_shard`` (HSDP), and ``dp`` is their flattening. With
expert parallelism dp is made of ``edp`` x ``ep``, and FSDP shards each block's routed experts over ``edp``.

Checkpoints: replica 0 of each stage writes the stage's shard (the replicas hold the same values).
With ZeRO the optimizer state is first consolidated onto replica 0 (a collective over the dp group),
so a shard always holds its stage's whole optimizer state and every replica loads its part back.
The replica count and ``--zero`` are recorded in the manifest's config and a resume with other
values is refused in one line (:mod:`executor.state.checkpoint`), except from and into ZeRO-2/3,
whose shards hold each stage whole (gathered by every replica, written by replica 0).

Dropout: replica d > 0 draws its masks from its own seed, so replicas do not repeat each other's
masks; replica 0 draws what a single pipeline draws.

Limits: a parameter whose gradient is None on a step takes no part in that step's average where every
replica lacks it (a routed expert a replica's rows missed is taken as zero there where another has it:
:class:`executor.parallel.gradient_average.GradientAverage`); the all-reduce adds the rows' weights
in fp32, so an uneven split agrees with one process to float rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from executor.device import backend_device
from executor.models.moe import MixtureOfExperts
from executor.parallel.expert_zero import consolidate as consolidate_optimizer
from executor.parallel.expert_zero import expert_sharded_optimizer, held_states
from executor.parallel.gradient_average import GradientAverage, local_tensor
from executor.parallel.sharding_checks import check_fully_sharded, reshards_after_forward
from executor.parallel.sharing import SharedGroup
from executor.runtime.data import split
from executor.runtime.optim import make_scheduler, optimizer_class_and_kwargs
from executor.runtime.seeds import mix_seed
from executor.runtime.stage import PipelineStage
from executor.transport.p2p import ACT, GRAD
from sim.engine.placement import device_of, replica_and_stage
from sim.errors import GpipeInputError
from sim.formats.layout import ParallelLayout
from sim.schedules.microbatch import split_rows
from sim.schedules.schedule import Action, Kind, device_of_virtual_stage

DP, PP, TP = "dp", "pp", "tp"  # the mesh's dimension names: data-parallel, pipeline, tensor-parallel
DP_REPLICATE, DP_SHARD = "dp_replicate", "dp_shard"  # HSDP: dp as (groups replicated, ranks sharded within one)
EDP, EP = "edp", "ep"  # expert parallelism: dp as (replicas holding the same experts, the E sharing a stage's)
REPLICA_SEED = 0x5EED  # mixed with the replica into replica d > 0's dropout seed


class ReplicaSettings(Protocol):
    """What this module reads of a run's settings (an :class:`executor.config.RunConfig`, which
    calls :func:`check_data_parallel` from its ``validate``: so this module does not import it)."""

    layout: ParallelLayout
    batch_size: int
    trace: str

    @property
    def stages(self) -> int: ...


def replica_rows(batch_size: int, replicas: int) -> list[int]:
    """Rows of each replica's share of a global batch, as ``torch.chunk(batch, replicas)`` splits it.

    Raises GpipeInputError (one line) when a replica would get no rows.
    """
    if batch_size < replicas:
        raise GpipeInputError(f"--batch {batch_size} has fewer rows than --replicas {replicas}; every replica "
                              f"needs rows of the global batch: use --batch {replicas} or more")
    rows = split_rows(batch_size, replicas)
    if len(rows) < replicas:
        raise GpipeInputError(f"--batch {batch_size} splits by torch.chunk into {len(rows)} chunks "
                              f"({','.join(map(str, rows))}) for --replicas {replicas}; use a batch that is a "
                              f"multiple of {replicas}")
    return rows


def check_data_parallel(config: ReplicaSettings) -> None:
    """The replica settings of ``config``, one line each: rows for every replica, ZeRO only with D > 1,
    ZeRO-2/3 where FSDP can run it (:mod:`executor.parallel.sharding_checks`)."""
    if config.layout.zero and config.layout.replicas == 1:
        raise GpipeInputError(f"--zero {config.layout.zero} shards state over data-parallel replicas but --replicas is 1; "
                              "add --replicas 2 or more, or drop --zero")
    check_fully_sharded(config)
    replica_rows(config.batch_size, config.layout.replicas)


def replica_seed(seed: int, replica: int) -> int:
    """The seed replica ``replica``'s dropout masks come from (replica 0: ``seed`` itself)."""
    return seed if replica == 0 else mix_seed(seed, REPLICA_SEED, replica)


@dataclass
class Layout:
    """This rank's place among D replicas of a K-stage pipeline, and the groups it talks over."""

    replicas: int  # D
    stages: int  # K
    replica: int  # d, this rank's replica
    stage: int  # k, this rank's stage
    rows: int  # rows of every global batch this replica trains
    batch_size: int  # B, the global batch
    zero: int  # 1: optimizer state sharded over the dp group
    stage_ranks: tuple[int, ...]  # global rank of each stage of this replica
    mesh: DeviceMesh
    boundary_groups: dict[tuple[int, str], dist.ProcessGroup]  # this replica's, as transport.boundary_groups
    shared_groups: list[dist.ProcessGroup | None]  # this replica's owners of each shared parameter (None: one rank)
    tensor_parallel: int = 1  # T ranks per stage (executor.parallel.tensor_parallel)
    tp_rank: int = 0  # t, this rank's place among them
    shard_group: int | None = None  # ZeRO-2/3: shard within groups of this many replicas (HSDP); None: all D
    reshard_after_forward: bool = False  # ZeRO-3 on one stage (executor.parallel.fully_sharded)
    reduce_every_microbatch: bool = False  # ZeRO-2/3, gradient sync "microbatch": reduce-scatter after each backward
    expert_parallel: int = 1  # E: the stage's experts sharded over E replicas (executor.parallel.expert_parallel)
    traced: bool = False  # --trace: the experts' all-to-alls recorded as spans of their own
    flat_dp_mesh: DeviceMesh | None = None  # E > 1: dp as flattened from (edp, ep), kept (torch deprecates slicing it)

    @property
    def hsdp(self) -> bool:
        """Whether ZeRO-2/3 shards within groups of replicas and replicates across them."""
        return self.zero >= 2 and self.shard_group is not None and self.shard_group < self.replicas

    @property
    def sharding(self) -> Any:
        """ZeRO-2/3: how this rank's chunks are sharded (:class:`executor.parallel.fully_sharded.Sharding`,
        over dp, or (replicate, shard) with HSDP); None otherwise."""
        if self.zero < 2 or self.replicas == 1:
            return None
        from executor.parallel.fully_sharded import Sharding  # FSDP is slow to import: ZeRO-2/3 runs only

        mesh = self.mesh[(DP_REPLICATE, DP_SHARD)] if self.hsdp else self.flat_dp_mesh or self.mesh[DP]
        experts = self.mesh[EDP] if self.expert_parallel > 1 else None  # the replicas holding the same experts
        return Sharding(mesh, self.reshard_after_forward, self.weight, self.reduce_every_microbatch, experts)

    @property
    def experts(self) -> Any:
        """With E > 1: this rank's place in its stage's expert grid
        (:class:`executor.parallel.expert_parallel.ExpertSharding`); None otherwise."""
        if self.expert_parallel == 1:
            return None
        from executor.parallel.expert_parallel import ExpertSharding

        data = self.mesh.get_group(EDP) if self.replicas > self.expert_parallel else None
        return ExpertSharding(self.mesh.get_group(EP), self.mesh.get_local_rank(EP), self.expert_parallel, data,
                              self.weight)

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The T ranks of this stage (None with T = 1)."""
        return self.mesh[TP] if self.tensor_parallel > 1 else None

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The D ranks that hold this stage: replica d is group rank d."""
        return self.mesh.get_group(DP)

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The K ranks of this replica's pipeline."""
        return self.mesh.get_group(PP)

    @property
    def weight(self) -> float:
        """This replica's share of the global batch, ``rows_d / B``: its gradients' and loss's weight."""
        return self.rows / self.batch_size

    def share(self, value: Any) -> Any:
        """This replica's rows of a global batch's inputs or targets (``torch.chunk`` along rows)."""
        return value if self.replicas == 1 else split(value, self.replicas)[self.replica]

    def global_loss(self, loss: float) -> float:
        """The global batch's mean loss from every replica's (on the last stages; collective there)."""
        if self.replicas == 1:
            return loss
        total = torch.tensor(loss * self.weight, dtype=torch.float64, device=backend_device(dist.get_backend(self.dp_group)))
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_group)
        return float(total)


def build_layout(config: ReplicaSettings, rank: int, device_type: str, shared: Sequence[SharedGroup]) -> Layout:
    """The mesh and every pipeline's boundary and shared-parameter groups; this rank's layout.

    With T tensor-parallel ranks per stage the T ranks of a stage are consecutive (device
    ``device_of(d, k) x T + t``, as the simulator places them), and tensor-parallel rank t of every
    stage of a replica forms a pipeline of its own: its sends, receives and tied parameters go to
    rank t of the other stages. Collective: every rank calls it at the same point (``new_group`` is
    collective, and every rank creates every pipeline's groups in the same order).
    """
    replicas, stages, placement = config.layout.replicas, config.stages, config.layout.placement
    parts = config.layout.tensor_parallel
    chunks = stages * config.layout.virtual_stages  # virtual stages, placed by sim.schedules.schedule.device_of_virtual_stage
    position = [device_of_virtual_stage(s, stages, config.layout.schedule) for s in range(chunks)]
    group_of_ranks, tp_rank = divmod(rank, parts)
    replica, stage = replica_and_stage(group_of_ranks, replicas, stages, placement)
    grid = [[[device_of(d, k, replicas, stages, placement) * parts + t for t in range(parts)] for k in range(stages)]
            for d in range(replicas)]
    ranks_grid = torch.tensor(grid, dtype=torch.int)
    names: tuple[str, ...] = (DP, PP, TP)
    if parts == 1:
        ranks_grid, names = ranks_grid[..., 0], (DP, PP)
    shard_group = config.layout.shard_group
    hsdp = config.layout.zero >= 2 and shard_group is not None and shard_group < replicas
    experts = config.layout.expert_parallel
    flat_dp_mesh = None
    if hsdp:  # dp as (replicate, shard): replicas r*N .. r*N + N-1 shard among themselves
        ranks_grid = ranks_grid.reshape(replicas // shard_group, shard_group, *ranks_grid.shape[1:])
        mesh = DeviceMesh(device_type, ranks_grid, mesh_dim_names=(DP_REPLICATE, DP_SHARD, *names[1:]))
        mesh[(DP_REPLICATE, DP_SHARD)]._flatten(DP)  # the dp group of every D ranks, as without HSDP
    elif experts > 1:  # dp as (edp, ep): replicas g*E .. g*E + E-1 hold the stage's experts between them
        ranks_grid = ranks_grid.reshape(replicas // experts, experts, *ranks_grid.shape[1:])
        mesh = DeviceMesh(device_type, ranks_grid, mesh_dim_names=(EDP, EP, *names[1:]))
        flat_dp_mesh = mesh[(EDP, EP)]._flatten(DP)
    else:
        mesh = DeviceMesh(device_type, ranks_grid, mesh_dim_names=names)
    boundary: dict[tuple[int, str], dist.ProcessGroup] = {}
    shared_groups: list[dist.ProcessGroup | None] = []
    for d in range(replicas):
        for t in range(parts):
            ranks = [grid[d][k][t] for k in range(stages)]
            mine = d == replica and t == tp_rank
            # virtual boundary b joins the ranks of virtual stages b and b+1 (where both are one rank,
            # with K = 1 or at the turn of a V, chunks hand over in process)
            for b in range(chunks - 1):
                if position[b] == position[b + 1]:
                    continue
                for channel in (ACT, GRAD):
                    group = dist.new_group(sorted({ranks[position[b]], ranks[position[b + 1]]}))
                    if mine:
                        boundary[(b, channel)] = group
            groups = []
            for g in shared:
                owners = sorted({ranks[position[owner]] for owner in g.owners})
                groups.append(dist.new_group(owners) if len(owners) > 1 else None)
            if mine:
                shared_groups = groups
    rows = replica_rows(config.batch_size, replicas)[replica]
    stage_ranks = tuple(grid[replica][k][tp_rank] for k in range(stages))
    return Layout(replicas, stages, replica, stage, rows, config.batch_size, config.layout.zero, stage_ranks,
                  mesh, boundary, shared_groups, parts, tp_rank, shard_group,
                  reshards_after_forward(config.layout.zero, stages),
                  config.layout.zero >= 2 and config.layout.resolved_gradient_sync == "microbatch",
                  experts, bool(config.trace), flat_dp_mesh)


def last_backward_index(actions: Sequence[Action]) -> int:
    """Position of the last action in a device's list that adds to the weights' gradients, a
    backward or (split-backward schedules) an I or W (-1 when it has none)."""
    gradients = (Kind.BACKWARD, Kind.INPUT, Kind.WEIGHT)
    return max((i for i, a in enumerate(actions) if a.kind in gradients), default=-1)


def chain(*hooks: Callable[[int, Action], None] | None) -> Callable[[int, Action], None] | None:
    """One after-action hook that calls each given one in turn (None when none is given)."""
    present = [h for h in hooks if h is not None]
    if not present:
        return None

    def hook(index: int, action: Action) -> None:
        for h in present:
            h(index, action)

    return hook


def attach(stage: Any, layout: Layout) -> Any:
    """Make ``stage`` (a :class:`PipelineStage`, or a device of several chunks under the
    interleaved schedule) one of D replicas: its own dropout seeds, its gradients averaged over its
    dp group (launched after its last backward, awaited at the end of the step) and, with ZeRO-1, its
    optimizer sharded; with ZeRO-2/3 (its layers sharded when they were made) its gradients
    reduce-scattered by FSDP instead (:mod:`executor.parallel.fully_sharded`), which returns what
    samples the gathered parameters. Nothing changes with one replica."""
    if layout.replicas == 1:
        return None
    parts = stage_parts(stage)
    for part in parts:
        part.config = replace(part.config, seed=replica_seed(part.config.seed, layout.replica))
    if layout.zero >= 2:
        from executor.parallel import fully_sharded

        gathered, reduce_after_last_backward = fully_sharded.attach(stage, parts, layout.sharding)
        stage.after_action = chain(stage.after_action, reduce_after_last_backward)
        if layout.experts is not None:  # the norm counting each expert once, the exchanges traced; FSDP reduces
            from executor.parallel import expert_parallel

            expert_parallel.attach(stage, parts, layout.experts, layout.traced)
        return gathered
    links = next((part.transport.links for part in parts if getattr(part.transport, "links", None) is not None), None)
    params = [p for part in parts for p in part.params]
    experts, expert_sum = layout.experts, None
    if experts is not None:  # the experts' gradients over their own replicas, already weighted
        from executor.parallel import expert_parallel

        expert_params = expert_parallel.attach(stage, parts, experts, layout.traced)
        params = [p for p in params if all(p is not q for q in expert_params)]
        if experts.data_group is not None:
            expert_sum = GradientAverage(expert_params, experts.data_group, 1.0, stage.recorder, links=links,
                                         sparse=True)
    # routed experts: a replica's rows may reach none of an expert, whose gradient it then lacks
    routed = any(isinstance(m, MixtureOfExperts) for part in parts for m in part.module.modules())
    average = GradientAverage(params, layout.dp_group, layout.weight, stage.recorder, links=links, sparse=routed)
    average.also = expert_sum
    last = last_backward_index(stage.actions)

    def launch_after_last_backward(index: int, action: Action) -> None:
        if index == last:
            average.launch()

    stage.after_action = chain(stage.after_action, launch_after_last_backward)
    stage.sync_gradients = average.wait
    if layout.zero:
        for part in parts:
            shard_optimizer(part, layout)
    return None


def gradient_sum_route(stage: Any) -> str | None:
    """How the stage's gradients are summed over its replicas: ``"shared memory"``, the dp group's
    backend (``"gloo"``, ``"nccl"``), or None with one replica."""
    average = getattr(stage.sync_gradients, "__self__", None)
    if not isinstance(average, GradientAverage):
        return None
    return "shared memory" if average.through_shared_memory else str(dist.get_backend(average.group))


def stage_parts(stage: Any) -> list[PipelineStage]:
    """The :class:`PipelineStage` objects a rank runs: a device's chunks, or the stage itself."""
    return list(getattr(stage, "chunks", [stage]))


def shard_optimizer(stage: PipelineStage, layout: Layout) -> None:
    """Replace the stage's optimizer by a ZeroRedundancyOptimizer over its dp group, with the same
    torch.optim class and settings (with expert parallelism, its routed experts' state sharded over
    their edp group instead: :mod:`executor.parallel.expert_zero`), and its learning-rate schedule by
    one over the new optimizer."""
    if stage.optimizer is None:
        return
    from torch.distributed.optim import ZeroRedundancyOptimizer  # slow to import (loaded_types): ZeRO runs only

    optimizer_class, kwargs = optimizer_class_and_kwargs(stage.optim)
    experts = layout.experts
    expert_params: list[Any] = []
    if experts is not None:
        from executor.parallel.expert_parallel import split_params

        expert_params = split_params(stage)[1]
    if expert_params and len(expert_params) < len(stage.params):  # the experts over edp, the rest over dp
        stage.optimizer = expert_sharded_optimizer(stage.params, expert_params, optimizer_class, kwargs,
                                                   layout.dp_group, experts.data_group)
    else:
        stage.optimizer = ZeroRedundancyOptimizer(stage.params, optimizer_class=optimizer_class,
                                                  process_group=layout.dp_group, **kwargs)
    stage.scheduler = make_scheduler(stage.optim, stage.optimizer)


def optimizer_state_bytes(stage: Any) -> int:
    """Bytes of optimizer state this rank holds (over its chunks): with ZeRO its shard only, about
    1/D of the stage's."""
    return sum(local_tensor(value).numel() * value.element_size() for part in stage_parts(stage)
               for state in held_states(part.optimizer) for value in state.values() if torch.is_tensor(value))


def consolidate(stage: Any) -> None:
    """Before a checkpoint: with ZeRO, gather the stage's (each chunk's) optimizer state onto
    replica 0 (group rank 0 of the dp group), which writes the shards. Collective over the dp
    group; a no-op otherwise."""
    for part in stage_parts(stage):
        consolidate_optimizer(part.optimizer)
