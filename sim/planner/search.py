"""Searching D, K, V, M, checkpoint policy, schedule, placement and partition for the fastest plan that fits.

On a system of N devices the search covers D data-parallel replicas of a K-stage pipeline with
D x K <= N, V chunks per device for the interleaved schedule (V x K <= layers, M a multiple of K),
each placement that differs (:mod:`sim.engine.placement`: on one node, or with D = 1 or K = 1, both
layouts are the same devices) and, when asked, ZeRO-1. ``batch_size`` is the global batch.

Every candidate gets a partition (min-max by default, respecting per-device memory through
:mod:`sim.engine.memory`) and a cheap lower bound on its step time (:mod:`sim.planner.bounds`). Candidates
are then simulated in order of their lower bound, and the search stops once the bound of the next
candidate exceeds the ``top``-th best simulated step time: the ranking it returns is exact, yet most
candidates are never partitioned, let alone simulated.

Partitions are cached: without a memory limit that binds, a partition depends on the micro-batch
rows, the checkpoint policy and V x K alone, so the placements, D and M of a candidate share it.
With the interleaved schedule the partitioner balances the V x K chunks checking each chunk's own
memory, then the whole device is checked; a plan that fits only by unbalancing chunks is not found.
"""

from __future__ import annotations

import bisect
import heapq
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from sim.catalog.hardware import Link, System
from sim.engine.engine import SimResult, simulate
from sim.formats.layout import ZERO_STAGES
from sim.engine.fsdp import gathered_in_flight_bytes
from sim.engine.memory import (Sharding, chunk_coefficients, expert_static_bytes, peak_coefficients,
                               peak_from_coefficients, sharded_static_bytes, sharding_of, with_expert_ranks)
from sim.engine.placement import PLACEMENTS
from sim.errors import GpipeInputError
from sim.planner.bounds import BalancedBounds, balanced_bound_s, lower_bound_s, replica_rows
from sim.planner.candidates import (Candidate, candidates, default_replica_options,  # noqa: F401 (the planner's names)
                                    default_stage_options, gradient_syncs, placements_differ)
from sim.planner.partition import min_max_partition, min_variance_partition
from sim.schedules.microbatch import split_rows
from sim.schedules.schedule import (CHECKPOINT_POLICIES, PLANNED_SCHEDULES, device_of_virtual_stage,
                                    virtual_stages_of_device)
from sim.engine.range_memory import RangeMemory
from sim.engine.stage_costs import CostTable, held_sizes, stage_bounds
from sim.workloads.moe.expert_parallel import expert_data_ranks, expert_replica_stride
from sim.workloads.workload import Workload, shared_parameters

__all__ = ["Candidate", "PlanOption", "SearchResult", "balanced_bound_s", "candidates", "choose_partition",
           "default_partition", "default_stage_options", "lower_bound_s", "placements_differ", "search", "simulate_candidate"]

PARTITIONERS = {"min_max": min_max_partition, "variance": min_variance_partition}
Progress = Callable[[int, int, "PlanOption | None"], None]


@dataclass
class PlanOption:
    candidate: Candidate
    partition: list[int] | None  # V x K entries; None: no partition fits memory
    lower_bound_s: float
    result: SimResult | None = None
    weight: float = 1.0  # what a second of its step costs in the ranking (1: rank by time)
    hardware: str = ""  # the system it was planned on (gpipe plan over several)
    cost: Any = None  # its days and dollars (sim.planner.training_cost.TrainingCost), where asked for

    @property
    def step_time_s(self) -> float:
        return self.result.step_time_s if self.result else float("inf")

    @property
    def score(self) -> float:
        """What the search ranks by: the step time, times ``weight`` (devices x price to rank by cost)."""
        return self.step_time_s * self.weight

    @property
    def max_peak_memory_bytes(self) -> int:
        return max(s.peak_memory_bytes for s in self.result.stages) if self.result else 0


@dataclass
class SearchResult:
    ranked: list[PlanOption]  # fitting plans, fastest first
    candidates: int
    simulated: int
    not_fitting: int
    elapsed_s: float
    unfit_examples: list[PlanOption] = field(default_factory=list)
    partitioned: int = 0  # candidates whose partition was computed; the rest were bounded out
    over_limit: int = 0  # candidates whose step (or its lower bound) exceeds ``step_limit_s``

    @property
    def best(self) -> PlanOption | None:
        return self.ranked[0] if self.ranked else None


def _layer_weights(table: CostTable, rows: int, checkpoint: str) -> list[float]:
    layers = table.layers(rows)
    recompute = checkpoint != "never"
    return [c.forward_s + c.backward_s + (c.recompute_s if recompute else 0.0) for c in layers]


