"""How far apart calibrations taken at different moments put the same held-out run.

``gpipe validate`` shows two measures of noise beside each error: the run's own rounds (``interval``)
and the calibration's odd and even design rounds (``halves``). Both come from one calibration, whose
rounds are interleaved over a few minutes: neither sees how the machine differs from one stretch of
minutes to the next, which moves the whole fit. This compares the validation results of several
calibrations (``benchmarks/calibration_accuracy.sh``, one result file each): for every held-out run
its error at the reference speed in each, the range between them, and their median, the error a run
would have if the moment of calibration were averaged out. Oversubscribed runs are left out, as in
``gpipe validate``'s summary.

Usage::

    .venv/bin/python benchmarks/calibration_spread.py benchmarks/results/calibration_validation_cpu_A.json \\
        benchmarks/results/calibration_validation_cpu_B.json [...] --out benchmarks/results/calibration_spread.json

Limits: with two calibrations the median is their mean; a run's range across N calibrations grows
with N; results files of different code mix its changes into the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def spread(results: list[dict]) -> dict:
    """Per held-out run in every result: its step and worst busy error (at the reference speed) and
    bubble error in each, their range and median; and the summary over the runs."""
    runs: dict[str, list[dict]] = {}
    for result in results:
        for run in result["runs"]:
            if not run.get("oversubscribed"):
                runs.setdefault(run["run"], []).append(run)
    rows = []
    for label, seen in runs.items():
        if len(seen) != len(results):
            continue  # a run not in every validation
        step = [run["step_error_at_reference"] for run in seen]
        busy = [max(run["busy_errors_at_reference"], key=abs) for run in seen]
        bubble = [run["bubble_error_points"] for run in seen]
        rows.append({"run": label, "step_errors": step, "step_range": max(step) - min(step),
                     "step_median": statistics.median(step), "worst_busy_errors": busy,
                     "worst_busy_median": statistics.median(busy), "bubble_error_points": bubble,
                     "bubble_median": statistics.median(bubble)})
    if not rows:
        raise SystemExit("no held-out run is in every results file; give validations of one model and design")
    ranges = [row["step_range"] for row in rows]
    medians = [abs(row["step_median"]) for row in rows]
    busy = [abs(row["worst_busy_median"]) for row in rows]
    bubble = [abs(row["bubble_median"]) for row in rows]
    summary = {"calibrations": len(results), "runs": len(rows),
               "median_step_range": statistics.median(ranges), "worst_step_range": max(ranges),
               "median_of_calibrations": {"step_median": statistics.median(medians), "step_worst": max(medians),
                                          "worst_busy_median": statistics.median(busy), "worst_busy_worst": max(busy),
                                          "bubble_median_points": statistics.median(bubble),
                                          "bubble_worst_points": max(bubble)}}
    return {"runs": rows, "summary": summary}


def format_spread(table: dict, names: list[str]) -> str:
    lines = [f"{'run':40s} " + " ".join(f"{name[-12:]:>12s}" for name in names) + "    range   median"]
    for row in table["runs"]:
        lines.append(f"{row['run'][:40]:40s} " + " ".join(f"{e * 100:+11.1f}%" for e in row["step_errors"])
                     + f" {row['step_range'] * 100:7.1f}  {row['step_median'] * 100:+6.1f}%")
    s = table["summary"]
    m = s["median_of_calibrations"]
    lines.append(f"step error at the reference speed across {s['calibrations']} calibrations: a run's range "
                 f"{s['median_step_range'] * 100:.1f} points (median), {s['worst_step_range'] * 100:.1f} at worst; "
                 f"the median over calibrations: median {m['step_median'] * 100:.1f}%, worst {m['step_worst'] * 100:.1f}%; "
                 f"a run's worst stage's busy error {m['worst_busy_median'] * 100:.1f}% / {m['worst_busy_worst'] * 100:.1f}%; "
                 f"bubble {m['bubble_median_points']:.1f} / {m['bubble_worst_points']:.1f} points")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="gpipe validate result files (JSON), one per calibration")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "calibration_spread.json"))
    args = parser.parse_args()
    if len(args.results) < 2:
        parser.error("give two or more validation results to compare")
    results = []
    for path in args.results:
        with open(path) as handle:
            results.append(json.load(handle))
    table = spread(results)
    names = [os.path.splitext(os.path.basename(path))[0] for path in args.results]
    print(format_spread(table, names))
    with open(args.out, "w") as handle:
        json.dump({"results": args.results, **table}, handle, indent=1)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
