"""What the design runs measured, paired with what the layer profile predicts for each action.

:func:`collect` reads one run's report into :class:`Observations`: per (K, kind of action) the
profiled and measured seconds of every action (:class:`ActionPoints`), the sends, the optimizer
steps, the gaps between actions and each step's compute per stage. Every duration enters at the
reference speed (divided by the run's speed factor, :mod:`calibrate.noise.speed`). The fits that
read them are in :mod:`calibrate.fit.pipeline_fit` and :mod:`calibrate.fit.design_fit`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from calibrate.fit.design import RunSpec
from calibrate.fit.step_components import action_gaps_s, compute_per_step_s, measured_records
from calibrate.noise.warm_up_fit import busy_since_wait_s
from sim.engine.stage_costs import stage_bounds
from sim.engine.host import IDLE_S, measured_paid_s
from sim.formats.costs import BACKWARD_WITH_RECOMPUTE, FIRST_STAGE_WEIGHT, FORWARD_WITH_GRAPH, MeasuredWorkload
from sim.schedules.schedule import build_schedule, cold_starts, recomputes, recomputes_per_layer


@dataclass
class ActionPoints:
    """One (K, kind)'s actions: profiled time, its fixed part, measured time, the run each came from
    and which of the run's actions it is (stage, chunk, micro-batch; the same in every round)."""

    profiled: list[float] = field(default_factory=list)
    fixed: list[float] = field(default_factory=list)
    measured: list[float] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    actions: list[tuple[int, int, int]] = field(default_factory=list)
    # a backward under full: its stage's recompute as profiled (time, fixed part), beside its backward's,
    # and its stage's layer count
    recompute: list[tuple[float, float]] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    # 1.0 where the action starts cold (sim.schedules.schedule.cold_starts), else 0.0
    cold: list[float] = field(default_factory=list)
    # the compute seconds its device ran since its last long wait before it (inf where none came):
    # what the action paid of a warm-up (calibrate.noise.warm_up_fit.busy_since_wait_s)
    since_wait: list[float] = field(default_factory=list)
    # the run's after-wait probe over the calibration's, over its speed factor: the warm-up it paid in
    # seconds at the reference speed is this times the warm-up at the calibration's probe (1.0 without)
    warm_up_scale: list[float] = field(default_factory=list)

    def typical(self) -> "ActionPoints":
        """One point per action of a run: its median over the rounds that measured it.

        Validation compares a run's median round, and a fit on relative residuals of every round's
        point settles below that median wherever rounds scatter (minimising ``sum((p - m) / m)^2``
        weighs each point by 1/m^2, so a round 15% fast pulls the line down more than one 15% slow
        pulls it up). On both sets of reports tried, the median point lowered the held-out step's
        median error at the reference speed (docs/notes/2026-11-26-fit-variants.md). Points without
        an action identity stay as they are."""
        if not self.actions:
            return self
        groups: dict[tuple[str, tuple[int, int, int]], list[int]] = {}
        for i, key in enumerate(zip(self.runs, self.actions)):
            groups.setdefault(key, []).append(i)
        rows = list(groups.items())
        return ActionPoints([self.profiled[members[0]] for _, members in rows],
                            [self.fixed[members[0]] for _, members in rows],
                            [statistics.median(self.measured[i] for i in members) for _, members in rows],
                            [run for (run, _), _ in rows], [action for (_, action), _ in rows],
                            [self.recompute[members[0]] for _, members in rows] if self.recompute else [],
                            [self.layers[members[0]] for _, members in rows] if self.layers else [],
                            [self.cold[members[0]] for _, members in rows] if self.cold else [],
                            [statistics.median(self.since_wait[i] for i in members) for _, members in rows]
                            if self.since_wait else [],
                            [statistics.median(self.warm_up_scale[i] for i in members) for _, members in rows]
                            if self.warm_up_scale else [])

    def less_warm_up(self, warm_up_s: float) -> "ActionPoints":
        """These points with what each paid of a warm-up of ``warm_up_s`` taken out of its measured time."""
        return replace(self, measured=[m - p for m, p in zip(self.measured, self.warm_up_paid(warm_up_s))])

    def warm_up_paid(self, warm_up_s: float) -> list[float]:
        """Per point, what it paid of a warm-up of ``warm_up_s`` at the calibration's after-wait probe,
        scaled to its run's (:func:`sim.engine.host.measured_paid_s`)."""
        if not self.since_wait:
            return [0.0] * len(self.measured)
        scales = self.warm_up_scale or [1.0] * len(self.measured)
        return [measured_paid_s(warm_up_s * scale, since, m)
                for since, m, scale in zip(self.since_wait, self.measured, scales)]


