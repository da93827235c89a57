"""The torchrun worker: one process per stage, rank == stage (with D replicas, rank =
``sim.engine.placement.device_of(replica, stage)``; :mod:`executor.parallel.replicas`).

Run as ``python -m executor.launch.worker CONFIG.json`` under torchrun (``gpipe train`` does this). Every
rank builds the model on the meta device and validates it (a bad plan fails on every rank the same
way, before any process group exists), gives its own stage's layers their first values only (read
from the file of ``factory()``'s values ``gpipe train`` wrote, from ``--init-from``, or seeded per
layer under ``--init meta``: :mod:`executor.models.initial_weights`), trains
``steps`` mini-batches,
saves checkpoints, and finally sends its timeline to rank 0, which writes ``--report`` and
``--trace``.

With several nodes, torchrun's static rendezvous makes ``RANK`` the stage (node n holds stages
n*K/N onwards, :mod:`executor.launch.agent`); every rank checks at start that no other process has its
rank and that every node was started with the same settings, and the report goes to each node
that asked for it (:mod:`executor.launch.nodes`).

Failure handling (:mod:`executor.launch.failures`): an exception prints ``gpipe: error: ...`` (user
errors) or the traceback, is written to the rendezvous store and to ``$GPIPE_ERROR_DIR`` (``gpipe
train`` shows it at the end), and the worker exits non-zero; torchrun stops the other workers of
its node at once, and every other node's workers see the failure in the store within a second and
stop with its message. A worker that only lost a peer waits a few seconds for the peer's own error
first. The process-group timeout (``timeout_s``) is the backstop for a hang that raises nothing.
Fault injection for tests: ``GPIPE_FAULT_RANK``, ``GPIPE_FAULT_STEP`` and ``GPIPE_FAULT``
(``kill``: SIGKILL itself; ``raise``: RuntimeError) act after the first action of that step, on
the first attempt only (not after a torchrun restart).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from executor.config import RunConfig
from executor.device import backend_device, device_api
from executor.launch import failures, nodes
from executor.models.build import has_router_loss, model_ref
from executor.models.moe_aux_loss import take_aux_loss
from executor.parallel import replicas
from executor.runtime.chunks import ChunkedDevice, shards
from executor.runtime.interleaved import make_dist_chunks
from executor.runtime.pipeline import make_dist_stage, prepare, step_batches, train_step_with_data
from executor.runtime.recording import Recorder, shared_origin_s
from executor.runtime.report import build_report
from executor.runtime.stage import PipelineStage
from executor.state import checkpoint
from sim.errors import GpipeInputError
from sim.formats.timeline import Timeline, merge
from sim.schedules.schedule import Action
from sim.views.progress import phase, say


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _fault_hook(rank: int, step_ref: list[int]):
    fault_rank = os.environ.get("GPIPE_FAULT_RANK")
    if fault_rank is None or int(fault_rank) != rank or _env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0:
        return None
    fault_step = _env_int("GPIPE_FAULT_STEP", 0)
    mode = os.environ.get("GPIPE_FAULT", "kill")

    def hook(index: int, action: Action) -> None:
        if step_ref[0] == fault_step and index == 0:
            if mode == "raise":
                raise RuntimeError(f"injected fault on rank {rank} at step {fault_step} after {action}")
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _setup_device(config: RunConfig, local_rank: int, local_world: int) -> tuple[torch.device, str]:
    api = device_api(config.device)
    api.prepare_process()
    if api.type == "cpu":  # the node's cores shared among its ranks
        torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // local_world))
    return api.select(local_rank), api.backend


def _init_process_group(backend: str, rank: int, world: int, timeout: timedelta) -> None:
    """``init_process_group`` on torchrun's store, under a prefix per restart attempt.

    torchrun keeps its store across ``--max-restarts``; without the prefix a restarted worker could
    read the previous attempt's addresses for the groups it creates and fail to connect.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent_store), timeout=timeout)
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    prefixed = dist.PrefixStore(f"gpipe/attempt-{attempt}", store)
    if prefixed.add(f"claims/rank-{rank}", 1) > 1:
        raise GpipeInputError(f"two processes have rank {rank}: two nodes were started with --node-rank "
                              f"{_env_int('GROUP_RANK', 0)}; give each node its own --node-rank")
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)


