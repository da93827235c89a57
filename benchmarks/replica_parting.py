"""How far two data-parallel replicas part in a step, run after run, beside each core's own speed.

Why: the simulator starts a data-parallel all-reduce later by the expected slowest of D replicas,
from the step-to-step deviations calibration measures between the two stages of its K = 2 runs
(:mod:`sim.engine.stragglers`). Held out, the D = 2, K = 1 run's replicas waited 0.5-1.1 ms a step for
each other in the validations of one VM, 7.4 ms in one of another, against an allowance of
2.5-4.9 ms. This script measures how much of that is the moment: it trains the calibration's
transformer (4 blocks, d_model 128, batch 32, SGD, ``--checkpoint except_last``, M = 3) with
``--stages 1 --replicas 2`` several times and takes, for each run, each replica's compute (F, R and
B seconds) per step and replica 1's share of the all-reduce span beyond replica 0's (the time the
faster one waits); and it times a 512 x 512 matrix multiply on one thread pinned to each core
(``taskset``), both at once, before and after the runs, for each core's speed at those moments.

    .venv/bin/python benchmarks/replica_parting.py [--runs 4] [out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from sim.formats.timeline import write_json_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--model", "transformer", "--layers", "4", "--d-model", "128", "--ff", "512", "--heads", "4",
         "--seq", "32", "--vocab", "256", "--batch", "32", "--optimizer", "sgd", "--checkpoint", "except_last"]
CORE_PROBE = """
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 512)
for _ in range(20):
    a @ b
start, count = time.perf_counter(), 0
while time.perf_counter() - start < 3.0:
    a @ b
    count += 1
print(count / (time.perf_counter() - start))
"""


def core_speeds() -> list[float] | None:
    """Matrix multiplies per second on each core, all cores at once; None without ``taskset``."""
    if shutil.which("taskset") is None:
        return None
    cores = os.cpu_count() or 1
    probes = [subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", CORE_PROBE],
                               stdout=subprocess.PIPE, text=True) for core in range(cores)]
    return [float(probe.communicate()[0]) for probe in probes]


def one_run(directory: str, steps: int) -> dict[str, object]:
    """One ``gpipe train`` of the two replicas; each replica's compute and all-reduce span per step."""
    path = os.path.join(directory, "report.json")
    command = [sys.executable, "-m", "gpipe.main", "train", *MODEL, "--stages", "1", "--replicas", "2",
               "--microbatches", "3", "--steps", str(steps), "--report", path, "--quiet"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(path) as handle:
        report = json.load(handle)
    measured = set(report["measured_steps"])
    compute = {0: {}, 1: {}}  # replica -> step -> seconds
    allreduce = {0: {}, 1: {}}
    for record in report["timeline"]["records"]:
        if record["step"] not in measured:
            continue
        replica, seconds = record.get("replica", 0), record["end_s"] - record["start_s"]
        if record["kind"] in ("F", "R", "B"):
            compute[replica][record["step"]] = compute[replica].get(record["step"], 0.0) + seconds
        elif record["kind"] == "allreduce_dp":
            allreduce[replica][record["step"]] = allreduce[replica].get(record["step"], 0.0) + seconds
    steps_seen = sorted(measured)
    apart = [compute[0][s] - compute[1][s] for s in steps_seen]
    return {"step_ms": report["step_time_s"] * 1e3,
            "compute_ms": [statistics.median(compute[r][s] for s in steps_seen) * 1e3 for r in (0, 1)],
            "allreduce_span_ms": [statistics.median(allreduce[r][s] for s in steps_seen) * 1e3 for r in (0, 1)],
            "replica_0_minus_1_ms": statistics.median(apart) * 1e3,
            "wait_of_the_faster_ms": statistics.median(abs(a) for a in apart) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.path.join(ROOT, "benchmarks", "results", "replica_parting.json"))
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    before = core_speeds()
    runs = []
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.runs):
            run = one_run(directory, args.steps)
            runs.append(run)
            print(f"step {run['step_ms']:.1f} ms; compute per step, replica 0 / 1: {run['compute_ms'][0]:.1f} / "
                  f"{run['compute_ms'][1]:.1f} ms; all-reduce span {run['allreduce_span_ms'][0]:.1f} / "
                  f"{run['allreduce_span_ms'][1]:.1f} ms; replicas apart {run['wait_of_the_faster_ms']:.1f} ms")
    after = core_speeds()
    print(f"matrix multiplies per second on each core, all at once: before {before}, after {after}")
    result = {"command": "gpipe train " + " ".join(MODEL) + f" --stages 1 --replicas 2 --microbatches 3 "
                         f"--steps {args.steps}", "cores": os.cpu_count(), "runs": runs,
              "core_speeds_before": before, "core_speeds_after": after}
    write_json_atomic(args.out, result)
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
