"""The same held-out measurement judged by several calibrations: how far the moment of calibration
moves a run's error.

``gpipe validate --costs A B ...`` measures the held-out runs once and predicts each with every
costs file. The two measures of noise a single calibration carries (a run's own rounds, the
calibration's odd and even design rounds) both come from a few minutes of one machine; on a shared
machine the next calibration, taken at another stretch of minutes, moves every fit together, by more
than either of those shows (docs/notes/2026-11-26-moment-of-calibration.md). Judging
one measurement by several calibrations shows that third noise beside each error, without the
validation's own noise mixed in; the median over the calibrations' errors is the error with the
moment of calibration averaged out.

Each calibration puts the run at its own reference speed (its own probes' median), as a single
validation does. Limits: the calibrations must be of the same model, batch, precision, optimizer and
machine, and profile the same process counts (refused otherwise); with two calibrations the median
is their mean; N calibrations' range grows with N.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from calibrate.goals import BUBBLE_GOAL_POINTS, BUSY_GOAL, STEP_GOAL, past_by_every

# what two costs files must share for their predictions of one held-out run to be comparable
SAME_CALIBRATION_KEYS = ("model", "batch_size", "precision", "optimizer")


def check_same_calibration(first: dict[str, Any], other: dict[str, Any], other_name: str) -> None:
    """Refuse, in one line, a costs file that cannot predict the same held-out runs as ``first``."""
    from sim.formats.costs import MeasuredWorkload
    from sim.errors import GpipeInputError

    for key in SAME_CALIBRATION_KEYS:
        if first.get(key) != other.get(key):
            raise GpipeInputError(f"costs file {other_name!r} calibrated another {key.replace('_', ' ')} "
                                  f"({other.get(key)!r}, not {first.get(key)!r}); give costs files of one "
                                  "gpipe calibrate command")
    if set(first.get("pipeline", {})) != set(other.get("pipeline", {})):
        raise GpipeInputError(f"costs file {other_name!r} fitted K in {sorted(other.get('pipeline', {}))}, "
                              f"not {sorted(first.get('pipeline', {}))}; give costs files of one gpipe calibrate "
                              "command")
    if MeasuredWorkload(first).tensor_parallel_options != MeasuredWorkload(other).tensor_parallel_options:
        raise GpipeInputError(f"costs file {other_name!r} profiled other tensor-parallel splits; give costs "
                              "files of one gpipe calibrate command")


def run_entry(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One held-out run as each calibration judged it (``runs``: its result dicts, one per costs
    file, the first file's first): each one's errors and step error interval
    (:func:`calibrate.validate.intervals.median_interval`), their range and their median, and whether every
    calibration's interval lies on one side of zero (``beyond_noise``; per stage for the busy time,
    ``busy_beyond_noise``; for the bubble, in points, ``bubble_beyond_noise``)."""
    step = [run["step_error_at_reference"] for run in runs]
    busy = [run["busy_errors_at_reference"] for run in runs]
    # with each stage's warm-up at the run's probed after-wait loss, as each calibration's probes put it
    probed = [run.get("busy_errors_at_probed_warm_up", run["busy_errors_at_reference"]) for run in runs]
    bubble = [run["bubble_error_points"] for run in runs]
    intervals = [list(run["step_error_interval_at_reference"]) for run in runs]
    busy_intervals = [[list(bounds) for bounds in run["busy_error_intervals_at_reference"]] for run in runs]
    probed_intervals = [[list(bounds) for bounds in run.get("busy_error_intervals_at_probed_warm_up",
                                                             run["busy_error_intervals_at_reference"])]
                        for run in runs]
    bubble_intervals = [run["bubble_error_interval_points"] for run in runs]
    return {"run": runs[0]["run"], "step_errors_at_reference": step,
            "step_error_range_at_reference": [min(step), max(step)],
            "step_error_intervals_at_reference": intervals, "beyond_noise": beyond_noise(intervals),
            "busy_beyond_noise": [beyond_noise(stage) for stage in zip(*busy_intervals)],
            "bubble_beyond_noise": beyond_noise(bubble_intervals),
            "past_goals": {"step": past_by_every(intervals, STEP_GOAL),
                           "busy": [past_by_every(stage, BUSY_GOAL) for stage in zip(*busy_intervals)],
                           "busy_at_probed_warm_up": [past_by_every(stage, BUSY_GOAL)
                                                      for stage in zip(*probed_intervals)],
                           "bubble": past_by_every(bubble_intervals, BUBBLE_GOAL_POINTS)},
            "predicted_steps_s": [run["predicted_step_s"] for run in runs],
            "busy_errors_at_reference": busy, "bubble_error_points": bubble,
            "median": {"step_error_at_reference": statistics.median(step),
                       "busy_errors_at_reference": [statistics.median(stage) for stage in zip(*busy)],
                       "busy_errors_at_probed_warm_up": [statistics.median(stage) for stage in zip(*probed)],
                       "bubble_error_points": statistics.median(bubble)}}


