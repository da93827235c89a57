"""Everything the design runs fit, in two passes, and the same fit on each half of the rounds.

First the per-action, send and optimizer fits, from the executor's own spans against the layer
profile (:mod:`calibrate.fit.pipeline_fit`); then, with those fixed, one step-overhead constant per K
from whole-step times (:mod:`calibrate.fit.step_fit`). Where the design has runs whose stages are
split over T ranks, their in-pipeline factors (:func:`fit_tensor_parallel`).
"""

from __future__ import annotations

from typing import Any, Sequence

from calibrate.fit.design import RunSpec
from calibrate.fit.observations import Observations, cold_marks, collect, profiled_action_s, starts_cold_in
from calibrate.fit.pipeline_fit import fit_pipeline
from calibrate.fit.step_fit import fit_step_overhead
from calibrate.noise.after_wait_probe import report_warm_up_factor
from sim.engine.stage_costs import stage_bounds
from sim.formats.costs import MeasuredWorkload


def fit_in_pipeline(data: dict[str, Any], specs: Sequence[RunSpec], reports: Sequence[dict[str, Any]],
                    speeds: Sequence[float], threads_of: dict[int, int]) -> dict[str, Any]:
    """Fit what the design runs measured into ``data`` (in place): ``pipeline`` (per K), each K's step
    overhead, and ``tensor_parallel_fit`` where the design has split runs; the residuals."""
    whole = [i for i, s in enumerate(specs) if s.layout.tensor_parallel == 1]
    obs = Observations()
    for i in whole:
        collect(MeasuredWorkload(data, specs[i].stages), specs[i], reports[i], obs, speeds[i],
                report_warm_up_factor(reports[i], data, specs[i].processes))
    data["pipeline"], residuals = fit_pipeline(obs, threads_of)
    residuals["step"] = fit_step_overhead(data, [specs[i] for i in whole], [reports[i] for i in whole],
                                          speeds=[speeds[i] for i in whole])
    if any(s.layout.tensor_parallel > 1 for s in specs):
        data["tensor_parallel_fit"] = fit_tensor_parallel(data, specs, reports, speeds)
    return residuals


# the terms fit_in_pipeline writes: what a half of the design rounds fits afresh (fit_halves)
FITTED_TERMS = ("pipeline", "tensor_parallel_fit")


def fit_halves(data: dict[str, Any], design_size: int, specs: Sequence[RunSpec], reports: Sequence[dict[str, Any]],
               speeds: Sequence[float], threads_of: dict[int, int]) -> list[dict[str, Any]]:
    """The calibration's own noise: the same fit on the odd and on the even design rounds
    (``specs`` is the design repeated round after round), each half's :data:`FITTED_TERMS`.

    Validation predicts every held-out run with both halves too (:func:`calibrate.validate.comparison.compare`):
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
    their dispatch per parameter, which K's line, fitted on plain tensors, does not (several times K's
    line for the demo model's T=2 stage with AdamW:
    docs/notes/2026-11-27-figures-behind-the-code.md).
    Limits: one factor per kind
    whatever the rows; fitted on one-stage runs."""
    def ratio(xs: Sequence[float], ys: Sequence[float]) -> float:
        return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)

    pairs: dict[int, dict[str, tuple[list[float], list[float]]]] = {}
    optimizer_pairs: dict[int, tuple[list[float], list[float]]] = {}  # K's optimizer line's seconds, measured
    for spec, report, speed in zip(specs, reports, speeds):
        if spec.layout.tensor_parallel == 1:
            continue
        workload = MeasuredWorkload(data, spec.stages, spec.layout.checkpoint, spec.layout.microbatches, spec.layout.tensor_parallel)
        bounds = stage_bounds(spec.partition)
        cold = cold_marks(spec)
        for action in report["actions"]:
            kind = action["kind"]
            if kind not in "FRB":
                continue
            line = workload.fit.actions[kind]
            xs, ys = pairs.setdefault(spec.layout.tensor_parallel, {}).setdefault(kind, ([], []))
            xs.append(profiled_action_s(workload, spec.layout.checkpoint, action, bounds, spec.layout.microbatches))
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
            xs, ys = optimizer_pairs.setdefault(spec.layout.tensor_parallel, ([], []))
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
