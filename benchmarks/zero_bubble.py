"""Benchmark: ZB-H1 against 1F1B on this machine, measured and predicted side by side.

The calibration model (the 4-block transformer of ``benchmarks/calibration_accuracy.sh``) with
K = 2 stages and M = 8 micro-batches, checkpoint ``never``, trained by the executor with each
schedule in alternating order inside the same launches (``calibrate.runs``: one torchrun launch
runs the configurations one after the other, so both see the same drifts of a shared machine), and
predicted by the simulator from the calibration's costs file
(``benchmarks/results/calibration_costs_cpu.json``; W priced as half the backward of a layer with
weights, :func:`sim.stage_costs.layer_weight_grad_s`). Writes ``benchmarks/results/zero_bubble.json``.

    .venv/bin/python benchmarks/zero_bubble.py [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from calibrate.calibration import RunSpec, predict, run_config  # noqa: E402
from calibrate.runs import run_configs  # noqa: E402
from sim.timeline import write_json_atomic  # noqa: E402

MODEL = ("transformer", {"layers": 4, "d_model": 128, "ff": 512, "heads": 4, "seq": 32, "vocab": 256})
COSTS = os.path.join(ROOT, "benchmarks", "results", "calibration_costs_cpu.json")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "zero_bubble.json")
SCHEDULES = ("1f1b", "zb-h1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    with open(COSTS) as handle:
        costs = json.load(handle)
    name, options = MODEL
    specs = {s: RunSpec((3, 3), args.microbatches, "never", s, int(costs["batch_size"])) for s in SCHEDULES}
    order = [specs[s] for s in SCHEDULES] * args.rounds  # alternating
    reports = run_configs([run_config(name, options, spec, args.steps) for spec in order])
    measured: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    bubbles: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    for spec, report in zip(order, reports):
        measured[spec.schedule].append(report["step_time_s"])
        busy = [stage["busy_s"] for stage in report["stages"]]
        bubbles[spec.schedule].append(1 - statistics.mean(busy) / report["step_time_s"])
    rows = {}
    for schedule in SCHEDULES:
        predicted = predict(costs, specs[schedule])
        rows[schedule] = {"measured_step_s": statistics.median(measured[schedule]),
                          "measured_rounds_s": measured[schedule],
                          "measured_bubble": statistics.median(bubbles[schedule]),
                          "predicted_step_s": predicted.step_time_s, "predicted_bubble": predicted.bubble_fraction}
        print(f"{schedule:6s} measured {rows[schedule]['measured_step_s'] * 1e3:7.2f} ms (bubble "
              f"{rows[schedule]['measured_bubble']:.1%})  predicted {predicted.step_time_s * 1e3:7.2f} ms "
              f"(bubble {predicted.bubble_fraction:.1%})")
    measured_gain = rows["1f1b"]["measured_step_s"] / rows["zb-h1"]["measured_step_s"]
    predicted_gain = rows["1f1b"]["predicted_step_s"] / rows["zb-h1"]["predicted_step_s"]
    print(f"1f1b / zb-h1: measured {measured_gain:.3f}, predicted {predicted_gain:.3f}")
    write_json_atomic(RESULTS, {"model": {"name": name, "options": options}, "stages": 2,
                                "microbatches": args.microbatches, "checkpoint": "never", "steps": args.steps,
                                "rounds": args.rounds, "rows": rows, "measured_speedup": measured_gain,
                                "predicted_speedup": predicted_gain,
                                "command": "python benchmarks/zero_bubble.py " + " ".join(sys.argv[1:])})
    print(f"results written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
