"""Where a step's time goes, read the same way from a measured report and a simulated timeline.

Busy seconds per stage (forward, recompute, backward and their split parts, the optimizer), the
executor's own time between two actions of a device, and the end-of-step span: from the last
compute action of the step on any stage to the end of the step's last span (the optimizer,
all-reduces, sends finishing, and in a prediction the fitted per-step overhead), plus, in a
measured run, the start-of-step span from the previous step's end to the step's first compute
action (drawing the batch, zeroing gradients, posting receives). A measured step lasts from the
previous step's end to its own, so both spans are in it; the simulator prices one step from its
first action and puts all of that time in its end-of-step overhead, so the two compare as one sum.
Validation compares both sides with these; calibration bounds its fitted overhead by the measured
span (:func:`calibrate.fit.step_fit.fit_step_overhead`) and fits the model's gaps on the measured ones.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from sim.formats.timeline import RECV_WAIT, SEND_ACTIVATION, SEND_GRADIENT
from sim.schedules.schedule import COMPUTE_KINDS


def end_of_step_span_s(records: Sequence[Any], step: int) -> float:
    """From the last forward, recompute or backward of ``step`` on any stage to the end of its last
    span (the optimizer, all-reduces, sends finishing, a fitted overhead): the end-of-step phase."""
    ends = [(r.kind, r.end_s) for r in records if r.step == step]
    compute = [end for kind, end in ends if kind in COMPUTE_KINDS]
    return max(end for _, end in ends) - max(compute) if compute else 0.0


def start_of_step_span_s(records: Sequence[Any], step: int) -> float:
    """From the end of the previous step's last span to ``step``'s first compute action: the
    executor's work between two steps before any action starts (a stage's wait for its input is
    no work: the last stage of a one-micro-batch run waits through most of the previous step's
    end). Negative where a stage began the step before another had finished the last one (stage
    0's first forward while the last stage's optimizer runs): the measured step is then that much
    shorter than the one step the simulator prices. 0 for a step whose previous step is not in
    ``records``."""
    previous = [r.end_s for r in records if r.step == step - 1]
    starts = [r.start_s for r in records if r.step == step and r.kind in COMPUTE_KINDS]
    return min(starts) - max(previous) if previous and starts else 0.0


def device_spans(records: Sequence[Any], steps: Sequence[int]) -> dict[tuple[int, int], list[Any]]:
    """Per (stage, step) of ``steps``, replica 0's first tensor-parallel rank's spans in time order."""
    chosen = set(steps)
    by_device: dict[tuple[int, int], list[Any]] = {}
    for r in records:
        if r.step in chosen and not r.replica and not r.tp:
            by_device.setdefault((r.stage, r.step), []).append(r)
    for spans in by_device.values():
        spans.sort(key=lambda r: r.start_s)
    return by_device


def action_gaps_s(records: Sequence[Any], steps: Sequence[int]) -> dict[tuple[int, int], list[tuple[str, float]]]:
    """The executor's own time between two actions of a device whose input was there: from the end of
    one (its send included) to the start of the next, where no wait for a neighbour's tensor came
    between them (the model's :attr:`sim.engine.stage_costs.StageCost.gap_after_s`).

    Per (stage, step) of ``steps``, replica 0's first tensor-parallel ranks, one (kind of the action the
    gap follows, seconds) per such pair of actions. Where the next input was away, the executor did its
    chores (posting receives, drawing the next batch) while it waited, and the simulator, which spends
    the gap before the wait, hides them in the wait as well; counting them made the gaps of a plan of few
    micro-batches, whose actions mostly wait, look several times the model's (the demo's interleaved M=2
    plan, every backward on its first stage followed by a wait:
    docs/notes/2026-11-27-figures-behind-the-code.md). :func:`calibrate.fit.pipeline_fit.fit_pipeline`
    takes the median, which a chore once a step does not move. Measured timelines only: a simulated
    send's span is its time on the link, not the sender's."""
    gaps: dict[tuple[int, int], list[tuple[str, float]]] = {}
    for key, spans in sorted(device_spans(records, steps).items()):
        previous_end, previous_kind, waited = None, "", False
        for r in spans:
            if r.kind in COMPUTE_KINDS:
                if previous_end is not None and not waited:
                    gaps.setdefault(key, []).append((previous_kind, max(0.0, r.start_s - previous_end)))
                previous_end, previous_kind, waited = r.end_s, r.kind, False
            elif previous_end is not None and r.kind == RECV_WAIT and r.end_s > r.start_s:
                waited = True
            elif previous_end is not None and r.kind in (SEND_ACTIVATION, SEND_GRADIENT):
                previous_end = max(previous_end, r.end_s)
    return gaps


def measured_records(report: dict[str, Any]) -> tuple[list[Any], list[int]]:
    """A report's timeline records and its measured steps (every step where it names none)."""
    from sim.formats.timeline import Timeline

    records = Timeline.from_dict(report["timeline"]).records
    return records, report["measured_steps"] or sorted({r.step for r in records})


