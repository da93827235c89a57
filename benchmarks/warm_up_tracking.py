"""Whether the after-wait probe tracks a pipeline stage's busy time from one round to the next.

Why: a one-layer stage that waits before nearly every backward (the embedding stage of [1,5] under
1F1B) has a third to nearly half of its predicted busy time in the warm-up after long waits
(:mod:`sim.engine.host`), and the loss a wait costs moves 3-4x within minutes on this machine. ``gpipe
validate`` scales each stage's predicted warm-up to the after-wait probe taken around its run
(:mod:`calibrate.noise.after_wait_probe`). This script checks that the probe carries the information:
it runs three held-out-like configurations of the calibration's transformer (``[1,5]`` 1F1B at M=6
and M=16, ``[3,3]`` 1F1B at M=6) in interleaved rounds through the same launcher calibration uses
(:func:`calibrate.measure.runs.run_configs`, every rank probing speed and after-wait loss just before and
after each run), and fits, per stage, its raw busy seconds per step over the rounds two ways: as a
multiple of the speed factor alone (``busy = c v``, what the reference speed assumes) and as
compute that follows the speed plus a warm-up that follows the probe (``busy = c v + w f``). Where
the probe tracks the stage, the second leaves less unexplained and its ``w`` comes near the
simulator's predicted warm-up per step for the stage.

Limits: the fits are least squares over a dozen rounds of one stretch of minutes; ``v`` and ``f``
move together on this machine (both fall when the machine is fast), so ``c`` and ``w`` trade off and
each is known only roughly.

    .venv/bin/python benchmarks/warm_up_tracking.py COSTS.json [--rounds 12] [out.json]

COSTS.json: a full ``gpipe calibrate`` of the transformer of ``benchmarks/calibration_accuracy.sh``
(it gives the reference speed, the reference after-wait loss and the predictions).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from calibrate.noise.after_wait_probe import run_after_wait_probes, warm_up_factor  # noqa: E402
from calibrate.fit.design import RunSpec, run_config  # noqa: E402
from calibrate.fit.step_fit import predict  # noqa: E402
from calibrate.measure.runs import run_configs  # noqa: E402
from calibrate.noise.speed import run_probes, speed_factor  # noqa: E402
from sim.errors import GpipeInputError  # noqa: E402
from sim.formats.timeline import write_json_atomic  # noqa: E402

SPECS = [RunSpec.of((1, 5), 6, "except_last", "1f1b", 32), RunSpec.of((1, 5), 16, "never", "1f1b", 32),
         RunSpec.of((3, 3), 6, "never", "1f1b", 32)]
STEPS = 10


def fits(speeds: list[float], factors: list[float], busy_s: list[float]) -> dict[str, float]:
    """``busy = c v`` and ``busy = c v + w f`` by least squares, with their residuals' spread over
    the mean busy time (and the busy time's own spread, for scale)."""
    v, f, b = np.array(speeds), np.array(factors), np.array(busy_s)
    (c_alone,), *_ = np.linalg.lstsq(v[:, None], b, rcond=None)
    (c, w), *_ = np.linalg.lstsq(np.stack([v, f], 1), b, rcond=None)
    mean = float(b.mean())
    return {"spread": float(b.std() / mean), "speed_alone_c_s": float(c_alone),
            "speed_alone_residual": float((b - c_alone * v).std() / mean),
            "with_probe_c_s": float(c), "with_probe_w_s": float(w),
            "with_probe_residual": float((b - c * v - w * f).std() / mean),
            "correlation_busy_speed": float(np.corrcoef(b, v)[0, 1]),
            "correlation_busy_probe": float(np.corrcoef(b, f)[0, 1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("costs")
    parser.add_argument("out", nargs="?", default=os.path.join(ROOT, "benchmarks", "results", "warm_up_tracking.json"))
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    if args.rounds < 3:
        raise GpipeInputError(f"--rounds {args.rounds} leaves nothing to fit two terms to; give 3 or more")
    with open(args.costs) as handle:
        data = json.load(handle)
    references = data.get("speed", {})
    if "2" not in references.get("after_wait_reference_s", {}):
        raise GpipeInputError(f"{args.costs} has no after-wait reference for two processes; calibrate again "
                              "with gpipe calibrate (K up to 2 or more)")
    model = data["model"]
    configs = [run_config(model["name"], model["options"], spec, STEPS) for spec in SPECS]
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    reports = run_configs(configs * args.rounds)
    speed_reference, loss_reference = references["reference_s"]["2"], references["after_wait_reference_s"]["2"]
    rows = []
    for i, spec in enumerate(SPECS):
        predicted = sorted((s for s in predict(data, spec).stages if s.replica == 0), key=lambda s: s.stage)
        rounds = reports[i::len(SPECS)]
        speeds = [speed_factor(run_probes(r), speed_reference) for r in rounds]
        factors = [warm_up_factor(run_after_wait_probes(r), loss_reference) for r in rounds]
        for stage, expected in enumerate(predicted):
            busy = [r["stages"][stage]["busy_s"] for r in rounds]
            rows.append({"run": spec.label(), "stage": stage, "predicted_busy_s": expected.busy_s,
                         "predicted_warm_up_s": expected.host.warm_up_s if expected.host else 0.0, "speeds": speeds, "factors": factors,
                         "busy_s": busy, **fits(speeds, factors, busy)})
    result = {"costs": os.path.basename(args.costs), "started": started, "rounds": args.rounds, "steps": STEPS,
              "cores": os.cpu_count(), "after_wait_reference_s": loss_reference, "rows": rows}
    write_json_atomic(args.out, result)
    print(f"{'run':<34} {'stage':>5} {'pred ms':>8} {'warm ms':>8} {'spread':>7} {'v alone':>8} "
          f"{'c ms':>7} {'w ms':>7} {'v + f':>7} {'r(busy,f)':>9}")
    for row in rows:
        print(f"{row['run']:<34} {row['stage']:>5} {row['predicted_busy_s'] * 1e3:>8.2f} "
              f"{row['predicted_warm_up_s'] * 1e3:>8.2f} {row['spread'] * 100:>6.1f}% "
              f"{row['speed_alone_residual'] * 100:>7.1f}% {row['with_probe_c_s'] * 1e3:>7.2f} "
              f"{row['with_probe_w_s'] * 1e3:>7.2f} {row['with_probe_residual'] * 100:>6.1f}% "
              f"{row['correlation_busy_probe']:>9.2f}")
    print(f"probe factors over the rounds: {min(min(r['factors']) for r in rows):.2f}-"
          f"{max(max(r['factors']) for r in rows):.2f}; results written to {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GpipeInputError as error:
        sys.exit(f"warm_up_tracking.py: {error}")