class Partitions:
    """:func:`choose_partition` with the memory-free partitions cached across candidates."""

    def __init__(self, table: CostTable, system: System, batch_size: int, partitioner: str = "min_max",
                 given: Sequence[int] | None = None) -> None:
        self.table, self.system, self.batch_size, self.partitioner = table, system, batch_size, partitioner
        self.given = list(given) if given is not None else None  # a stated split, taken for its V x K, memory or not
        self.expert_stride = expert_replica_stride(table.workload)  # ZeRO-1 splits expert state over D / this
        self._shardings: dict[Candidate, Sharding] = {}
        self._free: dict[tuple, list[int] | None] = {}
        self._ends: dict[tuple, list[int]] = {}
        self._ranges: dict[tuple, RangeMemory] = {}

    def __call__(self, candidate: Candidate) -> list[int] | None:
        c = candidate
        rows = replica_rows(self.batch_size, c.replicas, c.microbatches)
        parts = c.stages * c.virtual_stages
        if parts > self.table.workload.num_layers:
            return None
        if self.given is not None and len(self.given) == parts:
            return list(self.given)
        key = (rows[0], c.checkpoint != "never", parts)
        if key not in self._free:
            weights = _layer_weights(self.table, rows[0], c.checkpoint)
            self._free[key] = PARTITIONERS[self.partitioner](weights, parts, None)
        free = self._free[key]
        capacity = self.system.device.memory_bytes
        if capacity == float("inf"):
            return free
        if self._static_share(rows[0], c) > capacity:  # some device holds at least its share of the weights
            return None
        if free is not None and self._fits_holding_everything(free, rows[0], len(rows), c):
            return free
        held = [peak_coefficients(c.stages, len(rows), c.schedule, c.checkpoint, k, c.virtual_stages)
                for k in range(c.stages)]
        if free is not None and self._devices_fit(free, rows[0], held, c):
            return free
        return self._constrained(rows[0], held, c)

    def _static_share(self, rows: int, c: Candidate) -> float:
        """The K devices' static bytes (weights, gradients, optimizer state) averaged: the fullest
        holds at least this much, whatever the partition, so above capacity nothing fits."""
        layers = self.table.workload.num_layers
        whole = self.table.stage(rows, 0, layers).static_bytes
        gradient, optimizer = self.table.gradient_and_optimizer_bytes(rows, 0, layers)
        sharding = self._sharding(c)
        experts = self.table.expert_gradient_bytes(rows, 0, layers)
        if sharding.zero >= 2:  # the shards alone: the gathered units come on top
            params = max(0, whole - gradient - optimizer)
            return sharded_static_bytes(params, gradient, optimizer, 0, sharding, experts) / c.stages
        return expert_static_bytes(whole, optimizer, gradient, experts, sharding.ranks, sharding.zero,
                                   self.expert_stride) / c.stages

    def _sharding(self, c: Candidate) -> Sharding:
        """:func:`_sharding` of ``c``, under ZeRO-2/3 with the routed experts over their expert-data-parallel
        ranks where the workload splits them (:func:`sim.workloads.moe.expert_parallel.expert_data_ranks`)."""
        found = self._shardings.get(c)
        if found is None:
            found = self._shardings[c] = with_expert_ranks(_sharding(c), expert_data_ranks(self.table.workload,
                                                                                              c.replicas))
        return found

    def _memory_ends(self, rows: int, counts: tuple[tuple[int, int, int], ...], c: Candidate) -> list[int]:
        """For each first layer, the furthest end whose layers fit one chunk holding ``counts`` (a
        two-pointer sweep: fitting is monotone in the range); all ranges at once where the stages
        are sums of layers (:mod:`sim.engine.range_memory`)."""
        capacity = self.system.device.memory_bytes
        layers = self.table.workload.num_layers
        if self.table.workload.stage_cost is None:
            key = (rows, c.checkpoint, self._sharding(c))
            if key not in self._ranges:
                self._ranges[key] = RangeMemory(self.table.layers(rows), shared_parameters(self.table.workload),
                                                c.checkpoint, self._sharding(c), self.expert_stride)
            return self._ranges[key].furthest_ends(counts, capacity)

        def fits(first: int, end: int) -> bool:
            stash, saved, transient = held_sizes(self.table.stage(rows, first, end), c.checkpoint)
            peak = max(a * stash + b * saved + t * transient for a, b, t in counts)
            return self._chunk_static(rows, first, end, c) + peak <= capacity

        ends, j = [], 0
        for i in range(layers):
            j = max(j, i)
            while j < layers and fits(i, j + 1):
                j += 1
            ends.append(j)
        return ends

    def _fits_holding_everything(self, partition: Sequence[int], rows: int, microbatches: int, c: Candidate) -> bool:
        """Whether each device fits even holding every micro-batch's largest of stash and saved
        activations on every chunk at once: more than any schedule holds, and cheap to check."""
        bounds = stage_bounds(partition)
        capacity = self.system.device.memory_bytes
        for k in range(c.stages):
            total = 0
            for a, b in (bounds[s] for s in virtual_stages_of_device(k, c.stages, c.virtual_stages, c.schedule)):
                stash, saved, transient = held_sizes(self.table.stage(rows, a, b), c.checkpoint)
                total += self._chunk_static(rows, a, b, c) + microbatches * max(stash, saved) + transient
            if total > capacity:
                return False
        return True

    def _chunk_static(self, rows: int, first: int, end: int, c: Candidate) -> int:
        cost = self.table.stage(rows, first, end)
        gradient_bytes, optimizer_bytes = self.table.gradient_and_optimizer_bytes(rows, first, end)
        sharding = self._sharding(c)
        if sharding.zero >= 2:
            params = max(0, cost.static_bytes - gradient_bytes - optimizer_bytes)
            gathered = gathered_in_flight_bytes([layer.param_bytes for layer in self.table.layers(rows)[first:end]],
                                                sharding.holds_all)
            return sharded_static_bytes(params, gradient_bytes, optimizer_bytes, gathered, sharding,
                                        self.table.expert_gradient_bytes(rows, first, end))
        return expert_static_bytes(cost.static_bytes, optimizer_bytes, gradient_bytes,
                                   self.table.expert_gradient_bytes(rows, first, end), sharding.ranks, sharding.zero,
                                   self.expert_stride)

    def _devices_fit(self, partition: Sequence[int], rows: int, held, c: Candidate) -> bool:
        bounds = stage_bounds(partition)
        capacity = self.system.device.memory_bytes
        for k in range(c.stages):
            chunks = [bounds[s] for s in virtual_stages_of_device(k, c.stages, c.virtual_stages, c.schedule)]
            total = sum(self._chunk_static(rows, a, b, c) for a, b in chunks)
            total += peak_from_coefficients([self.table.stage(rows, a, b) for a, b in chunks], held[k], c.checkpoint)
            if total > capacity:
                return False
        return True

    def _constrained(self, rows: int, held, c: Candidate) -> list[int] | None:
        # Each part's furthest fitting end per first layer depends only on its chunk's activation counts
        # (and the rows, policy and state sharding), which many parts and candidates share: swept once each
        ends = []
        for part in range(c.stages * c.virtual_stages):
            device, chunk = device_of_virtual_stage(part, c.stages, c.schedule), part // c.stages
            key = (rows, c.checkpoint, self._sharding(c), chunk_coefficients(held[device], chunk, c.checkpoint))
            if key not in self._ends:
                self._ends[key] = self._memory_ends(rows, key[-1], c)
            ends.append(self._ends[key])

        def fits(part: int, first: int, end: int) -> bool:
            return end <= ends[part][first]

        weights = _layer_weights(self.table, rows, c.checkpoint)
        if self.partitioner == "min_max":
            partition = min_max_partition(weights, c.stages * c.virtual_stages, memory_ends=ends)
        else:
            partition = PARTITIONERS[self.partitioner](weights, c.stages * c.virtual_stages, fits)
        if partition is None or (c.virtual_stages > 1 and not self._devices_fit(partition, rows, held, c)):
            return None
        return partition


