"""Searching K, M, checkpoint policy, schedule and partition for the fastest plan that fits.

Every candidate gets a partition (min-max by default, respecting per-stage memory through
:mod:`sim.memory`) and a cheap lower bound on its step time. Candidates are then simulated in
order of their lower bound, and the search stops once the bound of the next candidate exceeds the
``top``-th best simulated step time: the ranking it returns is exact, yet most candidates are never
simulated.

The lower bound for stage k: the forwards of the first micro-batch on stages before k, all of stage
k's own work, and the backwards of one micro-batch on stages before k (a stage's last backward
must still flow back to stage 0). It ignores communication, so it never exceeds the simulated time.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from sim.engine import SimResult, simulate
from sim.errors import GpipeInputError
from sim.hardware import System
from sim.memory import peak_coefficients, peak_from_coefficients
from sim.microbatch import split_rows
from sim.partition import min_max_partition, min_variance_partition
from sim.schedule import CHECKPOINT_POLICIES, SCHEDULES, recomputes
from sim.stage_costs import CostTable, StageCost, stage_bounds
from sim.workload import Workload

PARTITIONERS = {"min_max": min_max_partition, "variance": min_variance_partition}
Progress = Callable[[int, int, "PlanOption | None"], None]


@dataclass(frozen=True)
class Candidate:
    stages: int
    microbatches: int
    checkpoint: str
    schedule: str


@dataclass
class PlanOption:
    candidate: Candidate
    partition: list[int] | None  # None: no partition fits memory
    lower_bound_s: float
    result: SimResult | None = None

    @property
    def step_time_s(self) -> float:
        return self.result.step_time_s if self.result else float("inf")

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

    @property
    def best(self) -> PlanOption | None:
        return self.ranked[0] if self.ranked else None


def default_stage_options(system: System, num_layers: int) -> list[int]:
    """Powers of two up to the number of devices and layers."""
    limit = min(system.total_devices, num_layers)
    options, k = [], 1
    while k <= limit:
        options.append(k)
        k *= 2
    return options


def candidates(stage_options: Iterable[int], microbatch_options: Iterable[int], batch_size: int,
               checkpoints: Sequence[str] = CHECKPOINT_POLICIES,
               schedules: Sequence[str] = SCHEDULES) -> list[Candidate]:
    """Every combination; M values that torch.chunk would turn into the same split appear once."""
    out = []
    for k in stage_options:
        seen_splits = set()
        for m in microbatch_options:
            split = tuple(split_rows(batch_size, m))
            if split in seen_splits:
                continue
            seen_splits.add(split)
            for checkpoint in checkpoints:
                if checkpoint == "except_last" and len(split) == 1:
                    continue  # identical to never with one micro-batch
                for schedule in schedules:
                    if schedule == "1f1b" and k == 1:
                        continue  # identical to gpipe on one stage
                    out.append(Candidate(k, len(split), checkpoint, schedule))
    return out


def _layer_weights(table: CostTable, rows: int, checkpoint: str) -> list[float]:
    layers = table.layers(rows)
    recompute = checkpoint != "never"
    return [c.forward_s + c.backward_s + (c.recompute_s if recompute else 0.0) for c in layers]


def choose_partition(table: CostTable, system: System, batch_size: int, candidate: Candidate,
                     partitioner: str = "min_max") -> list[int] | None:
    """The partition of ``candidate`` under ``partitioner``, or None if nothing fits memory."""
    rows = split_rows(batch_size, candidate.microbatches)[0]
    capacity = system.device.memory_bytes
    c = candidate

    held = [peak_coefficients(c.stages, c.microbatches, c.schedule, c.checkpoint, k) for k in range(c.stages)]

    def fits(stage: int, first: int, end: int) -> bool:  # coefficients looked up once, not per call
        cost = table.stage(rows, first, end)
        return cost.static_bytes + peak_from_coefficients(cost, held[stage]) <= capacity

    weights = _layer_weights(table, rows, c.checkpoint)
    if c.stages > len(weights):
        return None
    return PARTITIONERS[partitioner](weights, c.stages, None if capacity == float("inf") else fits)


def default_partition(workload: Workload, system: System, batch_size: int, candidate: Candidate,
                      partitioner: str = "min_max", table: CostTable | None = None) -> list[int]:
    """The partition ``gpipe simulate`` and ``gpipe train`` use when none is given.

    The best partition that fits memory; if none fits, the best one ignoring memory, so that the
    simulation can report which stage overflows and by how much.
    """
    table = table if table is not None else CostTable(workload, system.device)
    partition = choose_partition(table, system, batch_size, candidate, partitioner)
    if partition is None:
        unlimited = System("unlimited", replace(system.device, memory_bytes=float("inf")),
                           system.devices_per_node, system.intra_link, system.inter_link, system.nodes)
        partition = choose_partition(table, unlimited, batch_size, candidate, partitioner)
    assert partition is not None  # without memory limits some partition always exists
    return partition


def lower_bound_s(table: CostTable, batch_size: int, candidate: Candidate, partition: list[int]) -> float:
    rows = split_rows(batch_size, candidate.microbatches)
    bounds = stage_bounds(partition)
    by_rows: dict[int, list[StageCost]] = {r: [table.stage(r, a, b) for a, b in bounds] for r in set(rows)}
    first = by_rows[rows[0]]
    best = 0.0
    fill = drain = 0.0
    for k in range(len(partition)):
        busy = first[k].optimizer_s + first[k].step_overhead_s
        for m, r in enumerate(rows):
            cost = by_rows[r][k]
            busy += cost.forward_s + cost.backward_s
            if recomputes(candidate.checkpoint, m, len(rows)):
                busy += cost.recompute_s
        best = max(best, fill + busy + drain)
        fill += first[k].forward_s
        drain += min(by_rows[r][k].backward_s for r in by_rows)
    return best


def balanced_bound_s(table: CostTable, batch_size: int, candidate: Candidate) -> float:
    """A lower bound that needs no partition: the whole model's work spread evenly over K stages.

    The slowest stage does at least the average; :func:`lower_bound_s` is never below this.
    """
    rows = split_rows(batch_size, candidate.microbatches)
    layers = table.workload.num_layers
    whole_model = table.stage(rows[0], 0, layers)
    total = whole_model.optimizer_s + whole_model.step_overhead_s * candidate.stages  # every stage has it
    for m, r in enumerate(rows):
        whole = table.stage(r, 0, layers)
        total += whole.forward_s + whole.backward_s
        if recomputes(candidate.checkpoint, m, len(rows)):
            total += whole.recompute_s
    return total / candidate.stages


def search(workload: Workload, system: System, batch_size: int, stage_options: Sequence[int],
           microbatch_options: Sequence[int], checkpoints: Sequence[str] = CHECKPOINT_POLICIES,
           schedules: Sequence[str] = SCHEDULES, partitioner: str = "min_max", top: int = 10,
           progress: Progress | None = None) -> SearchResult:
    """Rank the ``top`` fastest fitting plans among all candidates (exactly; see module doc).

    Best-first on two bounds: candidates wait, ordered by :func:`balanced_bound_s`, until their
    partition is needed; partitioned ones wait, ordered by :func:`lower_bound_s`, until their
    simulation is. A candidate is simulated only when no other can have a smaller bound, and the
    search ends when the smallest bound left exceeds the ``top``-th best simulated step.
    """
    if partitioner not in PARTITIONERS:
        raise GpipeInputError(f"unknown partitioner {partitioner!r}; choose one of {', '.join(PARTITIONERS)}")
    started = time.perf_counter()
    table = CostTable(workload, system.device)
    unfit: list[PlanOption] = []
    all_candidates = candidates(stage_options, microbatch_options, batch_size, checkpoints, schedules)
    waiting = sorted(((balanced_bound_s(table, batch_size, c), i, c) for i, c in enumerate(all_candidates)),
                     key=lambda entry: entry[:2])
    partitioned: list[tuple[float, int, PlanOption]] = []  # min-heap by lower bound
    kept: list[tuple[float, int, PlanOption]] = []  # max-heap of the top fitting, by -step time
    simulated = examined = 0
    next_waiting = 0
    while True:
        worst_kept = -kept[0][0] if len(kept) >= top else float("inf")
        cheapest_waiting = waiting[next_waiting][0] if next_waiting < len(waiting) else float("inf")
        if partitioned and partitioned[0][0] <= cheapest_waiting:
            bound, index, option = heapq.heappop(partitioned)
            if bound > worst_kept:
                break
            c = option.candidate
            option.result = simulate(workload, system, option.partition, batch_size, c.microbatches,
                                     c.checkpoint, c.schedule, costs=table, record=False)
            simulated += 1
            if option.result.fits:
                heapq.heappush(kept, (-option.step_time_s, index, option))
                if len(kept) > top:
                    heapq.heappop(kept)
            else:
                unfit.append(option)
            if progress is not None:
                progress(examined, len(all_candidates), max(kept, key=lambda entry: entry[0])[2] if kept else None)
        elif next_waiting < len(waiting):
            if cheapest_waiting > worst_kept:
                break
            _, index, candidate = waiting[next_waiting]
            next_waiting += 1
            examined += 1
            partition = choose_partition(table, system, batch_size, candidate, partitioner)
            if partition is None:
                unfit.append(PlanOption(candidate, None, float("inf")))
                continue
            bound = lower_bound_s(table, batch_size, candidate, partition)
            heapq.heappush(partitioned, (bound, index, PlanOption(candidate, partition, bound)))
        else:
            break
    ranked = sorted((entry[2] for entry in kept),
                    key=lambda o: (o.step_time_s, o.max_peak_memory_bytes, o.candidate.stages))
    return SearchResult(ranked=ranked, candidates=len(all_candidates), simulated=simulated,
                        not_fitting=len(unfit), elapsed_s=time.perf_counter() - started,
                        unfit_examples=unfit[:5], partitioned=examined)
