"""Traced executor runs for calibration and validation: many configurations per launch of ranks.

Starting ranks and setting up their process groups costs more than a small run itself, so the
configurations that share a replica count D, a stage count K and a tensor-parallel degree T run one after
another inside the same D x K x T worker processes (``calibrate.measure.runs CONFIGS OUTDIR`` as D*K*T
ranks, started as ``gpipe train`` starts its own: :func:`executor.launch.agent.launch_captured`). Each
configuration runs exactly as ``gpipe train`` runs it: the executor's own
:func:`executor.runtime.pipeline.prepare`, :func:`executor.runtime.pipeline.make_dist_stage` (each rank's
replica and stage as laid out by :mod:`sim.engine.placement`, its layers read from ``factory()``'s values
written once by the launching process, as ``gpipe train`` writes them),
:class:`executor.runtime.recording.Recorder` and :func:`executor.runtime.report.build_report`, with
cores/(D x K) threads per process; its first ``warmup_steps`` are left out of the step time as in ``gpipe
train``. With D > 1 the replicas are made as ``gpipe train`` makes them
(:mod:`executor.parallel.replicas`), the losses are the global batch's mean, the report's per-stage
figures are replica 0's (whose rows ``torch.chunk`` makes the largest) and step times span every rank.
With T tensor-parallel ranks per stage (D x K x T processes, cores/(D x K x T) threads each) a stage's
figures are its rank 0's. Differences from a fresh ``gpipe train`` launch: the process, its allocator and
the gloo groups are reused from the previous configuration, and every rank times the speed probe of
:mod:`calibrate.noise.speed` and the after-wait probe of :mod:`calibrate.noise.after_wait_probe` just
before and just after the run (all ranks at once, outside the timed steps); the report's
``speed_probe_s`` and ``after_wait_probe_s`` hold them, per rank.

:func:`train_report` runs one plan through the real ``gpipe train`` command instead (the demo does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Sequence

from sim.views.progress import phase

PROBE_BUDGET_S = 0.1  # speed probe before and after each configuration (calibrate.noise.speed)
# the repository root, two folders above calibrate/measure/
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_configs(configs: Sequence[Any], timeout_s: float = 900.0,
                progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run every :class:`executor.config.RunConfig`; the reports come back in the same order."""
    by_shape: dict[tuple[int, int, int], list[int]] = {}  # (D, K, T) -> configurations, one launch each
    for index, config in enumerate(configs):
        by_shape.setdefault((config.layout.replicas, config.stages, config.layout.tensor_parallel), []).append(index)
    reports: list[dict[str, Any]] = [{} for _ in configs]
    with phase("executor runs", total=len(configs), unit="run") as bar:
        for (replicas, stages, parts), indices in sorted(by_shape.items(),
                                                         key=lambda item: (item[0][2], item[0][1], item[0][0])):
            _run_launch(configs, indices, replicas, stages, parts, reports, timeout_s, progress)
            bar.update(len(indices))
    return reports


def _run_launch(configs: Sequence[Any], indices: list[int], replicas: int, stages: int, parts: int,
                reports: list[dict[str, Any]], timeout_s: float, progress: Callable[[str], None] | None) -> None:
    """One launch of D x K x T workers running ``configs[indices]`` in turn; fills ``reports``."""
    from executor.launch.agent import launch_captured
    from executor.transport.shm_transport import SHM_DIR_ENV, shared_directory

    world = replicas * stages * parts
    shape = (f"D={replicas} " if replicas > 1 else "") + f"K={stages}" + (f" T={parts}" if parts > 1 else "")
    if progress is not None:
        progress(f"running {len(indices)} executor configuration(s) with {shape}")
    with tempfile.TemporaryDirectory(prefix="gpipe-runs-") as directory:
        path = os.path.join(directory, "configs.json")
        with open(path, "w") as handle:
            json.dump([_with_factory_weights(configs[i], os.path.join(directory, f"weights-{i}")).to_dict()
                       for i in indices], handle)
        threads = max(1, (os.cpu_count() or 1) // world)
        with shared_directory() as shared:  # the ranks' message files, as gpipe train makes them
            outcome, output = launch_captured("calibrate.measure.runs", [path, directory], world,
                                              {**_env(threads), SHM_DIR_ENV: shared}, timeout_s)
        if outcome.failed:
            tail = output.strip().splitlines()[-5:] or [outcome.agent_error or f"exit code {outcome.exitcode}"]
            raise RuntimeError(f"executor runs with {shape} failed: " + " | ".join(tail))
        for position, index in enumerate(indices):
            with open(os.path.join(directory, f"report-{position}.json")) as handle:
                reports[index] = json.load(handle)


def _with_factory_weights(config: Any, directory: str) -> Any:
    """``config`` starting from ``factory()``'s values written once here, as ``gpipe train`` writes
    them, so the ranks read their own layers instead of each building the whole model."""
    if config.init != "factory" or config.init_from or config.factory_weights:
        return config
    from dataclasses import replace

    from executor.models.initial_weights import save_factory_weights
    from executor.models.build import build_meta_model

    meta = build_meta_model(config.model, config.options)
    return replace(config, factory_weights=save_factory_weights(config.model, config.options, config.seed, meta,
                                                                directory))


def train_report(plan_path: str, steps: int, report_path: str, warmup_steps: int = 1,
                 data: str = "") -> dict[str, Any]:
    """Train a plan file with ``gpipe train`` (one process per stage) on ``data`` (its
    ``--data``; "" synthetic); its report. Its steps advance a progress bar as they are printed."""
    command = [sys.executable, "-m", "gpipe.main", "train", "--plan", plan_path, "--steps", str(steps),
               "--warmup-steps", str(warmup_steps), "--report", report_path]
    if data:
        command += ["--data", data]
    lines: list[str] = []
    with phase("training", total=steps, unit="step") as bar, \
            subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) as process:
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("gpipe: step "):
                bar.update(1)
                bar.set_postfix_str("loss " + line.split()[4])
    if process.returncode != 0:
        tail = "".join(lines).strip().splitlines()[-3:]
        raise RuntimeError("gpipe train failed: " + " | ".join(tail))
    with open(report_path) as handle:
        return json.load(handle)


