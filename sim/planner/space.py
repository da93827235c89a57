"""What the planner searches: the candidate values of every degree of a layout, as one typed record.

A :class:`SearchSpace` names the values tried for the data-parallel replicas D, the pipeline stages
K, the virtual stages V, the tensor-parallel degree T, the context-parallel degree C, the
micro-batches M, the schedules, the checkpoint policies, ZeRO and the placements, and the hardware
systems to plan on: each a :class:`Target`, the system with the model as priced there and the
precision chosen for it. A degree left ``None`` takes its default on each system (powers of two up to
its devices, or the model's); :func:`sim.planner.plan_search.search_plans` searches the space.

What only one system can tell is checked per system, in one line naming the value and the fix:
V without a schedule that interleaves, ZeRO-1 with one replica (:func:`on_system`), D x K beyond the
devices and V x K beyond the layers (:func:`check_fits`), T and C the model cannot split
(:func:`tensor_parallel_values`). The messages name ``gpipe plan``'s flags, which build the space.

Limits: one precision per system (the one chosen for its device), one C per search; the sequence
parallelism of a T > 1 plan is the model's default or the one asked for, not searched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from sim.catalog.hardware import Link, System
from sim.engine.placement import PLACEMENTS
from sim.errors import GpipeInputError
from sim.schedules.schedule import CHECKPOINT_POLICIES, MULTI_CHUNK_SCHEDULES, PLANNED_SCHEDULES, V_SHAPED_SCHEDULES
from sim.workloads.tensor_parallel import check_context_parallel, check_tensor_parallel
from sim.workloads.workload import Workload, check_checkpoint_for

DEFAULT_MICROBATCHES = tuple(range(1, 65))  # M: 1-64
DEFAULT_VIRTUAL_STAGES = (1, 2, 4)  # V: 1 runs gpipe and 1f1b, 2 and 4 the interleaved schedule


class MeasuredCosts(Protocol):
    """A workload measured for one layout at a time (a costs file's, :mod:`sim.formats.costs`): its
    fits are those of as many processes as D x K, so it is bound to each K and D before they are
    searched, and its all-reduce is the one measured where the system is the measured one. A
    workload says it is one by ``measured_costs`` (:class:`sim.workloads.workload.WorkloadCapabilities`)."""

    def bind(self, system: System, stages: int, checkpoint: str = ..., microbatches: int | None = ...,
             replicas: int = ...) -> tuple[Workload, System]: ...

    def allreduce_link(self, system: System) -> Link | None: ...


@dataclass(frozen=True)
class Target:
    """One hardware system to plan on: the system (its nodes and any efficiency given), the model as
    priced there (``workload``, the global ``batch`` in rows) and the precision chosen for it.
    ``tensor_parallel_link(sequence_parallel)`` gives the tensor-parallel collectives a calibration
    measured on this system, asked only for the T > 1 searched (None: the catalog's node link)."""

    system: System
    workload: Workload
    batch: int
    precision: str
    tensor_parallel_link: Callable[[bool], Link | None] = field(default=lambda sequence_parallel: None)


@dataclass(frozen=True)
class SearchSpace:
    """The candidate values of each degree; ``None``: the default on each system."""

    hardware: tuple[Target, ...]  # the systems searched, each ranked with the others
    stages: tuple[int, ...] | None = None  # K; default powers of two up to the devices and layers
    microbatches: tuple[int, ...] = DEFAULT_MICROBATCHES  # M
    checkpoints: tuple[str, ...] | None = None  # None: every policy, selective where it differs
    schedules: tuple[str, ...] = PLANNED_SCHEDULES
    replicas: tuple[int, ...] | None = None  # D; default powers of two up to the devices
    virtual_stages: tuple[int, ...] | None = None  # V; default DEFAULT_VIRTUAL_STAGES
    zero: tuple[int, ...] = (0,)
    zero_escalates: bool = False  # a layout that does not fit is tried at the next ZeRO stage (--zero-options auto)
    shard_groups: tuple[int, ...] = ()  # HSDP's shard groups tried beside all replicas with ZeRO-2/3
    gradient_syncs: tuple[str | None, ...] = (None,)  # ZeRO-2/3's gradient syncs tried; None: the trainers' default
    placements: tuple[str, ...] = PLACEMENTS
    tensor_parallel: tuple[int, ...] | None = None  # T; default the powers of two the model splits into
    context_parallel: int = 1  # C, one value per search
    sequence_parallel: bool | None = None  # None: on wherever T > 1 and the model allows it
    partitioner: str = "min_max"
    dp_overlap: bool = False  # the all-reduce bucket by bucket inside the last backward
    expert_parallel: tuple[int, ...] | None = None  # E; default the divisors of the experts (1 without experts)
    expert_tensor_parallel: tuple[int, ...] | None = None  # ETP; default 1 and T

    @property
    def policies(self) -> tuple[str, ...]:
        return self.checkpoints if self.checkpoints is not None else CHECKPOINT_POLICIES

    @property
    def splits_by_shape(self) -> bool:
        """Whether some candidate splits layers (T or C > 1): a Hugging Face model is then planned as
        the built-in transformer of its shape, which tensor and context parallelism can split."""
        return self.context_parallel > 1 or any(t > 1 for t in self.tensor_parallel or ())


@dataclass(frozen=True)
class SystemSpace:
    """The degrees on one system, defaults filled in."""

    replicas: tuple[int, ...]
    virtual_stages: tuple[int, ...]
    zero: tuple[int, ...]
    schedules: tuple[str, ...]  # those the V values leave
    replicas_given: bool


def _listed(values) -> str:
    return ",".join(map(str, values))


def on_system(space: SearchSpace, system: System) -> SystemSpace:
    """D, V and ZeRO on ``system`` and the schedules they leave; refused in one line where they
    cannot combine (V without the interleaved schedule, ZeRO-1 with one replica)."""
    from sim.planner.search import default_replica_options

    replicas = space.replicas if space.replicas is not None else tuple(default_replica_options(system))
    virtual = space.virtual_stages if space.virtual_stages is not None else DEFAULT_VIRTUAL_STAGES
    schedules = list(space.schedules)
    interleaving = [v for v in virtual if v >= 2]
    given = space.virtual_stages is not None
    if given and interleaving and not set(schedules) & set(MULTI_CHUNK_SCHEDULES):
        raise GpipeInputError(f"--virtual-stages-options {interleaving[0]} needs the interleaved schedule; add it to "
                              f"--schedules (e.g. --schedules {','.join(schedules)},interleaved)")
    if given and not interleaving and schedules == ["interleaved"]:
        raise GpipeInputError("--schedules interleaved needs --virtual-stages-options 2 or more")
    # V-shaped schedules run two chunks per device whatever V lists for the interleaved one
    kept = tuple(s for s in schedules if (s == "interleaved" and interleaving) or s in V_SHAPED_SCHEDULES
                 or (s != "interleaved" and 1 in virtual))
    if not kept:
        raise GpipeInputError(f"--virtual-stages-options {_listed(virtual)} leaves none of --schedules "
                              f"{','.join(schedules)}: V=1 runs gpipe and 1f1b, V >= 2 the interleaved schedule")
    if 0 not in space.zero and tuple(replicas) == (1,):
        what = "optimizer state" if tuple(space.zero) == (1,) else "state"
        raise GpipeInputError(f"--zero-options {_listed(space.zero)} shards {what} over the data-parallel group, "
                              "which needs --replicas-options 2 or more; use --zero-options 0 with one replica")
    return SystemSpace(tuple(replicas), tuple(virtual), tuple(space.zero), kept, space.replicas is not None)


def stage_values(space: SearchSpace, system: System, num_layers: int) -> list[int]:
    """K to search on ``system``: those asked for, each within the layers and the devices, else the
    powers of two up to both."""
    from sim.planner.search import default_stage_options

    if space.stages is None:
        return default_stage_options(system, num_layers)
    too_many = [k for k in space.stages if k > num_layers]
    if too_many:
        raise GpipeInputError(f"--stages-options {too_many[0]} exceeds the model's {num_layers} "
                              f"layers; use values up to {num_layers}")
    for k in space.stages:
        system.check_fits(k)
    return list(space.stages)


def policies_for(space: SearchSpace, workload: Workload) -> list[str]:
    """The policies to search; ``selective`` asked for explicitly where the model has no attention
    core to recompute is refused in one line (by default :func:`sim.planner.search.search` leaves it out)."""
    if space.checkpoints is not None:
        for checkpoint in space.checkpoints:
            check_checkpoint_for(workload, checkpoint)
    return list(space.policies)


def check_fits(degrees: SystemSpace, stage_options: list[int], microbatch_options: list[int], system: System,
               num_layers: int) -> None:
    """D x K within the system's devices, and for the interleaved schedule alone V x K within the
    layers and M a multiple of K, for at least one K."""
    for d in degrees.replicas if degrees.replicas_given else ():  # defaults beyond the devices are skipped
        system.check_fits(min(stage_options), d)
    interleaving = [v for v in degrees.virtual_stages if v >= 2]
    if interleaving and list(degrees.schedules) == ["interleaved"]:
        deep = [k for k in stage_options if k > 1]
        if not deep:
            raise GpipeInputError("the interleaved schedule needs 2 stages or more; add them to --stages-options")
        if min(interleaving) * min(deep) > num_layers:
            v, k = min(interleaving), min(deep)
            raise GpipeInputError(f"{v} virtual stages x {k} stages = {v * k} chunks but the model has "
                                  f"{num_layers} layers; use fewer --virtual-stages-options or --stages-options")
        if not any(m % k == 0 for m in microbatch_options for k in deep):
            raise GpipeInputError(f"the interleaved schedule needs micro-batches (M) a multiple of stages (K), and no "
                                  f"--microbatch-options value is a multiple of any --stages-options value above 1; "
                                  f"use e.g. --microbatch-options {2 * min(deep)}")


def tensor_parallel_values(space: SearchSpace, workload: Workload, system: System) -> list[int]:
    """T to search, each checked; by default the powers of two up to a node that the model allows
    (T = 1 for models tensor parallelism is not modelled for, for measured costs unless asked, and
    on the ``cpu`` system, whose cores share one memory: plans for it are what ``gpipe train`` runs)."""
    c = space.context_parallel
    if space.tensor_parallel is not None:
        for t in space.tensor_parallel:
            check_tensor_parallel(t, workload, system)
            check_context_parallel(c, workload, system, t)
        return list(space.tensor_parallel)
    check_context_parallel(c, workload, system)
    if system.name == "cpu" or workload.measured_costs:
        return [1]
    options = []
    for t in (2 ** i for i in range(system.devices_per_node.bit_length())):
        try:
            check_tensor_parallel(t, workload, system)
            check_context_parallel(c, workload, system, t)
        except GpipeInputError:
            continue
        options.append(t)
    return options


def expert_values(space: SearchSpace, workload: Workload, tensor_parallel: int) -> list[tuple[int, int | None]]:
    """The (E, ETP) pairs to search at T = ``tensor_parallel`` (ETP None: T, the default): E among those
    asked for (default the divisors of the routed experts), ETP among those asked for (default 1 and T);
    (1, None) alone for a model without experts. Each E is checked against the model in one line; which
    pairs divide T x C x D is left to the replicas searched."""
    from sim.workloads.moe.expert_parallel import check_expert_parallel, expert_count

    experts = expert_count(workload)
    if not experts:
        for e in space.expert_parallel or ():
            check_expert_parallel(workload, e)
        return [(1, None)]
    es = list(space.expert_parallel) if space.expert_parallel is not None else \
        [e for e in range(1, experts + 1) if experts % e == 0]
    for e in es:
        check_expert_parallel(workload, e)
    if workload.measured_costs:  # a costs file's experts are whole on whole stages (T = 1): ETP is T
        for etp in space.expert_tensor_parallel or ():
            if etp != tensor_parallel:
                raise GpipeInputError(f"--expert-tensor-parallel-options {etp} with --costs: a costs file prices whole "
                                      "experts; leave the option out")
        return [(e, None) for e in es]
    etps = list(space.expert_tensor_parallel) if space.expert_tensor_parallel is not None else \
        sorted({1, tensor_parallel})
    return [(e, None if etp == tensor_parallel else etp) for e in es for etp in etps]