def _sharding(c: Candidate) -> Sharding:
    """What of ``c`` a device's static memory depends on (:func:`sim.engine.memory.sharding_of`): with
    no ZeRO over D > 1 replicas every D holds what one replica does."""
    return sharding_of(c)


def choose_partition(table: CostTable, system: System, batch_size: int, candidate: Candidate,
                     partitioner: str = "min_max") -> list[int] | None:
    """The partition of ``candidate`` (V x K entries) under ``partitioner``, or None if nothing fits memory."""
    return Partitions(table, system, batch_size, partitioner)(candidate)


def default_partition(workload: Workload, system: System, batch_size: int, candidate: Candidate,
                      partitioner: str = "min_max", table: CostTable | None = None) -> list[int]:
    """The partition ``gpipe simulate`` and ``gpipe train`` use when none is given.

    The best partition that fits memory; if none fits, the best one ignoring memory, so that the
    simulation can report which stage overflows and by how much.
    """
    table = table if table is not None else CostTable(workload, system.device)
    partition = choose_partition(table, system, batch_size, candidate, partitioner)
    if partition is None:
        unlimited = replace(system, name="unlimited", device=replace(system.device, memory_bytes=float("inf")))
        partition = choose_partition(table, unlimited, batch_size, candidate, partitioner)
    assert partition is not None  # without memory limits some partition always exists
    return partition


