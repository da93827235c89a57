"""Peak activation memory of a stage without running the simulator, for the partitioner.

Walking a stage's action list, the bytes it holds are always ``a * stash + b * saved`` for whole
numbers a, b (stashed boundary inputs and sets of saved activations of micro-batches in flight).
The peak over the step is therefore the largest of a few such pairs, which depend only on the
schedule, the checkpoint policy, K, M and the stage index, and can be cached. The simulator's own
accounting (:mod:`sim.engine`) is the reference; a test checks the two agree.

Uses the largest micro-batch's sizes for every micro-batch, so with an uneven split it may
overestimate slightly (never underestimate).
"""

from __future__ import annotations

from functools import lru_cache

from sim.schedule import Kind, recomputes, stage_actions
from sim.stage_costs import StageCost


@lru_cache(maxsize=1 << 16)
def peak_coefficients(stages: int, microbatches: int, schedule: str, checkpoint: str,
                      stage: int) -> tuple[tuple[int, int], ...]:
    """Pareto-maximal (stash count, saved-set count) pairs reached on ``stage``."""
    actions = stage_actions(stage, stages, microbatches, schedule, checkpoint)
    stash = saved = 0
    points = set()
    for action in actions:
        m = action.microbatch
        if action.kind is Kind.FORWARD:
            if recomputes(checkpoint, m, microbatches):
                stash += 1
            else:
                saved += 1
        elif action.kind is Kind.RECOMPUTE:
            stash -= 1
            saved += 1
        else:
            saved -= 1
        points.add((stash, saved))
    return tuple(p for p in points
                 if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points))


def peak_activation_bytes(cost: StageCost, stages: int, microbatches: int, schedule: str,
                          checkpoint: str, stage: int) -> int:
    """Peak bytes of stashed inputs and saved activations held by ``stage`` during a step.

    ``saved`` includes the stage's input (see :mod:`sim.stage_costs`), so a re-materialized
    micro-batch moves from holding ``stash`` to holding ``saved``, not both.
    """
    return peak_from_coefficients(cost, peak_coefficients(stages, microbatches, schedule, checkpoint, stage))


def peak_from_coefficients(cost: StageCost, pairs: tuple[tuple[int, int], ...]) -> int:
    """``a * stash + b * saved`` at its largest over the (a, b) pairs of :func:`peak_coefficients`."""
    return max((a * cost.stash_bytes + b * cost.saved_bytes for a, b in pairs), default=0)
