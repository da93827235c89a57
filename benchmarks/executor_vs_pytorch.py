"""Benchmark: the gpipe executor against torch.distributed.pipelining and unpipelined training.

For each configuration (model, D replicas, K stages, V virtual stages, M, schedule), in one run on
this machine:
  * executor: ``gpipe train`` (torchrun, one process per stage and replica, checkpoint ``never`` to
    match PyTorch's schedules, which do not re-materialize); step time = median after warm-up, from
    its report;
  * pytorch: ``torch.distributed.pipelining`` PipelineStage + ScheduleGPipe / Schedule1F1B /
    ScheduleInterleaved1F1B (V stages per rank) on the same model, partition, batch, M, threads per
    process and optimizer, each stage module wrapped in DistributedDataParallel over the
    data-parallel dimension of a DeviceMesh ("dp", "pp") when D > 1 (the pipelining stages hold its
    gradient synchronisation back until the last micro-batch), launched the same way (this file
    re-runs itself under torchrun); step time = median of the same steps, measured on rank 0 around
    ``schedule.step`` + ``optimizer.step`` after a barrier. With torch 2.13, DDP under ScheduleGPipe
    fails an internal assertion when it rebuilds its buckets unless built with ``static_graph=True``,
    and under Schedule1F1B ``static_graph=True`` leaves the last stage's replicas unsynchronised, so
    the static graph is used with GPipe alone; every run ends by checking that the replicas hold
    identical weights;
  * ZeRO-2/3: ``gpipe train --zero`` against the same PipelineStage and schedule on stage modules
    given FSDP2's ``fully_shard`` per layer with parameters and on the stage's root over the mesh's
    "dp" dimension (reshard after forward with ZeRO-3 on one stage only), no DDP;
  * zero bubble: ``zbv`` and ``dualpipev`` against ScheduleZBVZeroBubble and ScheduleDualPipeV, both
    with the V placement (chunks d and 2K-1-d on rank d) and the backward split into I and W;
  * single: the whole model trained in one process with all cores, one batch per step;
  * ideal: the executor's own per-micro-batch compute cost (F + B durations from its report) spread
    over K devices with the K*M/(M+K-1) speed-up of a balanced pipeline; ``bound``: per step, the
    schedule's critical path with that step's measured compute durations and free hand-offs, plus
    the optimizer step (:mod:`benchmarks.critical_path`). ``overhead`` is the median over steps of
    the part of each step outside its bound (sends, receives, Python, the chores between steps),
    with where the measured critical path spent it. Given for one pipeline (D = T = 1; V chunks per
    device allowed).

Usage: ``python benchmarks/executor_vs_pytorch.py [--configs pipeline|scale_out|tensor|zero_bubble|fsdp|all] [--steps 20]
[--out benchmarks/results/...json]``. On a machine with fewer cores than D x K processes the run is
oversubscribed, and the ratio says how the two cope with that, not how they scale.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import critical_path  # noqa: E402

CONFIGS = [
    {"model": "mlp", "options": {"layers": 8, "width": 1024}, "stages": 2, "batch": 64, "microbatches": 4},
    {"model": "mlp", "options": {"layers": 8, "width": 1024}, "stages": 2, "batch": 64, "microbatches": 8},
    {"model": "transformer", "options": {"layers": 4, "d_model": 128, "ff": 512, "seq": 64},
     "stages": 2, "batch": 16, "microbatches": 4},
]
# data-parallel replicas and the interleaved schedule (D x K processes; V chunks per process)
SCALE_OUT_CONFIGS = [
    {"model": "mlp", "options": {"layers": 8, "width": 1024}, "replicas": 2, "stages": 1, "batch": 64,
     "microbatches": 4, "schedules": ["gpipe"]},
    {"model": "mlp", "options": {"layers": 8, "width": 1024}, "stages": 2, "virtual_stages": 2, "batch": 64,
     "microbatches": 4, "schedules": ["interleaved"]},
    {"model": "transformer", "options": {"layers": 4, "d_model": 128, "ff": 512, "seq": 64},
     "stages": 2, "virtual_stages": 2, "batch": 16, "microbatches": 4, "schedules": ["interleaved"]},
    {"model": "mlp", "options": {"layers": 8, "width": 1024}, "replicas": 2, "stages": 2, "batch": 64,
     "microbatches": 4, "schedules": ["1f1b"]},
]
# tensor parallelism inside each stage (D x K x T processes), against torch's pipelining composed with
# DTensor tensor parallelism on the same (dp, pp, tp) mesh and the same layer plan
TENSOR_CONFIGS = [
    {"model": "transformer", "options": {"layers": 4, "d_model": 128, "ff": 512, "seq": 64},
     "stages": 2, "tensor_parallel": 2, "batch": 16, "microbatches": 4, "schedules": ["gpipe", "1f1b"]},
]
# two chunks per process in a V, the backward split into I and W: against torch's ScheduleZBVZeroBubble
# and ScheduleDualPipeV on the same V placement (chunks d and 2K-1-d on rank d)
ZERO_BUBBLE_CONFIGS = [
    {"model": "mlp", "options": {"layers": 8, "width": 1024}, "stages": 2, "virtual_stages": 2, "batch": 64,
     "microbatches": 8, "schedules": ["zbv", "dualpipev"]},
    # embedding + block, block, block, block + head: each rank two blocks (an even split would give rank 0
    # one block and both light layers, rank 1 three blocks)
    {"model": "transformer", "options": {"layers": 4, "d_model": 128, "ff": 512, "seq": 64},
     "stages": 2, "virtual_stages": 2, "batch": 16, "microbatches": 8, "partition": [2, 1, 1, 2],
     "schedules": ["zbv", "dualpipev"]},
]
# ZeRO-2/3 (FSDP2 per layer and on each stage's root over the replicas) against torch's PipelineStage and
# schedules on stage modules to which fully_shard is applied the same way; ZeRO-3 reshards after forward
# only with one stage (torchtitan's policy under a pipeline)
FSDP_CONFIGS = [
    {"model": "mlp", "options": {"layers": 8, "width": 1024}, "replicas": 2, "stages": 1, "batch": 64,
     "microbatches": 4, "zero": 3, "schedules": ["gpipe"]},
    {"model": "mlp", "options": {"layers": 8, "width": 1024}, "replicas": 2, "stages": 2, "batch": 64,
     "microbatches": 4, "zero": 3, "schedules": ["1f1b"]},
]
CONFIG_SETS = {"pipeline": CONFIGS, "scale_out": SCALE_OUT_CONFIGS, "tensor": TENSOR_CONFIGS,
               "zero_bubble": ZERO_BUBBLE_CONFIGS, "fsdp": FSDP_CONFIGS,
               "all": CONFIGS + SCALE_OUT_CONFIGS + TENSOR_CONFIGS + ZERO_BUBBLE_CONFIGS + FSDP_CONFIGS}


def _shape(cfg: dict) -> tuple[int, int, int]:
    """(D, K, V) of a configuration."""
    return cfg.get("replicas", 1), cfg["stages"], cfg.get("virtual_stages", 1)


def _partition(cfg: dict, layers: int, even_partition) -> tuple[int, ...]:
    """The configuration's layers per (virtual) stage: its own, else an even split."""
    _, stages, virtual = _shape(cfg)
    return tuple(cfg["partition"]) if "partition" in cfg else even_partition(layers, stages * virtual)


