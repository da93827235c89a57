"""What keeps a calibration from storing a wildly corrected measurement or a fit that misses its runs.

Each design run is corrected before it enters the fits: divided by its speed factor (the machine's
pace around the run over the calibration's reference pace, :mod:`calibrate.noise.speed`), its warm-up
after waits scaled by its after-wait factor (:mod:`calibrate.noise.after_wait_probe`). A probe is a few
milliseconds of work; when another program takes the cores for a moment, one probe can be tens of
times slower than the run it stands beside, and the "corrected" run then enters the fits tens of
times too fast or too slow. So every correction is bounded (:data:`SPEED_FACTOR_BOUNDS`,
:data:`WARM_UP_FACTOR_BOUNDS`) and recorded beside the run; a run whose correction falls outside its
bounds is measured once more, and refused with one line if it falls outside again.

After the fit, every design run is predicted with the fitted costs; one the fit misses by more than
:data:`sim.formats.costs.DESIGN_FIT_GOAL` is measured once more and the whole fit redone; a miss that
remains refuses the calibration. The costs file carries the outcome (``fit_quality``,
:func:`sim.formats.costs.fit_quality`), so a command reading an older or hand-edited file can warn.

``gpipe validate`` holds its held-out rounds to the same speed bounds
(:func:`calibrate.validate.held_out.speeds_within_bounds`): a round outside is measured once more, and
a run with a round outside again is shown but not judged.

Limits: the bounds are wide on purpose (a real drift of tens of percent is what the probe is there
to correct); a correction that is wrong by less than the bound passes, and shows only in the fit's
residuals and in ``gpipe validate``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from calibrate.noise.after_wait_probe import report_warm_up_factor, run_after_wait_probes
from calibrate.noise.speed import model_probe_description, reference_s, run_probes, speed_factor
from sim.errors import GpipeInputError
from sim.formats.costs import DESIGN_FIT_GOAL, design_step_errors

# (machine now) / (reference) outside this range is not drift a probe can be trusted to correct
SPEED_FACTOR_BOUNDS = (0.5, 2.0)
# the warm-up a run paid after waits, relative to the calibration's: scaled at most this far
WARM_UP_FACTOR_BOUNDS = (0.0, 4.0)

Remeasure = Callable[[Sequence[int]], list[dict[str, Any]]]
Say = Callable[[str], None]


class CalibrationRefused(GpipeInputError):
    """A design run that stayed out of bounds, or unfitted, after it was measured a second time."""


def run_speed_reference(model: str, specs: Sequence[Any], reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The reference pace per number of processes: the median speed probe over the design runs with
    that many (K x T; validation looks a run up by its D x K x T).

    Per count because that many processes probing at once contend as the run will, and the fits of
    runs with that many processes are what the reference speed anchors.

    The after-wait probes (:mod:`calibrate.noise.after_wait_probe`) give ``after_wait_reference_s`` the same
    way: the loss a wait cost at the calibration's moments, which the fitted warm-ups stand for.
    """
    by_k: dict[int, list[float]] = {}
    losses: dict[int, list[float]] = {}
    for spec, report in zip(specs, reports):
        by_k.setdefault(spec.processes, []).extend(run_probes(report))
        losses.setdefault(spec.processes, []).extend(run_after_wait_probes(report))
    return {"probe": model_probe_description(model, specs[0].batch_size) if specs else "",
            "reference_s": {str(k): reference_s(p) for k, p in sorted(by_k.items()) if p},
            "after_wait_reference_s": {str(k): reference_s(p) for k, p in sorted(losses.items()) if p}}


def run_corrections(report: dict[str, Any], processes: int, speed: dict[str, Any]) -> dict[str, float]:
    """The factors one run's measurements are corrected by: ``speed`` (its durations are divided by
    it) and ``warm_up`` (its warm-up after waits is scaled by it), against the reference ``speed``
    (:func:`run_speed_reference`)."""
    return {"speed": speed_factor(run_probes(report), speed.get("reference_s", {}).get(str(processes))),
            "warm_up": report_warm_up_factor(report, {"speed": speed}, processes)}


def outside_bounds(name: str, value: float, bounds: tuple[float, float]) -> str | None:
    """The correction ``name`` as text (``"speed x40.1 outside x0.5..x2"``) if ``value`` falls outside
    ``bounds``; None inside them."""
    if bounds[0] <= value <= bounds[1]:
        return None
    return f"{name.replace('_', '-')} x{value:.3g} outside x{bounds[0]:g}..x{bounds[1]:g}"


def out_of_bounds(corrections: dict[str, float]) -> list[str]:
    """Each correction outside its bounds, as text (``"speed x40.1 outside x0.5..x2"``); [] if none."""
    said = [outside_bounds(name, corrections[name], bounds)
            for name, bounds in (("speed", SPEED_FACTOR_BOUNDS), ("warm_up", WARM_UP_FACTOR_BOUNDS))]
    return [text for text in said if text is not None]


def corrected_within_bounds(model: str, specs: Sequence[Any], reports: list[dict[str, Any]],
                            remeasure: Remeasure, say: Say) -> tuple[list[dict[str, Any]], dict[str, Any],
                                                                     list[dict[str, float]]]:
    """(reports, speed reference, each run's corrections) with every correction inside its bounds.

    Runs outside are measured once more through ``remeasure(indices)`` (their new reports, in order)
    and the references recomputed from all runs; a run outside again refuses the calibration.
    """
    reports = list(reports)
    for attempt in (1, 2):
        speed = run_speed_reference(model, specs, reports)
        corrections = [run_corrections(r, s.processes, speed) for s, r in zip(specs, reports)]
        bad = [i for i, c in enumerate(corrections) if out_of_bounds(c)]
        if not bad:
            return reports, speed, corrections
        first = bad[0]
        what = (f"design run {specs[first].label()}: {', '.join(out_of_bounds(corrections[first]))} "
                f"(raw step {reports[first]['step_time_s'] * 1e3:.2f} ms, corrected "
                f"{reports[first]['step_time_s'] / corrections[first]['speed'] * 1e3:.2f} ms)")
        if attempt == 2:
            raise CalibrationRefused(
                f"calibration refused: {what}, measured twice; the machine's speed swung while it was "
                "measured (another program busy?); run it again on a quiet machine (gpipe calibrate --force)")
        say(f"{what}; measuring {len(bad)} run(s) again")
        for i, report in zip(bad, remeasure(bad)):
            reports[i] = report
    raise AssertionError("unreachable")


def missed_design_runs(data: dict[str, Any], goal: float = DESIGN_FIT_GOAL) -> list[tuple[str, float]]:
    """(run label, step error at the reference speed) of each design run the fit misses past ``goal``."""
    return [(run, error) for run, error in design_step_errors(data) if abs(error) > goal]


def refuse_missed(data: dict[str, Any], goal: float = DESIGN_FIT_GOAL) -> None:
    """Refuse the calibration in one line if its fit still misses a design run past ``goal``."""
    missed = missed_design_runs(data, goal)
    if missed:
        run, error = max(missed, key=lambda m: abs(m[1]))
        entry = next(e for e in data["design"] if e["run"] == run)
        raise CalibrationRefused(
            f"calibration refused: the fit misses design run {run} by {error * 100:+.0f}% (predicted "
            f"{entry['predicted_step_s'] * 1e3:.2f} ms, measured {entry['measured_step_s'] * 1e3:.2f} ms), past "
            f"its goal of {goal * 100:.0f}%, after measuring it again; the machine was likely busy or drifting; "
            "run it again on a quiet machine (gpipe calibrate --force; more --rounds average more drift out)")
