"""How steady this machine's speed is: one fixed single-thread matrix multiply, timed without pause.

Any step-time prediction is judged against measurements, and a measurement can be no steadier than
the machine. This times a 512 x 512 fp32 matrix multiply on one thread back to back for a while,
then asks, for windows of 0.5, 2 and 10 seconds: how far does a window's median stray from the
whole run's median, and how far from the window just before it? The first is the drift a
calibration taken minutes earlier suffers; the second is what a speed probe taken next to a
measurement can still miss. Writes benchmarks/results/machine_noise.json.

    .venv/bin/python benchmarks/machine_noise.py [seconds, default 120]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from sim.formats.timeline import write_json_atomic

RESULTS = os.path.join(os.path.dirname(__file__), "results", "machine_noise.json")
WINDOWS_S = (0.5, 2.0, 10.0)


def _percent(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 100 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str]) -> int:
    duration_s = float(argv[0]) if argv else 120.0
    shortest_s = 2 * max(WINDOWS_S)  # two of the longest windows, so there is a previous one
    if not duration_s >= shortest_s:
        print(f"machine_noise: error: {duration_s:g} s is too short to compare {max(WINDOWS_S):g}-second "
              f"windows; give {shortest_s:g} seconds or more", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(20):
        a @ b
    samples: list[tuple[float, float]] = []  # (time since start, seconds per multiply)
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < duration_s:
        a @ b
        samples.append((now - start, time.perf_counter() - now))
    overall = statistics.median(s for _, s in samples)
    result = {"duration_s": duration_s, "multiplies": len(samples), "median_s": overall, "windows": {}}
    for window in WINDOWS_S:
        medians = []
        for index in range(int(duration_s // window)):
            inside = [s for t, s in samples if index * window <= t < (index + 1) * window]
            if inside:
                medians.append(statistics.median(inside))
        drift = [abs(m / overall - 1) for m in medians]
        step = [abs(later / earlier - 1) for earlier, later in zip(medians, medians[1:])]
        entry = {"windows": len(medians), "drift_median_pct": _percent(drift, 0.5),
                 "drift_p90_pct": _percent(drift, 0.9), "neighbour_median_pct": _percent(step, 0.5),
                 "neighbour_p90_pct": _percent(step, 0.9)}
        result["windows"][str(window)] = entry
        print(f"{window:>5.1f} s windows ({len(medians)}): off the overall median by {entry['drift_median_pct']:.1f}% "
              f"(median), {entry['drift_p90_pct']:.1f}% (p90); off the previous window by "
              f"{entry['neighbour_median_pct']:.1f}% (median), {entry['neighbour_p90_pct']:.1f}% (p90)")
    write_json_atomic(RESULTS, result)
    print(f"results written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
