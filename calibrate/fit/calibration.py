"""Calibration from start to finish: profile, ping-pong, the design runs, the fit, the costs file's content.

The pieces: the design of executor runs (:mod:`calibrate.fit.design`), what they measured
(:mod:`calibrate.fit.observations`), the fit (:mod:`calibrate.fit.design_fit`), and the checks that
keep a wild correction or a missed design run out of the costs file
(:mod:`calibrate.fit.design_checks`). :func:`calibrate` wires them with the measurements of
:mod:`calibrate.measure`.

Everything is fitted at a reference speed (:mod:`calibrate.noise.speed`): the profile's rounds are put at
the median pace of the probes around them, and every design run at the median pace of the probes
its ranks took around the design runs with the same K (``data["speed"]["reference_s"]``), so a
moment when the shared machine ran slow does not bend the fits, and validation can tell later
drift of the machine from error of the model.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

from calibrate.fit.design import RunSpec, calibration_design, run_config
from calibrate.fit.design_checks import corrected_within_bounds, missed_design_runs, refuse_missed
from calibrate.fit.design_fit import fit_halves, fit_in_pipeline
from calibrate.fit.least_squares import fit_link, fit_roofline
from calibrate.fit.step_fit import design_entry
from sim.formats.costs import DESIGN_FIT_GOAL, fit_quality
from sim.views.progress import phase
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, optimizer_slots

Progress = Callable[[str], None]


def fit_efficiency(model: str, options: dict[str, Any], profile: dict[str, Any], device: Any,
                   precision: str = "fp32") -> dict | None:
    """Roofline efficiency of the analytic model against the measured forwards (built-ins only, and
    only at a precision the device has a peak for: none for bf16 on the CPU, which emulates it)."""
    from sim.workloads.models import BUILTIN_MODELS, LAYER_OVERHEAD_S
    from sim.workloads.moe.workload import builtin_workload

    if model not in BUILTIN_MODELS or model == "uniform" or precision not in device.peak_flops:
        return None
    analytic = builtin_workload(model, {**options, "precision": precision})
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

    The design runs are measured ``rounds`` times, interleaved, and each action enters the fits at its
    median over the rounds (:meth:`calibrate.fit.observations.ActionPoints.typical`), so a moment when
    the machine ran slow weighs less; with two rounds or more (not ``quick``) the fits on the odd and on
    the even rounds are kept beside the whole one (:func:`calibrate.fit.design_fit.fit_halves`). They
    train with ``optimizer``, which the costs file records with its state per parameter. Layers are
    profiled and the design runs trained at ``precision`` (:mod:`executor.runtime.precision`), which the
    costs file records too. ``tensor_parallel`` T > 1 also profiles the layers split over T ranks
    (:mod:`calibrate.measure.tp_profile`); None does so with T = 2 in a full calibration where two ranks
    fit and the model has a plan.
    """
    import torch

    from executor.device import device_api

    from calibrate.measure.machine import machine_stamp
    from calibrate.measure.expert_profile import profile_experts
    from calibrate.measure.profile import Repeats, profile_model
    from calibrate.noise.speed import SpeedProbe
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
    # plan searches the split-backward schedules only when named, gpipe.plan_space.default_schedules)
    repeats = Repeats(min_runs=3, budget_s=0.02, max_runs=15, split=False) if quick else Repeats()
    profile = profile_model(net, lambda r: example_batch(model, options, r, seed=1), loss, rows,
                            sorted(set(threads_of.values()), reverse=True), torch.device(device), repeats,
                            progress=say, probe=SpeedProbe.model(model, options, batch_size, device=device),
                            precision=precision)
    experts = profile_experts(net, lambda r: example_batch(model, options, r, seed=1), rows,
                              sorted(set(threads_of.values()), reverse=True), torch.device(device), repeats,
                              precision)
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
    if experts is not None:  # a mixture of experts: its routed experts timed apart, for expert parallelism
        data["experts"] = experts
    measure_links(data, device, quick, max_stages, say)
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
    reports, speeds, corrections = measure_and_fit_design(data, model, len(design), specs, configs, threads_of, say)
    data["fit_quality"] = fit_quality(data, corrections)
    if not quick and rounds >= 2:
        data["fit_halves"] = fit_halves(data, len(design), specs, reports, speeds, threads_of)
    if device == "cpu":
        data["efficiency"] = fit_efficiency(model, options, data["profile"], LOCAL_CPU, precision)
    say("calibration done")
    return data


