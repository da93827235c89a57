"""The held-out runs summed up: median and worst errors, the noise beside them, the misses past the goals.

Oversubscribed runs (:mod:`calibrate.validate.held_out_design`) and runs not judged (a round's speed
correction out of bounds, :mod:`calibrate.validate.held_out`) are counted, not summed.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from calibrate.goals import BUBBLE_GOAL_POINTS, BUSY_GOAL, STEP_GOAL, past
from calibrate.validate.comparison import Comparison


def summarize(all_comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """Median and worst errors over the runs judged; oversubscribed ones and ones not judged are counted."""
    comparisons = [c for c in all_comparisons if not c.oversubscribed and not c.not_judged]
    steps = [abs(c.step_error) for c in comparisons]
    at_reference = [abs(c.step_error_at_reference) for c in comparisons]
    memory = [abs(e) for c in comparisons for e in c.memory_errors]
    busy = [abs(e) for c in comparisons for e in c.busy_errors]
    busy_at_reference = [abs(e) for c in comparisons for e in c.busy_errors_at_reference]
    bubbles = [abs(c.bubble_error_points) for c in comparisons]
    kinds: dict[str, list[float]] = {}  # signed: a kind predicted low everywhere shows as such
    worst_step = max(comparisons, key=lambda c: abs(c.step_error_at_reference), default=None)
    stage_busy = [(abs(e), interval, c, k) for c in comparisons
                  for k, (e, interval) in enumerate(zip(c.busy_errors_at_reference, c.busy_error_intervals_at_reference))]
    worst_stage = max(stage_busy, key=lambda item: item[0], default=None)
    half_widths = [(high - low) / 2 for c in comparisons for low, high in [c.step_error_interval_at_reference]]
    busy_half_widths = [(high - low) / 2 for _, (low, high), _, _ in stage_busy]
    for c in comparisons:
        for kind, errors in c.kind_errors_at_reference.items():
            kinds.setdefault(kind, []).extend(e for e in errors if e is not None)
    return {"runs": len(comparisons), "oversubscribed_runs": sum(1 for c in all_comparisons if c.oversubscribed),
            "not_judged_runs": sum(1 for c in all_comparisons if c.not_judged),
            "median_busy_error": statistics.median(busy) if busy else 0.0, "worst_busy_error": max(busy, default=0.0),
            "median_busy_error_at_reference": statistics.median(busy_at_reference) if busy_at_reference else 0.0,
            "worst_busy_error_at_reference": max(busy_at_reference, default=0.0),
            "median_bubble_error_points": statistics.median(bubbles) if bubbles else 0.0,
            "worst_bubble_error_points": max(bubbles, default=0.0),
            "median_step_error": statistics.median(steps) if steps else 0.0,
            "worst_step_error": max(steps, default=0.0),
            "median_step_error_at_reference": statistics.median(at_reference) if at_reference else 0.0,
            "worst_step_error_at_reference": max(at_reference, default=0.0),
            "median_round_spread": statistics.median(c.round_spread for c in comparisons) if comparisons else 0.0,
            "median_busy_round_spread": (statistics.median(c.busy_round_spread for c in comparisons)
                                         if comparisons else 0.0),
            "median_memory_error": statistics.median(memory) if memory else 0.0,
            "worst_memory_error": max(memory, default=0.0),
            "median_kind_error_at_reference": {kind: statistics.median(errors) for kind, errors in kinds.items()},
            # the noise beside the errors: how far each run's own rounds let its error move (median_interval)
            "median_step_error_half_width_at_reference": statistics.median(half_widths) if half_widths else 0.0,
            "worst_step_error_interval_at_reference": (list(worst_step.step_error_interval_at_reference)
                                                       if worst_step else [0.0, 0.0]),
            "runs_with_step_error_beyond_noise": sum(1 for c in comparisons for low, high in
                                                     [c.step_error_interval_at_reference] if not low <= 0.0 <= high),
            "median_busy_error_half_width_at_reference": (statistics.median(busy_half_widths)
                                                          if busy_half_widths else 0.0),
            "worst_busy_error_interval_at_reference": list(worst_stage[1]) if worst_stage else [0.0, 0.0],
            "worst_busy_stage_at_reference": _stage_entry(worst_stage[2], worst_stage[3]) if worst_stage else None,
            "runs_with_bubble_error_beyond_noise": sum(1 for c in comparisons for low, high in
                                                       [c.bubble_error_interval_points] if not low <= 0.0 <= high),
            **halves_summary(comparisons, worst_step), **probed_warm_up_summary(comparisons),
            "beyond_goals_beyond_noise": beyond_goals(comparisons)}


def beyond_goals(comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """The errors that miss their goal by more than their own rounds allow: the stages whose busy error
    at the reference speed has its whole interval (:func:`calibrate.validate.intervals.median_interval`)
    beyond :data:`BUSY_GOAL`, also with the warm-up at each run's after-wait probe where runs were
    probed, and the runs whose step or bubble interval lies beyond :data:`STEP_GOAL` or
    :data:`BUBBLE_GOAL_POINTS`. An error past its goal whose interval still reaches inside it is one this
    machine's noise can explain; these cannot be. Each stage as [run, stage, error, low, high]; each run
    as [run, error, low, high]."""
    def stages(errors: Callable[[Comparison], list[float]],
               intervals: Callable[[Comparison], list[tuple[float, float]]]) -> list[list[Any]]:
        return [[c.run, k, e, low, high] for c in comparisons
                for k, (e, (low, high)) in enumerate(zip(errors(c), intervals(c))) if past((low, high), BUSY_GOAL)]

    result: dict[str, Any] = {
        "stages": sum(len(c.busy_errors_at_reference) for c in comparisons),
        "busy": stages(lambda c: c.busy_errors_at_reference, lambda c: c.busy_error_intervals_at_reference),
        "step": [[c.run, c.step_error_at_reference, *c.step_error_interval_at_reference] for c in comparisons
                 if past(c.step_error_interval_at_reference, STEP_GOAL)],
        "bubble": [[c.run, c.bubble_error_points, *c.bubble_error_interval_points] for c in comparisons
                   if past(c.bubble_error_interval_points, BUBBLE_GOAL_POINTS)]}
    if any(c.round_warm_up_factors for c in comparisons):
        result["busy_at_probed_warm_up"] = stages(lambda c: c.busy_errors_at_probed_warm_up,
                                                  lambda c: c.busy_error_intervals_at_probed_warm_up)
    return result


def _stage_entry(comparison: Comparison, stage: int) -> dict[str, Any]:
    """A stage named in the summary: its run, its index, how much of its predicted busy time is the
    warm-up after long waits (0 where none was recorded) and its run's after-wait probe against the
    calibration's."""
    shares = comparison.warm_up_shares
    return {"run": comparison.run, "stage": stage, "warm_up_share": shares[stage] if stage < len(shares) else 0.0,
            "warm_up_factor": comparison.warm_up_factor}


