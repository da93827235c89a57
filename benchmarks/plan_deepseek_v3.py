"""How long ``gpipe plan --model deepseek-v3 --hardware h100-nvlink --nodes 256`` takes (issue 51's goal:
under 60 s on one core).

The command as a user types it, on one core (pinned with ``taskset`` where the machine has it): every T,
K, D, E and ETP (the divisors of the 256 routed experts dividing T x D, ETP 1 and T), V, M, checkpoint
policy, schedule, placement and ZeRO (auto) by default, at the default batch; then at a batch of 4,096
sequences (16.8M tokens), where the best plan splits the experts. Writes
benchmarks/results/plan_deepseek_v3.json with the wall time of the whole command, the search's own time,
the command's CPU time and the best plan.

    .venv/bin/python benchmarks/plan_deepseek_v3.py
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time

from sim.formats.timeline import write_json_atomic

RESULTS = os.path.join(os.path.dirname(__file__), "results", "plan_deepseek_v3.json")
COMMAND = ["plan", "--model", "deepseek-v3", "--hardware", "h100-nvlink", "--nodes", "256", "--quiet", "--json"]


def run(top: int, pin: list[str], extra: tuple[str, ...] = ()) -> dict:
    """One timed command: ``--top`` plans ranked (each of them simulated in full), with ``extra`` flags."""
    command = [*COMMAND, *extra, "--top", str(top)]
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([*pin, sys.executable, "-m", "gpipe.main", *command], capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)  # the core's own time
    if proc.returncode:
        raise SystemExit(proc.stderr)
    report = json.loads(proc.stdout)
    best = report["ranked"][0]
    row = {"command": "gpipe " + " ".join(command), "top": top, "wall_s": wall_s, "cpu_s": cpu_s,
           "search_s": report["elapsed_s"],
           "candidates": report["candidates"], "simulated": report["simulated"],
           "parameter_count": report["parameter_count"],
           "best": {k: best.get(k, 1 if k == "expert_parallel" else None)
                    for k in ("tensor_parallel", "replicas", "expert_parallel", "expert_tensor_parallel",
                              "pipeline_stages", "virtual_stages", "microbatches", "checkpoint", "schedule", "zero",
                              "step_time_s")}}
    b = row["best"]
    print(f"--top {top}: {report['candidates']} candidates, {report['simulated']} simulated: search "
          f"{report['elapsed_s']:.1f} s, whole command {wall_s:.1f} s ({cpu_s:.1f} s of CPU); "
          f"best T={b['tensor_parallel']} "
          f"D={b['replicas']} E={b['expert_parallel']} K={b['pipeline_stages']} V={b['virtual_stages']} M={b['microbatches']} "
          f"{b['checkpoint']} {b['schedule']} ZeRO-{b['zero']}: {b['step_time_s']:.1f} s per step")
    return row


def main() -> int:
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    rows = [run(top, pin) for top in (1, 10)]
    rows.append(run(10, pin, ("--batch", "4096")))  # a batch at which expert parallelism wins
    write_json_atomic(RESULTS, {"one_core": bool(pin), "runs": rows,
                                "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                            "processor": platform.processor() or platform.machine()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
