"""The limits of a plan: the deepest model (most layers) that fits in memory for each K.

For each number of stages K and each re-materialization setting, the depth is found by doubling
then bisecting on the ``layers`` option: a depth fits when some micro-batch count M among the
options admits a partition whose every stage holds its weights, gradients, optimizer state, stashed
inputs and saved activations within the device's memory (the partitioner's own memory check,
:func:`sim.planner.search.choose_partition`, so this agrees with ``gpipe plan``). The search packs layers
greedily, which is exact for feasibility and cheap; the partition reported is the planner's. Fitting is assumed
monotone in depth: a model that fits still fits with a layer fewer. The doubling stops at
:data:`MAX_DEPTH` layers: a small model on a large device fits deeper than any model is trained, and is
reported as fitting at least that deep.

"With re-materialization" is the GPipe paper's setting, ``checkpoint=always`` (every micro-batch
keeps only its boundary input until its backward); "without" is ``never``. M is tried largest
first, since smaller micro-batches hold less; the depth reported is the best over the options.

Limits: memory is the simulator's model (:mod:`sim.engine.stage_costs`): no workspace, fragmentation or
communication buffers, so a real run needs some headroom below these depths.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from sim.catalog.hardware import System
from sim.engine.memory import peak_activation_bytes, peak_coefficients
from sim.engine.stage_costs import CostTable, held_sizes, stage_bounds
from sim.planner.search import Candidate, choose_partition
from sim.schedules.microbatch import split_rows
from sim.workloads.workload import Workload

WITH_REMAT, WITHOUT_REMAT = "always", "never"
# The deepest model searched: beyond any model trained (the GPipe paper's deepest, a 1,663-layer
# Transformer, ran on 128 cores), and the planner's partition of this many layers is still quick; a
# model that fits this deep is reported as fitting at least this deep (DepthLimit.capped). Unbounded,
# a small model on an 80 GB device doubled past 100,000 layers, where one partition's candidate
# bottlenecks (every contiguous segment's cost, O(L^2)) take minutes and gigabytes.
MAX_DEPTH = 2048


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds at its peak, in bytes (activations and stash at the same instant)."""

    stage: int
    layers: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # tensors saved for backward, of the micro-batches in flight
    stash_bytes: int  # boundary inputs kept for re-materialization (under full: in activation_bytes)
    capacity_bytes: float

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes
                + self.stash_bytes)


@dataclass(frozen=True)
class DepthLimit:
    """The deepest model that fits on ``stages`` stages with ``checkpoint``; depth 0: none fits;
    ``capped``: it still fits at :data:`MAX_DEPTH`, the deepest searched, so it fits at least that deep."""

    stages: int
    checkpoint: str
    depth: int  # the ``layers`` option
    microbatches: int
    partition: tuple[int, ...]
    parameter_count: int
    memory: tuple[StageMemory, ...]
    capped: bool = False

    def to_dict(self) -> dict:
        data = asdict(self)
        data["memory"] = [{**asdict(m), "total_bytes": m.total_bytes} for m in self.memory]
        return data


def stage_memory(table: CostTable, system: System, batch_size: int, candidate: Candidate,
                 partition: Sequence[int]) -> list[StageMemory]:
    """Per-stage peak memory split into weights, gradients, optimizer state, activations, stash."""
    rows = split_rows(batch_size, candidate.microbatches)[0]
    layers = table.layers(rows)
    out = []
    for k, (first, end) in enumerate(stage_bounds(partition)):
        cost = table.stage(rows, first, end)
        points = peak_coefficients(candidate.stages, candidate.microbatches, candidate.schedule,
                                   candidate.checkpoint, k)
        stash, saved, transient = held_sizes(cost, candidate.checkpoint)
        peak = max(points, default=(0, 0, 0), key=lambda p: p[0] * stash + p[1] * saved + p[2:3].count(1) * transient)
        stash_count, saved_count, running = peak[0], peak[1], peak[2:3].count(1)
        own = layers[first:end]
        out.append(StageMemory(
            stage=k, layers=end - first, weights_bytes=sum(c.param_bytes for c in own),
            gradient_bytes=sum(c.grad_bytes for c in own),
            optimizer_bytes=sum(c.optimizer_bytes for c in own),
            activation_bytes=saved_count * saved + running * transient, stash_bytes=stash_count * stash,
            capacity_bytes=system.device.memory_bytes))
    return out


def _stage_fits(table: CostTable, capacity: float, rows: int, candidate: Candidate, stage: int,
                first: int, end: int) -> bool:
    """The partitioner's memory test (:func:`sim.planner.search.choose_partition`) for one stage."""
    cost = table.stage(rows, first, end)
    c = candidate
    return cost.static_bytes + peak_activation_bytes(cost, c.stages, c.microbatches, c.schedule,
                                                     c.checkpoint, stage) <= capacity


def _packs(table: CostTable, system: System, batch_size: int, candidate: Candidate) -> bool:
    """Whether the layers fit on the candidate's stages: each stage takes as many as fit.

    Greedy packing is exact for feasibility because fitting is monotone in the layer range, and
    with a binary search per stage it costs O(K log L) stage checks where the min-max partitioner
    costs O(L^2 log L); the partitioner then runs once, at the depth found.
    """
    rows = split_rows(batch_size, candidate.microbatches)[0]
    total, start = table.workload.num_layers, 0
    capacity = system.device.memory_bytes
    for stage in range(candidate.stages):
        if not _stage_fits(table, capacity, rows, candidate, stage, start, start + 1):
            return False
        low, high = start + 1, total + 1  # [start, low) fits; [start, high) does not (or is past L)
        while high - low > 1:
            middle = (low + high) // 2
            if _stage_fits(table, capacity, rows, candidate, stage, start, middle):
                low = middle
            else:
                high = middle
        start = low
        if start == total:
            return stage + 1 <= candidate.stages
    return False