@dataclass
class Observations:
    """Measured spans of executor runs paired with what the layer profile predicts for them."""

    actions: dict[tuple[int, str], ActionPoints] = field(default_factory=dict)
    sends: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)
    optimizer: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)
    # per K and kind of action: the executor's own time after one, before the device's next
    gaps: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    # per K of two stages or more, per design run: each measured step's compute seconds per stage
    step_compute: dict[int, dict[str, list[list[float]]]] = field(default_factory=dict)
    # per K: the first stage's I actions (a split backward's, computing no gradient), seconds
    first_input: dict[int, list[float]] = field(default_factory=dict)

    @staticmethod
    def _add(table: dict, key: Any, x: float, y: float) -> None:
        xs, ys = table.setdefault(key, ([], []))
        xs.append(x)
        ys.append(y)


def collect(workload: MeasuredWorkload, spec: RunSpec, report: dict[str, Any], obs: Observations,
            speed: float = 1.0, after_wait_factor: float = 1.0) -> None:
    """Add one run's spans to ``obs``: compute actions, sends, optimizer steps and the gaps between
    actions (:func:`calibrate.fit.step_components.action_gaps_s`) of measured steps.

    Durations are divided by ``speed`` (:func:`calibrate.noise.speed.speed_factor` of the run), so every
    run enters the fits at the reference speed, and the warm-up its actions paid is scaled by its
    ``after_wait_factor`` (:func:`calibrate.noise.after_wait_probe.warm_up_factor`), so the fitted warm-up
    is the one at the calibration's after-wait probe, as ``gpipe validate`` scales it. A stage's
    optimizer step is the sum of its step's ``optimizer`` spans (the gradient norm, then clipping
    and the update, either side of the wait for the other stages' norms).
    """
    k_count = spec.stages
    bounds = stage_bounds(spec.partition)
    m_count = len([a for a in report["actions"] if a["stage"] == 0 and a["kind"] == "F"])
    cold = cold_marks(spec)
    records, steps = measured_records(report)  # the timeline read once, for the waits and the gaps
    since_wait = busy_since_wait_s(records, steps, IDLE_S)
    for action in report["actions"]:
        kind = fitted_kind(action, bounds, spec.layout.checkpoint, m_count)
        if kind is None:
            if action["kind"] == "I":
                obs.first_input.setdefault(k_count, []).append(action["duration_s"] / speed)
            continue
        profiled, fixed = profiled_action_parts(workload, spec.layout.checkpoint, action, bounds, m_count)
        points = obs.actions.setdefault((k_count, kind), ActionPoints())
        points.profiled.append(profiled)
        points.fixed.append(fixed)
        points.measured.append(action["duration_s"] / speed)
        points.runs.append(spec.label())
        points.actions.append((action["stage"], action.get("virtual_stage", 0), action["microbatch"]))
        points.cold.append(1.0 if starts_cold_in(cold, action) else 0.0)
        points.since_wait.append(since_wait.get((action["stage"], action.get("virtual_stage"), action["kind"],
                                                 action["microbatch"]), math.inf) / speed)
        points.warm_up_scale.append(after_wait_factor / speed)
        if kind == BACKWARD_WITH_RECOMPUTE:
            first, end = bounds[action["stage"]]
            parts = [workload.profiled_parts_s("R", i, action["rows"]) for i in range(first, end)]
            points.recompute.append((sum(t for t, _ in parts), sum(f for _, f in parts)))
            points.layers.append(end - first)
    measured = set(report["measured_steps"])
    optimizer_s: dict[tuple[int, int], float] = {}  # (stage, step) -> seconds
    for record in report["timeline"]["records"]:
        if record["step"] not in measured:
            continue
        duration = (record["end_s"] - record["start_s"]) / speed
        first, end = bounds[record["stage"]]
        rows = _rows_of(spec, record["microbatch"])
        if record["kind"] in ("send_act", "send_grad") and record["microbatch"] >= 0 and duration > 0:
            key = "output_bytes" if record["kind"] == "send_act" else "input_bytes"
            layer = end - 1 if record["kind"] == "send_act" else first
            Observations._add(obs.sends, k_count, workload._mem(key, layer, rows), duration)
        elif record["kind"] == "optimizer":
            key = (record["stage"], record["step"])
            optimizer_s[key] = optimizer_s.get(key, 0.0) + duration
    for (stage, _), duration in sorted(optimizer_s.items()):
        if duration > 0:
            first, end = bounds[stage]
            params = sum(int(workload.memory[i]["param_bytes"]) for i in range(first, end))
            Observations._add(obs.optimizer, k_count, params, duration)
    for gaps in action_gaps_s(records, steps).values():
        for kind, gap in gaps:
            obs.gaps.setdefault(k_count, {}).setdefault(kind, []).append(gap / speed)
    if k_count >= 2:
        obs.step_compute.setdefault(k_count, {}).setdefault(spec.label(), []).extend(
            [seconds / speed for seconds in row] for row in compute_per_step_s(report))


