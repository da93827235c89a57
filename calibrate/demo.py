"""``gpipe demo``: the main job. Calibrate this machine, plan, simulate, train, report; one HTML page.

With no arguments, on a fresh machine: profile and fit the default model (cached in ``out/`` after
the first run), search K, M, checkpoint policy, schedule and partition for the fastest plan of each
K that fits this machine using the measured costs, simulate the best plan with the most stages the
machine has room for (a pipeline, even where one process on all cores would be faster), train it
with the executor (``gpipe train``, one process per stage) on the shipped Shakespeare, byte by byte
(``--data text``: the loss falls from ln(256), where synthetic tokens keep it), and write
``out/report.html`` with the predicted and measured step on one time axis, the loss curve, the
bubble and memory per stage, and the errors. The last line printed says where the report is.
Calibration times synthetic data (the same shapes cost the same), so ``--data synthetic`` changes
only what the model learns.

The default model is a small transformer (6 pipeline layers: embedding, 4 blocks, head) sized so
one block's micro-batch takes milliseconds on one core: large enough that sends and per-action
overheads do not swamp the compute, so two stages on two cores pipeline meaningfully, and small
enough that calibration, planning and training fit in a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Any

from sim.errors import GpipeInputError
from sim.warm_up import IDLE_S

DEMO_MODEL = "transformer"
DEMO_OPTIONS: dict[str, Any] = {"layers": 4, "d_model": 128, "ff": 512, "heads": 4, "seq": 32, "vocab": 256}
DEMO_BATCH = 32
# Enough AdamW steps at the default learning rate (0.01) for the byte-level loss to fall from ln(256)
# = 5.55 to about 2.6 on the shipped text; each step costs tens of milliseconds here.
DEMO_STEPS = 30
MICROBATCH_OPTIONS = (1, 2, 4, 8, 16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="out", help="where the costs cache, plan and report go (default out)")
    parser.add_argument("--steps", type=int, default=DEMO_STEPS,
                        help=f"training steps of the chosen plan (default {DEMO_STEPS})")
    parser.add_argument("--data", choices=("text", "synthetic"), default="text",
                        help="what the chosen plan trains on: text (default; the shipped Shakespeare, one token "
                             "per byte, so the loss falls) or synthetic (random tokens, as calibration times)")
    parser.add_argument("--force", action="store_true", help="calibrate again even if the cache is valid")
    parser.add_argument("--picture", metavar="FILE.png",
                        help="also write the report's timelines and loss curve as one PNG (needs kaleido)")
    parser.add_argument("--quiet", action="store_true",
                        help="print only the losses and where the report is, no progress")


def plan_best(data: dict[str, Any], batch: int, max_stages: int) -> dict[int, tuple[Any, Any, Any]]:
    """The fastest fitting plan for each K = 1..max_stages with the measured costs.

    ``{K: (option, workload, system)}``, the workload bound to the plan's K, policy and M.
    """
    from sim.costs import MeasuredWorkload
    from sim.hardware import get_system
    from sim.planner import search

    best = {}
    for k in range(1, max_stages + 1):
        workload, system = MeasuredWorkload(data).bind(get_system(data.get("system", "cpu")), k)
        found = search(workload, system, batch, [k], MICROBATCH_OPTIONS, top=1)
        if found.best is None:
            continue
        c = found.best.candidate  # forwards costed for the candidate's own checkpoint policy and M
        bound, system = MeasuredWorkload(data).bind(system, k, c.checkpoint, c.microbatches)
        best[k] = (found.best, bound, system)
    if not best:
        raise GpipeInputError("no plan fits this machine's memory; use a smaller model or batch")
    return best


def run(args: argparse.Namespace) -> int:
    from calibrate.calibration import check_timed_steps

    check_timed_steps(args.steps)  # before torch is imported
    from calibrate.cli import calibrate_cached
    from calibrate.runs import train_report
    from executor.models import model_ref
    from sim.planner import simulate_candidate
    from sim.plan import Plan, save_plan
    from sim import progress

    if args.picture:
        from calibrate.report_picture import kaleido_major_version
        from sim.cli_options import check_output_path

        check_output_path(args.picture, "--picture")
        kaleido_major_version()  # refused now, not after the demo's minute of work
    started = time.perf_counter()
    try:  # made and written to now, not after the demo's minute of work
        os.makedirs(args.out_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".gpipe-probe-", dir=args.out_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise GpipeInputError(f"--out-dir {args.out_dir} cannot be written ({exc.strerror or exc}); give a "
                              "directory this user can create and write") from None

    def say(message: str) -> None:
        if not args.quiet:
            progress.say(f"[demo {time.perf_counter() - started:6.1f}s] {message}")

    def note(message: str) -> None:  # calibration's progress lines: shown only beside its bars
        if progress.bars_shown():
            say("    " + message)

    say(f"1/5 calibrating {DEMO_MODEL} {DEMO_OPTIONS} batch {DEMO_BATCH} on this machine")
    costs_path = os.path.join(args.out_dir, "costs.json")
    data = calibrate_cached(costs_path, DEMO_MODEL, DEMO_OPTIONS, DEMO_BATCH, quick=True, force=args.force,
                            progress=note, announce=lambda m: say("    " + m))
    max_stages = max((int(k) for k in data.get("pipeline", {})), default=1)
    say(f"2/5 planning over K=1..{max_stages}, M in {list(MICROBATCH_OPTIONS)}, every policy and schedule")
    per_k = plan_best(data, DEMO_BATCH, max_stages)
    for k, (candidate_option, _, _) in sorted(per_k.items()):
        c = candidate_option.candidate
        say(f"    best with K={k}: M={c.microbatches} partition {candidate_option.partition} {c.checkpoint} "
            f"{c.schedule}, predicted {candidate_option.step_time_s * 1e3:.1f} ms")
    option, workload, system = per_k[max(per_k)]
    c = option.candidate
    say("    " + chosen_line(per_k))
    say("3/5 simulating the chosen plan")
    predicted = simulate_candidate(workload, system, option.partition, DEMO_BATCH, c, record=True)
    say(f"    predicted step {predicted.step_time_s * 1e3:.1f} ms, bubble {predicted.bubble_fraction:.1%}")
    ref = model_ref(DEMO_MODEL, DEMO_OPTIONS)
    plan = Plan(model=ref, partition=tuple(option.partition), batch_size=DEMO_BATCH, microbatches=c.microbatches,
                checkpoint=c.checkpoint, schedule=c.schedule, optimizer=workload.optimizer,
                replicas=c.replicas, virtual_stages=c.virtual_stages, zero=c.zero, placement=c.placement,
                hardware={"system": system.name, "nodes": 1},
                predicted={"step_time_s": predicted.step_time_s, "bubble_fraction": predicted.bubble_fraction})
    plan_path = os.path.join(args.out_dir, "plan.json")
    save_plan(plan, plan_path)
    what = "the shipped Shakespeare, byte by byte" if args.data == "text" else "synthetic random tokens"
    say(f"4/5 training the plan with the executor for {args.steps} steps on {what} (gpipe train)")
    pace = MachinePace(data)
    report = train_report(plan_path, args.steps, os.path.join(args.out_dir, "train_report.json"),
                          data="" if args.data == "synthetic" else args.data)
    report["machine_pace"] = pace.finish()
    report["data"] = args.data
    say(f"    measured step {report['step_time_s'] * 1e3:.1f} ms (median after warm-up)")
    progress.say(f"losses over {len(report['losses'])} steps (ln 256 = {math.log(256):.2f} is a uniform guess): "
                 f"{loss_summary(report['losses'])}")
    if report["machine_pace"] is not None:
        say(f"    speed probe around training: {report['machine_pace']:.2f}x its time while calibrating "
            f"(above 1: the machine ran slower)")
    say("5/5 writing the report")
    path = os.path.join(args.out_dir, "report.html")
    write_demo_report(path, data, plan, predicted, report, args.picture)
    say(f"done in {time.perf_counter() - started:.0f} s")
    print(f"report written to {os.path.abspath(path)}")
    return 0


def loss_summary(losses: list[float], shown: int = 7) -> str:
    """About ``shown`` losses evenly spaced from the first step to the last, step by step."""
    if not losses:
        return "none"
    every = max(1, math.ceil((len(losses) - 1) / max(1, shown - 1)))
    steps = sorted({*range(0, len(losses), every), len(losses) - 1})
    return ", ".join(f"{losses[s]:.2f} (step {s})" if s in (0, len(losses) - 1) else f"{losses[s]:.2f}"
                     for s in steps)


class MachinePace:
    """The speed probe (:mod:`calibrate.speed`) just before and just after training, in this process.

    The ratio to the profile's reference pace says whether the machine ran slower or faster while
    the plan trained than while it was calibrated, so a reader can tell drift from model error.
    None where the costs file has no reference (written before probes existed).
    """

    def __init__(self, data: dict[str, Any]) -> None:
        import torch

        from calibrate.speed import SpeedProbe

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
        from calibrate.speed import speed_factor

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
    from calibrate.step_components import end_of_step_span_s, measured_end_span_s

    return end_of_step_span_s(predicted.records, 0), measured_end_span_s(report)


def chosen_line(per_k: dict[int, tuple[Any, ...]]) -> str:
    """The plan the demo trains, from the best plan per stage count K (``plan_best``): the one with
    the most stages this machine has room for, a pipeline, even where fewer stages are predicted
    faster (on a few CPU cores one process using them all often is); the line says so then."""
    option = per_k[max(per_k)][0]
    c = option.candidate
    chunks = f" V={c.virtual_stages}" if c.virtual_stages > 1 else ""
    fastest_k = min(per_k, key=lambda k: per_k[k][0].step_time_s)
    why = (f" (a pipeline, the most stages this machine has room for; K={fastest_k} is predicted faster, "
           f"{per_k[fastest_k][0].step_time_s * 1e3:.1f} ms)" if fastest_k != max(per_k) else "")
    return f"chosen: K={c.stages}{chunks} M={c.microbatches} partition {option.partition} {c.checkpoint} {c.schedule}{why}"


def gap_rows(report: dict[str, Any], gap_after_s: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """Error-table rows of stage 0's time between two actions, per kind of the action before: the
    fitted gap against the median of this run's (:func:`calibrate.step_components.measured_gap_medians_s`)."""
    from calibrate.step_components import measured_gap_medians_s
    from sim.timeline import KIND_NAMES

    return [(f"stage 0 between actions, after {KIND_NAMES[kind]} (the executor's own time, neither busy nor "
             f"waiting; median)", f"{gap_after_s.get(kind, 0.0) * 1e6:.0f} us", f"{measured * 1e6:.0f} us",
             _rel(gap_after_s.get(kind, 0.0), measured)) for kind, measured in measured_gap_medians_s(report, 0).items()]


