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
(:mod:`calibrate.validate.across_calibrations`), the noise neither of the first two sees.

The warm-up after long waits (:mod:`sim.engine.warm_up`) moves more between moments than the speed does, so
each round is also bracketed by an after-wait probe (:mod:`calibrate.noise.after_wait_probe`): the busy
errors with each stage's predicted warm-up scaled to its run's probe stand beside the others
(``busy_errors_at_probed_warm_up``), and the table gives how far the probes ranged against the
calibration's.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from calibrate.fit.design import run_config
from calibrate.validate.comparison import compare
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
    The costs files in ``others`` (other calibrations of the same model, checked by
    :func:`calibrate.validate.across_calibrations.check_same_calibration`) judge the same measurements: each
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
                              tensor_parallel=workload.tensor_parallel_options[1:])
    device = data.get("machine", {}).get("device", "cpu")
    configs = [run_config(model["name"], model["options"], s, steps, device, data.get("optimizer", "sgd"),
                          measured_precision(data))
               for s in specs]
    progress(f"validating on {len(specs)} held-out configurations ({steps} steps each, {rounds} rounds)")
    reports = run_configs(configs * rounds, progress=progress)
    available = machine_processes(device)
    comparisons = [compare(data, s, reports[i::len(specs)], available) for i, s in enumerate(specs)]
    summary, runs = summarize(comparisons), [c.to_dict() for c in comparisons]
    if others:
        from calibrate.validate import across_calibrations

        judged = [[compare(other, s, reports[i::len(specs)], available).to_dict() for i, s in enumerate(specs)]
                  for other in others]
        for k, run in enumerate(runs):
            run["calibrations"] = across_calibrations.run_entry([run] + [each[k] for each in judged])
        summary["across_calibrations"] = across_calibrations.summary(
            [run["calibrations"] for run in runs if not run["oversubscribed"]])
    return {"model": model, "precision": measured_precision(data), "machine": data.get("machine", {}),
            "steps": steps, "rounds": rounds, "summary": summary, "runs": runs}

