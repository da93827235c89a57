"""A trained plan beside its prediction: one verdict line, one step error, and the HTML report.

``gpipe demo`` and ``gpipe train --plan --html`` write the same page: both timelines on one time
axis, the loss curve, busy and bubble per stage, memory, the error table and the calibration's fit
quality, under one verdict line. There is one step error, the measured step against the prediction;
the machine's drift between calibration and training (the speed probe's factor,
:class:`MachinePace`) is stated beside it as a fact, not turned into a second error.

The verdict judges the error against :data:`calibrate.goals.STEP_GOAL` only where the plan was priced
with costs measured on this machine; a plan priced with the catalog (uncalibrated, or for another
device than the one that trained it) gets its error shown and the reason it is not judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from calibrate.goals import STEP_GOAL
from sim.engine.host import IDLE_S


@dataclass(frozen=True)
class Pricing:
    """How the prediction was priced: ``calibrated`` (a costs file measured here) or not, and why."""

    calibrated: bool
    says: str  # e.g. "priced with out/costs.json, measured on this machine"


def pricing_of(plan: Any, trained_on: str, costs_path: str | None) -> Pricing:
    """The :class:`Pricing` of ``plan`` trained on device type ``trained_on`` ("cpu" or "cuda")."""
    system = plan.hardware.get("system", "cpu")
    if costs_path:
        return Pricing(True, f"priced with {costs_path}, measured on this machine")
    if system == "cpu" and trained_on == "cpu":
        return Pricing(False, "priced with the catalog's uncalibrated cpu figures (calibrate with gpipe calibrate "
                              "and plan with --costs to get a prediction worth judging)")
    return Pricing(False, f"priced for {system} from the catalog; this run trained on {trained_on}, so the two "
                          "are not comparable")


def step_verdict(predicted_s: float, measured_s: float, pricing: Pricing, pace: float | None = None,
                 goal: float = STEP_GOAL) -> str:
    """One line: predicted and measured step, the error, and whether it is within ``goal`` (flagged
    when not); the speed probe's factor, where there is one, as a fact beside it."""
    error = (predicted_s - measured_s) / measured_s
    figures = f"predicted {predicted_s * 1e3:.2f} ms, measured {measured_s * 1e3:.2f} ms per step ({error * 100:+.1f}%)"
    drift = ""
    if pace is not None:
        drift = (f"; the machine ran {abs(pace - 1) * 100:.0f}% {'slower' if pace >= 1 else 'faster'} while "
                 "training than while calibrating (speed probe)" if abs(pace - 1) >= 0.005 else
                 "; the machine ran at its calibration's speed (speed probe)")
    if not pricing.calibrated:
        return f"Not judged: {figures}, {pricing.says}{drift}"
    if abs(error) <= goal:
        return f"Within the goal: {figures}, within the {goal * 100:.0f}% step goal{drift}"
    cause = ("the machine's speed moved by more than the goal, so calibrate again when it is steady "
             "(gpipe calibrate --force)" if pace is not None and abs(pace - 1) > goal
             else "the table shows which part of the step the model misprices")
    return f"FLAGGED: {figures}, past the {goal * 100:.0f}% step goal{drift}; {cause}"


class MachinePace:
    """The speed probe (:mod:`calibrate.noise.speed`) just before and just after training, in this process.

    The ratio to the profile's reference pace says whether the machine ran slower or faster while
    the plan trained than while it was calibrated, so a reader can tell drift from model error.
    None where the costs file has no reference (written before probes existed).
    """

    def __init__(self, data: dict[str, Any]) -> None:
        import torch

        from calibrate.noise.speed import SpeedProbe

        references = data["profile"].get("speed_reference_s", {})
        self.threads = max((int(t) for t in references), default=0)
        self.reference = references.get(str(self.threads))  # JSON keys: the costs file as read
        self.probe = None
        if self.reference:
            torch.set_num_threads(self.threads)
            model = data["model"]
            self.probe = SpeedProbe.model(model["name"], model["options"], int(data["batch_size"]))
            self.before = self.probe.measure(0.2)

    def finish(self) -> float | None:
        from calibrate.noise.speed import speed_factor

        if self.probe is None:
            return None
        return speed_factor([self.before, self.probe.measure(0.2)], self.reference)


def _rel(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.1f}%" if measured else "n/a"


