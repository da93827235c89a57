"""How much longer an action takes when the action before it on its device was of another kind.

The simulator prices every forward (backward) of a stage alike wherever it falls in the step. In
the executor an action that follows one of its own kind finds its weights, activations and code in
the caches; one that follows another kind of work (the optimizer before the step's first forward, a
backward before a forward under 1F1B) does not. This script measures that within runs, so that the
machine's drift between runs cancels: it trains the demo's transformer (4 blocks, d_model 128,
batch 32, SGD) with ``gpipe train --report`` on a balanced and a skewed two-stage partition under
GPipe and 1F1B (M micro-batches, ``--checkpoint never``), several times each in turns, and for each
stage and kind of action takes the median duration over the measured steps of the actions that
follow one of their own kind (``warm``), follow another kind (``after_other``), or open the step
(``first``). The figures say how a cold start grows with the stage (the partition gives stages of
one, three and five layers); what the model should do with them is for the calibration to test on
held-out runs (docs/notes/2026-11-26-cold-starts.md: one constant per kind was tried and put one-layer stages of
held-out 1F1B runs 44-60% high).

    .venv/bin/python benchmarks/cold_starts.py [--repeats 2] [--microbatches 16] [out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from sim.formats.timeline import write_json_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--model", "transformer", "--layers", "4", "--d-model", "128", "--ff", "512", "--heads", "4",
         "--seq", "32", "--vocab", "256", "--batch", "32", "--optimizer", "sgd", "--checkpoint", "never"]
CONFIGURATIONS = [("1,5", "gpipe"), ("1,5", "1f1b"), ("3,3", "gpipe"), ("3,3", "1f1b")]


def train_report(partition: str, schedule: str, microbatches: int, directory: str) -> dict:
    """One ``gpipe train`` of 10 steps; its report."""
    path = os.path.join(directory, "report.json")
    command = [sys.executable, "-m", "gpipe.main", "train", *MODEL, "--partition", partition, "--schedule", schedule,
               "--microbatches", str(microbatches), "--steps", "10", "--report", path, "--quiet"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(path) as handle:
        return json.load(handle)


def durations_by_predecessor(report: dict) -> dict[tuple[int, str, str], list[float]]:
    """Per (stage, kind, what came before it: first / warm / after_other), the durations in seconds
    of the measured steps' forwards and backwards, replica 0."""
    measured = set(report["measured_steps"])
    by_device: dict[tuple[int, int], list[dict]] = {}
    for record in report["timeline"]["records"]:
        if record["step"] in measured and record["kind"] in ("F", "B") and not record.get("replica"):
            by_device.setdefault((record["stage"], record["step"]), []).append(record)
    groups: dict[tuple[int, str, str], list[float]] = {}
    for (stage, _step), records in by_device.items():
        records.sort(key=lambda r: r["start_s"])
        for i, record in enumerate(records):
            before = "first" if i == 0 else ("warm" if records[i - 1]["kind"] == record["kind"] else "after_other")
            groups.setdefault((stage, record["kind"], before), []).append(record["end_s"] - record["start_s"])
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.path.join(ROOT, "benchmarks", "results", "cold_starts.json"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=16)
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as directory:
        for repeat in range(args.repeats):
            for partition, schedule in CONFIGURATIONS:
                report = train_report(partition, schedule, args.microbatches, directory)
                groups = durations_by_predecessor(report)
                layers = [int(n) for n in partition.split(",")]
                rows = [{"stage": stage, "layers": layers[stage], "kind": kind, "before": before,
                         "actions": len(values), "median_us": statistics.median(values) * 1e6}
                        for (stage, kind, before), values in sorted(groups.items())]
                runs.append({"repeat": repeat, "partition": partition, "schedule": schedule,
                             "step_ms": report["step_time_s"] * 1e3, "rows": rows})
                print(f"[{partition}] {schedule:5s} step {report['step_time_s'] * 1e3:6.1f} ms  " + "  ".join(
                    f"s{r['stage']}({r['layers']}) {r['kind']} {r['before']} {r['median_us']:.0f}us x{r['actions']}"
                    for r in rows))
    result = {"command": "gpipe train " + " ".join(MODEL) + f" --microbatches {args.microbatches} --steps 10",
              "cores": os.cpu_count(), "repeats": args.repeats, "runs": runs}
    write_json_atomic(args.out, result)
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
