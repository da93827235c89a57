"""``gpipe calibrate``: profile this machine for a model, fit the costs, write the costs file.

The executor runs of the design train with ``--optimizer`` (default adamw) at ``--precision``
(default fp32); the costs file records both, so ``--costs`` predictions hold the optimizer's state
and take its step time. A second run for the same machine, library versions, model, options,
batch, optimizer and precision reuses the file unless ``--force`` is given, so scripts (and
``gpipe demo``) can call it unconditionally.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from gpipe.options import (add_batch_argument, add_device_argument, add_force_argument, add_json_argument,
                           add_model_arguments, add_optimizer_argument, add_out_argument, add_precision_argument,
                           add_rounds_argument, add_steps_argument, add_tensor_parallel_argument, check_output_path,
                           model_options)
from calibrate.fit.design import check_timed_steps
from calibrate.noise.after_wait_probe import WAIT_S as AFTER_WAIT_S, after_wait_reference_s
from sim.engine.stragglers import straggle_fraction
from sim.engine.host import IDLE_S
from sim.errors import GpipeInputError, require_positive
from sim.views.progress import note
from sim.workloads.model_defaults import DEFAULT_BATCH
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, check_optimizer
from sim.workloads.precision import DEFAULT_PRECISION, check_precision

DEFAULT_MODEL = "transformer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, costs=False, default=DEFAULT_MODEL)
    add_optimizer_argument(parser, recorded=None)
    add_precision_argument(parser, DEFAULT_PRECISION)
    add_batch_argument(parser)
    add_out_argument(parser, "costs file to write (default costs.json)", default="costs.json")
    add_device_argument(parser, "calibrate the CPU (gloo) or the GPUs (NCCL)")
    parser.add_argument("--max-stages", type=int, default=None,
                        help="largest K to calibrate (default: 2 on CPU, the GPU count on CUDA)")
    add_steps_argument(parser, 5, "steps per executor run, the first a warm-up")
    add_rounds_argument(parser, 2, "measure the design runs this many times, interleaved; all enter the fits")
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions, one round (noisier)")
    add_tensor_parallel_argument(parser, None, "default: 2 in a full calibration where the machine has two cores and "
                                               "the model a tensor-parallel plan, none with --quick; 1: none",
                                 "also profile every layer split over T tensor-parallel ranks, for plans with "
                                 "--tensor-parallel T")
    add_force_argument(parser, "measure again even if --out is up to date")
    add_json_argument(parser, "print the fitted numbers as one JSON object")


def cached(path: str, model: str, options: dict[str, Any], batch: int, device: str,
           optimizer: str = DEFAULT_OPTIMIZER, precision: str = DEFAULT_PRECISION) -> dict[str, Any] | None:
    """The costs at ``path`` if they were measured here, with these versions, for this model, with
    this optimizer and at this precision, and their fit holds its own design runs."""
    from sim.formats.costs import fit_quality_warning, measured_precision, read_costs, requested_options
    from calibrate.measure.machine import machine_stamp, same_machine

    if not os.path.exists(path):
        return None
    try:
        data = read_costs(path, warn=False)
    except GpipeInputError:
        return None
    if fit_quality_warning(data):  # a fit that misses its own runs is measured again, never reused
        return None
    stored = data.get("model", {})
    wanted = requested_options(model, options)
    if (stored.get("name") != model or any(stored.get("options", {}).get(k) != v for k, v in wanted.items())
            or data.get("batch_size") != batch or data.get("optimizer", "sgd") != optimizer
            or measured_precision(data) != precision):
        return None
    return data if same_machine(data.get("machine", {}), machine_stamp(device)) else None


def calibrate_cached(path: str, model: str, options: dict[str, Any], batch: int, device: str = "cpu",
                     max_stages: int | None = None, steps: int = 5, quick: bool = False, force: bool = False,
                     progress=print, rounds: int = 2, optimizer: str = DEFAULT_OPTIMIZER,
                     precision: str = DEFAULT_PRECISION, tensor_parallel: int | None = None,
                     announce=None, retries_after_refusal: int = 0) -> dict[str, Any]:
    """Reuse the costs at ``path`` when valid (see :func:`cached`) and holding the tensor-parallel
    profile asked for, else calibrate and write them. ``progress`` takes calibration's progress
    lines, ``announce`` (default ``progress``) the line saying the file was reused. A calibration
    refused for drift (:class:`calibrate.fit.design_checks.CalibrationRefused`) is taken again from
    the start up to ``retries_after_refusal`` times, as ``gpipe demo`` does, before the refusal stands."""
    from calibrate.fit.calibration import calibrate
    from calibrate.fit.design_checks import CalibrationRefused
    from sim.formats.costs import read_costs, write_costs

    if not force:
        data = cached(path, model, options, batch, device, optimizer, precision)
        if data is not None and tensor_parallel not in (None, 1) \
                and str(tensor_parallel) not in data.get("tensor_parallel_profile", {}):
            data = None
        if data is not None:
            (announce or progress)(f"reusing {path} (same machine, versions, model, optimizer and precision; --force to "
                     "measure again)")
            return data
    for attempt in range(retries_after_refusal + 1):
        try:
            data = calibrate(model, options, batch, device, max_stages, steps, quick, progress, rounds, optimizer,
                             precision, tensor_parallel)
            break
        except CalibrationRefused as refused:
            if attempt == retries_after_refusal:
                raise
            progress(f"{refused}; calibrating once more from the start")
    write_costs(data, path)
    return read_costs(path)


def run(args: argparse.Namespace) -> int:
    precision = check_precision(args.precision or DEFAULT_PRECISION, trained=True)
    check_output_path(args.out, "--out")
    options = model_options(args)
    optimizer = check_optimizer(args.optimizer or DEFAULT_OPTIMIZER)
    batch = args.batch if args.batch is not None else DEFAULT_BATCH.get(args.model, 32)
    require_positive("batch size", batch, "use --batch 1 or more")
    check_timed_steps(args.steps)
    require_positive("--rounds", args.rounds, "use --rounds 1 or more")
    if args.max_stages is not None:
        require_positive("--max-stages", args.max_stages, "use --max-stages 1 or more")
    if args.tensor_parallel is not None:
        require_positive("--tensor-parallel", args.tensor_parallel, "use 1 (no split profile) or more")
    from executor.device import device_api

    device_api(args.device).check_available()
    announce = (lambda message: print(message, file=sys.stderr, flush=True)) if args.json else print
    data = calibrate_cached(args.out, args.model, options, batch, args.device, args.max_stages, args.steps,
                            args.quick, args.force, note, args.rounds, optimizer, precision,
                            args.tensor_parallel, announce=None if getattr(args, "quiet", False) else announce)
    if args.json:
        from sim.formats.costs import costs_summary

        json.dump(costs_summary(data), sys.stdout)
        print()
    else:
        print(summary_text(data))
        print(f"costs written to {args.out}")
    return 0


def summary_text(data: dict[str, Any]) -> str:
    from sim.formats.costs import fit_quality_warning

    lines = [f"model {data['model']['name']} {data['model']['options']} batch {data['batch_size']}, "
             f"optimizer {data.get('optimizer', 'sgd')}, precision {data.get('precision', DEFAULT_PRECISION)}"]
    link = data.get("link")
    if link:
        lines.append(f"link: latency {link['latency_s'] * 1e6:.1f} us, bandwidth "
                     f"{link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    lines += allreduce_lines(data.get("allreduce"))
    for k, fit in sorted(data.get("pipeline", {}).items()):
        loss = after_wait_reference_s(data, int(k))  # per process count, K here
        warm_up_s = fit.get("host", {}).get("warm_up_s")  # a CPU host's effect (sim.engine.host), where measured
        acts = ", ".join(f"{kind} x{a['slope']:.3f}"
                         + (f" (fixed part x{a['fixed_slope']:.3f})" if a.get("fixed_slope") is not None else "")
                         + f"{a['intercept'] * 1e6:+.0f}us"
                         + (f" (cold start +{a['cold_start_s'] * 1e6:.0f}us)" if a.get("cold_start_s") else "")
                         for kind, a in fit["actions"].items())
        if fit.get("full_backward_per_layer_s") is not None:
            acts += f", B under full B + R + {fit['full_backward_per_layer_s'] * 1e3:.2f} ms per layer after the first"
        gaps = "/".join(f"{kind} {gap * 1e6:.0f}" for kind, gap in fit.get("gap_after_s", {}).items())
        spread = fit.get("replica_spread")
        lines.append(f"K={k} ({fit['threads']} thread(s)): {acts}; "
                     + (f"between actions, after {gaps} us; " if gaps else "")
                     + f"step overhead {fit['step_overhead_s'] * 1e3:.2f} ms"
                     + (f"; after a wait of {IDLE_S * 1e3:.0f} ms or more, half speed until "
                        f"{warm_up_s * 1e6:.0f} us are lost" if warm_up_s else "")
                     + (f" (meanwhile the after-wait probe, the first layer's forward after a "
                        f"{AFTER_WAIT_S * 1e3:.0f} ms wait, lost {loss * 1e6:.0f} us)"
                        if warm_up_s and loss is not None else "")
                     + (f"; the slowest of 2 replicas {straggle_fraction(spread, 2) * 100:+.1f}% of their compute"
                        if spread else ""))
    for parts, factors in sorted(data.get("tensor_parallel_fit", {}).items()):
        lines.append(f"T={parts} (layers profiled split over {parts} ranks): in-pipeline factor "
                     + ", ".join(f"{kind} x{value:.3f}" for kind, value in factors.items()))
    eff = data.get("efficiency")
    if eff:
        lines.append(f"efficiency vs {eff['relative_to']}: {eff['efficiency']:.3f} of peak FLOP/s, "
                     f"{eff['bandwidth_efficiency']:.3f} of peak bandwidth")
    for run in data.get("design", []):
        error = (run["predicted_step_s"] - run["measured_step_s"]) / run["measured_step_s"]
        busy = ""
        if run.get("measured_busy_s"):  # costs files from before it was kept have none
            busy = ", busy per stage " + "/".join(f"{(p - m) / m * 100:+.1f}%" for p, m in
                                                  zip(run["predicted_busy_s"], run["measured_busy_s"]))
        lines.append(f"  fitted on {run['run']}: measured {run['measured_step_s'] * 1e3:.2f} ms, "
                     f"predicted {run['predicted_step_s'] * 1e3:.2f} ms ({error * 100:+.1f}%{busy})")
    quality = data.get("fit_quality")
    if quality and "speed_factor_range" in quality:
        low, high = quality["speed_factor_range"]
        lines.append(f"fit quality: worst design run {quality['worst_step_error'] * 100:+.1f}% "
                     f"({quality['worst_run']}), goal {quality['goal'] * 100:.0f}%; speed corrections "
                     f"x{low:.2f}..x{high:.2f}")
    warning = fit_quality_warning(data)
    if warning:
        lines.append(warning)
    return "\n".join(lines)


def allreduce_lines(entry: dict[str, Any] | None) -> list[str]:
    """The all-reduce fit, then each group size's measured points (bytes: time), one line each."""
    if not entry:
        return []
    lines = [f"all-reduce ({entry['backend']}, ring model): latency {entry['latency_s'] * 1e6:.1f} us, "
             f"bandwidth {entry['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, worst point off by "
             f"{entry.get('worst_relative', 0.0) * 100:.1f}%"]
    lines += _points_lines(entry, entry["measured_s"], "all-reduce among")
    shared = entry.get("shared_memory")
    if shared:  # the route the executor takes where the group's ranks share a host and fit its cores
        lines.append(f"gradient sum through shared memory (ranks that fit this host's cores): latency "
                     f"{shared['latency_s'] * 1e6:.1f} us, bandwidth {shared['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, "
                     f"worst point off by {shared.get('worst_relative', 0.0) * 100:.1f}%")
        lines += _points_lines(entry, shared["measured_s"], "among")
    return lines


def _points_lines(entry: dict[str, Any], measured_s: list[list[float]], label: str) -> list[str]:
    """One line per group size: each size's measured time."""
    return [f"  {label} {parties} ranks: " + ", ".join(f"{_size(b)} {t * 1e3:.3g} ms"
                                                      for b, t in zip(entry["sizes_bytes"], row))
            for parties, row in zip(entry["parties"], measured_s)]


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"
