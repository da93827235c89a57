"""The user's loop, repeated: `make demo` in N fresh clones in a row, and what each stored and said.

Each round clones the repository at HEAD into a new temporary folder and runs `make demo` there
(set-up included, as a new user would). It records whether the calibration was refused, every
correction stored in the costs file against its bounds (calibrate/fit/design_checks.py), the fit's
quality, and the demo's verdict line: one step error, within the step goal or flagged.

    .venv/bin/python benchmarks/demo_loop.py --rounds 10 --out benchmarks/results/demo_loop_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from calibrate.fit.design_checks import out_of_bounds  # noqa: E402


def one_round(number: int) -> dict:
    folder = tempfile.mkdtemp(prefix="gpipe-demo-loop-")
    try:
        subprocess.run(["git", "clone", "--quiet", ROOT, folder], check=True)
        started = time.perf_counter()
        done = subprocess.run(["make", "demo"], cwd=folder, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        said = done.stdout + done.stderr
        verdicts = [line for line in said.splitlines()
                    if line.startswith(("Within the goal: ", "FLAGGED: ", "Not judged: "))]
        refused = [line for line in said.splitlines() if "calibration refused" in line]
        result = {"round": number, "exit": done.returncode, "seconds": round(seconds, 1),
                  "verdict": verdicts[0] if verdicts else None, "refused": refused[0] if refused else None}
        costs = os.path.join(folder, "out", "costs.json")
        if os.path.exists(costs):
            with open(costs) as handle:
                data = json.load(handle)
            corrections = [c for run in data["design"] for c in run.get("corrections", [])]
            result["corrections_out_of_bounds"] = sum(bool(out_of_bounds(c)) for c in corrections)
            result["speed_factors"] = [round(c["speed"], 3) for c in corrections]
            result["fit_quality"] = data.get("fit_quality")
        if done.returncode != 0 and not refused:
            result["tail"] = said.strip().splitlines()[-5:]
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "demo_loop_cpu.json"))
    args = parser.parse_args()
    rounds = []
    for number in range(1, args.rounds + 1):
        rounds.append(one_round(number))
        print(json.dumps(rounds[-1]), flush=True)
    summary = {
        "rounds": len(rounds),
        "reports_written": sum(r["exit"] == 0 for r in rounds),
        "refused": sum(r["refused"] is not None for r in rounds),
        "stored_out_of_bounds": sum(r.get("corrections_out_of_bounds", 0) for r in rounds),
        "within_goal": sum((r["verdict"] or "").startswith("Within the goal") for r in rounds),
        "flagged": sum((r["verdict"] or "").startswith("FLAGGED") for r in rounds),
        "other_failures": sum(r["exit"] != 0 and r["refused"] is None for r in rounds),
    }
    with open(args.out, "w") as handle:
        json.dump({"command": "benchmarks/demo_loop.py", "summary": summary, "rounds": rounds}, handle, indent=1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
