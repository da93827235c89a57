"""Held-out validation: predict runs the fit never saw, measure them with the executor, compare.

The pieces: which runs are held out (:mod:`calibrate.validate.held_out_design`), one run's
prediction against its rounds (:mod:`calibrate.validate.comparison`), the summary
(:mod:`calibrate.validate.summary`) and the table (:mod:`calibrate.validate.table`). :func:`validate`
measures the runs and wires them.

Each round of a run is also put at the calibration's reference speed: divided by the speed factor
of the probes its ranks took just before and after it (:mod:`calibrate.noise.speed`). The error against
that (``step_error_at_reference``) is the simulator's own error with the machine's drift since
calibration taken out; ``round_spread`` (interquartile range of those rounds over their median) is
how precisely this machine measured the run at all. Both are published beside the raw error.

Two measures of noise stand beside each error: ``interval``, where the error lies given this validation's
own rounds (:func:`calibrate.validate.intervals.median_interval`), and ``halves``, the error as the
calibration's fits on its odd and on its even design rounds predict the run
(:func:`calibrate.fit.design_fit.fit_halves`; costs files from a quick calibration have none): what a
calibration from the other half of the same minutes would have predicted. An error inside both is one
this machine cannot tell from noise. A third, ``calibs``, where other costs files are given: the error as
calibrations taken at other moments predict the same measurement
(:mod:`calibrate.noise.across_calibrations`), the noise neither of the first two sees.

The warm-up after long waits (:mod:`sim.engine.host`) moves more between moments than the speed does, so
each round is also bracketed by an after-wait probe (:mod:`calibrate.noise.after_wait_probe`): the busy
errors with each stage's predicted warm-up scaled to its run's probe stand beside the others
(``busy_errors_at_probed_warm_up``), and the table gives how far the probes ranged against the
calibration's.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from calibrate.fit.design import RunSpec, run_config
from calibrate.fit.design_checks import SPEED_FACTOR_BOUNDS, Remeasure, outside_bounds
from calibrate.validate.comparison import compare, round_speed_factor
from calibrate.validate.held_out_design import machine_processes, validation_design
from calibrate.validate.summary import summarize


def check_fit_halves(data: dict[str, Any]) -> None:
    """Refuse, in one line, a costs file whose ``fit_halves`` is not two fits with a ``pipeline`` each."""
    from sim.errors import GpipeInputError

    halves = data.get("fit_halves", [])
    if not (isinstance(halves, list) and len(halves) in (0, 2)
            and all(isinstance(half, dict) and isinstance(half.get("pipeline"), dict) for half in halves)):
        raise GpipeInputError("the costs file's fit_halves is not two fits with a pipeline each; run gpipe "
                              "calibrate --force to measure it again")


def validate(data: dict[str, Any], steps: int = 5, limit: int | None = None,
             progress: Callable[[str], None] = print, rounds: int = 3,
             others: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Run the held-out design for the model in the costs ``data``; the comparisons and summary.

    Each configuration is measured in ``rounds`` rounds, the rounds interleaved (all configurations
    once, then all again), and compared by its median: on a shared machine whose speed drifts by
    tens of percent over seconds, one measurement of a run says more about the moment than the run.
    A round whose speed correction falls outside the calibration's bounds is measured once more, and
    its run, if a round stays outside, is shown but not judged (:func:`speeds_within_bounds`).
    The costs files in ``others`` (other calibrations of the same model, checked by
    :func:`calibrate.noise.across_calibrations.check_same_calibration`) judge the same measurements: each
    run's ``calibrations`` entry and the summary's ``across_calibrations``.
    """
    from calibrate.measure.runs import run_configs
    from sim.formats.costs import MeasuredWorkload, allreduce_link, measured_precision

    for each in (data, *others):
        allreduce_link(each)  # a malformed entry is refused before any run starts
        check_fit_halves(each)
    model = data["model"]
    max_stages = max((int(k) for k in data.get("pipeline", {})), default=1)
    workload = MeasuredWorkload(data)
    specs = validation_design(int(model["num_layers"]), int(data["batch_size"]), max_stages, limit,
                              attention_core=workload.has_attention_core,
                              tensor_parallel=workload.tensor_parallel_options[1:],
                              experts=workload.experts_profiled)
    device = data.get("machine", {}).get("device", "cpu")
    configs = [run_config(model["name"], model["options"], s, steps, device, data.get("optimizer", "sgd"),
                          measured_precision(data))
               for s in specs]
    progress(f"validating on {len(specs)} held-out configurations ({steps} steps each, {rounds} rounds)")
    reports = run_configs(configs * rounds, progress=progress)

    def remeasure(indices: Sequence[int]) -> list[dict[str, Any]]:
        return run_configs([configs[i % len(specs)] for i in indices], progress=progress)

    reports, not_judged = speeds_within_bounds(data, specs, reports, remeasure, progress)
    available = machine_processes(device)
    comparisons = [compare(data, s, reports[i::len(specs)], available, not_judged.get(i)) for i, s in enumerate(specs)]
    summary, runs = summarize(comparisons), [c.to_dict() for c in comparisons]
    if others:
        from calibrate.noise import across_calibrations

        judged = [[compare(other, s, reports[i::len(specs)], available).to_dict() for i, s in enumerate(specs)]
                  for other in others]
        for k, run in enumerate(runs):
            run["calibrations"] = across_calibrations.run_entry([run] + [each[k] for each in judged])
        summary["across_calibrations"] = across_calibrations.summary(
            [run["calibrations"] for run in runs if not run["oversubscribed"] and not run["not_judged"]])
    return {"model": model, "precision": measured_precision(data), "machine": data.get("machine", {}),
            "steps": steps, "rounds": rounds, "summary": summary, "runs": runs}


def speeds_within_bounds(data: dict[str, Any], specs: Sequence[RunSpec], reports: Sequence[dict[str, Any]],
                         remeasure: Remeasure,
                         say: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """(reports, why each run is not judged, by its index in ``specs``): the rounds (``reports``, the
    runs of ``specs`` round after round) whose speed factor falls outside the calibration's bounds
    (:data:`calibrate.fit.design_checks.SPEED_FACTOR_BOUNDS`) measured once more through
    ``remeasure(indices)``; a run with a round still outside is not judged.

    The same bounds as calibration's: a probe that another program slowed for a moment would put the
    round tens of times off at the reference speed, and the error against it would be the probe's,
    not the model's. The after-wait factor is not bounded here: it moves only the after-wait figures
    beside the errors, not the errors themselves.
    """
    reports = list(reports)

    def outside(i: int) -> str | None:
        return outside_bounds("speed", round_speed_factor(data, specs[i % len(specs)], reports[i]), SPEED_FACTOR_BOUNDS)

    bad = [i for i in range(len(reports)) if outside(i)]
    if bad:
        runs = sorted({specs[i % len(specs)].label() for i in bad})
        say(f"held-out {'; '.join(runs)}: {outside(bad[0])}; measuring {len(bad)} round(s) again")
        for i, report in zip(bad, remeasure(bad)):
            reports[i] = report
    not_judged: dict[int, str] = {}
    for i in range(len(reports)):
        why = outside(i)
        if why is not None and i % len(specs) not in not_judged:
            not_judged[i % len(specs)] = f"round {i // len(specs) + 1} {why}, measured twice"
    return reports, not_judged
