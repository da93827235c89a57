"""Wall time of a short ``gpipe train``, from the command's start to its first step and to its exit.

A short run is mostly start-up: the launcher's imports and checks, starting the ranks (each
importing torch and the executor, when each is a new interpreter), their process groups, and the
interpreters' exits. This script runs the real command, ``gpipe train --model mlp --stages K
--steps 1``, for K in 1, 2 and 4, several times each in turns (so that the machine's drift falls on
every K alike), and records for each run the seconds until the first step's line is printed, until
the command exits, and the CPU seconds of the command and everything under it. Run it from two
checkouts (``--label`` names each) in turns to compare two launchers on the same machine.

    .venv/bin/python benchmarks/launch_time.py [--repeats 5] [--label NAME] [out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = (1, 2, 4)


def one_run(stages: int) -> dict[str, float]:
    """One ``gpipe train`` of one step: seconds to its first step line, to its exit, and CPU seconds."""
    command = [sys.executable, "-m", "gpipe.main", "train", "--model", "mlp", "--stages", str(stages), "--steps", "1"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step_s = None
    for line in process.stdout:  # type: ignore[union-attr]
        if first_step_s is None and line.startswith("gpipe: step 0 "):
            first_step_s = time.perf_counter() - started
    code = process.wait()
    exit_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0 or first_step_s is None:
        raise RuntimeError(f"{' '.join(command)} failed with exit code {code}")
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"first_step_s": first_step_s, "exit_s": exit_s, "cpu_s": cpu_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.path.join(ROOT, "benchmarks", "results", "launch_time.json"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    runs: dict[int, list[dict[str, float]]] = {k: [] for k in STAGES}
    for _ in range(args.repeats):
        for stages in STAGES:
            runs[stages].append(one_run(stages))
    medians = {str(k): {key: statistics.median(r[key] for r in runs[k]) for key in runs[k][0]} for k in STAGES}
    result = {"label": args.label, "root": ROOT, "cores": os.cpu_count(), "repeats": args.repeats,
              "command": "gpipe train --model mlp --stages K --steps 1", "median": medians,
              "runs": {str(k): v for k, v in runs.items()}}
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    for k in STAGES:
        m = medians[str(k)]
        print(f"{args.label or ROOT} K={k}: first step {m['first_step_s']:.2f} s, exit {m['exit_s']:.2f} s, "
              f"CPU {m['cpu_s']:.2f} s (median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