@dataclass
class History:
    """Per-step results the last stage keeps for the report: from step 0, across resumes."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # global L2 norm before clipping


def _save(config: RunConfig, stage: PipelineStage | ChunkedDevice, step: int, history: History,
          layout: replicas.Layout) -> None:
    """Replica 0 of each stage writes its shards, one per (virtual) stage (with ZeRO, its optimizer
    state gathered first)."""
    replicas.consolidate(stage)
    # a stage's T ranks gather its shards (with ZeRO-2/3 its D x T ranks, with expert parallelism the
    # E x T of replica 0's expert group); replica 0's rank t = 0 writes them
    if layout.replica < layout.expert_parallel or layout.zero >= 2:
        for shard in shards(stage):
            checkpoint.save_shard(config.checkpoint_dir, step, shard,
                                  write=layout.tp_rank == 0 and layout.replica == 0)
    dist.barrier()
    if stage.is_last and layout.replica == 0 and layout.tp_rank == 0:
        checkpoint.write_manifest(config.checkpoint_dir, step, len(config.partition), history.losses,
                                  config.to_dict(), history.grad_norms)


def train(config: RunConfig) -> None:
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    if world != config.world_size:
        plan = f"{config.stages} stages" if config.layout.replicas == 1 else \
            f"{config.layout.replicas} replicas x {config.stages} stages"
        if config.layout.tensor_parallel > 1:
            plan += f" x {config.layout.tensor_parallel} tensor-parallel ranks"
        if config.world_size != config.stages:
            plan += f" = {config.world_size} ranks"
        raise GpipeInputError(f"the plan has {plan} but torchrun started {world} processes; start exactly one "
                              f"process per stage (nnodes x nproc-per-node = {config.world_size})")
    device, backend = _setup_device(config, local_rank, local_world)
    prepared = prepare(config)  # validates before any communication
    _init_process_group(backend, rank, world, timedelta(seconds=config.timeout_s))
    try:
        views = nodes.share(config, _env_int("GROUP_RANK", 0))
        nodes.check_same_settings(views)
        writers = nodes.output_writers(views)
        layout = replicas.build_layout(config, rank, device.type, prepared.shared)
        recorder = Recorder(layout.stage, device, replica=layout.replica, tp=layout.tp_rank,
                            collectives=bool(config.trace) and config.layout.tensor_parallel > 1)
        make = make_dist_chunks if config.layout.virtual_stages > 1 else make_dist_stage
        stage = make(config, prepared, rank, device, recorder, layout=layout)
        gathered = replicas.attach(stage, layout)  # ZeRO-2/3: samples the gathered parameters
        recorder.restart(shared_origin_s())  # one time axis for the ranks of a host
        del prepared
        history, start = _resume(config, stage)
        step_ref = [start]
        stage.after_action = replicas.chain(_fault_hook(rank, step_ref), stage.after_action)
        first_step = start
        take_aux_loss()  # the routers' auxiliary losses of this launch's steps (executor.models.moe_aux_loss)
        routers = has_router_loss(config.model, config.options)
        aux_losses: list[float | None] = [None] * start
        batches = step_batches(config, stage, layout)
        reports = stage.is_last and layout.replica == 0 and layout.tp_rank == 0  # prints the losses, keeps the history
        bar = phase("training", total=config.steps, initial=start, unit="step", shown=config.progress and reports)
        for step in range(start, config.steps):
            step_ref[0] = step
            loss = train_step_with_data(config, stage, step, layout, batches)
            aux = _global_aux_loss(take_aux_loss() * layout.weight, layout) if routers else None
            aux_losses.append(aux)
            if stage.is_last:
                loss = layout.global_loss(loss)  # type: ignore[arg-type]
            if reports:
                history.losses.append(float(loss))  # type: ignore[arg-type]
                norm = ""
                if stage.grad_norm is not None:  # taken only when clipping
                    history.grad_norms.append(float(stage.grad_norm))
                    norm = f" grad norm {stage.grad_norm:.4g}"
                if aux is not None:
                    norm = f" aux loss {aux:.6f}{norm}"
                if not config.quiet:
                    say(f"gpipe: step {step} loss {loss:.6f}{norm} lr {stage.lr:.4g}", bar_shown=config.progress)
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
            if config.save_every and (step + 1) % config.save_every == 0:
                _save(config, stage, step, history, layout)
        bar.close()
        _finish(config, stage, history if reports else None, first_step, device, writers, layout, gathered,
                aux_losses if routers else None)
    finally:
        dist.destroy_process_group()


def _resume(config: RunConfig, stage: PipelineStage | ChunkedDevice) -> tuple[History, int]:
    """Losses and norms so far and the first step to run, from the last checkpoint when resuming."""
    restarted = _env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0
    if not config.checkpoint_dir or not (config.resume or restarted):
        return History(), 0
    manifest = checkpoint.read_manifest(config.checkpoint_dir)
    if manifest is None:
        if config.resume and not restarted:
            print(f"gpipe: no checkpoint in {config.checkpoint_dir!r} yet; starting from step 0", flush=True)
        return History(), 0
    checkpoint.check_resumable(manifest, config.to_dict())
    for shard in shards(stage):
        checkpoint.load_shard(config.checkpoint_dir, manifest, shard)
    return History(list(manifest["losses"]), list(manifest.get("grad_norms", []))), int(manifest["step"]) + 1


def _finish(config: RunConfig, stage: PipelineStage | ChunkedDevice, history: History | None, first_step: int,
            device: torch.device, writers: dict[int, tuple[str, str]], layout: replicas.Layout,
            gathered: Any = None, aux_losses: list[float | None] | None = None) -> None:
    """Gather every rank's timeline to rank 0 and write the report and trace there and on each
    other node that asked (``writers``); a last barrier makes a failed write fail every rank.
    ``history`` is the reporting rank's (replica 0's last stage), None elsewhere."""
    payload: dict[str, Any] = {
        "timeline": stage.recorder.timeline.to_dict(),
        "peak_activation_bytes": stage.counter.peak_bytes,
        "peak_allocated_bytes": device_api(device).peak_allocated_bytes(device),
        "history": asdict(history) if history is not None else None,
        "replica": layout.replica, "stage": layout.stage, "tp": layout.tp_rank,
        "optimizer_state_bytes": replicas.optimizer_state_bytes(stage),
        "gradient_sum": replicas.gradient_sum_route(stage),
        "aux_losses": aux_losses,
    }
    if layout.expert_parallel > 1:  # the bytes the simulator predicts: n/E experts (executor.parallel.expert_parallel)
        from executor.parallel.expert_parallel import memory_bytes as expert_bytes

        payload["sharded"] = expert_bytes(shards(stage))
    if gathered is not None:  # ZeRO-2/3: the bytes the simulator predicts (executor.parallel.fully_sharded)
        from executor.parallel.fully_sharded import memory_bytes

        payload["sharded"] = memory_bytes(shards(stage), gathered)
        payload["gradient_sum"] = f"reduce-scatter ({dist.get_backend(layout.dp_group)})"
    gathered: list[Any] = [None] * config.world_size if dist.get_rank() == 0 else []
    dist.gather_object(payload, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() == 0:
        report = _report(config, gathered, first_step, device)
        nodes.write_outputs(report, config.report, config.trace)
        nodes.send_outputs(report, writers)
    elif dist.get_rank() in writers:
        report = nodes.receive_outputs(writers[dist.get_rank()])
    if dist.get_rank() == 0 or dist.get_rank() in writers:
        # with no step after the warm-up the report times every step (executor.runtime.report): say so
        timed_warmup = config.steps <= first_step + config.warmup_steps
        print(f"gpipe: trained {config.steps} step{'s' if config.steps != 1 else ''}, median step "
              f"{report['step_time_s'] * 1e3:.2f} ms"
              + (f" (warm-up included: --steps {first_step + config.warmup_steps + 1} or more leaves it out)"
                 if timed_warmup else ""), flush=True)
    dist.barrier()


def _report(config: RunConfig, gathered: list[Any], first_step: int, device: torch.device) -> dict[str, Any]:
    timeline = merge(Timeline.from_dict(p["timeline"]) for p in gathered)  # a row per rank
    gathered = [p for p in gathered if p["tp"] == 0]  # a stage's figures: its tensor-parallel rank 0's
    gathered = sorted(gathered, key=lambda p: (p["replica"], p["stage"]))  # replica 0's stages first
    timeline.meta.update({"model": config.model, "partition": list(config.partition),
                          "microbatches": config.layout.microbatches, "schedule": config.layout.schedule,
                          "checkpoint": config.layout.checkpoint, "device": device.type})
    plan = config.plan(model_ref(config.model, config.options, config.seed)).to_dict()
    allocated = [p["peak_allocated_bytes"] for p in gathered]
    allocated = allocated if any(a is not None for a in allocated) else None
    last = next(p["history"] for p in gathered if p["history"] is not None)
    aux_losses = gathered[0]["aux_losses"]  # every rank's are the whole model's (_global_aux_loss)
    report = build_report(timeline, last["losses"], config.to_dict(), plan,
                          [p["peak_activation_bytes"] for p in gathered], allocated, first_step, last["grad_norms"],
                          [p["optimizer_state_bytes"] for p in gathered], [p["gradient_sum"] for p in gathered],
                          [p.get("sharded") for p in gathered])
    if aux_losses is not None:  # a model with routers: their load-balancing loss per step, coefficient included
        report["aux_losses"] = aux_losses
    return report


def _global_aux_loss(weighted: float, layout: replicas.Layout) -> float:
    """The step's auxiliary loss of the whole model from this rank's ``weighted`` tally (already times
    its replica's share of the global batch): summed over every stage and replica, one tensor-parallel
    rank per stage (its T ranks route the same tokens). Collective over every rank."""
    total = torch.tensor(weighted if layout.tp_rank == 0 else 0.0, dtype=torch.float64,
                         device=backend_device(dist.get_backend()))
    dist.all_reduce(total)
    return float(total)


def _watchdog() -> failures.Watchdog | None:
    """This worker's watchdog on torchrun's store (none outside torchrun)."""
    if "MASTER_ADDR" not in os.environ:
        return None
    endpoint = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return failures.Watchdog(endpoint, _env_int("RANK", 0), _env_int("GROUP_RANK", 0),
                             _env_int("TORCHELASTIC_RESTART_COUNT", 0)).start()


def _fail(watchdog: failures.Watchdog | None, message: str, exc: BaseException | None = None) -> None:
    """Record this rank's failure here and in the store; after a lost peer, first give the peer's
    own error time to arrive (the watchdog then ends this process with it)."""
    kind = failures.RAISED
    if exc is not None and failures.is_peer_loss(exc) and watchdog is not None:
        time.sleep(failures.PEER_LOSS_GRACE_S)
        kind = failures.PEER
    if watchdog is not None:
        watchdog.stop()  # from here on this rank's own error is the one it records
    record = failures.FailureRecord(_env_int("GROUP_RANK", 0), _env_int("RANK", 0), message, kind)
    failures.record_locally(record)
    if watchdog is not None:
        try:
            watchdog.post(record)
        except Exception:  # the store is gone; this node's gpipe train still reports the error
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m executor.launch.worker CONFIG.json (started by gpipe train)", file=sys.stderr)
        return 2
    rank = os.environ.get("RANK", "0")
    watchdog = _watchdog()
    try:
        train(RunConfig.load(argv[0]))
    except GpipeInputError as exc:
        print(f"gpipe: error: {exc}", file=sys.stderr, flush=True)
        _fail(watchdog, str(exc))
        return 2
    except Exception as exc:
        traceback.print_exc()
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        print(f"gpipe: error: rank {rank} failed: {message}", file=sys.stderr, flush=True)
        _fail(watchdog, message, exc)
        return 1
    if watchdog is not None:
        watchdog.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