# ----------------------------------------------------------------------------- worker side


def _run_one(config: Any, rank: int, groups: dict, device: Any, probe: Any, after_wait: Any,
             directory: str) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from executor.device import device_api
    from executor.runtime.pipeline import prepare, step_batches, train_step_with_data
    from executor.runtime.recording import shared_origin_s

    prepared = prepare(config)
    dist.barrier()
    pace_before = probe.measure(PROBE_BUDGET_S)  # every rank at once, as the run will load the machine
    loss_before = after_wait.measure()
    dist.barrier()
    stage, layout, held = _make_stage(config, prepared, rank, device, groups)
    stage.recorder.restart(shared_origin_s())  # one time axis for the ranks, as gpipe train's
    del prepared
    losses = []
    batches = step_batches(config, stage, layout)  # the next step's data drawn while waiting, as gpipe train does
    for step in range(config.steps):
        loss = train_step_with_data(config, stage, step, layout, batches)
        if layout is not None:
            if stage.is_last:
                loss = layout.global_loss(loss)  # the global batch's mean; collective over the last stages
        if stage.is_last:
            losses.append(float(loss))  # type: ignore[arg-type]
    dist.barrier()
    pace_after = probe.measure(PROBE_BUDGET_S)
    loss_after = after_wait.measure()
    payload = {"timeline": stage.recorder.timeline.to_dict(),
               "peak_activation_bytes": stage.counter.peak_bytes,
               "peak_allocated_bytes": device_api(device).peak_allocated_bytes(device),
               "losses": losses if stage.is_last else None,
               "speed_probe_s": [pace_before, pace_after], "after_wait_probe_s": [loss_before, loss_after]}
    if held is not None:  # ZeRO-2/3: the shards' and gathered units' bytes, as gpipe train reports them
        from executor.parallel.fully_sharded import memory_bytes
        from executor.runtime.chunks import shards

        payload["sharded"] = memory_bytes(shards(stage), held)
    elif config.layout.expert_parallel > 1:  # each rank's n/E routed experts' bytes, as gpipe train reports them
        from executor.parallel.expert_parallel import memory_bytes as expert_bytes
        from executor.runtime.chunks import shards

        payload["sharded"] = expert_bytes(shards(stage))
    gathered = _gather_through_files(payload, rank, config.world_size, directory)
    return _report(config, gathered, device) if gathered is not None else None


def _gather_through_files(payload: dict[str, Any], rank: int, world: int, directory: str) -> list[Any] | None:
    """Every rank's payload on rank 0 (None elsewhere), through files in the launch's directory.

    Not ``dist.gather_object``: gloo starts a thread of its own for each new size of message it carries,
    and once a gather of a few hundred KiB (a timeline) has started them, the same process computes on
    two threads slower for the rest of its life (a 1-thread loop is unchanged;
    docs/notes/2026-11-27-figures-behind-the-code.md). The launch runs its configurations one after
    another in the same processes, so every configuration after the first large timeline ran slow. The
    ranks of a launch share one host (a standalone launch)."""
    import torch.distributed as dist

    from sim.formats.timeline import write_json_atomic

    write_json_atomic(os.path.join(directory, f"payload-{rank}.json"), payload)
    dist.barrier()
    if rank != 0:
        dist.barrier()  # rank 0 has read them
        return None
    gathered = []
    for other in range(world):
        path = os.path.join(directory, f"payload-{other}.json")
        with open(path) as handle:
            gathered.append(json.load(handle))
        os.unlink(path)
    dist.barrier()
    return gathered


