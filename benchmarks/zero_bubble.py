"""Benchmark: ZB-H1 and ZB-V against 1F1B on this machine, measured and predicted side by side.

The costs file's model (the 4-block transformer of ``benchmarks/calibration_accuracy.sh``) with
K = 2 stages and M = 8 micro-batches, checkpoint ``never``, trained by the executor with each
schedule in alternating order inside the same launches (``calibrate.measure.runs``: one torchrun launch
runs the configurations one after the other, so all see the same drifts of a shared machine), and
predicted by the simulator from a calibration's costs file (``--costs``; a profile with I and W
timed apart prices the split backward as measured, an older one at half the backward of a layer
with weights for free). 1F1B and ZB-H1 split the six layers [3, 3]; ZB-V's four chunks are
[2, 1, 1, 2] (each process: two blocks and one light layer). Writes
``benchmarks/results/zero_bubble.json``.

    .venv/bin/python benchmarks/zero_bubble.py --costs COSTS [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from calibrate.fit.design import RunSpec, run_config  # noqa: E402
from calibrate.fit.step_fit import predict  # noqa: E402
from calibrate.measure.runs import run_configs  # noqa: E402
from sim.formats.timeline import write_json_atomic  # noqa: E402

COSTS = os.path.join(ROOT, "benchmarks", "results", "calibration_costs_cpu.json")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "zero_bubble.json")
SCHEDULES = ("1f1b", "zb-h1", "zbv")
PARTITIONS = {"1f1b": (3, 3), "zb-h1": (3, 3), "zbv": (2, 1, 1, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--costs", default=COSTS)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    with open(args.costs) as handle:
        costs = json.load(handle)
    name, options = costs["model"]["name"], costs["model"]["options"]  # the model the costs were measured on
    specs = {s: RunSpec.of(PARTITIONS[s], args.microbatches, "never", s, int(costs["batch_size"]),
                        virtual_stages=len(PARTITIONS[s]) // 2) for s in SCHEDULES}
    order = [specs[s] for s in SCHEDULES] * args.rounds  # alternating
    reports = run_configs([run_config(name, options, spec, args.steps) for spec in order])
    measured: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    bubbles: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    for spec, report in zip(order, reports):
        measured[spec.layout.schedule].append(report["step_time_s"])
        busy = [stage["busy_s"] for stage in report["stages"]]
        bubbles[spec.layout.schedule].append(1 - statistics.mean(busy) / report["step_time_s"])
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
    gains = {}
    for schedule in SCHEDULES[1:]:
        gains[schedule] = {"measured": rows["1f1b"]["measured_step_s"] / rows[schedule]["measured_step_s"],
                           "predicted": rows["1f1b"]["predicted_step_s"] / rows[schedule]["predicted_step_s"]}
        print(f"1f1b / {schedule}: measured {gains[schedule]['measured']:.3f}, "
              f"predicted {gains[schedule]['predicted']:.3f}")
    write_json_atomic(args.out, {"model": {"name": name, "options": options}, "stages": 2,
                                 "partitions": {s: list(p) for s, p in PARTITIONS.items()}, "costs": args.costs,
                                 "microbatches": args.microbatches, "checkpoint": "never", "steps": args.steps,
                                 "rounds": args.rounds, "rows": rows, "speedups_over_1f1b": gains,
                                 "command": "python benchmarks/zero_bubble.py " + " ".join(sys.argv[1:])})
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