def _processes(cfg: dict) -> int:
    """D x K x T ranks."""
    replicas, stages, _ = _shape(cfg)
    return replicas * stages * cfg.get("tensor_parallel", 1)


def _torchrun(nproc: int, argv: list[str], env: dict[str, str]) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *argv]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def _env(threads: int) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)


def run_executor(cfg: dict, schedule: str, steps: int, warmup: int, threads: int, transport: str = "auto") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        from gpipe.train import even_partition
        from executor.models.build import model_ref

        replicas, stages, virtual = _shape(cfg)
        layers = model_ref(cfg["model"], cfg["options"]).num_layers
        partition = ",".join(map(str, _partition(cfg, layers, even_partition)))  # as the PyTorch side splits
        argv = [sys.executable, "-m", "gpipe.main", "train", "--model", cfg["model"], "--partition", partition,
                "--batch", str(cfg["batch"]), "--microbatches", str(cfg["microbatches"]), "--schedule", schedule,
                "--checkpoint", "never", "--optimizer", "sgd", "--steps", str(steps), "--warmup-steps", str(warmup),
                "--threads", str(threads), "--transport", transport, "--report", report_path]
        if replicas > 1:
            argv += ["--replicas", str(replicas)]
        if virtual > 1:
            argv += ["--virtual-stages", str(virtual)]
        if cfg.get("tensor_parallel", 1) > 1:
            argv += ["--tensor-parallel", str(cfg["tensor_parallel"])]
        if cfg.get("zero"):
            argv += ["--zero", str(cfg["zero"])]
        for key, value in cfg["options"].items():
            argv += ["--option", f"{key}={value}"]
        result = subprocess.run(argv, cwd=ROOT, env=_env(threads), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(result.stderr[-3000:])
        with open(report_path) as handle:
            return json.load(handle)


def ideal(report: dict, stages: int) -> dict:
    """Compute-only figures from the executor's own per-action durations: the balanced pipeline's
    step (all compute spread evenly, K*M/(M+K-1) speed-up), and per step the schedule's critical path
    with the step's measured compute and free hand-offs, with where the measured step's critical
    path spent the rest (:mod:`benchmarks.critical_path`)."""
    per_stage = [0.0] * stages
    microbatches = 0
    for action in report["actions"]:
        per_stage[action["stage"]] += action["duration_s"]
        microbatches = max(microbatches, action["microbatch"] + 1)
    total = sum(per_stage)
    balanced_s = total / (stages * microbatches / (microbatches + stages - 1))
    analysis = critical_path.analyse(report, report["config"].get("warmup_steps", 1))
    median = analysis["median"]
    return {"compute_s": total, "ideal_balanced_s": balanced_s, "bottleneck_bound_s": median["compute_bound_s"],
            "overhead_fraction": median["overhead"],
            "critical_path_s": {key: median[key] for key in ("compute", "send", "handoff", "between_actions",
                                                             "between_steps", "optimizer_and_end")}}


def run_pytorch(cfg: dict, schedule: str, steps: int, warmup: int, threads: int,
                keep_freed_memory: bool = False) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(cfg, schedule=schedule, steps=steps, warmup=warmup, threads=threads,
                   out=os.path.join(tmp, "pt.json"), keep_freed_memory=keep_freed_memory)
        path = os.path.join(tmp, "job.json")
        with open(path, "w") as handle:
            json.dump(job, handle)
        _torchrun(_processes(cfg), [os.path.abspath(__file__), "--pytorch-worker", path], _env(threads))
        with open(job["out"]) as handle:
            return json.load(handle)["step_time_s"]


def pytorch_worker(path: str) -> None:
    """One rank of torch.distributed.pipelining (with DDP over the replicas, DTensor tensor
    parallelism inside each stage) on the same model and partition: rank (d*K + k)*T + t runs
    tensor-parallel rank t of pipeline rank k of replica d, as ``gpipe train`` places them."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
    from torch.nn.parallel import DistributedDataParallel

    from gpipe.train import even_partition
    from executor.runtime.data import batch_for_step
    from executor.models.build import build_model, default_loss, loss_function
    from executor.runtime.shapes import stage_module
    from sim.schedules.schedule import virtual_stages_of_device

    with open(path) as handle:
        job = json.load(handle)
    torch.set_num_threads(job["threads"])
    if job.get("keep_freed_memory"):  # the host allocator setting gpipe's ranks run with
        from executor.transport.host_allocator import keep_freed_memory

        keep_freed_memory()
    replicas, stages, virtual = _shape(job)
    parts = job.get("tensor_parallel", 1)
    dist.init_process_group("gloo")
    if parts > 1:
        mesh = init_device_mesh("cpu", (replicas, stages, parts), mesh_dim_names=("dp", "pp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (replicas, stages), mesh_dim_names=("dp", "pp"))
    replica, pipeline_rank = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    model = build_model(job["model"], job["options"], 0)
    partition = _partition(job, len(model), even_partition)
    loss_fn = loss_function(default_loss(job["model"]))
    pipeline_stages, modules = [], []
    indices = virtual_stages_of_device(pipeline_rank, stages, virtual, job["schedule"])  # a loop, or a V
    for index in indices:
        module = stage_module(model, partition, index)
        if parts > 1:  # the layer plan gpipe train uses, applied by torch's parallelize_module
            from executor.parallel.tensor_parallel import parallelize_stage

            parallelize_stage(module, mesh["tp"])
        if job.get("zero", 0) >= 2:  # FSDP2 on each layer with parameters, then on the stage's root
            from torch.distributed.fsdp import fully_shard

            reshard = job["zero"] == 3 and stages == 1
            for layer in module:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
            fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard)
        modules.append(module)
        if replicas > 1 and not job.get("zero", 0) >= 2:
            module = DistributedDataParallel(module, process_group=mesh["dp"].get_group(), static_graph=job["schedule"] == "gpipe")
        pipeline_stages.append(PipelineStage(module, index, stages * virtual, torch.device("cpu"),
                                             group=mesh["pp"].get_group()))
    multi = {"interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
    if job["schedule"] in multi:
        schedule = multi[job["schedule"]](pipeline_stages, job["microbatches"], loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if job["schedule"] == "gpipe" else Schedule1F1B
        schedule = cls(pipeline_stages[0], job["microbatches"], loss_fn=loss_fn)
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.01)
    first, last = 0 in indices, stages * virtual - 1 in indices
    times = []
    for step in range(job["steps"]):
        inputs, targets = batch_for_step(job["model"], job["options"], job["batch"], 0, step)
        inputs, targets = torch.chunk(inputs, replicas)[replica], torch.chunk(targets, replicas)[replica]
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        if first and last:
            schedule.step(inputs, target=targets, losses=[])
        elif first:
            schedule.step(inputs)
        elif last:
            schedule.step(target=targets, losses=[])
        else:
            schedule.step()
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if replicas > 1:  # replicas saw different rows: equal weights show the gradients were averaged
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for m in modules for p in m.parameters()]
        checksum = torch.stack([p.detach().double().sum() for p in whole])
        copies = [torch.empty_like(checksum) for _ in range(replicas)]
        dist.all_gather(copies, checksum, group=mesh["dp"].get_group())
        if not all(torch.allclose(c, checksum, rtol=1e-6, atol=1e-6) for c in copies):
            raise RuntimeError("PyTorch's replicas diverged: DDP did not synchronise the gradients")
    if dist.get_rank() == 0:
        with open(job["out"], "w") as handle:
            json.dump({"step_time_s": statistics.median(times[job["warmup"]:])}, handle)
    del schedule, pipeline_stages  # DDP's reducers before the process group they use
    dist.barrier()
    dist.destroy_process_group()


def run_single(cfg: dict, steps: int, warmup: int, threads: int) -> float:
    import torch

    from executor.runtime.data import batch_for_step
    from executor.models.build import build_model, default_loss, loss_function

    torch.set_num_threads(threads)
    model = build_model(cfg["model"], cfg["options"], 0)
    loss_fn = loss_function(default_loss(cfg["model"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for step in range(steps):
        inputs, targets = batch_for_step(cfg["model"], cfg["options"], cfg["batch"], 0, step)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--pytorch-worker":
        pytorch_worker(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", choices=sorted(CONFIG_SETS), default="all")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternate executor and PyTorch runs this many times; medians are reported")
    parser.add_argument("--pytorch-keep-freed-memory", action="store_true",
                        help="run PyTorch's workers with the host allocator setting gpipe's ranks use "
                             "(executor.transport.host_allocator), to see how much of the difference it explains")
    parser.add_argument("--transport", choices=("auto", "dist"), default="auto",
                        help="gpipe train's --transport (auto: shared memory between the ranks of this host)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "executor_vs_pytorch_all.json"))
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    rows = []
    for cfg in CONFIG_SETS[args.configs]:
        replicas, stages, virtual = _shape(cfg)
        parts, processes = cfg.get("tensor_parallel", 1), _processes(cfg)
        threads = max(1, cores // processes)
        single_s = run_single(cfg, args.steps, args.warmup, cores)
        for schedule in cfg.get("schedules", ("gpipe", "1f1b")):
            reports, pytorch_runs = [], []
            for _ in range(args.rounds):  # alternating, so both see the same drifts of a shared machine
                reports.append(run_executor(cfg, schedule, args.steps, args.warmup, threads, args.transport))
                pytorch_runs.append(run_pytorch(cfg, schedule, args.steps, args.warmup, threads,
                                                args.pytorch_keep_freed_memory))
            reports.sort(key=lambda r: r["step_time_s"])
            report = reports[len(reports) // 2]
            pytorch_s = statistics.median(pytorch_runs)
            step_s = report["step_time_s"]
            row = {"model": cfg["model"], "options": cfg["options"], "D": replicas, "K": stages, "V": virtual,
                   "T": parts, "zero": cfg.get("zero", 0), "M": cfg["microbatches"], "batch": cfg["batch"], "schedule": schedule,
                   "processes": processes, "oversubscribed": processes > cores,
                   "executor_step_s": step_s, "pytorch_step_s": pytorch_s, "single_process_step_s": single_s,
                   "speedup_vs_pytorch": pytorch_s / step_s,
                   "executor_rounds_s": [r["step_time_s"] for r in reports], "pytorch_rounds_s": pytorch_runs}
            bound_text = ""
            if replicas == parts == 1:
                bounds = ideal(report, stages)
                row.update(bounds)
                path = " ".join(f"{key} {value * 1e3:.2f}" for key, value in bounds["critical_path_s"].items())
                bound_text = (f"  ideal {bounds['ideal_balanced_s'] * 1e3:7.2f} ms  bound "
                              f"{bounds['bottleneck_bound_s'] * 1e3:7.2f} ms  overhead {row['overhead_fraction']:.1%}"
                              f"  (critical path ms: {path})")
            rows.append(row)
            print(f"{cfg['model']:12s} D={replicas} K={stages} V={virtual} T={parts} ZeRO={cfg.get('zero', 0)} "
                  f"M={cfg['microbatches']} {schedule:11s} "
                  f"executor {step_s * 1e3:7.2f} ms  pytorch {pytorch_s * 1e3:7.2f} ms  "
                  f"x{row['speedup_vs_pytorch']:.2f}  single {single_s * 1e3:7.2f} ms{bound_text}", flush=True)
    import torch

    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "cores": cores,
                          "torch": torch.__version__, "python": platform.python_version()},
              "command": "python benchmarks/executor_vs_pytorch.py " + " ".join(sys.argv[1:]),
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
              "pytorch_keep_freed_memory": args.pytorch_keep_freed_memory, "rows": rows}
    from sim.formats.timeline import write_json_atomic

    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