def _fit(workload: Workload, system: System, batch_size: int, stages: int, microbatches: Sequence[int],
         checkpoint: str, schedule: str, partition: bool = False) -> tuple[Candidate, list[int] | None, CostTable] | None:
    """The first (largest) M among ``microbatches`` whose layers fit, or None.

    With ``partition`` the min-max partitioner's choice comes along (None if it finds none).
    """
    if stages > workload.num_layers:
        return None
    table = CostTable(workload, system.device)
    for m in sorted(set(microbatches), reverse=True):
        candidate = Candidate(stages, len(split_rows(batch_size, m)), checkpoint, schedule)
        if not partition and _packs(table, system, batch_size, candidate):
            return candidate, None, table
        if partition:
            chosen = choose_partition(table, system, batch_size, candidate)
            if chosen is not None:
                return candidate, chosen, table
    return None


def max_depth(make_workload: Callable[[int], Workload], system: System, batch_size: int, stages: int,
              microbatches: Sequence[int], checkpoint: str, schedule: str = "gpipe") -> DepthLimit:
    """The largest ``layers`` for which ``make_workload(layers)`` fits on ``stages`` stages."""
    microbatches = [m for m in microbatches if m <= batch_size] or [batch_size]
    cache: dict[int, bool] = {}  # whether each depth tried fits (its cost table is not kept)

    def fit(depth: int) -> bool:
        if depth not in cache:
            cache[depth] = _fit(make_workload(depth), system, batch_size, stages, microbatches,
                                checkpoint, schedule) is not None
        return cache[depth]

    extra_layers = make_workload(1).num_layers - 1  # e.g. a transformer's embedding and head
    low = max(1, stages - extra_layers)
    if not fit(low):
        return DepthLimit(stages, checkpoint, 0, 0, (), 0, ())
    high = min(low * 2, MAX_DEPTH)
    while high > low and fit(high):
        low, high = high, min(high * 2, MAX_DEPTH)
    capped = low == MAX_DEPTH
    while high - low > 1:  # fit(low) holds, fit(high) does not
        middle = (low + high) // 2
        if fit(middle):
            low = middle
        else:
            high = middle
    final = _fit(make_workload(low), system, batch_size, stages, microbatches, checkpoint, schedule, True)
    while final is None and low > 1:  # greedy packing and the partitioner disagree only at the edge
        low -= 1
        final = _fit(make_workload(low), system, batch_size, stages, microbatches, checkpoint, schedule, True)
    if final is None:
        return DepthLimit(stages, checkpoint, 0, 0, (), 0, ())
    candidate, partition, table = final
    memory = stage_memory(table, system, batch_size, candidate, partition)
    return DepthLimit(stages, checkpoint, low, candidate.microbatches, tuple(partition),
                      int(table.workload.describe()["parameter_count"]), tuple(memory), capped and low == MAX_DEPTH)


def depth_limits(make_workload: Callable[[int], Workload], system: System, batch_size: int,
                 stage_options: Sequence[int], microbatches: Sequence[int],
                 schedule: str = "gpipe") -> list[tuple[DepthLimit, DepthLimit]]:
    """(with re-materialization, without) for every K in ``stage_options``."""
    return [tuple(max_depth(make_workload, system, batch_size, k, microbatches, policy, schedule)
                  for policy in (WITH_REMAT, WITHOUT_REMAT))  # type: ignore[misc]
            for k in stage_options]


def format_limits(limits: Sequence[tuple[DepthLimit, DepthLimit]], system: System, batch_size: int,
                  model: str, precision: str) -> str:
    """A table of depths per K, then each limit's per-stage memory breakdown in GiB."""
    gib = 1 << 30
    capacity = system.device.memory_bytes / gib
    lines = [f"deepest {model} that fits, batch {batch_size}, {precision}, on {system.name} "
             f"({system.device.name}, {capacity:.1f} GiB per device)",
             f"{'K':>4}  {'re-materialization (always)':>34}  {'none (never)':>34}"]
    for pair in limits:
        cells = [f"{('>=' if d.capped else '') + str(d.depth):>6} layers, M={d.microbatches:<3} "
                 f"{d.parameter_count / 1e9:>7.2f}B params"
                 if d.depth else f"{'does not fit even one layer':>34}" for d in pair]
        lines.append(f"{pair[0].stages:>4}  {cells[0]:>34}  {cells[1]:>34}")
    if any(d.capped for pair in limits for d in pair):
        lines.append(f">=: still fits at {MAX_DEPTH} layers, the deepest searched")
    lines.append("per-stage memory at the limit (GiB): weights, gradients, optimizer state, "
                 "activations, stashed inputs, total")
    for pair in limits:
        for limit in pair:
            if not limit.depth:
                continue
            lines.append(f"K={limit.stages} checkpoint {limit.checkpoint}, {limit.depth} layers, "
                         f"M={limit.microbatches}, partition {','.join(map(str, limit.partition))}")
            for m in limit.memory:
                lines.append(f"  stage {m.stage:>3} ({m.layers:>4} layers): {m.weights_bytes / gib:7.2f} "
                             f"{m.gradient_bytes / gib:7.2f} {m.optimizer_bytes / gib:7.2f} "
                             f"{m.activation_bytes / gib:7.2f} {m.stash_bytes / gib:7.2f}  = "
                             f"{m.total_bytes / gib:7.2f} of {capacity:.2f}")
    return "\n".join(lines)
