"""Each K's in-pipeline fits on the design runs' actions: the per-action lines, sends, optimizer step,
the warm-up after long waits, the gaps between actions and how a replica's compute varies.

The lines scale the layer profile's times to what an action takes inside the pipeline (where the
executor adds its own work around the layers); they are fitted on each action's median over the
rounds (:meth:`calibrate.fit.observations.ActionPoints.typical`). The ``pipeline`` section of the
costs file (:mod:`sim.formats.costs`) is what :func:`fit_pipeline` returns.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from calibrate.fit.least_squares import AffineFit, fit_action, fit_affine, replica_spread
from calibrate.fit.observations import ActionPoints, Observations
from calibrate.noise.warm_up_fit import fit_warm_up
from sim.engine.stragglers import straggle_fraction
from sim.engine.host import IDLE_S
from sim.formats.costs import BACKWARD_WITH_RECOMPUTE, FIRST_STAGE_WEIGHT, FORWARD_WITH_GRAPH, ActionFit
from sim.schedules.schedule import COMPUTE_KINDS


# the lines that take another's per-action overhead rather than fit their own (fit_pipeline)
OVERHEAD_OF = {FORWARD_WITH_GRAPH: "F", "I": "B", "W": "B", FIRST_STAGE_WEIGHT: "B"}


def fit_full_backward(points: ActionPoints, backward: ActionFit, recompute: ActionFit) -> AffineFit:
    """The seconds each layer after a stage's first adds to a backward under ``full`` beyond the
    backward's and the recompute's lines summed (the fit's slope over the stage's layer count less one,
    through zero, at least 0), by least squares on the relative residuals.

    The executor's ``full`` backward restores each layer's random state, reruns its forward and calls
    autograd on it, one layer at a time: work per layer, not per row. The lines' per-action overheads
    hold one such call (a stage's recompute, then its backward); each further layer pays its own. A
    factor over the two lines (fitted before) put the held-out K = 1 ``full`` run at 8 rows high where
    the design's run, at 4 rows, sat on it; a time for every layer put the one-layer embedding stage of
    a K = 2 ``full`` run far too high. Not a line of its own: a full design run's backwards all have the
    same rows, and at K = 1, where every stage holds every layer, a line's per-action overhead cannot be
    told from its scale of the profile's fixed part (two calibrations split it opposite ways, and a line
    sharing that overhead put the held-out K = 1 ``full`` run far apart by the two). The two lines' sum
    is known at every row count, whichever way they split it. At least 0: the work it stands for takes
    time. The figures: docs/notes/2026-11-26-full-backward.md."""
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
        # 5- and 6-row actions fitted W an overhead that priced the zbv's chunks far too long;
        # docs/notes/2026-11-27-figures-behind-the-code.md)
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
