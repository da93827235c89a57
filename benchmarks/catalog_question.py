"""The days-and-dollars question, answered over the catalog on one core, timed.

"llama3-70b for 15T tokens, at most 1024 accelerators: which hardware and layout is cheapest, and
which is fastest?" One ``gpipe plan`` command over several systems (pinned to one core with
``taskset`` where the machine has it), at each system's on-demand list price from the catalog; then
the same question with a deadline (``--max-days``), whose cheapest answer is one a team can use.
Writes benchmarks/results/catalog_question.json with each command's wall time, the fastest and the
cheapest plans and the top of the ranking.

    .venv/bin/python benchmarks/catalog_question.py [--hardware a,b,c] [--max-days 180]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

from sim.formats.timeline import write_json_atomic

RESULTS = os.path.join(os.path.dirname(__file__), "results", "catalog_question.json")
HARDWARE = "a100-nvlink,h100-nvlink,h200-nvlink,b200-nvlink,mi300x,mi325x"  # the priced 8-GPU systems
COMMAND = ["plan", "--model", "llama3-70b", "--train-tokens", "15T", "--max-devices", "1024", "--batch", "1024",
           "--precision", "bf16-model", "--dp-overlap", "--top", "5", "--quiet", "--json"]


def row(option: dict) -> dict:
    training = option["training"]
    return {"hardware": option["hardware"], "T": option["tensor_parallel"], "D": option["replicas"],
            "K": option["pipeline_stages"], "V": option["virtual_stages"], "M": option["microbatches"],
            "checkpoint": option["checkpoint"], "schedule": option["schedule"], "devices": training["devices"],
            "step_s": option["step_time_s"], "mfu": training["mfu"], "days": training["days"],
            "cost_usd": training["cost"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default=HARDWARE)
    parser.add_argument("--max-days", default="180")
    args = parser.parse_args()
    answers = [ask([*COMMAND, "--hardware", args.hardware]),
               ask([*COMMAND, "--hardware", args.hardware, "--max-days", args.max_days])]
    write_json_atomic(RESULTS, {"questions": answers,
                                "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                            "processor": platform.processor() or platform.machine()}})
    return 0


def ask(command: list[str]) -> dict:
    """One command, timed on one core, and what it answered."""
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    started = time.perf_counter()
    proc = subprocess.run([*pin, sys.executable, "-m", "gpipe.main", *command], capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(proc.stderr)
    report = json.loads(proc.stdout)
    result = {"command": "gpipe " + " ".join(command), "one_core": bool(pin), "wall_s": wall_s,
              "candidates": report["candidates"], "simulated": report["simulated"],
              "fastest": row(report["fastest"]), "cheapest": row(report["cheapest"]),
              "ranked": [row(o) for o in report["ranked"]],
              # each system's entry with its best plan as a row (not its devices' figures, megabytes of them)
              "hardware": {name: {**entry, "best": row(entry["best"]) if entry.get("best") else None}
                           for name, entry in report["hardware"].items()},
              "limits": report["limits"]}
    print(result["command"])
    for label in ("fastest", "cheapest"):
        r = result[label]
        print(f"{label}: {r['hardware']} T={r['T']} D={r['D']} K={r['K']} V={r['V']} M={r['M']} {r['checkpoint']} "
              f"{r['schedule']}, {r['devices']} devices, MFU {r['mfu']:.1%}, {r['days']:.1f} days, "
              f"${r['cost_usd']:,.0f}")
    print(f"{report['candidates']} candidates over {len(report['hardware'])} systems, {report['simulated']} simulated, "
          f"{wall_s:.1f} s for the whole command")
    return result


if __name__ == "__main__":
    sys.exit(main())
