"""Where a step's time goes, read the same way from a measured report and a simulated timeline.

Busy seconds per stage (forward, recompute, backward and their split parts, the optimizer) and the
end-of-step span: from the last compute action of the step on any stage to the end of the step's
last span (the optimizer, all-reduces, sends finishing, and in a prediction the fitted per-step
overhead). Validation compares both sides with these; calibration bounds its fitted overhead by
the measured span (:func:`calibrate.calibration.fit_step_overhead`).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from sim.schedule import COMPUTE_KINDS


def end_of_step_span_s(records: Sequence[Any], step: int) -> float:
    """From the last forward, recompute or backward of ``step`` on any stage to the end of its last
    span (the optimizer, all-reduces, sends finishing, a fitted overhead): the end-of-step phase."""
    ends = [(r.kind, r.end_s) for r in records if r.step == step]
    compute = [end for kind, end in ends if kind in COMPUTE_KINDS]
    return max(end for _, end in ends) - max(compute) if compute else 0.0


def measured_end_span_s(report: dict[str, Any]) -> float:
    """The median end-of-step span over a report's measured steps (every step where none is past its
    warm-up), replica 0's first tensor-parallel ranks."""
    from sim.timeline import Timeline

    records = [r for r in Timeline.from_dict(report["timeline"]).records if not r.replica and not r.tp]
    steps = report["measured_steps"] or sorted({r.step for r in records})
    return statistics.median(end_of_step_span_s(records, step) for step in steps)


def measured_components(reports: Sequence[dict[str, Any]]) -> tuple[list[float], float]:
    """Median over rounds of each stage's busy seconds, and of the median end-of-step span."""
    busy = [statistics.median(r["stages"][k]["busy_s"] for r in reports) for k in range(len(reports[0]["stages"]))]
    return busy, statistics.median(measured_end_span_s(r) for r in reports)


def predicted_end_span_s(result: Any) -> float:
    """The end-of-step span of a simulated step (replica 0)."""
    return end_of_step_span_s([r for r in result.timeline.records if not r.replica], 0)
