"""Calibration from start to finish: profile, ping-pong, a design of executor runs, fit, costs dict.

The design (:func:`calibration_design`) is a handful of runs chosen to make every fitted term
identifiable: several micro-batch sizes (so per-action scale and overhead separate), both stage
counts the machine has room for, a balanced and a skewed partition (different sums of layers per
action and different boundary tensors), every checkpoint policy and both schedules. The held-out set
of :mod:`calibrate.validate.held_out` is disjoint from it by construction.

Fitting happens in two passes. First the per-action, send and optimizer fits, from the executor's
own spans against the layer profile; then, with those fixed, one step-overhead constant per K from
whole-step times, by simulating each design run with the fitted costs.

Everything is fitted at a reference speed (:mod:`calibrate.noise.speed`): the profile's rounds are put at
the median pace of the probes around them, and every design run at the median pace of the probes
its ranks took around the design runs with the same K (``data["speed"]["reference_s"]``), so a
moment when the shared machine ran slow does not bend the fits, and validation can tell later
drift of the machine from error of the model.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from sim.errors import require_at_least
from sim.formats.costs import (DESIGN_FIT_GOAL, BACKWARD_WITH_RECOMPUTE, fit_quality, FIRST_STAGE_WEIGHT,
                               FORWARD_WITH_GRAPH, ActionFit, MeasuredWorkload)
from calibrate.fit.least_squares import (AffineFit, fit_action, fit_affine, fit_constant, fit_link, fit_roofline,
                                         fit_warm_up, replica_spread)
from calibrate.fit.design_checks import corrected_within_bounds, missed_design_runs, refuse_missed
from calibrate.noise.after_wait_probe import report_warm_up_factor
from calibrate.fit.step_components import (action_gaps_s, busy_since_wait_s, compute_per_step_s, measured_end_span_s,
                                           measured_records, predicted_end_span_s)
from sim.engine.stage_costs import stage_bounds
from sim.engine.stragglers import straggle_fraction
from sim.engine.host import IDLE_S, measured_paid_s
from sim.planner.partition import even_partition
from sim.schedules.schedule import COMPUTE_KINDS, build_schedule, cold_starts, recomputes, recomputes_per_layer
from sim.views.progress import phase
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, optimizer_slots

Progress = Callable[[str], None]


@dataclass(frozen=True)
class RunSpec:
    """One executor run: (D, K, T, V, M, partition, checkpoint, schedule) at a global batch size.

    ``replicas`` D copies of the pipeline train on ``torch.chunk`` of the batch each and average
    their gradients; each stage runs on ``tensor_parallel`` T ranks (D x K x T processes in all);
    under a multi-chunk schedule each process runs ``virtual_stages`` V chunks (the partition lists
    V x K); the calibration design keeps D = T = V = 1.
    """

    partition: tuple[int, ...]
    microbatches: int
    checkpoint: str
    schedule: str
    batch_size: int
    replicas: int = 1
    tensor_parallel: int = 1
    virtual_stages: int = 1

    @property
    def stages(self) -> int:
        return len(self.partition) // self.virtual_stages

    @property
    def processes(self) -> int:
        """D x K x T: one process per (replica, stage, tensor-parallel rank)."""
        return self.replicas * self.stages * self.tensor_parallel

    def label(self) -> str:
        parts = ",".join(map(str, self.partition))
        replicas = f"D={self.replicas} " if self.replicas > 1 else ""
        split = f" T={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        chunks = f" V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"{replicas}K={self.stages}{split}{chunks} M={self.microbatches} [{parts}] {self.checkpoint} "
                f"{self.schedule}")


def skewed(num_layers: int, stages: int) -> tuple[int, ...]:
    """A deliberately unbalanced split: the first stage gets about a quarter of the layers."""
    if stages == 1:
        return (num_layers,)
    first = max(1, num_layers // 4)
    return (first,) + even_partition(num_layers - first, stages - 1)


def calibration_design(num_layers: int, batch_size: int, max_stages: int = 2,
                       tensor_parallel: Sequence[int] = (), split_backward: bool = False,
                       row_span: bool = True, per_layer_recompute: bool = True) -> list[RunSpec]:
    """The runs the fit learns from (small: every run costs a few seconds on 2 cores); for each T in
    ``tensor_parallel`` (the splits the profile measured) two one-stage runs split over T ranks,
    whose actions fit the split stages' in-pipeline factor (:func:`fit_tensor_parallel`). With
    ``split_backward`` (a profile that timed I and W apart) a zb-h1 run, whose I and W actions get
    in-pipeline factors of their own: a backward split in two pays its dispatch twice and keeps
    its graph between the halves, which the whole backward's factor does not see. It keeps every
    forward's graph (``never``) at 5-6 rows, where the other runs that do have 8 or 16.

    ``row_span`` (a full calibration) adds runs at the ends of the rows a plan can use: the whole
    batch in one micro-batch (K = 1 and 2, every kind of action at the batch's rows) and K = 1 with
    16 micro-batches keeping their graphs (the fewest rows a forward that keeps its graph has).
    Without them the lines rest on 4 to 16 rows at K = 1 and 2 to 16 at K = 2, and the held-out
    runs with the whole batch in one micro-batch came out low in each of five calibrations (K = 1 by
    6-20%, K = 2 by 2-20%).

    ``per_layer_recompute`` (a full calibration) adds a ``--checkpoint full`` run at K = 1 and at
    K = 2 (4 rows), whose backwards, each layer recomputed just before its own, measure the time each
    layer after a stage's first adds beyond the backward's and the recompute's lines (:func:`fit_full_backward`)."""
    single = even_partition(num_layers, 1)
    specs = [RunSpec(single, 2, "never", "gpipe", batch_size),
             RunSpec(single, 8, "always", "gpipe", batch_size)]
    if row_span:
        specs += [RunSpec(single, 1, "always", "gpipe", batch_size),
                  RunSpec(single, 16, "never", "gpipe", batch_size)]
    if per_layer_recompute:
        specs.append(RunSpec(single, 8, "full", "gpipe", batch_size))
    if max_stages >= 2 and num_layers >= 2:
        specs += [RunSpec(even_partition(num_layers, 2), 4, "except_last", "gpipe", batch_size),
                  RunSpec(skewed(num_layers, 2), 8, "always", "1f1b", batch_size),
                  RunSpec(even_partition(num_layers, 2), 2, "never", "1f1b", batch_size),
                  RunSpec(even_partition(num_layers, 2), 16, "always", "gpipe", batch_size)]
        if row_span:
            specs.append(RunSpec(even_partition(num_layers, 2), 1, "always", "gpipe", batch_size))
        if split_backward:
            specs.append(RunSpec(even_partition(num_layers, 2), 6, "never", "zb-h1", batch_size))
        if per_layer_recompute:
            specs.append(RunSpec(even_partition(num_layers, 2), 8, "full", "gpipe", batch_size))
    for parts in tensor_parallel:
        specs += [RunSpec(even_partition(num_layers, 1), 2, "never", "gpipe", batch_size, 1, parts),
                  RunSpec(even_partition(num_layers, 1), 4, "except_last", "gpipe", batch_size, 1, parts)]
    return specs


WARMUP_STEPS = 1  # each run's first steps, left out of its timing (the report's measured steps)


def check_timed_steps(steps: int) -> int:
    """``--steps`` of a command whose runs are timed: more than the warm-up, which the timing leaves
    out (with no step left, a report times every step, the warm-up included)."""
    return require_at_least("steps", steps, WARMUP_STEPS + 1, "the first step is a warm-up, left out of "
                            f"the timing; use --steps {WARMUP_STEPS + 1} or more")


def run_config(model: str, options: dict[str, Any], spec: RunSpec, steps: int, device: str = "cpu",
               optimizer: str = DEFAULT_OPTIMIZER, precision: str = "fp32") -> Any:
    from executor.config import RunConfig

    return RunConfig(model=model, options=dict(options), partition=spec.partition,
                     batch_size=spec.batch_size, microbatches=spec.microbatches,
                     schedule=spec.schedule, checkpoint=spec.checkpoint, steps=steps,
                     warmup_steps=WARMUP_STEPS, device=device, timeout_s=120.0, optimizer=optimizer,
                     precision=precision, replicas=spec.replicas,
                     tensor_parallel=spec.tensor_parallel, virtual_stages=spec.virtual_stages).validate()


# ----------------------------------------------------------------------------- observations


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
    # what the action paid of a warm-up (calibrate.fit.step_components.busy_since_wait_s)
    since_wait: list[float] = field(default_factory=list)
    # the run's after-wait probe over the calibration's, over its speed factor: the warm-up it paid in
    # seconds at the reference speed is this times the warm-up at the calibration's probe (1.0 without)
    warm_up_scale: list[float] = field(default_factory=list)

    def typical(self) -> "ActionPoints":
        """One point per action of a run: its median over the rounds that measured it.

        Validation compares a run's median round, and a fit on relative residuals of every round's
        point settles below that median wherever rounds scatter (minimising ``sum((p - m) / m)^2``
        weighs each point by 1/m^2, so a round 15% fast pulls the line down more than one 15% slow
        pulls it up). On two sets of reports whose rounds spread by 12%, the held-out step's median
        error at the reference speed went from 7.0% to 4.8% and from 6.1% to 4.0%
        (benchmarks/README.md). Points without an action identity stay as they are."""
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
        kind = fitted_kind(action, bounds, spec.checkpoint, m_count)
        if kind is None:
            if action["kind"] == "I":
                obs.first_input.setdefault(k_count, []).append(action["duration_s"] / speed)
            continue
        profiled, fixed = profiled_action_parts(workload, spec.checkpoint, action, bounds, m_count)
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
    for actions in build_schedule(spec.stages, spec.microbatches, spec.schedule, spec.checkpoint,
                                  spec.virtual_stages):
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
    backward's and the recompute's lines summed (:func:`fit_full_backward`)."""
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

    rows = split_rows(spec.batch_size, spec.microbatches)
    return rows[microbatch] if 0 <= microbatch < len(rows) else rows[0]


# the lines that take another's per-action overhead rather than fit their own (fit_pipeline)
OVERHEAD_OF = {FORWARD_WITH_GRAPH: "F", "I": "B", "W": "B", FIRST_STAGE_WEIGHT: "B"}


def fit_full_backward(points: ActionPoints, backward: ActionFit, recompute: ActionFit) -> AffineFit:
    """The seconds each layer after a stage's first adds to a backward under ``full`` beyond the
    backward's and the recompute's lines summed (the fit's slope over the stage's layer count less one,
    through zero, at least 0), by least squares on the relative residuals.

    The executor's ``full`` backward restores each layer's random state, reruns its forward and calls
    autograd on it, one layer at a time: work per layer, not per row. The lines' per-action overheads
    hold one such call (a stage's recompute, then its backward); each further layer pays its own. A
    factor over the two lines (fitted before) put the held-out K = 1 ``full`` run at 8 rows 8.6% high
    where the design's run, at 4 rows, sat on it; a time for every layer put the one-layer embedding
    stage of a K = 2 ``full`` run 15-51% high. Not a line of its own: a full design run's backwards all
    have the same rows, and at K = 1, where every stage holds every layer, a line's per-action overhead
    cannot be told from its scale of the profile's fixed part (one calibration here fitted the backward
    5.9 ms of overhead and none of the fixed part, the next the reverse; a line sharing that overhead
    put the held-out K = 1 ``full`` run -14.9% and +0.5% off). The two lines' sum is known at every row
    count, whichever way they split it. At least 0: the work it stands for takes time."""
    combined = [backward(p, f) + recompute(*r) for p, f, r in zip(points.profiled, points.fixed, points.recompute)]
    further = [n - 1 for n in points.layers]
    per_layer = [n / m for n, m in zip(further, points.measured)]
    short = [1.0 - c / m for c, m in zip(combined, points.measured)]
    spread = sum(a * a for a in per_layer)
    seconds = max(0.0, sum(a * s for a, s in zip(per_layer, short)) / spread) if spread else 0.0
    return AffineFit(seconds, 0.0, tuple((c + n * seconds) / m - 1.0
                                         for c, n, m in zip(combined, further, points.measured)))


def fit_lines(typical: dict[str, ActionPoints], warm_up_s: float) -> tuple[dict[str, Any], float]:
    """One K's action lines on its points (each action's median over the rounds), with what each point
    paid of a warm-up of ``warm_up_s`` taken out (:mod:`sim.engine.host`); and their summed weighted squares.

    I and W only where a design run split its backward (the stage's costs otherwise scale their
    profile by the whole backward's factor, sim.formats.costs.MeasuredWorkload.stage_cost), a forward
    keeping its graph only where a design run had one (else it takes the forward's line); a backward
    under full takes a time per layer beyond the backward's and the recompute's lines (fit_full_backward)."""
    lines: dict[str, Any] = {}
    cost = 0.0
    for kind in ("F", "R", "B") + tuple(kind for kind in (FORWARD_WITH_GRAPH, "I", "W", FIRST_STAGE_WEIGHT)
                                        if kind in typical):
        if kind not in typical:
            lines[kind] = AffineFit(1.0, 0.0).to_dict()
            continue
        points = typical[kind]
        # overhead >= 0: a free intercept traded a slope above 1 for a negative overhead
        # on the design's few row counts and overshot at row counts outside them; a forward
        # keeping its graph takes the forward's, I and W the backward's (the executor's work
        # around the action is the same; their design runs' stages are all of one size at
        # one or two row counts, which cannot tell an overhead from a scale: one zb-h1 run's
        # 5- and 6-row actions fitted W an overhead of 3 ms, 30% too much on the zbv's chunks)
        shares = OVERHEAD_OF.get(kind)
        overhead = lines[shares]["intercept"] if shares else None
        line = fit_action(points.profiled, points.fixed, points.measured, points.runs,
                          overhead_s=overhead, cold=points.cold, extra=points.warm_up_paid(warm_up_s))
        lines[kind] = line.to_dict()
        cost += line.cost
    return lines, cost


def fit_pipeline(obs: Observations, threads_of: dict[int, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-K fits (``pipeline`` section of the costs file) and their residual summaries."""
    pipeline: dict[str, Any] = {}
    residuals: dict[str, Any] = {}
    for k in sorted({k for k, _ in obs.actions}):
        entry: dict[str, Any] = {"threads": threads_of[k]}
        typical = {kind: points.typical() for (at, kind), points in obs.actions.items() if at == k}
        waited = any(not math.isinf(since) for points in typical.values() for since in points.since_wait)
        # the warm-up after a long wait (a CPU host's effect, sim.engine.host), fitted with the lines: the one
        # whose lines fit best
        warm_up_s = fit_warm_up(lambda w: fit_lines(typical, w)[1]) if waited else 0.0
        entry["host"] = {"warm_up_s": warm_up_s}
        entry["actions"] = fit_lines(typical, warm_up_s)[0]
        entry["send"] = (fit_affine(*obs.sends[k], slope_bounds=(0.0, 1.0), intercept_bounds=(0.0, 1.0))
                         if k in obs.sends else AffineFit(0.0, 0.0)).to_dict()
        entry["optimizer"] = (fit_affine(*obs.optimizer[k], slope_bounds=(0.0, 1.0))
                              if k in obs.optimizer else AffineFit(0.0, 0.0)).to_dict()
        entry["step_overhead_s"] = 0.0
        if obs.first_input.get(k):
            entry["first_input_s"] = statistics.median(obs.first_input[k])
        full = None
        if (k, BACKWARD_WITH_RECOMPUTE) in obs.actions:
            full = fit_full_backward(typical[BACKWARD_WITH_RECOMPUTE].less_warm_up(warm_up_s),
                                     ActionFit.from_dict(entry["actions"]["B"]), ActionFit.from_dict(entry["actions"]["R"]))
            entry["full_backward_per_layer_s"] = full.slope
        # per kind of the action before, the median: a gap in which the executor did a chore while its
        # input was away (drawing the next batch, once a step) is no part of the time between two
        # actions that follow each other; a kind no design run had after it takes the median of all
        gaps = obs.gaps.get(k, {})
        pooled = [gap for values in gaps.values() for gap in values]
        entry["gap_after_s"] = ({kind: statistics.median(gaps.get(kind) or pooled) for kind in COMPUTE_KINDS}
                                if pooled else {})
        # how a process's compute varies from step to step: how late the slowest of D replicas finishes
        spread = replica_spread(list(obs.step_compute.get(k, {}).values()))
        if spread:
            entry["replica_spread"] = spread
        pipeline[str(k)] = entry
        residuals[str(k)] = {name: {key: value for key, value in fit.items() if key != "slope"}
                             for name, fit in [("send", entry["send"]), ("optimizer", entry["optimizer"])]
                             + [(f"action {kind}", line) for kind, line in entry["actions"].items()]}
        residuals[str(k)]["warm up"] = {"warm_up_s": warm_up_s, "idle_s": IDLE_S}
        if full is not None:
            residuals[str(k)][f"action {BACKWARD_WITH_RECOMPUTE}"] = {key: v for key, v in full.to_dict().items()
                                                                       if key != "slope"}
        if spread:
            residuals[str(k)]["replica spread"] = {
                "steps": sum(len(rows) for rows in obs.step_compute[k].values()),
                "straggle_of_2": straggle_fraction(spread, 2), "straggle_of_4": straggle_fraction(spread, 4)}
        for kind, values in sorted(gaps.items()):
            low, _, high = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
            residuals[str(k)][f"gap after {kind}"] = {"points": len(values), "median_s": entry["gap_after_s"][kind],
                                                      "quartiles_s": [low, high]}
    return pipeline, residuals


def predict(data: dict[str, Any], spec: RunSpec, system_name: str = "cpu") -> Any:
    """Simulate one run spec with the costs in ``data``; the :class:`sim.engine.engine.SimResult`.

    The pipeline fits and the profile's thread count are those of as many processes as the run
    has (D x K, :attr:`sim.formats.costs.MeasuredWorkload.fit`). The data-parallel all-reduce is priced on
    the measured all-reduce link where the costs file has one (:func:`sim.formats.costs.allreduce_link`).
    With T > 1 each stage is priced from the costs file's profile of the layers split over T ranks
    (:mod:`calibrate.measure.tp_profile`). A run with more processes than the system has devices (D x K = 4
    on two cores) is predicted as if each process had a core of its own, with the fits of the nearest
    fitted process count (a calibration fits no more processes than the machine has cores): the
    cores' sharing is a CPU host's effect the simulator does not model (:mod:`sim.engine.host`).
    """
    from sim.engine.engine import simulate
    from sim.catalog.hardware import get_system
    from sim.workloads.tensor_parallel import with_tensor_parallel

    system = get_system(system_name)
    if spec.processes > system.total_devices:
        system = replace(system, devices_per_node=spec.processes, nodes=1)
    workload, system = with_tensor_parallel(MeasuredWorkload(data), system, spec.tensor_parallel)
    workload, system = workload.bind(system, spec.stages, spec.checkpoint, spec.microbatches, spec.replicas)
    # one replica has nothing to average, so no all-reduce to price
    replicas = ({"replicas": spec.replicas, "allreduce_link": workload.allreduce_link(system)}
                if spec.replicas > 1 else {})
    return simulate(workload, system, spec.partition, spec.batch_size, spec.microbatches, spec.checkpoint,
                    spec.schedule, virtual_stages=spec.virtual_stages, **replicas)


def fit_step_overhead(data: dict[str, Any], specs: Sequence[RunSpec], reports: Sequence[dict[str, Any]],
                      system_name: str = "cpu", speeds: Sequence[float] | None = None) -> dict[str, Any]:
    """Fit each K's step overhead on whole-step times (in place in ``data``); its residuals.

    The overhead stands for time at the end of a step the model does not otherwise price, so it is
    bounded by what the runs measured there: the median over the K's runs of the measured
    end-of-step span less the predicted one without overhead (:mod:`calibrate.fit.step_components`).
    What the bound leaves of a misfit shows as the prediction's error, not as end-of-step time
    that was never measured. Step times and spans are divided by each run's ``speeds`` entry (1.0
    when not given), as in :func:`collect`.
    """
    summary = {}
    speeds = list(speeds) if speeds is not None else [1.0] * len(reports)
    for k in sorted({s.stages for s in specs}):
        data["pipeline"][str(k)]["step_overhead_s"] = 0.0
        runs = [(s, r, v, predict(data, s, system_name)) for s, r, v in zip(specs, reports, speeds) if s.stages == k]
        pairs = [(r["step_time_s"] / v, result.step_time_s) for _s, r, v, result in runs]
        unconstrained, _ = fit_constant([m for m, _ in pairs], [p for _, p in pairs])
        bound = statistics.median(max(0.0, measured_end_span_s(r) / v - predicted_end_span_s(result))
                                  for _s, r, v, result in runs)
        constant = max(0.0, min(unconstrained, bound))
        residuals = [(p + constant - m) / m for m, p in pairs]
        data["pipeline"][str(k)]["step_overhead_s"] = constant
        summary[str(k)] = {"step_overhead_s": constant, "unconstrained_s": unconstrained, "end_span_bound_s": bound,
                           "points": len(pairs), "worst_relative": max((abs(v) for v in residuals), default=0.0)}
    return summary


def design_entry(data: dict[str, Any], spec: RunSpec, reports: Sequence[dict[str, Any]],
                 corrections: Sequence[dict[str, float]]) -> dict[str, Any]:
    """How the finished fit predicts one design run over its rounds: step and busy time per stage
    (replica 0's, forward, recompute, backward and optimizer) at the reference speed, the raw step
    and each round's corrections (:mod:`calibrate.fit.design_checks`) beside them; a fit that reproduces
    its own runs' steps but not their busy time has put compute into some other term."""
    speeds = [c["speed"] for c in corrections]
    result = predict(data, spec)
    stages = len(reports[0]["stages"])
    busy = sorted((s for s in result.stages if s.replica == 0), key=lambda s: s.stage)
    return {"run": spec.label(),
            "measured_step_s": statistics.median(r["step_time_s"] / v for r, v in zip(reports, speeds)),
            "raw_measured_step_s": statistics.median(r["step_time_s"] for r in reports),
            "predicted_step_s": result.step_time_s,
            "measured_busy_s": [statistics.median(r["stages"][k]["busy_s"] / v for r, v in zip(reports, speeds))
                                for k in range(stages)],
            "predicted_busy_s": [s.busy_s for s in busy],
            "corrections": [dict(c) for c in corrections]}


def fit_tensor_parallel(data: dict[str, Any], specs: Sequence[RunSpec], reports: Sequence[dict[str, Any]],
                        speeds: Sequence[float]) -> dict[str, Any]:
    """Per T, the in-pipeline factor on the split profile's times, fitted on the design's split
    runs as K's slopes are on whole stages: for each kind (F, R, B) the least-squares ratio through
    the origin of the measured durations (at the reference speed, tensor-parallel rank 0's, less
    K's per-action overhead and, where the action starts cold, its cold start) to the profiled
    ones, a kind the design runs did not show taking the ratio over all of them
    (``tensor_parallel_fit`` in the costs file; :class:`sim.formats.costs.MeasuredWorkload` uses it in
    place of K's slopes). The optimizer step gets a factor the same way, on K's optimizer
    line for the stage's shard (``optimizer``): the step over a split stage's DTensor shards pays
    their dispatch per parameter, which K's line, fitted on plain tensors, does not (21 ms against
    3.7 ms predicted for the demo model's T=2 stage with AdamW). Limits: one factor per kind
    whatever the rows; fitted on one-stage runs."""
    def ratio(xs: Sequence[float], ys: Sequence[float]) -> float:
        return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)

    pairs: dict[int, dict[str, tuple[list[float], list[float]]]] = {}
    optimizer_pairs: dict[int, tuple[list[float], list[float]]] = {}  # K's optimizer line's seconds, measured
    for spec, report, speed in zip(specs, reports, speeds):
        if spec.tensor_parallel == 1:
            continue
        workload = MeasuredWorkload(data, spec.stages, spec.checkpoint, spec.microbatches, spec.tensor_parallel)
        bounds = stage_bounds(spec.partition)
        cold = cold_marks(spec)
        for action in report["actions"]:
            kind = action["kind"]
            if kind not in "FRB":
                continue
            line = workload.fit.actions[kind]
            xs, ys = pairs.setdefault(spec.tensor_parallel, {}).setdefault(kind, ([], []))
            xs.append(profiled_action_s(workload, spec.checkpoint, action, bounds, spec.microbatches))
            ys.append(action["duration_s"] / speed - line.intercept
                      - (line.cold_start_s if starts_cold_in(cold, action) else 0.0))
        measured = set(report.get("measured_steps", ()))
        optimizer_s: dict[tuple[int, int], float] = {}  # (stage, step) -> seconds, rank 0's
        for record in report.get("timeline", {}).get("records", ()):
            if (record["kind"] == "optimizer" and record["step"] in measured and not record.get("replica")
                    and not record.get("tp")):
                key = (record["stage"], record["step"])
                optimizer_s[key] = optimizer_s.get(key, 0.0) + (record["end_s"] - record["start_s"]) / speed
        whole_line = MeasuredWorkload(data, spec.stages).fit.optimizer  # K's line, unscaled
        for (stage, _), seconds in sorted(optimizer_s.items()):
            first, end = bounds[stage]
            params = sum(int(workload.memory[i]["param_bytes"]) for i in range(first, end))
            xs, ys = optimizer_pairs.setdefault(spec.tensor_parallel, ([], []))
            xs.append(whole_line(params))
            ys.append(seconds)
    fits: dict[str, dict[str, float]] = {}
    for parts, kinds in pairs.items():
        pooled = ratio([x for xs, _ in kinds.values() for x in xs], [y for _, ys in kinds.values() for y in ys])
        fits[str(parts)] = {kind: ratio(*kinds[kind]) if kind in kinds else pooled for kind in "FRB"}
    for parts, (xs, ys) in optimizer_pairs.items():
        if any(xs):
            fits.setdefault(str(parts), {})["optimizer"] = ratio(xs, ys)
    return fits


def fit_in_pipeline(data: dict[str, Any], specs: Sequence[RunSpec], reports: Sequence[dict[str, Any]],
                    speeds: Sequence[float], threads_of: dict[int, int]) -> dict[str, Any]:
    """Fit what the design runs measured into ``data`` (in place): ``pipeline`` (per K), each K's step
    overhead, and ``tensor_parallel_fit`` where the design has split runs; the residuals."""
    whole = [i for i, s in enumerate(specs) if s.tensor_parallel == 1]
    obs = Observations()
    for i in whole:
        collect(MeasuredWorkload(data, specs[i].stages), specs[i], reports[i], obs, speeds[i],
                report_warm_up_factor(reports[i], data, specs[i].processes))
    data["pipeline"], residuals = fit_pipeline(obs, threads_of)
    residuals["step"] = fit_step_overhead(data, [specs[i] for i in whole], [reports[i] for i in whole],
                                          speeds=[speeds[i] for i in whole])
    if any(s.tensor_parallel > 1 for s in specs):
        data["tensor_parallel_fit"] = fit_tensor_parallel(data, specs, reports, speeds)
    return residuals


# the terms fit_in_pipeline writes: what a half of the design rounds fits afresh (fit_halves)
FITTED_TERMS = ("pipeline", "tensor_parallel_fit")


def fit_halves(data: dict[str, Any], design_size: int, specs: Sequence[RunSpec], reports: Sequence[dict[str, Any]],
               speeds: Sequence[float], threads_of: dict[int, int]) -> list[dict[str, Any]]:
    """The calibration's own noise: the same fit on the odd and on the even design rounds
    (``specs`` is the design repeated round after round), each half's :data:`FITTED_TERMS`.

    Validation predicts every held-out run with both halves too (:func:`calibrate.validate.held_out.compare`):
    how far two calibrations taken minutes apart on this machine place the same run. Each half has
    half the rounds, so two whole calibrations would lie about 1/sqrt(2) as far apart (where the
    noise falls as the square root of the rounds)."""
    import copy

    halves = []
    for parity in (0, 1):
        chosen = [i for i in range(len(specs)) if (i // design_size) % 2 == parity]
        half = copy.deepcopy({key: value for key, value in data.items()
                              if key not in FITTED_TERMS + ("fit_halves",)})
        fit_in_pipeline(half, [specs[i] for i in chosen], [reports[i] for i in chosen],
                        [speeds[i] for i in chosen], threads_of)
        halves.append({key: half[key] for key in FITTED_TERMS if key in half})
    return halves


# ----------------------------------------------------------------------------- efficiency


def fit_efficiency(model: str, options: dict[str, Any], profile: dict[str, Any], device: Any,
                   precision: str = "fp32") -> dict | None:
    """Roofline efficiency of the analytic model against the measured forwards (built-ins only, and
    only at a precision the device has a peak for: none for bf16 on the CPU, which emulates it)."""
    from sim.workloads.models import BUILTIN_MODELS, LAYER_OVERHEAD_S, get_workload

    if model not in BUILTIN_MODELS or model == "uniform" or precision not in device.peak_flops:
        return None
    analytic = get_workload(model, {**options, "precision": precision})
    threads = max(int(t) for t in profile["times_s"])
    times = profile["times_s"][str(threads)] if str(threads) in profile["times_s"] else profile["times_s"][threads]
    flops, traffic, measured = [], [], []
    for i, spec in enumerate(analytic.layers):  # type: ignore[attr-defined]
        for j, rows in enumerate(profile["rows"]):
            flops.append(spec.flops_per_row * rows)
            traffic.append(spec.traffic_bytes_per_row * rows + spec.fixed_traffic_bytes)
            measured.append(times["F"][i][j])
    fit = fit_roofline(flops, traffic, measured, device.peak_flops[precision], device.memory_bandwidth_bytes_per_s,
                       LAYER_OVERHEAD_S)
    return {**fit.to_dict(), "relative_to": device.name, "threads": threads}


# ----------------------------------------------------------------------------- the whole thing


def split_profile_parts(model: str, options: dict[str, Any], device: str, quick: bool,
                        asked: int | None) -> int:
    """T to profile the layers split over (1: none). Asked for: checked against the model's plan
    (one line if it has none). By default 2 in a full calibration where the host has room for two
    ranks and the model a tensor-parallel plan."""
    from executor.device import device_api
    from executor.models.build import build_meta_model
    from executor.parallel.tensor_parallel import check_model
    from sim.errors import GpipeInputError

    parts = asked if asked is not None else (1 if quick or device_api(device).ranks_per_host() < 2 else 2)
    if parts == 1:
        return 1
    try:
        check_model(build_meta_model(model, options), parts)
    except GpipeInputError:
        if asked is not None:
            raise
        return 1
    return parts


def profile_rows(batch_size: int) -> list[int]:
    """Row counts to profile: powers of two below the batch, and the batch; others interpolate."""
    rows = {batch_size}
    r = 1
    while r < batch_size:
        rows.add(r)
        r *= 2
    return sorted(rows)


def calibrate(model: str, options: dict[str, Any], batch_size: int, device: str = "cpu",
              max_stages: int | None = None, steps: int = 5, quick: bool = False,
              progress: Progress = print, rounds: int = 2, optimizer: str = DEFAULT_OPTIMIZER,
              precision: str = "fp32", tensor_parallel: int | None = None) -> dict[str, Any]:
    """Measure and fit everything for ``model``; the costs file's content (see :mod:`sim.formats.costs`).

    The design runs are measured ``rounds`` times, interleaved, and each action enters the fits at
    its median over the rounds (:meth:`ActionPoints.typical`), so a moment when the machine ran slow
    weighs less; with two rounds or more (not ``quick``) the fits on the odd and on the even rounds
    are kept beside the whole one (:func:`fit_halves`). They train with ``optimizer``, which
    the costs file records with its state per parameter. Layers are profiled and the design runs
    trained at ``precision`` (:mod:`executor.runtime.precision`), which the costs file records too.
    ``tensor_parallel`` T > 1 also profiles the layers split over T ranks (:mod:`calibrate.measure.tp_profile`);
    None does so with T = 2 in a full calibration where two ranks fit and the model has a plan.
    """
    import torch

    from executor.device import device_api

    from calibrate.measure.collective import available_parties, calibrate_allreduce, party_counts
    from calibrate.measure.tp_collectives import calibrate_tensor_parallel
    from calibrate.measure.link import ping_pong
    from calibrate.measure.machine import machine_stamp
    from calibrate.measure.profile import Repeats, profile_model
    from calibrate.noise.speed import SpeedProbe
    from calibrate.measure.runs import run_configs
    from executor.models.build import build_model, default_loss, example_batch, loss_function, model_ref
    from executor.parallel.sharing import shared_tensors
    from sim.catalog.hardware import LOCAL_CPU

    started = time.perf_counter()

    def say(message: str) -> None:
        progress(f"[{time.perf_counter() - started:6.1f}s] {message}")

    ref = model_ref(model, options)
    options = dict(ref.options)
    cores = os.cpu_count() or 1
    if max_stages is None:
        max_stages = device_api(device).ranks_per_host() if device != "cpu" else min(2, cores)
    max_stages = max(1, min(max_stages, ref.num_layers))
    stage_counts = sorted({1, max_stages})
    threads_of = {k: (1 if device == "cuda" else max(1, cores // k)) for k in stage_counts}
    rows = profile_rows(batch_size)
    say(f"profiling {ref.num_layers} layers of {model} in {precision} at rows {rows} with threads "
        f"{sorted(set(threads_of.values()))}")
    net = build_model(model, options, seed=0)
    loss = loss_function(default_loss(model))
    # quick: fewer runs, and the split backward's I and W left out (its cost then unmeasured, so gpipe
    # plan searches the split-backward schedules only when named, gpipe.plan.default_schedules)
    repeats = Repeats(min_runs=3, budget_s=0.02, max_runs=15, split=False) if quick else Repeats()
    profile = profile_model(net, lambda r: example_batch(model, options, r, seed=1), loss, rows,
                            sorted(set(threads_of.values()), reverse=True), torch.device(device), repeats,
                            progress=say, probe=SpeedProbe.model(model, options, batch_size, device=device),
                            precision=precision)
    torch.set_num_threads(cores)
    data: dict[str, Any] = {
        "machine": machine_stamp(device), "system": "cpu" if device == "cpu" else "cuda",
        "catalog_device": LOCAL_CPU.name if device == "cpu" else device,
        "model": {"name": model, "options": options, "num_layers": ref.num_layers,
                  "parameter_count": ref.parameter_count},
        "batch_size": batch_size, "precision": precision, "optimizer": optimizer,
        "optimizer_slots": optimizer_slots(optimizer),
        "profile": profile.to_dict(), "pipeline": {},
        # parameters several layers use (tied embeddings): one copy per stage, summed gradients
        "shared_parameters": [{"name": f"{layers[0]}.{name}", "layers": list(layers), "param_bytes": numel * 4}
                              for name, layers, numel in shared_tensors(net)],
    }
    parties = party_counts(available_parties(device))
    links = phase("measuring links", total=(max_stages >= 2) + (len(parties) > 0) * (1 if quick else 2),
                  unit="link")
    if max_stages >= 2:
        say("ping-pong between two ranks")
        points = ping_pong(device)
        link = fit_link([p["bytes"] for p in points], [p["one_way_s"] for p in points])
        data["link"] = {"name": points[0].get("transport", device_api(device).backend), **link.to_dict(),
                        "measured": points}
        links.update(1)
    if parties:
        say(f"all-reduce among {', '.join(map(str, parties))} ranks (data-parallel gradient averaging)")
        data["allreduce"] = calibrate_allreduce(device, quick, parties)
        links.update(1)
        if not quick:  # a quick calibration leaves them out (the catalog's node link prices them)
            say("reduce-scatter, all-gather and all-reduce among 2 ranks (tensor-parallel collectives)")
            data["tensor_parallel"] = calibrate_tensor_parallel(device, quick, 2)
            links.update(1)
    links.close()
    parts = split_profile_parts(model, options, device, quick, tensor_parallel)
    if parts > 1:
        from calibrate.measure.tp_profile import profile_tensor_parallel, thread_counts

        split_threads = thread_counts(parts, stage_counts, cores if device == "cpu" else parts)
        say(f"profiling the layers split over {parts} tensor-parallel ranks at threads {split_threads}")
        data["tensor_parallel_profile"] = {str(parts): profile_tensor_parallel(
            model, options, batch_size, rows, split_threads, parts, device, quick, precision)}
    design = calibration_design(ref.num_layers, batch_size, max_stages, [parts] if parts > 1 else [],
                                split_backward=repeats.split, row_span=not quick, per_layer_recompute=not quick)
    specs = design * (1 if quick else rounds)
    configs = [run_config(model, options, s, steps, device, optimizer, precision) for s in specs]
    def remeasure(indices: Sequence[int]) -> list[dict[str, Any]]:
        return run_configs([configs[i] for i in indices], progress=say)

    reports = run_configs(configs, progress=say)
    for attempt in (1, 2):  # a design run the fit misses is measured once more, then refused
        reports, data["speed"], corrections = corrected_within_bounds(model, specs, reports, remeasure, say)
        speeds = [c["speed"] for c in corrections]
        data["fit_residuals"] = fit_in_pipeline(data, specs, reports, speeds, threads_of)
        data["design"] = [design_entry(data, s, reports[i::len(design)], corrections[i::len(design)])
                          for i, s in enumerate(design)]
        missed = {run for run, _ in missed_design_runs(data)}
        if not missed or attempt == 2:
            break
        again = [i for i, s in enumerate(specs) if s.label() in missed]
        say(f"the fit misses {', '.join(sorted(missed))} past {DESIGN_FIT_GOAL:.0%}; measuring again and refitting")
        for i, report in zip(again, remeasure(again)):
            reports[i] = report
    refuse_missed(data)
    data["fit_quality"] = fit_quality(data, corrections)
    if not quick and rounds >= 2:
        data["fit_halves"] = fit_halves(data, len(design), specs, reports, speeds, threads_of)
    if device == "cpu":
        data["efficiency"] = fit_efficiency(model, options, data["profile"], LOCAL_CPU, precision)
    say("calibration done")
    return data
