"""Whole steps: a run simulated with the fitted costs, each K's step overhead fitted on measured
steps, and how the finished fit predicts each design run.

This is the second pass of the fit: with the per-action lines fixed (:mod:`calibrate.fit.pipeline_fit`),
one step-overhead constant per K from whole-step times, by simulating each design run.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Sequence

from calibrate.fit.design import RunSpec
from calibrate.fit.least_squares import fit_constant
from calibrate.fit.step_components import measured_end_span_s, predicted_end_span_s
from sim.formats.costs import MeasuredWorkload


def predict(data: dict[str, Any], spec: RunSpec, system_name: str = "cpu") -> Any:
    """Simulate one run spec with the costs in ``data``; the :class:`sim.engine.engine.SimResult`.

    The pipeline fits and the profile's thread count are those of as many processes as the run
    has (D x K, :attr:`sim.formats.costs.MeasuredWorkload.fit`). The data-parallel all-reduce is priced on
    the measured all-reduce link where the costs file has one (:func:`sim.formats.costs.allreduce_link`).
    With T > 1 each stage is priced from the costs file's profile of the layers split over T ranks
    (:mod:`calibrate.measure.tp_profile`); with E > 1 its routed experts are split over E ranks
    (:mod:`sim.formats.measured_experts`). A run with more processes than the system has devices (D x K = 4
    on two cores) is predicted as if each process had a core of its own, with the fits of the nearest
    fitted process count (a calibration fits no more processes than the machine has cores): the
    cores' sharing is a CPU host's effect the simulator does not model (:mod:`sim.engine.host`).
    """
    from sim.engine.engine import simulate
    from sim.catalog.hardware import get_system
    from sim.workloads.moe.expert_parallel import with_expert_parallel
    from sim.workloads.tensor_parallel import with_tensor_parallel

    system = get_system(system_name)
    if spec.processes > system.total_devices:
        system = replace(system, devices_per_node=spec.processes, nodes=1)
    physical = system
    workload, system = with_tensor_parallel(MeasuredWorkload(data), system, spec.layout.tensor_parallel)
    # E > 1: the routed experts split as sim.formats.measured_experts prices them from the costs file
    workload = with_expert_parallel(workload, physical, spec.layout.expert_parallel,
                                    spec.layout.expert_tensor_parallel, spec.layout.schedule)
    workload, system = workload.bind(system, spec.stages, spec.layout.checkpoint, spec.layout.microbatches,
                                     spec.layout.replicas)
    # one replica has nothing to average, so no all-reduce to price
    link = workload.allreduce_link(system) if spec.layout.replicas > 1 else None
    return simulate(workload, system, spec.partition, spec.batch_size, spec.layout, allreduce_link=link)


def fit_step_overhead(data: dict[str, Any], specs: Sequence[RunSpec], reports: Sequence[dict[str, Any]],
                      system_name: str = "cpu", speeds: Sequence[float] | None = None) -> dict[str, Any]:
    """Fit each K's step overhead on whole-step times (in place in ``data``); its residuals.

    The overhead stands for time at the end of a step the model does not otherwise price, so it is
    bounded by what the runs measured there: the median over the K's runs of the measured
    end-of-step span less the predicted one without overhead (:mod:`calibrate.fit.step_components`).
    What the bound leaves of a misfit shows as the prediction's error, not as end-of-step time
    that was never measured. Step times and spans are divided by each run's ``speeds`` entry (1.0
    when not given), as in :func:`calibrate.fit.observations.collect`.
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
