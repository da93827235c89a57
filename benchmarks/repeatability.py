"""How much the same executor run varies on this machine: the floor under any prediction error.

Runs one K=2 configuration of the calibration model several times inside each of several torchrun
launches (interleaved with a second configuration, as validation does) and prints the spread of the
median step times. Writes benchmarks/results/repeatability.json.

    .venv/bin/python benchmarks/repeatability.py
"""

from __future__ import annotations

import os
import statistics
import sys

from calibrate.fit.design import RunSpec, run_config
from calibrate.measure.runs import run_configs
from sim.formats.timeline import write_json_atomic

MODEL = ("transformer", {"layers": 4, "d_model": 128, "ff": 512, "heads": 4, "seq": 32, "vocab": 256})
RESULTS = os.path.join(os.path.dirname(__file__), "results", "repeatability.json")


def main() -> int:
    name, options = MODEL
    skewed = RunSpec.of((1, 5), 16, "never", "1f1b", 32)
    balanced = RunSpec.of((3, 3), 12, "except_last", "gpipe", 32)
    order = [skewed, balanced, skewed, balanced, skewed]
    times: dict[str, list[float]] = {skewed.label(): [], balanced.label(): []}
    for _ in range(3):
        reports = run_configs([run_config(name, options, spec, 8) for spec in order])
        for spec, report in zip(order, reports):
            times[spec.label()].append(report["step_time_s"])
    summary = {}
    for label, values in times.items():
        median = statistics.median(values)
        summary[label] = {"step_times_s": values, "median_s": median,
                          "min_over_median": min(values) / median, "max_over_median": max(values) / median}
        print(f"{label:<36} median {median * 1e3:7.1f} ms, range {min(values) * 1e3:6.1f}-{max(values) * 1e3:6.1f} ms "
              f"({(min(values) / median - 1) * 100:+.0f}% to {(max(values) / median - 1) * 100:+.0f}%) over {len(values)} runs")
    write_json_atomic(RESULTS, summary)
    print(f"results written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
