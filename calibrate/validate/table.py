"""``gpipe validate``'s table: one line per held-out run, then the summary's lines.

The default view is the prediction's error: step, memory, busy time, bubble and the end of the step,
predicted against measured, raw and at the reference speed, and the errors past their goals beyond
noise. ``verbose`` adds what is about this machine's noise rather than the prediction's error: each
run's and each stage's round spread and interval, the calibration's halves, the spread across
calibrations, the runs beyond their interval's reach of zero, and the after-wait probe's figures.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from calibrate.fit.design_checks import SPEED_FACTOR_BOUNDS
from calibrate.goals import BUBBLE_GOAL_POINTS, BUSY_GOAL, STEP_GOAL
from calibrate.noise.after_wait_probe import WAIT_S


def _after_waits(share: float) -> str:
    """``n% after waits``: a stage's share of predicted busy time that is the warm-up after long waits
    (:mod:`sim.engine.host`)."""
    return f"{share * 100:.0f}% after waits"


def _stage_after_waits(result: dict[str, Any], label: str, stage: int) -> str:
    """`` (n% after waits; e% at the run's after-wait probe)`` of ``label``'s stage: its run's
    ``warm_up_shares``, and the median over the calibrations of its busy error with the warm-up at the
    run's probe where the run was probed (nothing for a stage without a warm-up)."""
    run = next((run for run in result["runs"] if run["run"] == label), {})
    shares = run.get("warm_up_shares") or []
    if stage >= len(shares) or shares[stage] <= 0:
        return ""
    probed = run.get("calibrations", {}).get("median", {}).get("busy_errors_at_probed_warm_up") or []
    at_probe = (f"; {probed[stage] * 100:+.1f}% at the run's after-wait probe"
                if run.get("round_warm_up_factors") and stage < len(probed) else "")
    return f" ({_after_waits(shares[stage])}{at_probe})"


def _worst_stage(summary: dict[str, Any], key: str = "worst_busy_stage_at_reference", probe: bool = True) -> str:
    """`` by <run> stage k (n% after waits)``: where the summary's worst busy error at the reference
    speed (or the one ``key`` names) is, with (``probe``) its run's after-wait probe against the
    calibration's where one was taken (nothing in results from before it was recorded)."""
    worst = summary.get(key)
    if not worst:
        return ""
    notes = [_after_waits(worst["warm_up_share"])] if worst["warm_up_share"] > 0 else []
    if probe and "median_busy_error_at_probed_warm_up" in summary and "warm_up_factor" in worst:
        notes.append(f"after-wait probe x{worst['warm_up_factor']:.2f}")
    return f", by {worst['run']} stage {worst['stage']}" + (f" ({'; '.join(notes)})" if notes else "")


def _beyond_goals_line(goals: dict[str, Any], runs: int, probe: bool = True) -> str:
    """The summary's :func:`calibrate.validate.summary.beyond_goals` as one line of the table, the busy
    errors at each run's after-wait probe with them where ``probe`` and the runs were probed."""
    return (f"past the goals by more than their own rounds allow (the error's whole interval beyond: busy "
            f"+-{BUSY_GOAL * 100:.0f}%, step +-{STEP_GOAL * 100:.0f}%, bubble +-{BUBBLE_GOAL_POINTS:.0f} "
            f"points): " + _goals_tally(goals, runs, probe and "busy_at_probed_warm_up" in goals))


def _past_goals_by_every_calibration_line(goals: dict[str, Any], runs: int, probed: bool) -> str:
    """The summary's :func:`calibrate.noise.across_calibrations.past_goals` as one line of the table."""
    return ("past the goals by more than their own rounds allow by every calibration (neither the machine's "
            "round-to-round noise nor the moment of calibration explains these; the median over the "
            "calibrations shown): " + _goals_tally(goals, runs, probed))


def _goals_tally(goals: dict[str, Any], runs: int, probed: bool) -> str:
    """How many stages and runs miss each goal, each named with its error and, where the entry carries
    them, its interval's ends: stages as [run, stage, error, *bounds], runs as [run, error, *bounds]."""
    def percent(error: float, bounds: Sequence[float]) -> str:
        return f"{error * 100:+.1f}%" + (f" ({_interval(bounds)})" if bounds else "")

    def stages(entries: Sequence[Sequence[Any]]) -> str:
        return "".join(f"; {run} stage {stage} {percent(error, bounds)}" for run, stage, error, *bounds in entries)

    text = f"busy {len(goals['busy'])} of {goals['stages']} stages{stages(goals['busy'])}"
    if probed:
        text += (f"; with the warm-up at each run's after-wait probe {len(goals['busy_at_probed_warm_up'])} of "
                 f"{goals['stages']}{stages(goals['busy_at_probed_warm_up'])}")
    text += f"; step {len(goals['step'])} of {runs} runs" + "".join(
        f"; {run} {percent(error, bounds)}" for run, error, *bounds in goals["step"])
    return text + f"; bubble {len(goals['bubble'])} of {runs} runs" + "".join(
        f"; {run} {points:+.1f} points" + (f" ({bounds[0]:+.1f}..{bounds[1]:+.1f})" if bounds else "")
        for run, points, *bounds in goals["bubble"])


def _worst_signed(errors: Sequence[float]) -> float:
    return max(errors, key=abs, default=0.0)


def _interval(bounds: Sequence[float]) -> str:
    return f"{bounds[0] * 100:+.0f}..{bounds[1] * 100:+.0f}%"


def _mib(values: Sequence[int]) -> str:
    return "/".join(f"{v / 2**20:.2f}" for v in values)


OVERSUBSCRIBED_MARK = "*"
NOT_JUDGED_MARK = "?"

Cell = Callable[[dict[str, Any]], str]


def _mark(run: dict[str, Any]) -> str:
    """After D: :data:`NOT_JUDGED_MARK`, :data:`OVERSUBSCRIBED_MARK` or a space."""
    if run.get("not_judged"):
        return NOT_JUDGED_MARK
    return OVERSUBSCRIBED_MARK if run.get("oversubscribed") else " "


def _busy_at_reference(run: dict[str, Any]) -> list[float]:
    return run.get("busy_errors_at_reference", run.get("busy_errors", []))


def _worst_busy_interval(run: dict[str, Any]) -> Sequence[float]:
    """The interval of the stage whose busy error at the reference speed is the run's worst."""
    errors = _busy_at_reference(run)
    intervals = run.get("busy_error_intervals_at_reference") or [[0.0, 0.0]] * len(errors)
    worst = max(range(len(errors)), key=lambda k: abs(errors[k]), default=None)
    return intervals[worst] if worst is not None else [0.0, 0.0]


def _halves(run: dict[str, Any]) -> str:
    halves = run.get("step_error_halves_at_reference")
    return f"{_interval(halves) if halves else '-':>11}"


def _calibrations(run: dict[str, Any]) -> str:
    calibrations = run.get("calibrations", {}).get("step_error_range_at_reference")
    return f"{_interval(calibrations) if calibrations else '-':>11}"


# Each group of columns as (header, cell, noise); groups are two spaces apart. Noise columns (how this
# machine's rounds and calibrations scatter, not how far the prediction is off) show only in the
# verbose view.
COLUMNS: list[list[tuple[str, Cell, bool]]] = [
    [(f"{'D':>2} ", lambda run: f"{run.get('replicas', 1):>2}{_mark(run)}", False),
     (f"{'run':<40}", lambda run: f"{run['run']:<40}", False),
     (f"{'pred ms':>9}", lambda run: f"{run['predicted_step_s'] * 1e3:>9.2f}", False),
     (f"{'meas ms':>9}", lambda run: f"{run['measured_step_s'] * 1e3:>9.2f}", False),
     (f"{'err':>7}", lambda run: f"{run['step_error'] * 100:>+6.1f}%", False),
     (f"{'@ref ms':>9}", lambda run: f"{run.get('measured_at_reference_s', run['measured_step_s']) * 1e3:>9.2f}",
      False),
     (f"{'err@ref':>8}", lambda run: f"{run.get('step_error_at_reference', run['step_error']) * 100:>+7.1f}%", False),
     (f"{'spread':>7}", lambda run: f"{run.get('round_spread', 0.0) * 100:>6.1f}%", True),
     (f"{'interval':>11}", lambda run: f"{_interval(run.get('step_error_interval_at_reference', [0.0, 0.0])):>11}",
      True),
     (f"{'halves':>11}", _halves, True),
     (f"{'calibs':>11}", _calibrations, True)],
    [(f"{'pred MiB':>13}", lambda run: f"{_mib(run['predicted_peak_activation_bytes']):>13}", False),
     (f"{'meas MiB':>13}", lambda run: f"{_mib(run['measured_peak_activation_bytes']):>13}", False),
     (f"{'mem err':>8}", lambda run: f"{max((abs(e) for e in run['memory_errors']), default=0.0) * 100:>7.2f}%",
      False)],
    [(f"{'busy err':>8}", lambda run: f"{_worst_signed(run.get('busy_errors', [])) * 100:>+7.1f}%", False),
     (f"{'busy@ref':>8}", lambda run: f"{_worst_signed(_busy_at_reference(run)) * 100:>+7.1f}%", False),
     (f"{'spread':>7}", lambda run: f"{run.get('busy_round_spread', 0.0) * 100:>6.1f}%", True),
     (f"{'interval':>11}", lambda run: f"{_interval(_worst_busy_interval(run)):>11}", True),
     (f"{'bubble p/m':>11}",
      lambda run: f"{run.get('predicted_bubble', 0.0) * 100:>5.1f}/{run.get('measured_bubble', 0.0) * 100:<5.1f}",
      False),
     (f"{'end p/m ms':>13}", lambda run: (f"{run.get('predicted_end_span_s', 0.0) * 1e3:>6.2f}/"
                                           f"{run.get('measured_end_span_s', 0.0) * 1e3:<6.2f}"), False)],
]


def format_table(result: dict[str, Any], verbose: bool = False) -> str:
    """A plain-text table: one line per run (D, then the run), then the median and worst errors.

    Runs with more processes than the machine has cores (GPUs) carry :data:`OVERSUBSCRIBED_MARK`
    after D, runs whose speed correction stayed out of bounds :data:`NOT_JUDGED_MARK`; both stay out
    of the summary lines. ``verbose`` adds the columns and lines about this machine's noise (see the
    module).
    """
    groups = [[column for column in group if verbose or not column[2]] for group in COLUMNS]
    header = "  ".join(" ".join(title for title, _, _ in group) for group in groups)
    lines = [header, "-" * len(header)]
    for run in result["runs"]:
        lines.append("  ".join(" ".join(cell(run) for _, cell, _ in group) for group in groups))
    s = result["summary"]
    lines.append("-" * len(header))
    lines.append(f"step time error: median {s['median_step_error'] * 100:.1f}%, worst "
                 f"{s['worst_step_error'] * 100:.1f}% over {s['runs']} runs; at the reference speed "
                 f"(machine drift since calibration taken out): median "
                 f"{s.get('median_step_error_at_reference', 0.0) * 100:.1f}%, worst "
                 f"{s.get('worst_step_error_at_reference', 0.0) * 100:.1f}%"
                 + (f"; rounds of one run spread by {s.get('median_round_spread', 0.0) * 100:.1f}% (median "
                    "interquartile range)" if verbose else ""))
    if verbose:
        lines += _noise_lines(s)
    across = s.get("across_calibrations")
    if across:
        if verbose:
            lines += _across_calibrations_noise_lines(result, across)
        if "past_goals_by_every_calibration" in across:
            lines.append(_past_goals_by_every_calibration_line(
                across["past_goals_by_every_calibration"], s["runs"],
                verbose and "median_busy_error_at_probed_warm_up" in s))
    lines.append("peak activation memory "
                 f"error: median {s['median_memory_error'] * 100:.2f}%, worst {s['worst_memory_error'] * 100:.2f}%")
    lines.append(f"components: busy time per stage error median {s.get('median_busy_error', 0.0) * 100:.1f}%, worst "
                 f"{s.get('worst_busy_error', 0.0) * 100:.1f}% (at the reference speed: median "
                 f"{s.get('median_busy_error_at_reference', s.get('median_busy_error', 0.0)) * 100:.1f}%, worst "
                 f"{s.get('worst_busy_error_at_reference', s.get('worst_busy_error', 0.0)) * 100:.1f}%"
                 f"{_worst_stage(s, probe=verbose)}"
                 + (f"; rounds spread a stage's busy time by {s.get('median_busy_round_spread', 0.0) * 100:.1f}%"
                    if verbose else "")
                 + f"); bubble error median {s.get('median_bubble_error_points', 0.0):.1f} points, worst "
                 f"{s.get('worst_bubble_error_points', 0.0):.1f} (bubble: 1 - mean busy / step; end: from the last "
                 "backward to the step's end, and in a measured step from the previous step's end to its first compute "
                 "action, predicted/measured)")
    if verbose and "median_busy_error_at_probed_warm_up" in s:
        lines.append(_after_wait_line(s))
    goals = s.get("beyond_goals_beyond_noise")
    if goals:
        lines.append(_beyond_goals_line(goals, s["runs"], probe=verbose))
    waits = [run for run in result["runs"] if run.get("replicas", 1) > 1 and run.get("measured_replica_wait_s")]
    if waits:
        lines.append(_replica_waits_line(waits))
    if s.get("median_kind_error_at_reference"):
        lines.append("by kind of action, at the reference speed, median signed error of a stage's step of them: "
                     + ", ".join(f"{kind} {error * 100:+.1f}%"
                                 for kind, error in sorted(s["median_kind_error_at_reference"].items())))
    if s.get("oversubscribed_runs"):
        lines.append(f"{OVERSUBSCRIBED_MARK} oversubscribed: more processes (D x K) than this machine has "
                     f"cores (GPUs); measured for correctness, {s['oversubscribed_runs']} run(s) left out of "
                     "the errors above")
    not_judged = [run for run in result["runs"] if run.get("not_judged")]
    if not_judged:
        lines.append(_not_judged_line(not_judged))
    return "\n".join(lines)


def _noise_lines(s: dict[str, Any]) -> list[str]:
    """The noise beside the errors: each run's rounds (``interval``) and the calibration's halves."""
    lines = []
    if "median_step_error_half_width_at_reference" in s:
        lines.append("noise beside the errors (interval: where a run's error at the reference speed lies, from "
                     "its median's interval over its rounds, at least 90% confidence): a run's step error known "
                     f"to +-{s['median_step_error_half_width_at_reference'] * 100:.1f}% (median half-width), "
                     f"the worst run's in {_interval(s['worst_step_error_interval_at_reference'])}; "
                     f"{s['runs_with_step_error_beyond_noise']} of {s['runs']} runs' step errors beyond their "
                     f"interval's reach of zero; a stage's busy error known to "
                     f"+-{s['median_busy_error_half_width_at_reference'] * 100:.1f}%, the worst in "
                     f"{_interval(s['worst_busy_error_interval_at_reference'])}; "
                     f"{s['runs_with_bubble_error_beyond_noise']} of {s['runs']} runs' bubble errors beyond their "
                     "interval's reach of zero")
    if "median_halves_apart" in s:
        lines.append("the calibration's own noise (halves: the step error as fits on the odd and on the even "
                     "design rounds predict it): the halves put a run "
                     f"{s['median_halves_apart'] * 100:.1f} points apart (median), "
                     f"{s['worst_halves_apart'] * 100:.1f} at worst; the worst run's error by the halves "
                     f"{_interval(s['worst_step_error_halves_at_reference'])}")
    return lines


def _across_calibrations_noise_lines(result: dict[str, Any], across: dict[str, Any]) -> list[str]:
    """How far the calibrations put a run apart, and what every one of them puts beyond noise."""
    s = result["summary"]
    over = across["median_over_calibrations"]
    lines = [f"the moment of calibration (calibs: the step error as each of {across['calibrations']} "
             "costs files predicts the run, each at its own reference speed): they put a run "
             f"{across['median_calibrations_apart'] * 100:.1f} points apart (median), "
             f"{across['worst_calibrations_apart'] * 100:.1f} at worst; the median over them: step "
             f"error median {over['median_step_error_at_reference'] * 100:.1f}%, worst "
             f"{over['worst_step_error_at_reference'] * 100:.1f}%; busy median "
             f"{over['median_busy_error_at_reference'] * 100:.1f}%, worst "
             f"{over['worst_busy_error_at_reference'] * 100:.1f}%"
             + (f" (with the warm-up at each run's probed after-wait loss: median "
                f"{over['median_busy_error_at_probed_warm_up'] * 100:.1f}%, worst "
                f"{over['worst_busy_error_at_probed_warm_up'] * 100:.1f}%)"
                if "median_busy_error_at_probed_warm_up" in s else "")
             + "; bubble median "
             f"{over['median_bubble_error_points']:.1f} points, worst {over['worst_bubble_error_points']:.1f}"]
    beyond = across["runs_beyond_noise_by_every_calibration"]
    lines.append(f"{len(beyond)} of {s['runs']} runs' step errors beyond their interval's reach of zero, on the "
                 "same side, by every calibration (errors no noise measured here explains)"
                 + (": " + "; ".join(beyond) if beyond else ""))
    stages = across["stages_beyond_noise_by_every_calibration"]
    lines.append(f"{len(stages)} stages' busy errors beyond their interval's reach of zero by every calibration"
                 + (": " + "; ".join(f"{run} stage {stage} {error * 100:+.1f}%{_stage_after_waits(result, run, stage)}"
                                     for run, stage, error in stages) if stages else ""))
    bubbles = across["bubbles_beyond_noise_by_every_calibration"]
    lines.append(f"{len(bubbles)} runs' bubble errors beyond their interval's reach of zero by every calibration"
                 + (": " + "; ".join(f"{run} {points:+.1f} points" for run, points in bubbles) if bubbles else ""))
    return lines


def _after_wait_line(s: dict[str, Any]) -> str:
    """How far the runs' after-wait probes ranged against the calibration's, and the busy errors with
    each stage's predicted warm-up scaled to them."""
    return ("the after-wait loss at each run's moment (the first layer's forward after a "
            f"{WAIT_S * 1e3:.0f} ms wait, probed around each round, against the calibration's): "
            f"x{s['warm_up_factor_range'][0]:.2f}-x{s['warm_up_factor_range'][1]:.2f} over the runs "
            f"(x{s['round_warm_up_factor_range'][0]:.2f}-x{s['round_warm_up_factor_range'][1]:.2f} over "
            "rounds); busy time per stage with each stage's predicted warm-up scaled to it: error median "
            f"{s['median_busy_error_at_probed_warm_up'] * 100:.1f}%, worst "
            f"{s['worst_busy_error_at_probed_warm_up'] * 100:.1f}%"
            f"{_worst_stage(s, 'worst_busy_stage_at_probed_warm_up')}")


def _replica_waits_line(waits: Sequence[dict[str, Any]]) -> str:
    """Replica 0's wait for the slowest replica of its stage, predicted against measured, per D > 1 run."""
    return ("replicas (D > 1): replica 0's wait for the slowest replica of its stage before the gradient "
            "all-reduce, a step, predicted (the straggler allowance calibration's deviations give) / "
            "measured, in ms and in points of the step (part of the bubble), and the measured spread of "
            "a replica's compute per step: "
            + "; ".join(f"{run['run']}: "
                        f"{statistics.fmean(run.get('predicted_replica_wait_s') or [0.0]) * 1e3:.1f}/"
                        f"{statistics.fmean(run['measured_replica_wait_s']) * 1e3:.1f} ms "
                        f"({run['replica_wait_points'][0]:.1f}/{run['replica_wait_points'][1]:.1f} points; "
                        f"spread {run['replica_busy_spread'] * 100:.1f}%)"
                        for run in waits))


def _not_judged_line(runs: Sequence[dict[str, Any]]) -> str:
    """The runs left unjudged because a round's speed correction stayed out of bounds, each with why."""
    low, high = SPEED_FACTOR_BOUNDS
    return (f"{NOT_JUDGED_MARK} not judged: a round's speed correction stayed outside x{low:g}..x{high:g} after "
            "it was measured again (the machine's speed swung: another program busy?); shown, "
            f"{len(runs)} run(s) left out of the errors above: "
            + "; ".join(f"{run['run']} ({run['not_judged']})" for run in runs))
