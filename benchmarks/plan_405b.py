"""How long ``gpipe plan`` takes for a 405B-parameter Llama-shaped model on 256 nodes of 8 H100.

Every T (1, 2, 4, 8), K, D, V, M, checkpoint policy, schedule, placement and ZeRO stage (0-3, each
ranked by time), on one core (pinned
with ``taskset`` where the machine has it), for ``hf:llama`` with Llama 3.1 405B's shape (126
layers, hidden 16384, FFN 53248, 128 heads, 8 key/value heads, vocabulary 128256, 8192 tokens),
a global batch of 2048 sequences (16M tokens), Megatron's bf16 model and overlapped reduction.
Writes benchmarks/results/plan_405b.json with the wall time of the whole command, the search's
own time, the command's CPU time (what it costs a core of its own where other jobs share the machine)
and the best plan.

    .venv/bin/python benchmarks/plan_405b.py
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

RESULTS = os.path.join(os.path.dirname(__file__), "results", "plan_405b.json")
SHAPE = {"num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
         "num_key_value_heads": 8, "vocab_size": 128256, "seq": 8192}
COMMAND = ["plan", "--model", "hf:llama", *[f"--option={k}={v}" for k, v in SHAPE.items()],
           "--precision", "bf16-model", "--hardware", "h100-nvlink", "--nodes", "256", "--batch", "2048",
           "--tensor-parallel-options", "1,2,4,8", "--zero-options", "0,1,2,3", "--dp-overlap", "--quiet", "--json"]


def run(top: int, pin: list[str]) -> dict:
    """One timed command: ``--top`` plans ranked (each of them simulated in full)."""
    command = [*COMMAND, "--top", str(top)]
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
           "best": {k: best[k] for k in ("tensor_parallel", "replicas", "pipeline_stages", "virtual_stages",
                                         "microbatches", "checkpoint", "schedule", "zero", "step_time_s")}}
    b = row["best"]
    print(f"--top {top}: {report['candidates']} candidates, {report['simulated']} simulated: search "
          f"{report['elapsed_s']:.1f} s, whole command {wall_s:.1f} s ({cpu_s:.1f} s of CPU); "
          f"best T={b['tensor_parallel']} "
          f"D={b['replicas']} K={b['pipeline_stages']} V={b['virtual_stages']} M={b['microbatches']} "
          f"{b['checkpoint']} {b['schedule']} ZeRO-{b['zero']}: {b['step_time_s']:.1f} s per step")
    return row


def main() -> int:
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    rows = [run(top, pin) for top in (1, 10)]
    write_json_atomic(RESULTS, {"one_core": bool(pin), "runs": rows,
                                "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                            "processor": platform.processor() or platform.machine()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