def cold_marks(spec: RunSpec) -> dict[tuple[int, str, int], bool]:
    """Per (virtual stage, kind, micro-batch) of the run's schedule, whether that action starts cold
    (:func:`sim.schedules.schedule.cold_starts`): the simulator walks the same lists."""
    marks: dict[tuple[int, str, int], bool] = {}
    for actions in build_schedule(spec.stages, spec.layout.microbatches, spec.layout.schedule, spec.layout.checkpoint,
                                  spec.layout.virtual_stages):
        for action, is_cold in zip(actions, cold_starts(actions)):
            marks[(action.stage, action.kind.value, action.microbatch)] = is_cold
    return marks


def starts_cold_in(marks: dict[tuple[int, str, int], bool], action: dict[str, Any]) -> bool:
    """Whether a report's action starts cold by ``marks`` (a chunk's own index where the run interleaves)."""
    return marks.get((action.get("virtual_stage", action["stage"]), action["kind"], action["microbatch"]), False)


def fitted_kind(action: dict[str, Any], bounds: Sequence[tuple[int, int]], checkpoint: str,
                microbatches: int) -> str | None:
    """The line a report's action is fitted on: its kind's, but a forward that keeps its graph for
    the backward (every one under ``never`` and ``selective``, the last under ``except_last``) on
    the line of its own (:data:`sim.formats.costs.FORWARD_WITH_GRAPH`); on the first stage (whose input needs
    no gradient) a split backward's W is the whole backward, on a line of its own
    (:data:`sim.formats.costs.FIRST_STAGE_WEIGHT`), and its I computes nothing (None: not on a line; its
    measured time is the first stage's I, ``first_input_s``), as
    :func:`sim.engine.stage_costs.weight_grad_time_s` and :func:`~sim.engine.stage_costs.input_grad_time_s` predict them;
    a backward under ``full`` (each layer recomputed just before its own backward) apart
    (:data:`sim.formats.costs.BACKWARD_WITH_RECOMPUTE`): its time per layer (after a stage's first) beyond the
    backward's and the recompute's lines summed (:func:`calibrate.fit.pipeline_fit.fit_full_backward`)."""
    kind = action["kind"]
    if kind == "B" and recomputes_per_layer(checkpoint):
        return BACKWARD_WITH_RECOMPUTE
    # under full a forward keeps each layer's input, no graph: a plain forward
    if kind == "F" and not recomputes(checkpoint, action["microbatch"], microbatches) \
            and not recomputes_per_layer(checkpoint):
        return FORWARD_WITH_GRAPH
    if kind in ("I", "W") and bounds[action["stage"]][0] == 0:
        return FIRST_STAGE_WEIGHT if kind == "W" else None
    return kind


def profiled_action_s(workload: MeasuredWorkload, checkpoint: str, action: dict[str, Any],
                      bounds: Sequence[tuple[int, int]], microbatches: int) -> float:
    """What the layer profile says one of a report's actions takes: its stage's layers' times of the
    kind it is fitted as (:func:`fitted_kind`; a forward that keeps its graph as the profile's forward
    with grad, which is what it runs; 0 for the first stage's I)."""
    return profiled_action_parts(workload, checkpoint, action, bounds, microbatches)[0]


def profiled_action_parts(workload: MeasuredWorkload, checkpoint: str, action: dict[str, Any],
                          bounds: Sequence[tuple[int, int]], microbatches: int) -> tuple[float, float]:
    """:func:`profiled_action_s` and its part that does not grow with the rows
    (:meth:`sim.formats.costs.MeasuredWorkload.profiled_parts_s`)."""
    first, end = bounds[action["stage"]]
    kind = fitted_kind(action, bounds, checkpoint, microbatches)
    if kind is None:
        return 0.0, 0.0
    kind = {FORWARD_WITH_GRAPH: "R", FIRST_STAGE_WEIGHT: "B", BACKWARD_WITH_RECOMPUTE: "B"}.get(kind, kind)
    parts = [workload.profiled_parts_s(kind, i, action["rows"]) for i in range(first, end)]
    return sum(t for t, _ in parts), sum(f for _, f in parts)


def _rows_of(spec: RunSpec, microbatch: int) -> int:
    from sim.schedules.microbatch import split_rows

    rows = split_rows(spec.batch_size, spec.layout.microbatches)
    return rows[microbatch] if 0 <= microbatch < len(rows) else rows[0]