def measured_action_gaps_s(report: dict[str, Any]) -> dict[tuple[int, int], list[tuple[str, float]]]:
    """:func:`action_gaps_s` over a report's measured steps."""
    return action_gaps_s(*measured_records(report))


def measured_gap_medians_s(report: dict[str, Any], stage: int) -> dict[str, float]:
    """Per kind of action, the median of ``stage``'s gaps after one over the measured steps (those
    whose next input was there, :func:`action_gaps_s`): what calibration fits the model's gap on, so a
    run's own gaps compare with it like for like (a sum would count the chores done while a message
    was away, time the model spends waiting). A kind after which every action waited has none."""
    by_kind: dict[str, list[float]] = {}
    for (k, _step), values in measured_action_gaps_s(report).items():
        if k == stage:
            for kind, gap in values:
                by_kind.setdefault(kind, []).append(gap)
    return {kind: statistics.median(gaps) for kind, gaps in sorted(by_kind.items())}


def compute_per_step_s(report: dict[str, Any], replica: int = 0) -> list[list[float]]:
    """Per measured step, each stage's compute seconds in it (its forwards, recomputes, backwards and
    their split parts; replica ``replica``, first tensor-parallel ranks), in stage order."""
    stages = len(report["stages"])
    steps = report["measured_steps"]
    rows = {step: [0.0] * stages for step in steps}
    for record in report["timeline"]["records"]:
        if (record["step"] in rows and record["kind"] in COMPUTE_KINDS and record.get("replica", 0) == replica
                and not record.get("tp")):
            rows[record["step"]][record["stage"]] += record["end_s"] - record["start_s"]
    return [rows[step] for step in steps]


def replica_waits(report: dict[str, Any], replicas: int) -> tuple[list[float], float]:
    """What replica 0 waits for the other replicas, measured: per stage, the mean over the measured
    steps of the slowest replica's compute seconds in the step less replica 0's (the gradient
    all-reduce at the step's end holds replica 0 until the slowest has finished; first
    tensor-parallel ranks); and the spread of one replica's compute seconds per step, the standard
    deviation over the mean of every (replica, stage, step). ([0.0] per stage, 0.0) for one replica.
    The simulator predicts this wait from calibration's deviations (:mod:`sim.engine.stragglers`;
    :func:`predicted_replica_waits_s`)."""
    stages = len(report["stages"])
    if replicas < 2:
        return [0.0] * stages, 0.0
    per_replica = [compute_per_step_s(report, d) for d in range(replicas)]  # [replica][step][stage]
    steps = range(len(per_replica[0]))
    waits = [statistics.fmean(max(rows[s][k] for rows in per_replica) - per_replica[0][s][k] for s in steps)
             if steps else 0.0 for k in range(stages)]
    values = [seconds for rows in per_replica for row in rows for seconds in row]
    spread = statistics.pstdev(values) / statistics.fmean(values) if len(values) > 1 and any(values) else 0.0
    return waits, spread


def predicted_replica_waits_s(result: Any, stages: int) -> list[float]:
    """Per stage, the simulated replica 0's wait between its last compute and its gradient
    all-reduce (the straggler allowance of :mod:`sim.engine.stragglers`); 0 where a stage has no
    all-reduce (one replica)."""
    from sim.formats.timeline import DP_ALLREDUCE

    records = [r for r in result.timeline.records if not r.replica]
    waits = [0.0] * stages
    for k in range(stages):
        reduce = [r.start_s for r in records if r.stage == k and r.kind == DP_ALLREDUCE]
        compute = [r.end_s for r in records if r.stage == k and r.kind in COMPUTE_KINDS]
        if reduce and compute:
            waits[k] = max(0.0, min(reduce) - max(compute))
    return waits


def measured_end_span_s(report: dict[str, Any]) -> float:
    """The median over a report's measured steps (every step past its warm-up) of the end-of-step
    span plus the start-of-step span before it (see the module), replica 0's first tensor-parallel
    ranks: the time a measured step holds outside its actions, which the simulator's end-of-step
    span stands for."""
    from sim.formats.timeline import Timeline

    records = [r for r in Timeline.from_dict(report["timeline"]).records if not r.replica and not r.tp]
    steps = report["measured_steps"] or sorted({r.step for r in records})
    return statistics.median(end_of_step_span_s(records, step) + start_of_step_span_s(records, step)
                             for step in steps)


def measured_components(reports: Sequence[dict[str, Any]]) -> tuple[list[float], float]:
    """Median over rounds of each stage's busy seconds, and of the median end-of-step span."""
    busy = [statistics.median(r["stages"][k]["busy_s"] for r in reports) for k in range(len(reports[0]["stages"]))]
    return busy, statistics.median(measured_end_span_s(r) for r in reports)


def predicted_end_span_s(result: Any) -> float:
    """The end-of-step span of a simulated step (replica 0)."""
    return end_of_step_span_s([r for r in result.timeline.records if not r.replica], 0)
