"""How far apart calibrations taken at different moments put the same held-out run.

``gpipe validate`` shows two measures of noise beside each error: the run's own rounds (``interval``)
and the calibration's odd and even design rounds (``halves``). Both come from one calibration, whose
rounds are interleaved over a few minutes: neither sees how the machine differs from one stretch of
minutes to the next, which moves the whole fit. This compares the validation results of several
calibrations (``benchmarks/calibration_accuracy.sh``, one result file each): for every held-out run
its error at the reference speed in each, the range between them, and their median, the error a run
would have if the moment of calibration were averaged out. Oversubscribed runs are left out, as in
``gpipe validate``'s summary.

The same files hold the other side: each validation measured the same held-out runs again, at its
own moment. Where the executor did not change between them, how far a run's measured bubble (and a
stage's share of the step, busy time over step time, which the machine's speed at that moment
cancels from) moves from one validation to the next is the measurement's noise across moments,
which no single validation's rounds see; the last file's predictions are placed in that range,
and compared with the median over the validations (``moments`` in the output).

Usage::

    .venv/bin/python benchmarks/calibration_spread.py benchmarks/results/calibration_validation_cpu_A.json \\
        benchmarks/results/calibration_validation_cpu_B.json [...] --out benchmarks/results/calibration_spread.json

``goals`` in the output pools the moments against the goals (:mod:`calibrate.goals`): each error (a
stage's busy time, a run's step and bubble, at the reference speed; per validation the median over
the calibrations that judged it, where several did) over the validations, its mean and the 90%
Student-t interval of that mean, and the errors whose whole interval lies past the goal: a miss that
recurs at every moment by more than the moments' scatter allows, which no single validation's
noise can show, and the model's own.

Limits: with two calibrations the median is their mean; a run's range across N calibrations grows
with N; results files of different code mix its changes into the spread; the interval takes the
moments as independent draws, so a bias every validation shares (the same calibration design, the
same machine) sits in the mean, not in the interval.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from calibrate.goals import BUBBLE_GOAL_POINTS, BUSY_GOAL, STEP_GOAL, past  # noqa: E402

CONFIDENCE = 0.9


def spread(results: list[dict]) -> dict:
    """Per held-out run in every result: its step and worst busy error (at the reference speed) and
    bubble error in each, their range and median; and the summary over the runs."""
    runs: dict[str, list[dict]] = {}
    for result in results:
        for run in result["runs"]:
            if not run.get("oversubscribed") and not run.get("not_judged"):
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
                     "bubble_median": statistics.median(bubble), **moments(seen)})
    if not rows:
        raise SystemExit("no held-out run is in every results file; give validations of one model and design")
    ranges = [row["step_range"] for row in rows]
    medians = [abs(row["step_median"]) for row in rows]
    busy = [abs(row["worst_busy_median"]) for row in rows]
    bubble = [abs(row["bubble_median"]) for row in rows]
    summary = {"calibrations": len(results), "runs": len(rows), "moments": moments_summary(rows),
               "median_step_range": statistics.median(ranges), "worst_step_range": max(ranges),
               "median_of_calibrations": {"step_median": statistics.median(medians), "step_worst": max(medians),
                                          "worst_busy_median": statistics.median(busy), "worst_busy_worst": max(busy),
                                          "bubble_median_points": statistics.median(bubble),
                                          "bubble_worst_points": max(bubble)}}
    return {"runs": rows, "summary": summary}


def moments(seen: list[dict]) -> dict:
    """One run as each validation measured it: its bubble (points) and each stage's share of the step
    (busy over step, raw: the moment's speed cancels), with the last validation's predictions of both
    and how far outside the measured range each falls (0 inside; points for the bubble, relative to
    the range's nearer end for a share)."""
    last = seen[-1]
    measured_bubbles = [run["measured_bubble"] * 100 for run in seen]
    predicted_bubble = last["predicted_bubble"] * 100
    shares = [[run["measured_busy_s"][k] / run["measured_step_s"] for run in seen]
              for k in range(len(last["measured_busy_s"]))]
    predicted_shares = [busy / last["predicted_step_s"] for busy in last["predicted_busy_s"]]
    return {"measured_bubbles": measured_bubbles, "predicted_bubble": predicted_bubble,
            "bubble_outside_points": outside(predicted_bubble, measured_bubbles),
            "bubble_error_vs_median_points": predicted_bubble - statistics.median(measured_bubbles),
            "share_errors_vs_median": [p / statistics.median(values) - 1 for p, values in zip(predicted_shares, shares)],
            "measured_busy_shares": shares, "predicted_busy_shares": predicted_shares,
            "share_outside": [outside(p, values) / (min(values) if p < min(values) else max(values))
                              for p, values in zip(predicted_shares, shares)]}


def outside(value: float, measured: list[float]) -> float:
    """How far ``value`` lies beyond the range of ``measured``, signed (below: negative); 0 within it."""
    if value < min(measured):
        return value - min(measured)
    if value > max(measured):
        return value - max(measured)
    return 0.0


def moments_summary(rows: list[dict]) -> dict:
    """Over the runs: how far a run's measured bubble moves between validations, and where the last
    validation's predictions fall against the measurements of every moment."""
    ranges = [max(row["measured_bubbles"]) - min(row["measured_bubbles"]) for row in rows]
    bubble_misses = [row["bubble_outside_points"] for row in rows]
    share_misses = [(row["run"], k, miss) for row in rows for k, miss in enumerate(row["share_outside"])]
    worst_share = max(share_misses, key=lambda item: abs(item[2]))
    bubble_errors = [row["bubble_error_vs_median_points"] for row in rows]
    share_errors = [(row["run"], k, error) for row in rows for k, error in enumerate(row["share_errors_vs_median"])]
    worst_share_error = max(share_errors, key=lambda item: abs(item[2]))
    return {"median_measured_bubble_range_points": statistics.median(ranges),
            "bubble_error_vs_median_points": {"median": statistics.median(abs(e) for e in bubble_errors),
                                              "worst": max(bubble_errors, key=abs)},
            "share_error_vs_median": {"median": statistics.median(abs(e) for *_, e in share_errors),
                                      "worst": {"run": worst_share_error[0], "stage": worst_share_error[1],
                                                "relative": worst_share_error[2]}},
            "worst_measured_bubble_range_points": max(ranges),
            "bubbles_within_measured_range": sum(1 for miss in bubble_misses if miss == 0.0),
            "worst_bubble_outside_points": max(bubble_misses, key=abs),
            "stages": len(share_misses),
            "shares_within_measured_range": sum(1 for *_, miss in share_misses if miss == 0.0),
            "worst_share_outside": {"run": worst_share[0], "stage": worst_share[1], "relative": worst_share[2]}}


def judged(run: dict) -> dict:
    """A run's errors at the reference speed as its validation judged them: the median over its
    calibrations where several judged it, else the first calibration's."""
    median = run.get("calibrations", {}).get("median")
    if median:
        return {"busy": median["busy_errors_at_reference"], "step": median["step_error_at_reference"],
                "bubble": median["bubble_error_points"]}
    return {"busy": run["busy_errors_at_reference"], "step": run["step_error_at_reference"],
            "bubble": run["bubble_error_points"]}


def mean_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The mean of ``values`` and the two-sided Student-t interval of it (at least two values)."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    half = float(t.ppf(0.5 + confidence / 2, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def goals(results: list[dict]) -> dict:
    """Every error of the runs in every result (oversubscribed and unjudged runs left out) pooled over the
    validations against its goal: [run, what ("busy stage k", "step" or "bubble"), the values, their
    mean, the interval's ends], and those whose interval lies wholly past the goal."""
    runs: dict[str, list[dict]] = {}
    for result in results:
        for run in result["runs"]:
            if not run.get("oversubscribed") and not run.get("not_judged"):
                runs.setdefault(run["run"], []).append(judged(run))
    errors = []
    for label, seen in runs.items():
        if len(seen) != len(results):
            continue
        series = [(f"busy stage {k}", [each["busy"][k] for each in seen], BUSY_GOAL)
                  for k in range(len(seen[0]["busy"]))]
        series += [("step", [each["step"] for each in seen], STEP_GOAL),
                   ("bubble", [each["bubble"] for each in seen], BUBBLE_GOAL_POINTS)]
        for what, values, goal in series:
            mean, low, high = mean_interval(values)
            errors.append({"run": label, "error": what, "values": values, "mean": mean, "interval": [low, high],
                           "past_goal": past((low, high), goal)})
    return {"validations": len(results), "confidence": CONFIDENCE, "errors": errors,
            "past_goals": [[e["run"], e["error"], e["mean"], *e["interval"]] for e in errors if e["past_goal"]]}


def format_goals(table: dict) -> str:
    def shown(entry: dict) -> str:
        unit, scale = (" points", 1.0) if entry["error"] == "bubble" else ("%", 100.0)
        low, high = entry["interval"]
        return (f"{entry['run']} {entry['error']} {entry['mean'] * scale:+.1f}{unit} "
                f"({low * scale:+.1f}..{high * scale:+.1f})")

    past_ones = [e for e in table["errors"] if e["past_goal"]]
    near = sorted((e for e in table["errors"] if not e["past_goal"] and e["error"] != "bubble"),
                  key=lambda e: -abs(e["mean"]))[:5]
    return (f"pooled over {table['validations']} validations (each error's mean over them and its "
            f"{table['confidence'] * 100:.0f}% interval): {len(past_ones)} of {len(table['errors'])} errors past their "
            "goal beyond the moments' scatter" + "".join(f"; {shown(e)}" for e in past_ones)
            + "; the largest means: " + "; ".join(shown(e) for e in near))


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
    lines.append(f"{'run':40s} {'measured bubble over the validations (points)':>46s}  {'last pred':>9s} {'outside':>8s}")
    for row in table["runs"]:
        measured = row["measured_bubbles"]
        lines.append(f"{row['run'][:40]:40s} {min(measured):14.1f} .. {statistics.median(measured):5.1f} .. "
                     f"{max(measured):5.1f} (min, median, max) {row['predicted_bubble']:9.1f} "
                     f"{row['bubble_outside_points']:+8.1f}")
    o = s["moments"]
    worst = o["worst_share_outside"]
    lines.append(f"measured across {s['calibrations']} validations: a run's bubble moves by "
                 f"{o['median_measured_bubble_range_points']:.1f} points (median range), "
                 f"{o['worst_measured_bubble_range_points']:.1f} at worst; the last validation's predicted bubble "
                 f"lies within the measured range for {o['bubbles_within_measured_range']} of {s['runs']} runs, "
                 f"the farthest {o['worst_bubble_outside_points']:+.1f} points outside; its predicted share of the "
                 f"step within the measured range for {o['shares_within_measured_range']} of {o['stages']} stages, "
                 f"the farthest {worst['relative'] * 100:+.1f}% beyond it ({worst['run']} stage {worst['stage']})")
    bubble, share = o["bubble_error_vs_median_points"], o["share_error_vs_median"]
    lines.append(f"against the median over the validations' measurements (the moment of measuring averaged out): "
                 f"bubble error median {bubble['median']:.1f} points, worst {bubble['worst']:+.1f}; a stage's share "
                 f"of the step median {share['median'] * 100:.1f}%, worst {share['worst']['relative'] * 100:+.1f}% "
                 f"({share['worst']['run']} stage {share['worst']['stage']})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="gpipe validate result files (JSON), one per calibration")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "calibration_spread.json"))
    args = parser.parse_args()
    if len(args.results) < 2:
        parser.error("give two or more validation results to compare")
    missing = [path for path in args.results if not os.path.isfile(path)]
    if missing:
        parser.error(f"no such validation result: {missing[0]}; give files gpipe validate wrote")
    results = []
    for path in args.results:
        with open(path) as handle:
            results.append(json.load(handle))
    table = spread(results)
    table["goals"] = goals(results)
    names = [os.path.splitext(os.path.basename(path))[0] for path in args.results]
    print(format_spread(table, names))
    print(format_goals(table["goals"]))
    with open(args.out, "w") as handle:
        json.dump({"results": args.results, **table}, handle, indent=1)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