def busy_rows(stages: Any, measured_busy_s: list[float]) -> list[tuple[str, str, str, str]]:
    """Error-table rows of each stage's busy time a step, predicted against measured, and under each the
    part of the prediction that is the warm-up after long waits (:mod:`sim.warm_up`) where it has one:
    the component this machine moves most from one moment to the next (docs/calibration.md)."""
    rows = []
    for k, (s, m) in enumerate(zip(stages, measured_busy_s)):
        rows.append((f"stage {k} busy per step", f"{s.busy_s * 1e3:.2f} ms", f"{m * 1e3:.2f} ms", _rel(s.busy_s, m)))
        if s.warm_up_s:
            rows.append((f"of it, running slow after waits of {IDLE_S * 1e3:g} ms or more for its input (the "
                         "fitted warm-up)", f"{s.warm_up_s * 1e3:.2f} ms", "-", "-"))
    return rows


def write_demo_report(path: str, data: dict[str, Any], plan: Any, predicted: Any, report: dict[str, Any],
                      picture: str | None = None) -> None:
    """The HTML report: timelines on one axis, the loss curve, bubble and memory side by side, the
    error table; with ``picture``, the timelines and the loss curve as one PNG there too."""
    from calibrate.report_html import error_table, loss_figure, one_step, summary_figure, write_report
    from sim.figures import compare_figure
    from sim.timeline import STEP_OVERHEAD

    measured_step = one_step(report)
    timelines = compare_figure([predicted.timeline, measured_step], ["predicted", "measured"],
                               title="One training step: simulator (top) and executor (bottom)")
    measured_busy = [s["busy_s"] for s in report["stages"]]
    pred_mem = [s.peak_activation_bytes for s in predicted.stages]
    meas_mem = [s["peak_activation_bytes"] for s in report["stages"]]
    summary = summary_figure([s.busy_s for s in predicted.stages], predicted.step_time_s, measured_busy,
                             report["step_time_s"], pred_mem, meas_mem)
    rows = [("step time", f"{predicted.step_time_s * 1e3:.2f} ms", f"{report['step_time_s'] * 1e3:.2f} ms",
             _rel(predicted.step_time_s, report["step_time_s"]))]
    measured_bubble = 1 - sum(measured_busy) / (len(measured_busy) * report["step_time_s"])
    rows.append(("bubble fraction", f"{predicted.bubble_fraction:.1%}", f"{measured_bubble:.1%}",
                 f"{(predicted.bubble_fraction - measured_bubble) * 100:+.1f} points"))
    for k, (p, m) in enumerate(zip(pred_mem, meas_mem)):
        rows.append((f"stage {k} peak activation", f"{p / 2**20:.3f} MiB", f"{m / 2**20:.3f} MiB", _rel(p, m)))
    rows += busy_rows(predicted.stages, measured_busy)
    predicted_end, measured_end = end_of_step_spans_s(predicted.timeline, report)
    rows.append(("end-of-step span (last compute to step end, and last step's end to first action)",
                 f"{predicted_end * 1e3:.2f} ms", f"{measured_end * 1e3:.2f} ms", _rel(predicted_end, measured_end)))
    rows += gap_rows(report, data.get("pipeline", {}).get(str(plan.stages), {}).get("gap_after_s", {}))
    overhead = sum(r.duration_s for r in predicted.timeline.records if r.kind == STEP_OVERHEAD and r.stage == 0)
    rows.append(("of it, the fitted per-step overhead (work between steps, at most the span measured there)",
                 f"{overhead * 1e3:.2f} ms", "-", "-"))
    pace = report.get("machine_pace")
    if pace:
        at_reference = report["step_time_s"] / pace
        rows.insert(1, ("step time at the calibration's machine speed", f"{predicted.step_time_s * 1e3:.2f} ms",
                        f"{at_reference * 1e3:.2f} ms (probe x{pace:.2f})", _rel(predicted.step_time_s, at_reference)))
    machine = data.get("machine", {})
    intro = (f"Plan K={plan.stages} M={plan.microbatches} partition {list(plan.partition)} {plan.checkpoint} "
             f"{plan.schedule} for {plan.model.name} {plan.model.options}, batch {plan.batch_size}, on "
             f"{machine.get('cpu_model', '?')} ({machine.get('cpu_cores', '?')} cores), torch "
             f"{machine.get('torch', '?')}; costs calibrated {machine.get('date', '?')}.")
    notes = ["Measured: the executor's median step after warm-up; the timeline shows that step.",
             "Peak activation memory counts tensors saved for backward and stashed inputs (executor.memory).",
             "Timings on a shared machine vary from run to run; gpipe validate measures the error on held-out runs.",
             "Machine speed: the model's forward and backward on fixed rows, timed just before and after training "
             "and divided by the same probe's median while calibrating (above 1: the machine ran slower); the "
             "step at the calibration's speed is the measured step divided by it."]
    data_label = ("the shipped Shakespeare, one token per byte" if report.get("data", "text") == "text"
                  else "synthetic random tokens: the loss cannot fall")
    loss = loss_figure(report["losses"], data_label, plan.model.options.get("vocab"))
    notes.insert(0, f"Training data: {data_label}; the loss is the global batch's mean at each step.")
    write_report(path, "gpipe demo: predicted vs measured", intro, timelines, summary, error_table(rows), notes,
                 loss=loss)
    if picture:
        from calibrate.report_picture import picture_figure, write_png

        steps = compare_figure([predicted.timeline, measured_step], ["predicted", "measured"], memory=False)
        title = (f"gpipe demo: {plan.model.name} K={plan.stages} M={plan.microbatches} {plan.schedule}, predicted "
                 f"{predicted.step_time_s * 1e3:.1f} ms, measured {report['step_time_s'] * 1e3:.1f} ms per step")
        write_png(picture_figure(steps, loss, title), picture)
