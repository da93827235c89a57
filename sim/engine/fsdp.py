"""ZeRO-2, ZeRO-3 (FSDP) and HSDP priced as FSDP2 runs them: per unit gathers and reduce-scatters.

A *unit* is one layer with parameters (a transformer block; the embedding and the head are units of
their own), as FSDP2's ``fully_shard`` wraps each block and the stage's root. Over a stage's shard
group (:attr:`sim.formats.layout.ParallelLayout.shard_ranks`: N of the D replicas' copies of the
stage) each unit's parameters, gradients and optimizer state are split N ways, and:

- **forward**: the unit's parameters are all-gathered (in the compute dtype: bf16 under the trainers'
  mixed precision, whose ``param_bytes`` are bf16) before its forward. The next unit's gather is
  prefetched while the current unit computes, so unit i's gather shows only by what it exceeds the
  compute of unit i - 1; the first unit's shows whole. With ``reshard_after_forward`` (ZeRO-3) the
  parameters are freed after the forward and gathered again, the same way, before the backward.
- **backward**: each unit's gradients are reduce-scattered (in the gradients' dtype: fp32 where the
  trainers reduce in fp32) as its backward ends, beside the backward of the units before it; with
  HSDP the reduce-scattered shard is then all-reduced across the D / N shard groups. What outlasts
  the compute it runs beside shows, and the last unit's (the stage's first layer) always does. With
  ZeRO-3's gathers in the same backward, a unit's backward has beside it both the next unit's gather
  and the previous unit's reduce-scatter, on the same links one after the other: they are priced
  together against it (:meth:`FsdpPricing.one_stage_reduce_s`).
- the optimizer steps the shard alone: 1/N of its time.

When: ZeRO-2, and any ZeRO under a pipeline (K > 1, torchtitan's policy: no reshard after forward),
gathers once per step, overlapped with the stage's first micro-batch's forward; ZeRO-3 with K = 1
gathers before every micro-batch's forward and again before its backward. ZeRO-3 therefore costs
what ZeRO-2 does when K > 1.

The gradients of the M micro-batches are reduced in one of two ways
(:attr:`sim.formats.layout.ParallelLayout.resolved_gradient_sync`):

- ``step`` (torch's pipeline schedules, torchtitan with a pipeline: the default when K > 1): they
  accumulate unsharded (fp32, held until the reduction: :attr:`ShardedMemory.accumulated_gradient_bytes`)
  and are reduce-scattered once per step, unit by unit beside the stage's last micro-batch's
  backward (with a pipeline, beside that backward as a whole), as the executor runs it
  (:mod:`executor.parallel.fully_sharded`);
- ``microbatch`` (FSDP2's and DeepSpeed ZeRO-2/3's gradient accumulation without a pipeline: the
  default when K = 1): every micro-batch's backward reduce-scatters as the last one does, unit by
  unit beside that backward (with a pipeline, beside the backward as a whole), into the sharded
  gradient; what outlasts the backward shows after it (:attr:`StageCost.fsdp_backward_reduce_s`,
  before the device's next action), the device's last backward's in the step's tail. No unsharded
  gradient outlasts a backward: M - 1 more reductions for the accumulated gradients' memory.

With expert parallelism (E > 1, :mod:`sim.workloads.moe.expert_parallel`), as torchtitan and NeMo
AutoModel compose FSDP2 with it: the routed experts' parameters, gradients and optimizer state (each
rank's experts / E, each split by ETP) are sharded over their expert-data-parallel group, the ranks
holding the same experts (:func:`sim.workloads.moe.expert_parallel.expert_data_ranks`: T x C x D / (E x
ETP)), the rest of each unit over the shard group as above. The experts' part of a layer is its
gradients' share (``expert_grad_bytes``) of its parameter and optimizer bytes. Each unit's experts
are gathered and reduce-scattered on their own group, after the rest of the unit's on the same links
(the two add up in the unit's gather and reduction): in Megatron-Core's rank order the group's
members are E x ETP GPUs apart, every (E x ETP / (T x C))-th replica's stage device, so it usually
spans nodes and is priced as such a group is below. The optimizer steps the experts' state over the
expert-data-parallel ranks and the rest over the shard group.

Collectives are rings (NCCL's all-gather and reduce-scatter): each of p ranks puts (p-1)/p of the
unsharded bytes on its link and pays p-1 latencies, inside a node on its link; a group spanning
nodes runs one ring per rail, so the inter-node link (one per device) carries 1/g of the bytes where
g members share a node (:func:`group_gather_s`, as the all-reduce is priced). A costs file's fitted
collective replaces the catalog's link where it has one.

Limits: units of one stage are taken in layer order with weightless layers' compute counted with the
unit before them; a gather or a reduce-scatter never slows the compute it overlaps, and they share no
bandwidth with pipeline transfers (with each other only in ZeRO-3's backward, where both run); every replica's shard group is priced as
replica 0's; dim 0 padding of each parameter to a multiple of N is not counted (bytes / N rounded up);
the unsharded gradient of the unit a backward is computing (and of the one being reduce-scattered)
is not counted in memory, with either gradient sync, as at M = 1; a backward's reduce-scatters are
priced beside its compute alone, apart from ZeRO-3's gathers before it (as the step's last are), and
what outlasts it delays the device's next action rather than overlapping it (FSDP2 waits for the
last in its post-backward callback). With E > 1: the experts are taken as part of their block's unit
(NeMo AutoModel and the executor, :mod:`executor.parallel.fully_sharded`, wrap them as a unit of their
own, gathered with the block's); an expert-data-parallel group inside one T x C group (E x ETP < T x C)
is priced over the stage devices alone, as if one member per device; HSDP with E > 1 (a shard group
below D) is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

from sim.catalog.hardware import Link, System
from sim.engine.allreduce import group_allreduce_s, ring_allreduce_s
from sim.engine.memory import expert_share, sharding_of
from sim.engine.placement import device_of
from sim.engine.stage_costs import CostTable, StageCost, backward_time_s, rerun_in_backward_s, stage_bounds
from sim.errors import GpipeInputError
from sim.workloads.moe.expert_parallel import expert_data_ranks, expert_replica_stride
from sim.workloads.workload import LayerCost

if TYPE_CHECKING:
    from sim.formats.layout import ParallelLayout


def ring_gather_s(nbytes: float, parties: int, link: Link) -> float:
    """A ring all-gather (or reduce-scatter) of ``nbytes`` unsharded among ``parties`` over ``link``:
    (p-1)/p of the bytes on each party's link and p-1 latencies (Patarasuk and Yuan, JPDC 2009), half
    of the ring all-reduce, which is a reduce-scatter followed by an all-gather."""
    return ring_allreduce_s(nbytes, parties, link) / 2


def group_gather_s(nbytes: float, devices: Sequence[int], system: System, link: Link | None = None) -> float:
    """All-gather (or reduce-scatter) of ``nbytes`` unsharded among ``devices`` of ``system``: half of
    :func:`sim.engine.allreduce.group_allreduce_s`, so a ring on the intra-node link inside one node;
    across nodes, with g members on a node, NCCL's rings (one per rail) carry 1/g of the bytes over
    each member's inter-node link and the rest inside the node:

        (g-1)/g x n / B_intra + (g-1) x L_intra  +  (N-1)/N x (n/g) / B_inter + (N-1) x L_inter

    (g = 1: a flat ring over the inter-node link). A given ``link`` (fitted) is a flat ring on it."""
    return group_allreduce_s(nbytes, devices, system, link) / 2


def shard_group(stage: int, replica: int, layout: ParallelLayout) -> list[int]:
    """The devices ``stage`` of ``replica`` shards with: the N consecutive replicas of its shard group
    (torchtitan's HSDP mesh puts the shard dimension innermost), all D without HSDP."""
    n = layout.shard_ranks
    first = replica - replica % n
    return [device_of(d, stage, layout.replicas, layout.stages, layout.placement) for d in range(first, first + n)]


def replicate_group(stage: int, replica: int, layout: ParallelLayout) -> list[int]:
    """The devices holding the same shard of ``stage`` in each of the D / N shard groups (HSDP)."""
    n = layout.shard_ranks
    return [device_of(d, stage, layout.replicas, layout.stages, layout.placement)
            for d in range(replica % n, layout.replicas, n)]


@dataclass(frozen=True)
class Unit:
    """One unit's gather and reduction seconds, and the compute it overlaps in a forward and a backward."""

    gather_s: float
    reduce_s: float  # reduce-scatter, and with HSDP the all-reduce of its shard across the groups
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class Collectives:
    """How one stage's shard group and (HSDP) replicate group price a unit's bytes."""

    shard_devices: tuple[int, ...]
    replicate_devices: tuple[int, ...]
    system: System
    gather_link: Link | None = None  # a fitted all-gather (costs file); None: the catalog's links
    reduce_link: Link | None = None  # a fitted reduce-scatter
    allreduce_link: Link | None = None  # a fitted all-reduce, for HSDP's across the groups
    expert_devices: tuple[int, ...] = ()  # E > 1: the stage devices holding the same experts; (): no experts split

    _seconds: dict[tuple[str, float], float] = field(default_factory=dict, compare=False, repr=False)

    def _priced(self, kind: str, nbytes: float) -> float:
        """Each collective of ``kind`` on ``nbytes`` priced once: a stage's units are mostly alike."""
        key = (kind, nbytes)
        if key not in self._seconds:
            if kind == "replicate":
                seconds = group_allreduce_s(nbytes, list(self.replicate_devices), self.system, self.allreduce_link)
            elif kind.startswith("expert"):  # the experts' own group (module docstring)
                link = self.gather_link if kind == "expert gather" else self.reduce_link
                seconds = group_gather_s(nbytes, self.expert_devices, self.system, link)
            else:
                link = self.gather_link if kind == "gather" else self.reduce_link
                seconds = group_gather_s(nbytes, self.shard_devices, self.system, link)
            self._seconds[key] = seconds
        return self._seconds[key]

    def gather_s(self, nbytes: float) -> float:
        return self._priced("gather", nbytes)

    def reduce_scatter_s(self, nbytes: float) -> float:
        return self._priced("reduce", nbytes)

    def replicate_s(self, nbytes: float) -> float:
        """HSDP: the all-reduce of a shard of ``nbytes`` across the shard groups (0 without HSDP)."""
        return self._priced("replicate", nbytes)

    def units(self, layers: Sequence[LayerCost], checkpoint_backward_s: Sequence[float]) -> list[Unit]:
        """The stage's units, first to last, from its ``layers`` and each layer's backward seconds; with
        experts split (``expert_devices``) a layer's routed experts gathered and reduce-scattered over
        their own group, after the rest of the layer's on the same links."""
        n = len(self.shard_devices)
        out: list[list[float]] = []
        for layer, backward_s in zip(layers, checkpoint_backward_s):
            if layer.param_bytes or not out:
                expert_grad = layer.expert_grad_bytes if self.expert_devices else 0
                expert_param = expert_share(layer.param_bytes, expert_grad, layer.grad_bytes)
                grad = layer.grad_bytes - expert_grad
                gather_s = self.gather_s(layer.param_bytes - expert_param)
                reduce_s = self.reduce_scatter_s(grad) + self.replicate_s(grad / n)
                if expert_grad:
                    gather_s += self._priced("expert gather", expert_param)
                    reduce_s += self._priced("expert reduce", expert_grad)
                out.append([gather_s, reduce_s, layer.forward_s, backward_s])
            else:  # a weightless layer's compute hides the communication of the unit before it
                out[-1][2] += layer.forward_s
                out[-1][3] += backward_s
        return [Unit(*u) for u in out]


def forward_exposed_s(units: Sequence[Unit]) -> float:
    """A forward's gathers beyond the compute they are prefetched beside: the first unit's whole,
    each later one's by what it exceeds the unit before it."""
    if not units:
        return 0.0
    return units[0].gather_s + sum(max(0.0, u.gather_s - before.forward_s) for before, u in zip(units, units[1:]))


def backward_exposed_s(units: Sequence[Unit], gathers: bool, reduces: bool) -> tuple[float, float, float]:
    """(gathers shown, reductions shown, the last unit's reduction) of one backward, units taken last to
    first: beside unit j's backward run the gather of unit j - 1 (``gathers``: ZeRO-3 with K = 1) and
    the reduction of unit j + 1 (``reduces``); what the two exceed it by shows, split between them in
    proportion. The last gather (the stage's last unit's, before anything computes) shows whole; the
    last reduction (the first unit's) is returned apart, for the caller to place."""
    if not units:
        return 0.0, 0.0, 0.0
    order = list(reversed(units))
    gather_shown = order[0].gather_s if gathers else 0.0
    reduce_shown = 0.0
    for j, unit in enumerate(order):
        gather = order[j + 1].gather_s if gathers and j + 1 < len(order) else 0.0
        reduce = order[j - 1].reduce_s if reduces and j > 0 else 0.0
        over = gather + reduce - unit.backward_s
        if over > 0:
            gather_shown += over * gather / (gather + reduce)
            reduce_shown += over * reduce / (gather + reduce)
    return gather_shown, reduce_shown, order[-1].reduce_s if reduces else 0.0


def pipelined_reduce_exposed_s(units: Sequence[Unit], last_backward_s: float) -> float:
    """K > 1: the once-per-step reductions run beside the last micro-batch's backward; what outlasts it
    shows, and never less than the last unit's (as :func:`sim.engine.allreduce.exposed_allreduce_s`)."""
    total = sum(u.reduce_s for u in units)
    if total <= 0:
        return 0.0
    return max(total - last_backward_s, units[0].reduce_s)


def gathered_in_flight_bytes(param_bytes: Sequence[int], holds_all: bool) -> int:
    """The unsharded parameters held at once: all the stage's units (ZeRO-2, or any K > 1: none is
    resharded before the step's reduction), else the current unit and the prefetched next (ZeRO-3, K = 1)."""
    units = [p for p in param_bytes if p]
    if holds_all or len(units) < 2:
        return sum(units)
    return max(a + b for a, b in zip(units, units[1:]))


def sharded_bytes(nbytes: int, ranks: int) -> int:
    """One rank's shard of ``nbytes`` split over ``ranks``, rounded up."""
    return -(-nbytes // ranks)


def layer_backward_s(layer: LayerCost, checkpoint: str) -> float:
    """One layer's backward as :func:`sim.engine.stage_costs.backward_time_s` times a stage's."""
    return layer.backward_s + rerun_in_backward_s(layer, checkpoint)


@dataclass(frozen=True)
class ShardedMemory:
    """One device's bytes under ZeRO-2/3, as the executor reports them per rank: its shards of the
    parameters, gradients and optimizer state, the unsharded parameters it holds at once at most, and
    (M > 1, gradient sync ``step``) the unsharded gradients accumulated until the once-per-step
    reduce-scatter (what the executor's report counts as held after an action)."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    gathered_parameter_bytes_peak: int
    accumulated_gradient_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes
                + self.gathered_parameter_bytes_peak + self.accumulated_gradient_bytes)

    def to_dict(self) -> dict[str, int]:
        return {"parameter_bytes": self.parameter_bytes, "gradient_bytes": self.gradient_bytes,
                "optimizer_state_bytes": self.optimizer_state_bytes,
                "gathered_parameter_bytes_peak": self.gathered_parameter_bytes_peak,
                "accumulated_gradient_bytes": self.accumulated_gradient_bytes}


def sharded_memory(param_bytes: int, gradient_bytes: int, optimizer_bytes: int, unit_param_bytes: Sequence[int],
                   ranks: int, holds_all: bool, accumulates: bool, expert_gradient_bytes: int = 0,
                   expert_ranks: int = 0) -> ShardedMemory:
    """A device's :class:`ShardedMemory` from its unsharded totals and its units' parameter bytes; with
    ``expert_ranks`` the routed experts' part (``expert_gradient_bytes`` of the gradients, the same share
    of the parameters and optimizer state) sharded over those ranks, the rest over ``ranks``."""
    gathered = gathered_in_flight_bytes(unit_param_bytes, holds_all)
    accumulated = gradient_bytes if accumulates else 0
    if not expert_ranks:
        return ShardedMemory(sharded_bytes(param_bytes, ranks), sharded_bytes(gradient_bytes, ranks),
                             sharded_bytes(optimizer_bytes, ranks), gathered, accumulated)
    expert_params = expert_share(param_bytes, expert_gradient_bytes, gradient_bytes)
    expert_state = expert_share(optimizer_bytes, expert_gradient_bytes, gradient_bytes)

    def split(total: int, experts: int) -> int:
        return sharded_bytes(total - experts, ranks) + sharded_bytes(experts, expert_ranks)

    return ShardedMemory(split(param_bytes, expert_params), split(gradient_bytes, expert_gradient_bytes),
                         split(optimizer_bytes, expert_state), gathered, accumulated)


class FsdpPricing:
    """What ZeRO-2/3 adds to one step of ``layout`` on ``system``: each virtual stage's exposed
    communication per action (:meth:`stage_cost`), each device's reduction after its last backward
    (:meth:`tail_s`) and its memory (:meth:`memory`). ``links``: fitted (all-gather, reduce-scatter,
    all-reduce) links of a costs file, or None each for the catalog's."""

    def __init__(self, table: CostTable, system: System, layout: ParallelLayout, partition: Sequence[int],
                 positions: Sequence[int], links: tuple[Link | None, Link | None, Link | None] = (None, None, None)):
        self.table, self.layout, self.partition = table, layout, partition
        self.bounds = stage_bounds(partition)
        self.positions = list(positions)
        self.gathers_once = sharding_of(layout).holds_all  # else ZeRO-3 on one stage: every micro-batch
        self.every_microbatch = layout.resolved_gradient_sync == "microbatch"  # else once per step
        self.ranks = layout.shard_ranks
        self.expert_ranks = expert_data_ranks(table.workload, layout.replicas)  # 0: no experts split
        if self.expert_ranks and self.ranks < layout.replicas:
            raise GpipeInputError(f"--shard-group {layout.shard_group} with expert parallelism: HSDP of the routed "
                                  "experts over their expert-data-parallel group is not modelled; leave --shard-group out")
        stride = expert_replica_stride(table.workload)
        self.collectives = [Collectives(tuple(shard_group(k, 0, layout)), tuple(replicate_group(k, 0, layout)),
                                        system, *links,
                                        expert_devices=tuple(shard_group(k, 0, layout)[::stride])
                                        if self.expert_ranks else ())
                            for k in range(layout.stages)]
        self._units: dict[tuple[int, int], list[Unit]] = {}

    def units(self, rows: int, virtual_stage: int) -> list[Unit]:
        key = (rows, virtual_stage)
        if key not in self._units:
            first, end = self.bounds[virtual_stage]
            layers = self.table.layers(rows)[first:end]
            checkpoint = self.layout.checkpoint
            self._units[key] = self.collectives[self.positions[virtual_stage]].units(
                layers, [layer_backward_s(layer, checkpoint) for layer in layers])
        return self._units[key]

    def stage_cost(self, rows: int, virtual_stage: int, cost: StageCost) -> StageCost:
        """``cost`` with the communication its actions leave exposed (module docstring): with gradient
        sync ``microbatch`` each backward's reductions too, by what they outlast it (the device's last
        backward's are the step's tail instead, :meth:`tail_s`)."""
        units = self.units(rows, virtual_stage)
        gathered = forward_exposed_s(units)
        reduce_s = self.backward_reduce_s(units, backward_time_s(cost, self.layout.checkpoint))
        if self.gathers_once:  # gathered once per step
            return replace(cost, fsdp_first_forward_gather_s=gathered, fsdp_backward_reduce_s=reduce_s)
        gather_s, _reduce_s, _last = backward_exposed_s(units, True, False)
        return replace(cost, fsdp_forward_gather_s=gathered, fsdp_backward_gather_s=gather_s,
                       fsdp_backward_reduce_s=reduce_s)

    def backward_reduce_s(self, units: Sequence[Unit], backward_s: float) -> float:
        """Gradient sync ``microbatch``: what one backward's reductions leave exposed after it (0 with
        ``step``), as the last backward's are with ``step``: one stage, each unit's beside the backward
        of the units before it, the first unit's whole (ZeRO-3's gathers priced apart, as they are
        there); a pipeline, all of them beside the backward as a whole. So at M = 1 the two syncs
        are one plan."""
        if not self.every_microbatch:
            return 0.0
        if self.layout.stages > 1:
            return pipelined_reduce_exposed_s(units, backward_s)
        return self.one_stage_reduce_s(units)

    def one_stage_reduce_s(self, units: Sequence[Unit]) -> float:
        """One stage: what a backward's reductions add to it, each unit's beside the backward of the units
        before it and the first unit's whole. With ZeRO-3's gathers in the same backward the two are
        priced together (:func:`backward_exposed_s` with both), since they cross the same links: FSDP2
        issues both on the shard group's one process group, and its own comment on the HSDP all-reduce
        stream ("collectives use different network resources and can overlap") is why only that one is
        given a stream of its own (torch ``distributed/fsdp/_fully_shard/_fsdp_param_group.py``). The
        gathers alone are already priced before each backward (``fsdp_backward_gather_s``); this is
        what the reductions add to them, so a backward shows the two together."""
        if self.gathers_once:
            _gathers, reduce_shown, last = backward_exposed_s(units, False, True)
            return reduce_shown + last
        gathers_alone, _reduce, _last = backward_exposed_s(units, True, False)
        gather_shown, reduce_shown, last = backward_exposed_s(units, True, True)
        return gather_shown + reduce_shown + last - gathers_alone

    def tail_s(self, rows: int, chunks: Sequence[int], last_backward_s: float) -> float:
        """Device's reductions left after its last backward. One stage: each unit's reduce-scatter runs
        beside the last micro-batch's backward of the units before it (FSDP2 with gradient sync on for
        that micro-batch), so what outlasts its neighbour's backward shows, and the first unit's whole.
        A pipeline: the once-per-step reductions of its chunks, by what they outlast that backward;
        with gradient sync ``microbatch`` only its first chunk's, the others' having followed their
        own backwards."""
        if self.every_microbatch:
            return self.backward_reduce_s(self.units(rows, chunks[0]), last_backward_s)
        if self.layout.stages == 1:
            return self.one_stage_reduce_s(self.units(rows, chunks[0]))
        units = [u for s in chunks for u in self.units(rows, s)]
        return pipelined_reduce_exposed_s(units, last_backward_s)  # chunk 0's first unit reduces last

    def optimizer_s(self, optimizer_s: float, expert_fraction: float = 0.0) -> float:
        """The optimizer steps the shard alone: with experts split, their ``expert_fraction`` of the
        state over the expert-data-parallel ranks, the rest over the shard group."""
        if not self.expert_ranks:
            return optimizer_s / self.ranks
        return optimizer_s * ((1 - expert_fraction) / self.ranks + expert_fraction / self.expert_ranks)

    def memory(self, rows: int, chunks: Sequence[int], microbatches: int) -> ShardedMemory:
        """Device's :class:`ShardedMemory` over its ``chunks``."""
        params = gradients = optimizer = experts = 0
        units: list[int] = []
        for s in chunks:
            first, end = self.bounds[s]
            gradient, state = self.table.gradient_and_optimizer_bytes(rows, first, end)
            experts += self.table.expert_gradient_bytes(rows, first, end)
            static = self.table.stage(rows, first, end).static_bytes
            params += max(0, static - gradient - state)
            gradients += gradient
            optimizer += state
            units += [layer.param_bytes for layer in self.table.layers(rows)[first:end]]
        sharding = sharding_of(self.layout, microbatches)
        return sharded_memory(params, gradients, optimizer, units, sharding.ranks, sharding.holds_all,
                              sharding.accumulates, experts, self.expert_ranks)


def sharded_layout(layout: Any) -> bool:
    """Whether ``layout`` shards parameters or gradients (ZeRO-2/3 over two ranks or more)."""
    return layout.zero >= 2 and layout.replicas > 1
