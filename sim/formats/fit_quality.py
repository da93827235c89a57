"""How well a costs file's fit holds: its fitted costs against its own design runs.

Calibration records the design runs' measured and fitted step times; a run missed past
:data:`DESIGN_FIT_GOAL` points at a noisy calibration, not the model, and a file past it is warned
about when it is read (recomputed from its runs, so a hand-edited summary cannot hide it).
"""

from __future__ import annotations

from typing import Any, Sequence


# A design run the fitted costs miss by more than this points at a noisy calibration, not the model:
# calibration measures such a run again and refuses if the miss remains; a file past it is warned about.
DESIGN_FIT_GOAL = 0.12
_WARNED: set[str] = set()  # costs files already warned about in this process


def design_step_errors(data: dict[str, Any]) -> list[tuple[str, float]]:
    """(run, relative step error) of each design run the file records: the fitted prediction against
    the measurement at the reference speed; [] for files without design runs."""
    return [(run["run"], (run["predicted_step_s"] - run["measured_step_s"]) / run["measured_step_s"])
            for run in data.get("design", []) if run.get("measured_step_s")]


def fit_quality(data: dict[str, Any], corrections: Sequence[dict[str, float]] = ()) -> dict[str, Any]:
    """How well the fit reproduces its own design runs: the goal, the worst and median step error,
    the run missed most, and the largest corrections applied to any run (``speed``, ``warm_up``)."""
    errors = design_step_errors(data)
    worst = max(errors, key=lambda e: abs(e[1]), default=("", 0.0))
    magnitudes = sorted(abs(e) for _, e in errors)
    quality: dict[str, Any] = {
        "goal": DESIGN_FIT_GOAL, "design_runs": len(errors),
        "worst_step_error": worst[1], "worst_run": worst[0],
        "median_abs_step_error": magnitudes[len(magnitudes) // 2] if magnitudes else 0.0,
        "within_goal": abs(worst[1]) <= DESIGN_FIT_GOAL}
    if corrections:
        quality["speed_factor_range"] = [min(c["speed"] for c in corrections), max(c["speed"] for c in corrections)]
        quality["warm_up_factor_range"] = [min(c["warm_up"] for c in corrections),
                                           max(c["warm_up"] for c in corrections)]
    return quality


def fit_quality_warning(data: dict[str, Any], path: str = "the costs file") -> str | None:
    """One line when the file's fit misses one of its own design runs past the goal (recomputed from
    its design runs, so a hand-edited ``fit_quality`` cannot hide it); None when it holds."""
    goal = float(data.get("fit_quality", {}).get("goal", DESIGN_FIT_GOAL))
    errors = design_step_errors(data)
    if not errors:
        return None
    run, error = max(errors, key=lambda e: abs(e[1]))
    if abs(error) <= goal:
        return None
    return (f"warning: {path} misses its own design run {run} by {error * 100:+.0f}% (goal {goal * 100:.0f}%): "
            "predictions from it can be off by as much; calibrate again with gpipe calibrate --force")


def warn_once(data: dict[str, Any], path: str) -> None:
    """Say :func:`fit_quality_warning` on stderr, once per file in this process."""
    import os
    import sys

    warning = fit_quality_warning(data, path)
    if warning and os.path.abspath(path) not in _WARNED:
        _WARNED.add(os.path.abspath(path))
        print(warning, file=sys.stderr, flush=True)