def end_of_step_spans_s(predicted: Any, report: dict[str, Any]) -> tuple[float, float]:
    """(predicted, measured) time from the step's last compute action to its end: the predicted
    step's, and the median over the measured steps of replica 0's first tensor-parallel ranks, with
    the time from the previous step's end to the step's first compute action added (the simulator
    prices that time at the end of its one step)."""
    from calibrate.fit.step_components import end_of_step_span_s, measured_end_span_s

    return end_of_step_span_s(predicted.records, 0), measured_end_span_s(report)


def gap_rows(report: dict[str, Any], gap_after_s: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """Error-table rows of stage 0's time between two actions, per kind of the action before: the
    fitted gap against the median of this run's (:func:`calibrate.fit.step_components.measured_gap_medians_s`)."""
    from calibrate.fit.step_components import measured_gap_medians_s
    from sim.formats.timeline import KIND_NAMES

    return [(f"stage 0 between actions, after {KIND_NAMES[kind]} (the executor's own time, neither busy nor "
             f"waiting; median)", f"{gap_after_s.get(kind, 0.0) * 1e6:.0f} us", f"{measured * 1e6:.0f} us",
             _rel(gap_after_s.get(kind, 0.0), measured)) for kind, measured in measured_gap_medians_s(report, 0).items()]


def busy_rows(stages: Any, measured_busy_s: list[float]) -> list[tuple[str, str, str, str]]:
    """Error-table rows of each stage's busy time a step, predicted against measured, and under each the
    part of the prediction that is the warm-up after long waits (a CPU host's effect, :mod:`sim.engine.host`) where it has one."""
    rows = []
    for k, (s, m) in enumerate(zip(stages, measured_busy_s)):
        rows.append((f"stage {k} busy per step", f"{s.busy_s * 1e3:.2f} ms", f"{m * 1e3:.2f} ms", _rel(s.busy_s, m)))
        if s.host and s.host.warm_up_s:
            rows.append((f"of it, running slow after waits of {IDLE_S * 1e3:g} ms or more for its input (the "
                         "fitted warm-up)", f"{s.host.warm_up_s * 1e3:.2f} ms", "-", "-"))
    return rows


def error_rows(costs: dict[str, Any] | None, plan: Any, predicted: Any,
               report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The error table: the step (the one step error), bubble, memory and busy per stage, the
    end-of-step span; with measured costs, the gaps between actions and the fitted per-step overhead."""
    from sim.formats.timeline import STEP_OVERHEAD

    measured_busy = [s["busy_s"] for s in report["stages"]]
    rows = [("step time", f"{predicted.step_time_s * 1e3:.2f} ms", f"{report['step_time_s'] * 1e3:.2f} ms",
             _rel(predicted.step_time_s, report["step_time_s"]))]
    measured_bubble = 1 - sum(measured_busy) / (len(measured_busy) * report["step_time_s"])
    rows.append(("bubble fraction", f"{predicted.bubble_fraction:.1%}", f"{measured_bubble:.1%}",
                 f"{(predicted.bubble_fraction - measured_bubble) * 100:+.1f} points"))
    measured_memory = [s["peak_activation_bytes"] for s in report["stages"]]
    for k, (p, m) in enumerate(zip((s.peak_activation_bytes for s in predicted.stages), measured_memory)):
        rows.append((f"stage {k} peak activation", f"{p / 2**20:.3f} MiB", f"{m / 2**20:.3f} MiB", _rel(p, m)))
    rows += busy_rows(predicted.stages, measured_busy)
    predicted_end, measured_end = end_of_step_spans_s(predicted.timeline, report)
    rows.append(("end-of-step span (last compute to step end, and last step's end to first action)",
                 f"{predicted_end * 1e3:.2f} ms", f"{measured_end * 1e3:.2f} ms", _rel(predicted_end, measured_end)))
    if costs is not None:
        rows += gap_rows(report, costs.get("pipeline", {}).get(str(plan.layout.stages), {}).get("gap_after_s", {}))
        overhead = sum(r.duration_s for r in predicted.timeline.records if r.kind == STEP_OVERHEAD and r.stage == 0)
        rows.append(("of it, the fitted per-step overhead (work between steps, at most the span measured there)",
                     f"{overhead * 1e3:.2f} ms", "-", "-"))
    return rows


def fit_quality_line(costs: dict[str, Any] | None) -> str:
    """The calibration's fit quality in one sentence (or that the prediction had no calibration)."""
    from sim.formats.costs import fit_quality

    if costs is None:
        return "Calibration: none; the prediction comes from the catalog's figures."
    quality = costs.get("fit_quality") or fit_quality(costs)
    line = (f"Calibration fit: its {quality['design_runs']} design runs reproduced within "
            f"{abs(quality['worst_step_error']) * 100:.1f}% (worst: {quality['worst_run'] or 'none'}; median "
            f"{quality['median_abs_step_error'] * 100:.1f}%), goal {quality['goal'] * 100:.0f}%")
    if "speed_factor_range" in quality:
        low, high = quality["speed_factor_range"]
        line += f"; speed corrections applied to them x{low:.2f}..x{high:.2f}"
    return line + "."


def describe_plan(plan: Any, costs: dict[str, Any] | None) -> str:
    """The plan and the machine in words, for the report's heading."""
    options = ", ".join(f"{k}={v}" for k, v in plan.model.options.items())
    chunks = f" V={plan.layout.virtual_stages}" if plan.layout.virtual_stages > 1 else ""
    replicas = f"D={plan.layout.replicas} " if plan.layout.replicas > 1 else ""
    text = (f"Plan {replicas}K={plan.layout.stages}{chunks} M={plan.layout.microbatches}, partition "
            f"{','.join(map(str, plan.partition))}, {plan.layout.checkpoint}, {plan.layout.schedule}, for {plan.model.name} "
            f"({options}), batch {plan.batch_size}, {plan.precision}, {plan.optimizer}.")
    if costs is not None:
        machine = costs.get("machine", {})
        text += (f" Costs measured on {machine.get('cpu_model', '?')} ({machine.get('cpu_cores', '?')} cores), "
                 f"torch {machine.get('torch', '?')}, {machine.get('date', '?')}.")
    return text


def write_run_report(path: str, title: str, verdict: str, costs: dict[str, Any] | None, plan: Any,
                     predicted: Any, report: dict[str, Any], picture: str | None = None) -> None:
    """The HTML report under ``verdict``: timelines on one axis, the loss curve, bubble and memory
    side by side, the error table and the fit quality; with ``picture``, the timelines and the loss
    curve as one PNG there too."""
    from calibrate.report.report_html import error_table, loss_figure, one_step, summary_figure, write_report
    from sim.views.figures import compare_figure

    measured_step = one_step(report)
    timelines = compare_figure([predicted.timeline, measured_step], ["predicted", "measured"],
                               title="One training step: simulator (top) and executor (bottom)")
    summary = summary_figure([s.busy_s for s in predicted.stages], predicted.step_time_s,
                             [s["busy_s"] for s in report["stages"]], report["step_time_s"],
                             [s.peak_activation_bytes for s in predicted.stages],
                             [s["peak_activation_bytes"] for s in report["stages"]])
    data_label = {"text": "the shipped Shakespeare, one token per byte",
                  "synthetic": "synthetic random tokens: the loss cannot fall"}.get(report.get("data", ""),
                                                                                 report.get("data") or "synthetic data")
    notes = [f"Training data: {data_label}; the loss is the global batch's mean at each step.",
             "Measured: the executor's median step after warm-up; the timeline shows that step.",
             "Peak activation memory counts tensors saved for backward and stashed inputs (executor.runtime.memory).",
             fit_quality_line(costs),
             "Speed probe: the model's forward and backward on fixed rows, timed just before and after training "
             "and divided by the same probe's median while calibrating (above 1: the machine ran slower). It says "
             "how far the machine drifted; the step error above is against the measured step as it was.",
             "Timings on a shared machine vary from run to run; gpipe validate measures the error on held-out runs."]
    loss = loss_figure(report["losses"], data_label, plan.model.options.get("vocab"))
    write_report(path, title, describe_plan(plan, costs), timelines, summary,
                 error_table(error_rows(costs, plan, predicted, report)), notes, loss=loss, verdict=verdict)
    if picture:
        from calibrate.report.report_picture import picture_figure, write_png

        steps = compare_figure([predicted.timeline, measured_step], ["predicted", "measured"], memory=False)
        heading = (f"{title}: {plan.model.name} K={plan.layout.stages} M={plan.layout.microbatches} {plan.layout.schedule}, predicted "
                   f"{predicted.step_time_s * 1e3:.1f} ms, measured {report['step_time_s'] * 1e3:.1f} ms per step")
        write_png(picture_figure(steps, loss, heading), picture)


# the fields of a plan that change what trains, beside its layout's; flags given to gpipe train beside --plan
# may change them
TRAINED_FIELDS = ("partition", "batch_size", "optimizer", "precision")
TRAINED_LAYOUT_FIELDS = ("microbatches", "checkpoint", "schedule", "replicas", "virtual_stages", "zero", "placement",
                         "tensor_parallel", "sequence_parallel")


def trained_plan(planned: Any, trained: Any) -> tuple[Any, list[str]]:
    """The plan as it trained: ``planned`` with the fields of ``trained`` (the run's own plan, from its
    configuration) that change what trains, and each change as "microbatches 8 -> 4" ([] when it
    trained as planned)."""
    from dataclasses import replace

    said = [f"{name} {getattr(planned, name)} -> {getattr(trained, name)}" for name in TRAINED_FIELDS
            if getattr(trained, name) != getattr(planned, name)]
    said += [f"{name} {getattr(planned.layout, name)} -> {getattr(trained.layout, name)}"
             for name in TRAINED_LAYOUT_FIELDS if getattr(trained.layout, name) != getattr(planned.layout, name)]
    if not said:
        return planned, said
    layout = replace(planned.layout, **{name: getattr(trained.layout, name) for name in TRAINED_LAYOUT_FIELDS},
                     stages=trained.layout.stages)
    return replace(planned, layout=layout, **{name: getattr(trained, name) for name in TRAINED_FIELDS}), said


class PlanComparison:
    """``gpipe train --plan``: its prediction found before training, the speed probe around it, and
    after it the verdict line and (``html``) the report.

    Made before any worker starts, so a plan whose costs file is missing or changed fails in one line
    when ``--html`` asks for the report, and otherwise says that it will not be compared.
    ``predict(plan, plan_path, costs_path)`` prices the plan as it was planned, the simulation result
    first (the command passes :func:`gpipe.simulate.predict_plan`, which resolves any model).
    """

    def __init__(self, plan_path: str, planned: Any, trained: Any, device_type: str, html: str | None,
                 predict: Callable[[Any, str, str | None], tuple[Any, ...]]) -> None:
        from sim.errors import GpipeInputError
        from sim.formats.plan import recorded_costs_path

        self.plan_path, self.html, self.device_type, self.predict = plan_path, html, device_type, predict
        self.plan, self.changes = trained_plan(planned, trained)
        self.costs_path: str | None = None
        self.skipped = ""
        if planned.costs is not None:
            try:
                self.costs_path = recorded_costs_path(planned.costs, f"plan {plan_path}",
                                                      f"re-plan (gpipe plan --costs {{path}} ... --out {plan_path})")
            except GpipeInputError as exc:
                if html:
                    raise GpipeInputError(f"--html compares with the plan's prediction, but {exc}") from None
                self.skipped = f"not compared with the plan's prediction: {exc}"
        self.costs = None
        self.pace = None
        self.predicted_step_s: float | None = None  # set by finish, where the run was compared
        if self.costs_path is not None:
            from sim.formats.costs import read_costs

            self.costs = read_costs(self.costs_path)
            if device_type == "cpu" and self.costs.get("system", "cpu") == "cpu":
                self.pace = MachinePace(self.costs)

    def finish(self, report: dict[str, Any]) -> str:
        """The verdict line (the report written where ``html`` says)."""
        if self.skipped:
            return self.skipped
        pace = self.pace.finish() if self.pace is not None else None
        predicted = self.predict(self.plan, self.plan_path, self.costs_path)[0]
        self.predicted_step_s = predicted.step_time_s
        verdict = step_verdict(predicted.step_time_s, report["step_time_s"],
                               pricing_of(self.plan, self.device_type, self.costs_path), pace)
        if self.changes:
            verdict += f" (re-predicted for the flags' changes to the plan: {', '.join(self.changes)})"
        if self.html:
            write_run_report(self.html, "gpipe train: predicted vs measured", verdict, self.costs, self.plan,
                             predicted, report)
        return verdict
