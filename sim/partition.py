"""Splitting L layers into K contiguous stages.

Two objectives:

- :func:`min_max_partition` minimises the most expensive stage, the pipeline's bottleneck. It binary
  searches the bottleneck over the O(L^2) candidate segment costs and checks each candidate
  greedily: every stage takes as many layers as it can without exceeding the bottleneck or its
  memory. Greedy is exact here because both limits are monotone (a shorter segment is never slower
  and never needs more memory), whatever the per-stage memory limits are. O(L log L + K L log L).
- :func:`min_variance_partition` is the GPipe paper's heuristic: minimise the variance of the stage
  costs (equivalently, with the total fixed, the sum of their squares), by dynamic programming in
  O(K L^2). It is kept for comparison; it can leave the bottleneck higher than necessary.

Stage memory limits enter as ``fits(stage, first, end) -> bool``, which must be monotone: if the
layers [first, end) fit on a stage, any sub-range does too.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Callable, Sequence

from sim.errors import GpipeInputError

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


def _greedy(prefix: list[float], stages: int, limit: float, fits: Fits | None) -> list[int] | None:
    """Layers per stage when each stage extends as far as ``limit`` and memory allow, else None."""
    num_layers = len(prefix) - 1
    parts, first = [], 0
    for k in range(stages):
        remaining_stages = stages - k - 1
        # the furthest end that leaves one layer for each remaining stage
        last_end = num_layers - remaining_stages
        end = bisect.bisect_right(prefix, prefix[first] + limit * (1 + 1e-12), first + 1, last_end + 1) - 1
        if fits is not None:
            while end > first and not fits(k, first, end):
                end -= 1
        if end <= first:
            return None
        if k == stages - 1 and end != num_layers:
            return None
        parts.append(end - first)
        first = end
    return parts


def min_max_partition(costs: Sequence[float], stages: int, fits: Fits | None = None) -> list[int] | None:
    """Layers per stage minimising the largest stage cost; None if no partition fits memory."""
    _check(len(costs), stages)
    prefix = _prefix(costs)
    n = len(costs)
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    low, high = 0, len(candidates) - 1
    best = _greedy(prefix, stages, candidates[high], fits)
    if best is None:
        return None
    while low < high:
        middle = (low + high) // 2
        parts = _greedy(prefix, stages, candidates[middle], fits)
        if parts is None:
            low = middle + 1
        else:
            best, high = parts, middle
    return best


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