def measure_links(data: dict[str, Any], device: str, quick: bool, max_stages: int, say: Progress) -> None:
    """Time the links and collectives the executor uses, into ``data`` (in place): the ping-pong between
    two ranks (``link``) where two stages fit, the data-parallel all-reduce among as many ranks as fit
    (``allreduce``) and, in a full calibration, the tensor-parallel collectives among 2 (``tensor_parallel``)
    and ZeRO-2/3's all-gather and reduce-scatter among as many as the all-reduce (``sharded``), and
    expert parallelism's all-to-all among as many (``expert_parallel``; in a quick calibration too where
    ``data`` holds a mixture of experts' ``experts`` profile, so its expert-parallel runs are priced)."""
    from calibrate.measure.collective import available_parties, calibrate_allreduce, calibrate_sharded, party_counts
    from calibrate.measure.ep_collectives import calibrate_expert_parallel
    from calibrate.measure.link import ping_pong
    from calibrate.measure.tp_collectives import calibrate_tensor_parallel
    from executor.device import device_api

    parties = party_counts(available_parties(device))
    exchange = bool(parties) and (not quick or "experts" in data)  # expert parallelism's all-to-all
    links = phase("measuring links", total=(max_stages >= 2) + (len(parties) > 0) * (1 if quick else 3) + exchange,
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
            say(f"all-gather and reduce-scatter among {', '.join(map(str, parties))} ranks (ZeRO-2/3's collectives)")
            data["sharded"] = calibrate_sharded(device, quick, parties)
            links.update(1)
    if exchange:
        say(f"all-to-all among {', '.join(map(str, parties))} ranks (expert parallelism's token exchange)")
        data["expert_parallel"] = calibrate_expert_parallel(device, quick, parties)
        links.update(1)
    links.close()


def measure_and_fit_design(data: dict[str, Any], model: str, design_size: int, specs: Sequence[RunSpec],
                           configs: Sequence[Any], threads_of: dict[int, int],
                           say: Progress) -> tuple[list[dict[str, Any]], list[float], list[dict[str, float]]]:
    """Run the design's ``configs`` (``specs``: the design of ``design_size`` runs, round after round),
    correct each run within its bounds and fit, into ``data`` (in place: ``speed``, the fits,
    ``fit_residuals`` and ``design``); (reports, speed factors, corrections) of the runs fitted.

    A run whose correction falls outside its bounds is measured once more (:mod:`calibrate.fit.design_checks`);
    a design run the fit misses is measured once more and everything refitted; either that remains
    refuses the calibration (:class:`calibrate.fit.design_checks.CalibrationRefused`)."""
    from calibrate.measure.runs import run_configs

    def remeasure(indices: Sequence[int]) -> list[dict[str, Any]]:
        return run_configs([configs[i] for i in indices], progress=say)

    design = specs[:design_size]
    reports = run_configs(list(configs), progress=say)
    for attempt in (1, 2):  # a design run the fit misses is measured once more, then refused
        reports, data["speed"], corrections = corrected_within_bounds(model, specs, reports, remeasure, say)
        speeds = [c["speed"] for c in corrections]
        data["fit_residuals"] = fit_in_pipeline(data, specs, reports, speeds, threads_of)
        data["design"] = [design_entry(data, s, reports[i::design_size], corrections[i::design_size])
                          for i, s in enumerate(design)]
        missed = {run for run, _ in missed_design_runs(data)}
        if not missed or attempt == 2:
            break
        again = [i for i, s in enumerate(specs) if s.label() in missed]
        say(f"the fit misses {', '.join(sorted(missed))} past {DESIGN_FIT_GOAL:.0%}; measuring again and refitting")
        for i, report in zip(again, remeasure(again)):
            reports[i] = report
    refuse_missed(data)
    return reports, speeds, corrections
