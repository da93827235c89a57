"""Splitting L layers into K contiguous stages.

Two objectives:

- :func:`min_max_partition` minimises the most expensive stage, the pipeline's bottleneck. It binary
  searches the bottleneck over the O(L^2) candidate segment costs, upwards from the memory-free one,
  and checks each candidate by sweeping which layer boundaries each stage can end on, O(K L) per
  check, so O(L^2 log L + K L log L) in all, with O(K L) calls of the memory check. Exact, including with a different memory limit per stage.
  Of the partitions at that bottleneck it returns a level one: last stage first, each stage starts at
  the feasible boundary nearest an equal share of what is left (98 layers in 48 chunks: two of 3 and
  46 of 2, not 25 of 3 and 23 of 1), so the stages below the bottleneck are as even as it allows.
- :func:`min_variance_partition` is the GPipe paper's heuristic: minimise the variance of the stage
  costs (equivalently, with the total fixed, the sum of their squares), by dynamic programming in
  O(K L^2). It is kept for comparison; it can leave the bottleneck higher than necessary.

Stage memory limits enter as ``fits(stage, first, end) -> bool``, which must be monotone: if the
layers [first, end) fit on a stage, any sub-range does too.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Callable, Sequence

from sim.errors import GpipeInputError, require_positive

Fits = Callable[[int, int, int], bool]


def _prefix(costs: Sequence[float]) -> list[float]:
    return [0.0, *itertools.accumulate(costs)]


def _check(num_layers: int, stages: int) -> None:
    if stages <= 0:
        raise GpipeInputError(f"stages (K) must be a positive integer, got {stages}; use --stages 1 or more")
    if stages > num_layers:
        raise GpipeInputError(
            f"{stages} stages for a model of {num_layers} layers leaves a stage empty; "
            f"use --stages {num_layers} or fewer")


def _memory_ends(num_layers: int, stage: int, fits: Fits | None) -> list[int]:
    """For each first layer i, the furthest end j such that layers [i, j) fit ``stage``'s memory.

    Fitting is monotone, so the furthest end never decreases with i: a two-pointer sweep with
    O(L) calls of ``fits``. ``ends[i] == i`` means not even layer i alone fits.
    """
    if fits is None:
        return [num_layers] * num_layers
    ends, j = [], 0
    for i in range(num_layers):
        j = max(j, i)
        while j < num_layers and fits(stage, i, j + 1):
            j += 1
        ends.append(j)
    return ends


def _furthest_ends(prefix: list[float], limit: float, memory_ends: list[int]) -> list[int]:
    """For each first layer i, the furthest end within ``limit`` and memory (two pointers again)."""
    num_layers = len(prefix) - 1
    ends, j = [], 0
    bound = limit * (1 + 1e-12)
    for i in range(num_layers):
        j = max(j, i)
        while j < num_layers and prefix[j + 1] - prefix[i] <= bound:
            j += 1
        ends.append(min(j, memory_ends[i]))
    return ends


def _feasible(prefix: list[float], limit: float, memory_ends: list[list[int]]) -> list[int] | None:
    """Layers per stage with no stage above ``limit`` or over memory, or None if impossible.

    Tracks which layer boundaries stage k can end on (reachable from boundary 0), as intervals: each
    stage's furthest ends never decrease with the first layer, so a run of reachable first layers
    that can each take a layer reaches one interval of boundaries. O(K) intervals per stage in the
    worst case, usually one. A greedy "take as much as you can" is not enough when memory limits
    differ per stage.
    """
    num_layers = len(prefix) - 1
    within = _furthest_ends(prefix, limit, [num_layers] * num_layers)  # the limit alone, then each memory's
    furthest: dict[int, tuple[list[int], list[int]]] = {}  # stages sharing one memory-ends list share these
    reachable = [(0, 0)]  # boundaries reachable after 0 stages, as closed intervals
    history = []
    for memory in memory_ends:
        key = id(memory)
        if key not in furthest:
            ends = list(map(min, within, memory))
            stuck = [0]  # running count of first layers that cannot take even one layer
            for first, end in enumerate(ends):
                stuck.append(stuck[-1] + (end <= first))
            furthest[key] = (ends, stuck)
        ends, stuck = furthest[key]
        after: list[tuple[int, int]] = []
        for low, high in reachable:
            high = min(high, num_layers - 1)
            first = low
            while first <= high:
                if ends[first] <= first:
                    first += 1
                    continue
                last = high
                if stuck[high + 1] - stuck[first]:  # a first layer that takes nothing splits the run
                    last = first
                    while last < high and ends[last + 1] > last + 1:
                        last += 1
                lo, hi = first + 1, ends[last]
                if after and lo <= after[-1][1] + 1:
                    after[-1] = (after[-1][0], max(after[-1][1], hi))
                else:
                    after.append((lo, hi))
                first = last + 1
        history.append((reachable, ends))
        reachable = after
    if not any(low <= num_layers <= high for low, high in reachable):
        return None
    parts, end = [], num_layers
    for k in range(len(memory_ends) - 1, -1, -1):
        starts, ends = history[k]
        target = prefix[end] * k / (k + 1)  # the stages before this one and it, level: an equal share each
        start = min((i for low, high in starts for i in range(low, min(high, end - 1) + 1) if ends[i] >= end),
                    key=lambda i: (abs(prefix[i] - target), -i))
        parts.append(end - start)
        end = start
    parts.reverse()
    return parts


@lru_cache(maxsize=256)
def _segment_costs(costs: tuple[float, ...]) -> list[float]:
    """Every contiguous segment's cost, sorted: the bottlenecks a partition can have (the planner asks
    for the same layer costs with many stage counts and memory limits)."""
    prefix, n = _prefix(costs), len(costs)
    return sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})


def min_max_partition(costs: Sequence[float], stages: int, fits: Fits | None = None,
                      memory_ends: list[list[int]] | None = None) -> list[int] | None:
    """Layers per stage minimising the largest stage cost; None if no partition fits memory.

    ``memory_ends`` may replace ``fits``: per stage, the furthest end that fits from each first
    layer (stages sharing one list object share the work on it)."""
    _check(len(costs), stages)
    prefix = _prefix(costs)
    n = len(costs)
    candidates = _segment_costs(tuple(costs))
    if fits is None and memory_ends is None:  # one memory-ends list for all stages; a greedy test finds the bottleneck
        memory_ends = [[n] * n] * stages
        return _feasible(prefix, candidates[_lowest_limit(tuple(costs), stages)], memory_ends)
    if memory_ends is None:
        memory_ends = [_memory_ends(n, k, fits) for k in range(stages)]
    # Memory only raises the bottleneck: search upwards from the memory-free one, galloping (most
    # layouts fit there or just above), then bisect what is left
    longest: dict[int, int] = {}  # the most layers each memory-ends list lets one stage take
    for ends in memory_ends:
        if id(ends) not in longest:
            longest[id(ends)] = max(end - first for first, end in enumerate(ends))
    if sum(longest[id(ends)] for ends in memory_ends) < n:  # the stages cannot hold every layer
        return None
    low, high = _lowest_limit(tuple(costs), stages), len(candidates) - 1
    best = _feasible(prefix, candidates[high], memory_ends)
    if best is None:  # not even the loosest limit fits
        return None
    probe, step = low, 1
    while probe < high:
        found = _feasible(prefix, candidates[probe], memory_ends)
        if found is not None:
            best, high = found, probe
            break
        low, probe, step = probe + 1, min(high, probe + step), 2 * step
    while low < high:
        middle = (low + high) // 2
        parts = _feasible(prefix, candidates[middle], memory_ends)
        if parts is None:
            low = middle + 1
        else:
            best, high = parts, middle
    return best


@lru_cache(maxsize=1024)
def _lowest_limit(costs: tuple[float, ...], stages: int) -> int:
    """:func:`_lowest_greedy_limit` of ``costs``, kept: the planner asks it for one list of layer
    costs with each stage count many times."""
    return _lowest_greedy_limit(_prefix(costs), _segment_costs(costs), stages)


def _lowest_greedy_limit(prefix: list[float], candidates: list[float], stages: int) -> int:
    """Index of the smallest candidate bottleneck that K stages can meet without memory limits.

    Without memory limits, "at most K contiguous parts of at most ``limit``" is decided greedily in
    O(L) (take as many layers as fit, then the next part), and with K <= L at most K parts means
    exactly K non-empty ones: the same test as :func:`_feasible`, which then builds the partition
    once, so the result is the one the general search returns.
    """
    n = len(prefix) - 1

    def greedy_fits(limit: float) -> bool:
        bound = limit * (1 + 1e-12)  # the tolerance of _furthest_ends
        parts, start = 0, 0
        while start < n:
            end = start
            while end < n and prefix[end + 1] - prefix[start] <= bound:
                end += 1
            if end == start:
                return False  # one layer alone is over the limit
            parts += 1
            if parts > stages:
                return False
            start = end
        return True

    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        if greedy_fits(candidates[middle]):
            high = middle
        else:
            low = middle + 1
    return high


def min_variance_partition(costs: Sequence[float], stages: int, fits: Fits | None = None) -> list[int] | None:
    """The GPipe paper's heuristic: layers per stage minimising the variance of stage costs."""
    _check(len(costs), stages)
    prefix = _prefix(costs)
    n = len(costs)
    inf = math.inf
    # best[k][j]: least sum of squared stage costs putting layers [0, j) on stages 0..k
    best = [[inf] * (n + 1) for _ in range(stages)]
    choice = [[-1] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        if fits is None or fits(0, 0, j):
            best[0][j] = prefix[j] ** 2
    for k in range(1, stages):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                if best[k - 1][i] == inf or (fits is not None and not fits(k, i, j)):
                    continue
                value = best[k - 1][i] + (prefix[j] - prefix[i]) ** 2
                if value < best[k][j]:
                    best[k][j], choice[k][j] = value, i
    if best[stages - 1][n] == inf:
        return None
    ends, j = [n], n
    for k in range(stages - 1, 0, -1):
        j = choice[k][j]
        ends.append(j)
    ends.reverse()
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


def even_partition(num_layers: int, stages: int) -> tuple[int, ...]:
    """Split ``num_layers`` over ``stages`` as evenly as possible, earlier stages one more."""
    require_positive("stages (K)", stages, "use --stages 1 or more")
    if stages > num_layers:
        raise GpipeInputError(f"--stages {stages} is more than the model's {num_layers} layers; "
                              f"use at most {num_layers} stages")
    base, extra = divmod(num_layers, stages)
    return tuple(base + (1 if k < extra else 0) for k in range(stages))


def stage_costs(costs: Sequence[float], partition: Sequence[int]) -> list[float]:
    """The summed cost of each stage of ``partition``."""
    prefix = _prefix(costs)
    out, first = [], 0
    for count in partition:
        out.append(prefix[first + count] - prefix[first])
        first += count
    return out


def brute_force_min_max(costs: Sequence[float], stages: int, fits: Fits | None = None) -> float:
    """The optimal bottleneck by trying every partition; for tests on small cases only."""
    n, best = len(costs), math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        if fits is not None and not all(fits(k, bounds[k], bounds[k + 1]) for k in range(stages)):
            continue
        parts = [bounds[k + 1] - bounds[k] for k in range(stages)]
        best = min(best, max(stage_costs(costs, parts)))
    return best
