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
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

from sim.errors import GpipeInputError

DEMO_MODEL = "transformer"
DEMO_OPTIONS: dict[str, Any] = {"layers": 4, "d_model": 128, "ff": 512, "heads": 4, "seq": 32, "vocab": 256}
DEMO_BATCH = 32
# Enough AdamW steps at the default learning rate (0.01) for the byte-level loss to fall from ln(256)
# = 5.55 to about 2.6 on the shipped text; each step is short (the demo's times: benchmarks/README.md).
DEMO_STEPS = 30
MICROBATCH_OPTIONS = (1, 2, 4, 8, 16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gpipe.options import add_data_argument, add_force_argument, add_json_argument, add_steps_argument

    parser.add_argument("--out-dir", default="out", help="where the costs cache, plan and report go (default out)")
    add_steps_argument(parser, DEMO_STEPS, "training steps of the chosen plan")
    add_data_argument(parser, default="text", names=("text", "synthetic"),
                      meaning="what the chosen plan trains on: text (default; the shipped Shakespeare, one token "
                              "per byte, so the loss falls) or synthetic (random tokens, as calibration times)")
    add_force_argument(parser, "calibrate again even if the cache is valid")
    parser.add_argument("--picture", metavar="FILE.png",
                        help="also write the report's timelines and loss curve as one PNG (needs kaleido)")
    add_json_argument(parser, "print one JSON object on stdout and nothing else: the plan chosen, its predicted and "
                              "measured step, the losses, the verdict and the files written")


def plan_best(data: dict[str, Any], batch: int, max_stages: int) -> dict[int, tuple[Any, Any, Any]]:
    """The fastest fitting plan for each K = 1..max_stages with the measured costs.

    ``{K: (option, workload, system)}``, the workload bound to the plan's K, policy and M.
    """
    from sim.formats.costs import MeasuredWorkload
    from sim.catalog.hardware import get_system
    from sim.planner.search import search

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
    from calibrate.fit.design import check_timed_steps

    check_timed_steps(args.steps)  # before torch is imported
    from gpipe.calibrate import calibrate_cached
    from calibrate.fit.design_checks import CalibrationRefused
    from calibrate.report.run_report import write_run_report
    from calibrate.measure.runs import train_report
    from executor.models.build import model_ref
    from sim.planner.search import simulate_candidate
    from calibrate.report.run_report import MachinePace, pricing_of, step_verdict
    from sim.formats.plan import Plan, costs_ref, save_plan
    from sim.views import progress

    if args.picture:
        from calibrate.report.report_picture import kaleido_major_version
        from gpipe.options import check_output_path

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

    quiet = args.quiet or args.json  # --json: the one object on stdout, no lines

    def say(message: str) -> None:
        if not quiet:
            progress.say(f"[demo {time.perf_counter() - started:6.1f}s] {message}")

    def note(message: str) -> None:  # calibration's progress lines: shown only beside its bars
        if progress.bars_shown():
            say("    " + message)

    options = ", ".join(f"{key}={value}" for key, value in DEMO_OPTIONS.items())
    say(f"1/5 calibrating {DEMO_MODEL} ({options}), batch {DEMO_BATCH}, on this machine")
    costs_path = os.path.join(args.out_dir, "costs.json")
    try:
        data = calibrate_cached(costs_path, DEMO_MODEL, DEMO_OPTIONS, DEMO_BATCH, quick=True, force=args.force,
                                progress=note, announce=lambda m: say("    " + m))
    except CalibrationRefused as refused:  # its runs were measured twice; a whole new calibration once more
        say(f"    {refused}")
        say("    calibrating once more from the start")
        data = calibrate_cached(costs_path, DEMO_MODEL, DEMO_OPTIONS, DEMO_BATCH, quick=True, force=True,
                                progress=note)
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
    plan = Plan(model=ref, partition=tuple(option.partition), batch_size=DEMO_BATCH, layout=c,
                optimizer=workload.optimizer, hardware={"system": system.name, "nodes": 1}, costs=costs_ref(costs_path),
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
    if not args.json:
        progress.say(f"losses over {len(report['losses'])} steps (ln 256 = {math.log(256):.2f} is a uniform guess): "
                     f"{loss_summary(report['losses'])}")
    verdict = step_verdict(predicted.step_time_s, report["step_time_s"], pricing_of(plan, "cpu", costs_path),
                           report["machine_pace"])
    if not args.json:
        progress.say(verdict)
    say("5/5 writing the report")
    path = os.path.join(args.out_dir, "report.html")
    write_run_report(path, "gpipe demo: predicted vs measured", verdict, data, plan, predicted, report, args.picture)
    say(f"done in {time.perf_counter() - started:.0f} s")
    if args.json:
        json.dump(demo_summary(per_k, predicted, report, verdict, costs_path, plan_path, os.path.abspath(path), args),
                  sys.stdout)
        print()
    else:
        print(f"report written to {os.path.abspath(path)}")
    return 0


def demo_summary(per_k: dict[int, tuple[Any, ...]], predicted: Any, report: dict[str, Any], verdict: str,
                 costs_path: str, plan_path: str, report_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--json``'s object: the best plan per K and the one trained, its predicted and measured step,
    the losses, the verdict, and where the costs, plan and report are."""
    def layout(option: Any) -> dict[str, Any]:
        c = option.candidate
        return {"stages": c.stages, "virtual_stages": c.virtual_stages, "microbatches": c.microbatches,
                "partition": list(option.partition), "checkpoint": c.checkpoint, "schedule": c.schedule,
                "predicted_step_s": option.step_time_s}

    return {"best_per_stages": [layout(option) for _, (option, _, _) in sorted(per_k.items())],
            "chosen": layout(per_k[max(per_k)][0]), "predicted_step_s": predicted.step_time_s,
            "predicted_bubble_fraction": predicted.bubble_fraction, "measured_step_s": report["step_time_s"],
            "step_times_s": report.get("step_times_s"), "losses": report["losses"], "data": args.data,
            "machine_pace": report["machine_pace"], "verdict": verdict, "costs": costs_path, "plan": plan_path,
            "train_report": os.path.join(args.out_dir, "train_report.json"), "report": report_path,
            "picture": args.picture}


def loss_summary(losses: list[float], shown: int = 7) -> str:
    """About ``shown`` losses evenly spaced from the first step to the last, step by step."""
    if not losses:
        return "none"
    every = max(1, math.ceil((len(losses) - 1) / max(1, shown - 1)))
    steps = sorted({*range(0, len(losses), every), len(losses) - 1})
    return ", ".join(f"{losses[s]:.2f} (step {s})" if s in (0, len(losses) - 1) else f"{losses[s]:.2f}"
                     for s in steps)


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