def probed_warm_up_summary(comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """The busy errors with each stage's warm-up at its run's probed after-wait loss
    (:attr:`Comparison.busy_errors_at_probed_warm_up`): median, worst and where, and how far the runs'
    probes ranged against the calibration's; {} where no run has probes against a reference."""
    probed = [c for c in comparisons if c.round_warm_up_factors]
    stages = [(abs(e), c, k) for c in probed for k, e in enumerate(c.busy_errors_at_probed_warm_up)]
    if not stages:
        return {}
    worst = max(stages, key=lambda item: item[0])
    rounds = [f for c in probed for f in c.round_warm_up_factors]
    return {"median_busy_error_at_probed_warm_up": statistics.median(e for e, _, _ in stages),
            "worst_busy_error_at_probed_warm_up": worst[0],
            "worst_busy_stage_at_probed_warm_up": _stage_entry(worst[1], worst[2]),
            "warm_up_factor_range": [min(c.warm_up_factor for c in probed), max(c.warm_up_factor for c in probed)],
            "round_warm_up_factor_range": [min(rounds), max(rounds)]}


def halves_summary(comparisons: Sequence[Comparison], worst_step: Comparison | None) -> dict[str, Any]:
    """How far the two half calibrations put each run's step apart (in points of its error): median
    and worst, and ``worst_step``'s errors by each half; {} without halves."""
    apart = [high - low for c in comparisons if c.step_error_halves_at_reference
             for low, high in [c.step_error_halves_at_reference]]
    if not apart or worst_step is None:
        return {}
    return {"median_halves_apart": statistics.median(apart), "worst_halves_apart": max(apart),
            "worst_step_error_halves_at_reference": list(worst_step.step_error_halves_at_reference or (0.0, 0.0))}