def simulate_candidate(workload: Workload, system: System, partition: Sequence[int], batch_size: int,
                       candidate: Candidate, table: CostTable | None = None, record: bool = False,
                       allreduce_link: Link | None = None, dp_overlap: bool = False) -> SimResult:
    """:func:`sim.engine.engine.simulate` of ``candidate`` with ``partition``."""
    return simulate(workload, system, partition, batch_size, candidate, costs=table, record=record,
                    allreduce_link=allreduce_link, dp_overlap=dp_overlap)


def distinct_policies(workload: Workload, checkpoints: Sequence[str]) -> list[str]:
    """``selective`` only where it is a plan of its own: where the workload has an attention core to
    recompute, and not beside ``never`` under flash attention, which keeps no attention probabilities
    to drop (the two would be the same plan twice)."""
    flash = workload.options.get("attention") == "flash"
    return [c for c in checkpoints
            if c != "selective" or (workload.has_attention_core and not (flash and "never" in checkpoints))]


def search(workload: Workload, system: System, batch_size: int, stage_options: Sequence[int],
           microbatch_options: Sequence[int], checkpoints: Sequence[str] = CHECKPOINT_POLICIES,
           schedules: Sequence[str] = PLANNED_SCHEDULES, partitioner: str = "min_max", top: int = 10,
           progress: Progress | None = None, replica_options: Sequence[int] = (1,),
           virtual_options: Sequence[int] = (2,), zero_options: Sequence[int] = (0,),
           placements: Sequence[str] = PLACEMENTS, allreduce_link: Link | None = None,
           dp_overlap: bool = False, weight: Callable[[Candidate], float] | None = None,
           max_groups: int | None = None, step_limit_s: Callable[[Candidate], float] | None = None,
           escalate_zero: bool = False, shard_group: int | None = None,
           shard_group_options: Sequence[int] = (),
           gradient_sync_options: Sequence[str | None] = (None,), ceiling_score: float = float("inf"),
           max_zero: int = ZERO_STAGES[-1], partition: Sequence[int] | None = None) -> SearchResult:
    """Rank the ``top`` fastest fitting plans among all candidates (exactly; see module doc).

    Best-first on two bounds: candidates wait, ordered by :func:`balanced_bound_s`, until their
    partition is needed; partitioned ones wait, ordered by :func:`lower_bound_s`, until their
    simulation is. A candidate is simulated only when no other can have a smaller bound, and the
    search ends when the smallest bound left exceeds the ``top``-th best simulated step.
    ``selective`` is searched only where it is a plan of its own (:func:`distinct_policies`).
    ``dp_overlap`` (:func:`sim.engine.engine.simulate`) leaves the all-reduce out of the bounds, which stay
    bounds: an overlapped all-reduce adds nothing or more.

    ``weight`` ranks by step time times a per-candidate factor instead (its devices times their
    price, to rank by cost): the bounds scale with it and stay bounds. ``max_groups`` drops
    candidates of more than that many D x K stage devices. ``step_limit_s`` gives each candidate the
    longest step it may take (what a limit on days or dollars allows it): a candidate is dropped as
    soon as a lower bound of its step exceeds it, and after its simulation if the step does, so the
    ranking stays exact among the plans within the limits.

    ``escalate_zero`` (``gpipe plan``'s default ``--zero-options auto``): a candidate of D > 1 that
    does not fit memory is tried again at the next ZeRO stage (0, 1, 2, 3 in turn), so each layout
    is ranked at the least sharding it fits with, and layouts that fit only sharded are found.

    ``ceiling_score``: the ``top``-th best score other searches of the same question have found (the
    planner's searches of several E): nothing scoring above it can enter the merged ranking, so the
    search ends once every bound left exceeds it, as it does past its own ``top``-th best. ``max_zero``:
    the highest ZeRO stage ``escalate_zero`` goes to. ``partition``: a split every candidate of its V x K
    takes in place of the partitioner's (a published run's, :mod:`sim.evidence.pipeline_split`), its memory
    checked by the simulation alone.
    """
    if partitioner not in PARTITIONERS:
        raise GpipeInputError(f"unknown partitioner {partitioner!r}; choose one of {', '.join(PARTITIONERS)}")
    checkpoints = distinct_policies(workload, checkpoints)
    started = time.perf_counter()
    table = CostTable(workload, system.device)
    unfit: list[PlanOption] = []
    all_candidates = candidates(stage_options, microbatch_options, batch_size, checkpoints, schedules,
                                replica_options, virtual_options, zero_options, placements, system,
                                workload.num_layers, shard_group, shard_group_options, gradient_sync_options)
    if max_groups is not None:
        all_candidates = [c for c in all_candidates if c.stages * c.replicas <= max_groups]
    weigh = weight or (lambda _candidate: 1.0)
    limit = step_limit_s or (lambda _candidate: float("inf"))
    bound_system = None if dp_overlap else system
    balanced = BalancedBounds(table, batch_size, bound_system, allreduce_link)
    bounded = [(balanced(c), i, c) for i, c in enumerate(all_candidates)]
    within = [(bound, i, c) for bound, i, c in bounded if bound <= limit(c)]
    over_limit = len(bounded) - len(within)
    waiting = sorted(((bound * weigh(c), i, c) for bound, i, c in within), key=lambda entry: entry[:2])
    partitions = Partitions(table, system, batch_size, partitioner, partition)
    extra = len(all_candidates)  # indices of the candidates escalated to a higher ZeRO stage

    def escalate(candidate: Candidate) -> None:
        """Queue ``candidate`` at the next ZeRO stage, where asked and there is one."""
        nonlocal extra, over_limit
        if not escalate_zero or candidate.replicas < 2 or candidate.zero >= max_zero:
            return
        zero = candidate.zero + 1
        group = shard_group if zero >= 2 and shard_group and candidate.replicas % shard_group == 0 else None
        counts = {len(split_rows(rows, candidate.microbatches)) for rows in split_rows(batch_size, candidate.replicas)}
        for sync in gradient_syncs(zero, counts, gradient_sync_options):
            sharded = replace(candidate, zero=zero, shard_group=group, gradient_sync=sync)
            bound = balanced(sharded)
            if bound > limit(sharded):
                over_limit += 1
                continue
            bisect.insort(waiting, (bound * weigh(sharded), extra, sharded), lo=next_waiting)
            extra += 1

    partitioned: list[tuple[float, int, PlanOption]] = []  # min-heap by lower bound
    kept: list[tuple[float, int, PlanOption]] = []  # max-heap of the top fitting, by -step time
    simulated = examined = 0
    next_waiting = 0
    while True:
        worst_kept = min(-kept[0][0] if len(kept) >= top else float("inf"), ceiling_score)
        cheapest_waiting = waiting[next_waiting][0] if next_waiting < len(waiting) else float("inf")
        if partitioned and partitioned[0][0] <= cheapest_waiting:
            bound, index, option = heapq.heappop(partitioned)
            if bound > worst_kept:
                break
            option.result = simulate_candidate(workload, system, option.partition, batch_size, option.candidate, table,
                                               allreduce_link=allreduce_link, dp_overlap=dp_overlap)
            simulated += 1
            if option.result.step_time_s > limit(option.candidate):
                over_limit += 1
            elif option.result.fits:
                heapq.heappush(kept, (-option.score, index, option))
                if len(kept) > top:
                    heapq.heappop(kept)
            else:
                if index < len(all_candidates):  # an escalated one is counted once, as its first try
                    unfit.append(option)
                escalate(option.candidate)
            if progress is not None:
                progress(examined, len(all_candidates), max(kept, key=lambda entry: entry[0])[2] if kept else None)
        elif next_waiting < len(waiting):
            if cheapest_waiting > worst_kept:
                break
            _, index, candidate = waiting[next_waiting]
            next_waiting += 1
            examined += 1
            partition = partitions(candidate)
            if partition is None:
                if index < len(all_candidates):
                    unfit.append(PlanOption(candidate, None, float("inf")))
                escalate(candidate)
                continue
            bound = lower_bound_s(table, batch_size, candidate, partition, bound_system, allreduce_link)
            if bound > limit(candidate):
                over_limit += 1
                continue
            factor = weigh(candidate)
            heapq.heappush(partitioned, (bound * factor, index, PlanOption(candidate, partition, bound, weight=factor)))
        else:
            break
    ranked = sorted((entry[2] for entry in kept), key=lambda o: (o.score, o.max_peak_memory_bytes,
                                                                  o.candidate.stages * o.candidate.replicas,
                                                                  o.candidate.stages))
    return SearchResult(ranked=ranked, candidates=len(all_candidates), simulated=simulated,
                        not_fitting=len(unfit), elapsed_s=time.perf_counter() - started,
                        unfit_examples=unfit[:5], partitioned=examined, over_limit=over_limit)