def beyond_noise(intervals: Sequence[Sequence[float]]) -> bool:
    """Whether every calibration's interval of an error lies on the same side of zero."""
    return all(low > 0 for low, _ in intervals) or all(high < 0 for _, high in intervals)


def summary(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over the runs (oversubscribed ones left out by the caller): how far apart the calibrations
    put a run's step error, median and worst, the errors of the median over the calibrations, and
    the runs whose step error (and the stages whose busy time, and the runs whose bubble) every
    calibration puts beyond its rounds' interval, on the same side of zero: errors no noise measured
    here explains, the model's own."""
    if not entries:
        return {}
    apart = [high - low for entry in entries for low, high in [entry["step_error_range_at_reference"]]]
    step = [abs(entry["median"]["step_error_at_reference"]) for entry in entries]
    busy = [abs(e) for entry in entries for e in entry["median"]["busy_errors_at_reference"]]
    probed = [abs(e) for entry in entries for e in entry["median"].get("busy_errors_at_probed_warm_up", [])]
    bubble = [abs(entry["median"]["bubble_error_points"]) for entry in entries]
    return {"calibrations": len(entries[0]["step_errors_at_reference"]),
            "median_calibrations_apart": statistics.median(apart), "worst_calibrations_apart": max(apart),
            "runs_beyond_noise_by_every_calibration": [entry["run"] for entry in entries if entry["beyond_noise"]],
            # each as (run, stage, the median over the calibrations of its busy error)
            "stages_beyond_noise_by_every_calibration": [
                [entry["run"], stage, entry["median"]["busy_errors_at_reference"][stage]] for entry in entries
                for stage, beyond in enumerate(entry["busy_beyond_noise"]) if beyond],
            # each as (run, the median over the calibrations of its bubble error in points)
            "bubbles_beyond_noise_by_every_calibration": [
                [entry["run"], entry["median"]["bubble_error_points"]] for entry in entries
                if entry["bubble_beyond_noise"]],
            "past_goals_by_every_calibration": past_goals(entries),
            "median_over_calibrations": {
                "median_step_error_at_reference": statistics.median(step),
                "worst_step_error_at_reference": max(step),
                "median_busy_error_at_reference": statistics.median(busy) if busy else 0.0,
                "worst_busy_error_at_reference": max(busy, default=0.0),
                "median_busy_error_at_probed_warm_up": statistics.median(probed) if probed else 0.0,
                "worst_busy_error_at_probed_warm_up": max(probed, default=0.0),
                "median_bubble_error_points": statistics.median(bubble),
                "worst_bubble_error_points": max(bubble)}}


def past_goals(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The errors every calibration puts past its goal by more than its rounds allow
    (:mod:`calibrate.goals`): a miss neither the machine's round-to-round noise nor the moment of
    calibration explains. Each stage as [run, stage, median busy error over the calibrations], each
    run as [run, median step error] or [run, median bubble error in points]; entries from results
    saved before the goals were judged here count as within them."""
    def stages(flags: str, errors: str) -> list[list[Any]]:
        return [[entry["run"], stage, entry["median"][errors][stage]] for entry in entries
                for stage, past in enumerate(entry.get("past_goals", {}).get(flags, [])) if past]

    return {"stages": sum(len(entry["busy_beyond_noise"]) for entry in entries),
            "busy": stages("busy", "busy_errors_at_reference"),
            "busy_at_probed_warm_up": stages("busy_at_probed_warm_up", "busy_errors_at_probed_warm_up"),
            "step": [[entry["run"], entry["median"]["step_error_at_reference"]] for entry in entries
                     if entry.get("past_goals", {}).get("step")],
            "bubble": [[entry["run"], entry["median"]["bubble_error_points"]] for entry in entries
                       if entry.get("past_goals", {}).get("bubble")]}
