"""Peak memory of a device without running the simulator, for the partitioner and the planner.

Walking a device's action list, the bytes it holds are always ``sum over its chunks c of
a_c * stash_c + b_c * saved_c`` for whole numbers a_c, b_c (stashed boundary inputs and sets of
saved activations of micro-batches in flight on chunk c; one chunk unless the schedule is
interleaved). The peak over the step is therefore the largest of a few such vectors, which depend
only on the schedule, the checkpoint policy, K, M, V and the device, and can be cached. The
simulator's own accounting (:mod:`sim.engine.engine`) is the reference; a test checks the two agree.

Static bytes (weights, gradients, optimizer state) are held all step; with ZeRO-1 over D replicas
a device keeps 1/D of its optimizer state (:func:`static_bytes`); with ZeRO-2/3 over N shard ranks
1/N of each, plus the unsharded parameters in flight (:func:`sharded_static_bytes`, :mod:`sim.engine.fsdp`);
with expert parallelism the routed experts' 1/EDP of theirs instead (their expert-data-parallel group).

Uses the largest micro-batch's sizes for every micro-batch, so with an uneven split it may
overestimate slightly (never underestimate).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple, Sequence

from sim.engine.stage_costs import StageCost, held_sizes
from sim.schedules.schedule import Kind, recomputes, recomputes_per_layer, stage_actions

Point = tuple[int, ...]  # (stash count, saved count) per chunk, chunk 0 first


def peak_coefficients(stages: int, microbatches: int, schedule: str, checkpoint: str,
                      stage: int, virtual_stages: int = 1) -> tuple[Point, ...]:
    """Pareto-maximal (stash, saved) counts per chunk reached on device ``stage``: with one chunk,
    pairs (a, b); with V chunks, vectors (a_0, b_0, ..., a_{V-1}, b_{V-1}) reached before anything
    but a forward (a superset of the maximal ones, which every caller's maximum of a non-negative
    combination cannot tell apart). Under ``full`` each vector ends with V more entries, 1 for the
    chunk whose backward is running (its transient, :func:`sim.engine.stage_costs.held_sizes`), 0 elsewhere.

    GPipe's devices all run the same list, and a 1F1B device's depends only on its warm-up
    (min(K - k - 1, M) forwards), so those are computed once per list, not once per device; and
    ``selective`` and ``selective_op`` keep whole micro-batches as ``never`` does (their smaller saved size is
    the cost's)."""
    if checkpoint in ("selective", "selective_op"):
        checkpoint = "never"
    if schedule == "gpipe":
        return _peak_coefficients(1, microbatches, schedule, checkpoint, 0, 1)
    if schedule == "1f1b":
        return _peak_coefficients(min(stages - stage - 1, microbatches) + 1, microbatches, schedule, checkpoint, 0, 1)
    return _peak_coefficients(stages, microbatches, schedule, checkpoint, stage, virtual_stages)


@lru_cache(maxsize=1 << 16)
def _peak_coefficients(stages: int, microbatches: int, schedule: str, checkpoint: str,
                       stage: int, virtual_stages: int = 1) -> tuple[Point, ...]:
    actions = stage_actions(stage, stages, microbatches, schedule, checkpoint, virtual_stages)
    counts = [0] * (2 * virtual_stages)
    per_layer = recomputes_per_layer(checkpoint)
    idle = (0,) * virtual_stages if per_layer else ()
    points = set()
    for index, action in enumerate(actions):
        base = 2 * (action.stage // stages)  # chunk of the virtual stage, times two
        if per_layer and action.kind is Kind.BACKWARD:  # the recomputed layer's tensors, on top
            running = [0] * virtual_stages
            running[action.stage // stages] = 1
            points.add(tuple(counts) + tuple(running))
        if action.kind is Kind.FORWARD:
            if recomputes(checkpoint, action.microbatch, microbatches):
                counts[base] += 1
            else:
                counts[base + 1] += 1
        elif action.kind is Kind.RECOMPUTE:
            counts[base] -= 1
            counts[base + 1] += 1
        elif action.kind is not Kind.INPUT:  # B, or W after its I: the micro-batch is freed
            counts[base + 1] -= 1
        following = actions[index + 1] if index + 1 < len(actions) else None
        if following is None or following.kind is not Kind.FORWARD:  # a forward next only adds: dominated
            points.add(tuple(counts) + idle)
    if virtual_stages > 1:  # in 2V or 3V dimensions the maximal set is most of them: not worth filtering
        return tuple(sorted(points, reverse=True))
    return _maximal(points)


def _maximal(points: set[Point]) -> tuple[Point, ...]:
    """The points no other point dominates. Taken in descending order, a point's dominator comes
    before it and is itself maximal (or dominated by one that is), so comparing with the kept
    points suffices: fast while the kept set is small, as it is here."""
    kept: list[Point] = []
    for p in sorted(points, reverse=True):
        if not any(all(x >= y for x, y in zip(q, p)) for q in kept):
            kept.append(p)
    return tuple(kept)


def peak_activation_bytes(cost: StageCost, stages: int, microbatches: int, schedule: str,
                          checkpoint: str, stage: int) -> int:
    """Peak bytes of stashed inputs and saved activations held by ``stage`` during a step.

    ``saved`` includes the stage's input (see :mod:`sim.engine.stage_costs`), so a re-materialized
    micro-batch moves from holding ``stash`` to holding ``saved``, not both.
    """
    return peak_from_coefficients(cost, peak_coefficients(stages, microbatches, schedule, checkpoint, stage),
                                  checkpoint)


def peak_from_coefficients(cost: StageCost | Sequence[StageCost], points: tuple[Point, ...],
                           checkpoint: str) -> int:
    """``sum_c a_c * stash_c + b_c * saved_c (+ t_c * transient_c)`` at its largest over ``points``
    of :func:`peak_coefficients` for ``checkpoint``; ``cost`` is the one chunk's, or the device's
    chunks' in order."""
    costs = (cost,) if isinstance(cost, StageCost) else tuple(cost)
    terms = [held_sizes(c, checkpoint) for c in costs]
    chunks = len(terms)
    best = 0
    for p in points:
        total = 0
        for i, (stash, saved, transient) in enumerate(terms):
            total += p[2 * i] * stash + p[2 * i + 1] * saved
            if len(p) > 2 * chunks:
                total += p[2 * chunks + i] * transient
        best = max(best, total)
    return best


@lru_cache(maxsize=1 << 14)
def chunk_coefficients(points: tuple[Point, ...], chunk: int, checkpoint: str) -> tuple[tuple[int, int, int], ...]:
    """The (stash, saved, transient) counts of chunk ``chunk`` alone over ``points``, maximal ones
    only: what :func:`chunk_peak_from_coefficients` maximises over, usually one or two triples."""
    chunks = len(points[0]) // (3 if recomputes_per_layer(checkpoint) else 2) if points else 1
    triples = {(p[2 * chunk], p[2 * chunk + 1], p[2 * chunks + chunk] if len(p) > 2 * chunks else 0) for p in points}
    return tuple(_maximal(triples)) if triples else ((0, 0, 0),)  # type: ignore[arg-type]


def chunk_peak_from_coefficients(cost: StageCost, points: tuple[Point, ...], chunk: int, checkpoint: str) -> int:
    """The peak of chunk ``chunk``'s own activations alone: never above the device's, so a chunk
    that does not fit by itself rules the device out (the partitioner's per-chunk check)."""
    stash, saved, transient = held_sizes(cost, checkpoint)
    chunks = len(points[0]) // (3 if recomputes_per_layer(checkpoint) else 2) if points else 1
    return max((p[2 * chunk] * stash + p[2 * chunk + 1] * saved
                + (p[2 * chunks + chunk] * transient if len(p) > 2 * chunks else 0) for p in points), default=0)


def static_bytes(stage_static_bytes: int, optimizer_bytes: int, replicas: int = 1, zero: int = 0) -> int:
    """Bytes held all step: weights, gradients and optimizer state; with ZeRO-1 the optimizer state
    is split over the D ranks of the data-parallel group (each keeps ceil(1/D) of it; torch's
    ZeroRedundancyOptimizer shards by whole parameters, so real shards can be less even)."""
    if zero and replicas > 1:
        return stage_static_bytes - optimizer_bytes + -(-optimizer_bytes // replicas)
    return stage_static_bytes


def expert_static_bytes(stage_static_bytes: int, optimizer_bytes: int, gradient_bytes: int, expert_gradient_bytes: int,
                        replicas: int = 1, zero: int = 0, expert_stride: int = 1) -> int:
    """:func:`static_bytes` with expert parallelism: under ZeRO-1 the routed experts' optimizer state
    (its share of the optimizer bytes, as its gradients' of the gradients) is split over the D /
    ``expert_stride`` replicas holding the same experts (their expert-data-parallel group,
    :func:`sim.workloads.moe.expert_parallel.expert_replica_stride`), the rest over all D."""
    if not expert_gradient_bytes:
        return static_bytes(stage_static_bytes, optimizer_bytes, replicas, zero)
    expert_state = optimizer_bytes * expert_gradient_bytes // max(1, gradient_bytes)
    return (static_bytes(stage_static_bytes - expert_state, optimizer_bytes - expert_state, replicas, zero)
            + static_bytes(expert_state, expert_state, max(1, replicas // expert_stride), zero))


class Sharding(NamedTuple):
    """What a layout's ZeRO stage does to a device's static bytes: the stage (0: nothing sharded),
    the ranks it shards over, and under ZeRO-2/3 whether every unit's parameters are held gathered
    at once (ZeRO-2, or K > 1) and whether unsharded gradients accumulate over micro-batches (M > 1
    and reduce-scattered once per step, gradient sync ``step``; with ``microbatch`` each micro-batch's
    are reduce-scattered after its backward into the sharded gradient: sim.engine.fsdp)."""

    zero: int = 0
    ranks: int = 1
    holds_all: bool = True
    accumulates: bool = False
    expert_ranks: int = 0  # ZeRO-2/3 with E > 1: the routed experts' expert-data-parallel ranks; 0: as the rest


def sharding_of(layout: Any, microbatches: int | None = None) -> Sharding:
    """The :class:`Sharding` of a :class:`sim.formats.layout.ParallelLayout` (``microbatches``: as run,
    where torch.chunk makes fewer than asked); nothing sharded with one replica."""
    if not layout.zero or layout.replicas < 2:
        return Sharding()
    if layout.zero == 1:
        return Sharding(1, layout.replicas)
    m = layout.microbatches if microbatches is None else microbatches
    return Sharding(layout.zero, layout.shard_ranks, layout.zero == 2 or layout.stages > 1,
                    m > 1 and layout.resolved_gradient_sync == "step")


def with_expert_ranks(sharding: Sharding, expert_ranks: int) -> Sharding:
    """``sharding`` with the routed experts sharded over ``expert_ranks`` under ZeRO-2/3 (0: no experts split)."""
    return sharding._replace(expert_ranks=expert_ranks) if sharding.zero >= 2 and expert_ranks else sharding


def expert_share(total: Any, expert_gradient_bytes: Any, gradient_bytes: Any) -> Any:
    """The routed experts' part of ``total`` parameter or optimizer bytes: their gradients' share of the
    gradients (the experts' parameters are in the same dtypes as the rest). Takes arrays as it takes ints."""
    return total * expert_gradient_bytes // (gradient_bytes + (gradient_bytes == 0))


def sharded_static_bytes(param_bytes: Any, gradient_bytes: Any, optimizer_bytes: Any, gathered_bytes: Any,
                         sharding: Sharding, expert_gradient_bytes: Any = 0) -> Any:
    """ZeRO-2/3: a device's shards of its parameters, gradients and optimizer state (each rounded up),
    the unsharded parameters it holds at once (``gathered_bytes``), and accumulated unsharded gradients.
    With ``sharding.expert_ranks`` the routed experts' part (``expert_gradient_bytes`` of the gradients,
    the same share of the parameters and optimizer state) is sharded over those ranks instead."""
    n = sharding.ranks
    accumulated = gradient_bytes if sharding.accumulates else 0
    experts = 0
    if sharding.expert_ranks:
        e = sharding.expert_ranks
        expert_params = expert_share(param_bytes, expert_gradient_bytes, gradient_bytes)
        expert_state = expert_share(optimizer_bytes, expert_gradient_bytes, gradient_bytes)
        experts = -(-expert_params // e) - (-expert_gradient_bytes // e) - (-expert_state // e)
        param_bytes, optimizer_bytes = param_bytes - expert_params, optimizer_bytes - expert_state
        gradient_bytes = gradient_bytes - expert_gradient_bytes
    return (-(-param_bytes // n) - (-gradient_bytes // n) - (-optimizer_bytes // n) + experts + gathered_bytes
            + accumulated)