def _make_stage(config: Any, prepared: Any, rank: int, device: Any, groups: dict) -> tuple[Any, Any, Any]:
    """This rank's stage as ``gpipe train`` makes it, its replica layout (None for one replica) and,
    under ZeRO-2/3, what samples its gathered parameters (:func:`executor.parallel.replicas.attach`).

    One replica of whole stages reuses the launch's boundary groups (rank == stage); with D replicas,
    T tensor-parallel ranks per stage or V chunks per rank the executor builds the mesh and every
    pipeline's groups (:mod:`executor.parallel.replicas`), collectively.
    """
    from executor.runtime.interleaved import make_dist_chunks
    from executor.runtime.pipeline import make_dist_stage
    from executor.runtime.recording import Recorder

    if config.layout.replicas == 1 and config.layout.tensor_parallel == 1 and config.layout.virtual_stages == 1:
        return make_dist_stage(config, prepared, rank, device, Recorder(rank, device), groups), None, None
    from executor.parallel import replicas

    layout = replicas.build_layout(config, rank, device.type, prepared.shared)
    recorder = Recorder(layout.stage, device, replica=layout.replica, tp=layout.tp_rank)
    make = make_dist_chunks if config.layout.virtual_stages > 1 else make_dist_stage  # several chunks per rank, as gpipe train
    stage = make(config, prepared, rank, device, recorder, layout=layout)
    held = replicas.attach(stage, layout)
    return stage, layout, held


def by_replica_and_stage(config: Any, gathered: Sequence[Any]) -> list[Any]:
    """Every stage's payload in (replica, stage) order, the order
    :func:`executor.runtime.report.build_report` reads peak bytes in (rank order when D = 1); ranks sit
    where :mod:`sim.engine.placement` puts them, a stage's tensor-parallel rank 0 standing for the stage
    (its T ranks hold equal shares)."""
    from sim.engine.placement import device_of

    parts = config.layout.tensor_parallel
    return [gathered[device_of(d, k, config.layout.replicas, config.stages, config.layout.placement) * parts]
            for d in range(config.layout.replicas) for k in range(config.stages)]


def _report(config: Any, gathered: Sequence[Any], device: Any) -> dict[str, Any]:
    """Rank 0's report of one configuration from every rank's payload (see the module for D > 1)."""
    from executor.models.build import model_ref
    from executor.runtime.report import build_report
    from sim.schedules.schedule import device_of_virtual_stage
    from sim.formats.timeline import Timeline, merge

    timeline = merge(Timeline.from_dict(p["timeline"]) for p in gathered)
    plan = config.plan(model_ref(config.model, config.options, config.seed)).to_dict()
    ordered = by_replica_and_stage(config, gathered)
    allocated = [p["peak_allocated_bytes"] for p in ordered]
    allocated = allocated if any(a is not None for a in allocated) else None
    # replica 0's device of the last (virtual) stage: the global mean with D > 1
    losses = ordered[device_of_virtual_stage(len(config.partition) - 1, config.stages, config.layout.schedule)]["losses"]
    report = build_report(timeline, losses, config.to_dict(), plan, [p["peak_activation_bytes"] for p in ordered],
                          allocated, 0, sharded_bytes=[p.get("sharded") for p in ordered])
    report["speed_probe_s"] = [p["speed_probe_s"] for p in gathered]  # per rank: [before, after]
    report["after_wait_probe_s"] = [p["after_wait_probe_s"] for p in gathered]
    return report


def main(argv: list[str]) -> int:
    """Worker entry point: run every configuration of the file in order, write report-N.json."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from executor.config import RunConfig
    from executor.device import device_api
    from calibrate.noise.after_wait_probe import AfterWaitProbe
    from calibrate.noise.speed import SpeedProbe
    from executor.transport.p2p import boundary_groups
    from sim.formats.timeline import write_json_atomic

    configs_path, out_dir = argv
    with open(configs_path) as handle:
        configs = [RunConfig.from_dict(c) for c in json.load(handle)]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    api = device_api(configs[0].device)
    device = api.select(local_rank)
    api.prepare_process()
    if api.type == "cpu":  # the cores shared among the ranks
        torch.set_num_threads(configs[0].threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(api.backend, timeout=timedelta(seconds=configs[0].timeout_s))
    try:
        groups = boundary_groups(world) if configs[0].layout.replicas == 1 and configs[0].layout.tensor_parallel == 1 else {}
        probes: dict[str, tuple[SpeedProbe, AfterWaitProbe]] = {}
        for position, config in enumerate(configs):
            if config.world_size != world or (config.layout.replicas, config.layout.tensor_parallel) != \
                    (configs[0].layout.replicas, configs[0].layout.tensor_parallel):
                raise ValueError(f"configuration {position} has {config.layout.replicas} replica(s) of {config.stages} "
                                 f"stage(s) of {config.layout.tensor_parallel} rank(s), the launch {configs[0].layout.replicas} "
                                 f"replica(s) of {configs[0].layout.tensor_parallel} rank(s) per stage in a world of {world}")
            key = json.dumps([config.model, config.options, config.batch_size, config.loss], sort_keys=True)
            if key not in probes:
                probe = SpeedProbe.model(config.model, config.options, config.batch_size, config.loss, device)
                probes[key] = probe, AfterWaitProbe(probe)
            report = _run_one(config, rank, groups, device, *probes[key], out_dir)
            if report is not None:
                write_json_atomic(os.path.join(out_dir, f"report-{position}.json"), report)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
