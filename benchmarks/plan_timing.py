"""Timing one ``gpipe plan`` command on one core, as the planner benchmarks (``plan_405b.py``,
``plan_deepseek_v3.py``) run it: the command in a process of its own, pinned with ``taskset`` where the
machine has it, its wall time, the search's own time and the command's CPU time (what it costs a core of
its own where other jobs share the machine), and the best plan it ranked.
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
from typing import Any

from sim.formats.timeline import write_json_atomic

BEST_KEYS = ("tensor_parallel", "replicas", "pipeline_stages", "virtual_stages", "microbatches", "checkpoint",
             "schedule", "zero", "step_time_s")


def one_core() -> list[str]:
    """The prefix that pins a command to core 0 (none where ``taskset`` is missing)."""
    return ["taskset", "-c", "0"] if shutil.which("taskset") else []


def timed_plan(command: list[str], top: int, pin: list[str], best_defaults: dict[str, Any] | None = None) -> dict:
    """``gpipe`` ``command`` with ``--top`` plans ranked (each of them simulated in full), timed; the best
    plan's degrees are :data:`BEST_KEYS` and those of ``best_defaults`` (their value where the plan
    leaves them out), printed in one line."""
    command = [*command, "--top", str(top)]
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
    defaults = best_defaults or {}
    keys = [*BEST_KEYS[:2], *defaults, *BEST_KEYS[2:]]
    row = {"command": "gpipe " + " ".join(command), "top": top, "wall_s": wall_s, "cpu_s": cpu_s,
           "search_s": report["elapsed_s"],
           "candidates": report["candidates"], "simulated": report["simulated"],
           "parameter_count": report["parameter_count"],
           "best": {k: best.get(k, defaults[k]) if k in defaults else best[k] for k in keys}}
    b = row["best"]
    experts = f" E={b['expert_parallel']}" if "expert_parallel" in b else ""
    print(f"--top {top}: {report['candidates']} candidates, {report['simulated']} simulated: search "
          f"{report['elapsed_s']:.1f} s, whole command {wall_s:.1f} s ({cpu_s:.1f} s of CPU); "
          f"best T={b['tensor_parallel']} "
          f"D={b['replicas']}{experts} K={b['pipeline_stages']} V={b['virtual_stages']} M={b['microbatches']} "
          f"{b['checkpoint']} {b['schedule']} ZeRO-{b['zero']}: {b['step_time_s']:.1f} s per step")
    return row


def write_results(path: str, rows: list[dict], pin: list[str]) -> None:
    write_json_atomic(path, {"one_core": bool(pin), "runs": rows,
                             "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                         "processor": platform.processor() or platform.machine()}})
