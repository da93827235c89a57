"""Fits of the calibration's in-pipeline terms compared on one set of measurements.

Measures once what ``gpipe calibrate`` and ``gpipe validate`` measure (the profile, the design runs
in 6 rounds, the held-out runs in 15 rounds of 10 steps) for the demo's transformer, keeps every
report, then fits the costs five ways from the same design runs and validates each on the same
held-out runs, so the difference between the variants is the model's, not the machine's moment:

* ``affine, no gaps``: one scale and a per-action overhead per kind of action, fitted on every
  action alike (the fit before the gap and two-part terms), and no time between actions;
* ``affine``: the same, with the measured gap after each kind of action (:mod:`sim.engine.replica_run`);
* ``two-part, F R B``: the profile's fixed part and the part that grows with rows scaled apart,
  every design run weighing alike (:func:`calibrate.fit.least_squares.fit_action`), gaps; one line per kind of
  action of the schedule: every forward on one, a split backward's I and W at the whole backward's
  factor;
* ``two-part, every round``: the same, and lines of their own for a forward that keeps its graph
  and for I and W (from the design's zb-h1 run), fitted on every round's point of every action;
* ``two-part``: what ``gpipe calibrate`` fits: the same on one point per action of a design run,
  its median over the rounds (:meth:`calibrate.fit.observations.ActionPoints.typical`).

Usage::

    .venv/bin/python benchmarks/calibration_fit_variants.py --reports out/fit_variants_reports.json
        # measures (about 15 minutes on 2 cores) into that file, then compares
    .venv/bin/python benchmarks/calibration_fit_variants.py --reports FILE --no-measure
        # compares the variants on reports measured before

Writes ``benchmarks/results/calibration_fit_variants_cpu.json`` (per variant: the fitted terms, each
design run's step and busy error, the held-out summary and per-run errors, for ``two-part`` with
the errors the fits on the odd and on the even design rounds give, as ``gpipe validate`` shows them)
and prints the tables.
The reports file (about 30 MB) stays out of the repository. The tensor-parallel profile and runs are
left out (``--tensor-parallel 1``): the variants differ in the whole-stage fits only.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = "transformer"
OPTIONS = {"layers": 4, "d_model": 128, "ff": 512, "heads": 4, "seq": 32, "vocab": 256}
BATCH = 32
DESIGN_ROUNDS, HELD_OUT_ROUNDS, STEPS = 6, 15, 10
VARIANTS = ("affine, no gaps", "affine", "two-part, F R B", "two-part, every round", "two-part")


def measure(path: str) -> None:
    """Calibrate as ``gpipe calibrate`` does, keeping the design runs' reports, then run the held-out
    design; everything into ``path``."""
    import calibrate.measure.runs as runs
    from calibrate.fit.calibration import calibrate
    from calibrate.fit.design import calibration_design, run_config
    from calibrate.validate.held_out_design import validation_design
    from sim.formats.costs import MeasuredWorkload

    design_reports: list = []
    run_configs = runs.run_configs

    def keeping(configs, *args, **kwargs):
        reports = run_configs(configs, *args, **kwargs)
        design_reports[:] = reports
        return reports

    runs.run_configs = keeping  # calibrate() looks it up when it runs
    try:
        data = calibrate(MODEL, OPTIONS, BATCH, rounds=DESIGN_ROUNDS, progress=print, tensor_parallel=1)
    finally:
        runs.run_configs = run_configs
    model = data["model"]
    held_out = validation_design(int(model["num_layers"]), BATCH, 2, attention_core=MeasuredWorkload(data).has_attention_core)
    configs = [run_config(model["name"], model["options"], spec, STEPS, "cpu", data["optimizer"], "fp32")
               for spec in held_out]
    print(f"{time.strftime('%H:%M:%S')} {len(held_out)} held-out runs x {HELD_OUT_ROUNDS} rounds", flush=True)
    held_out_reports = run_configs(configs * HELD_OUT_ROUNDS)
    with open(path, "w") as handle:
        json.dump({"data": data, "design_reports": design_reports,
                   "design": [s.label() for s in calibration_design(int(model["num_layers"]), BATCH, 2, split_backward=True)],
                   "held_out": [s.label() for s in held_out],
                   "held_out_reports": held_out_reports}, handle)


def fitted(base: dict, variant: str, specs: list, reports: list, speeds: list) -> dict:
    """The costs ``base`` measured, with the pipeline terms fitted as ``variant`` does."""
    from calibrate.noise.after_wait_probe import report_warm_up_factor
    from calibrate.fit.observations import Observations, collect
    from calibrate.fit.pipeline_fit import fit_pipeline
    from calibrate.fit.step_fit import fit_step_overhead
    from calibrate.fit.least_squares import fit_affine
    from sim.formats.costs import MeasuredWorkload

    data = copy.deepcopy(base)
    data.pop("fit_halves", None)  # the halves of the measured calibration's fit are not this variant's
    observations = Observations()
    for spec, report, speed in zip(specs, reports, speeds):
        # each run's warm-up at its own after-wait probe, as gpipe calibrate fits it (1.0 without probes)
        collect(MeasuredWorkload(data, spec.stages), spec, report, observations, speed,
                report_warm_up_factor(report, data, spec.processes))
    if variant != "two-part":  # every round's point: an action without its identity is not pooled
        for points in observations.actions.values():
            points.actions = []
    threads = {int(k): entry["threads"] for k, entry in data["pipeline"].items()}
    data["pipeline"], _ = fit_pipeline(observations, threads)
    if variant.startswith("affine"):
        for (k, kind), points in observations.actions.items():
            data["pipeline"][str(k)]["actions"][kind] = fit_affine(
                points.profiled, points.measured, slope_bounds=(0.2, 5.0), intercept_bounds=(0.0, 1.0)).to_dict()
    if variant.startswith("affine") or variant.endswith("F R B"):
        for entry in data["pipeline"].values():
            entry["actions"] = {kind: line for kind, line in entry["actions"].items() if kind in "FRB"}
    if variant.endswith("no gaps"):
        for entry in data["pipeline"].values():
            entry["gap_after_s"] = {}
    fit_step_overhead(data, specs, reports, speeds=speeds)
    return data


def compare_variants(path: str) -> dict:
    from calibrate.fit.design import calibration_design
    from calibrate.fit.design_fit import fit_halves
    from calibrate.fit.step_fit import design_entry
    from calibrate.noise.speed import run_probes, speed_factor
    from calibrate.validate.comparison import compare
    from calibrate.validate.held_out_design import validation_design
    from calibrate.validate.summary import summarize
    from calibrate.validate.table import format_table
    from sim.formats.costs import MeasuredWorkload

    with open(path) as handle:
        measured = json.load(handle)
    base = measured["data"]
    # reports measured before the design's zb-h1 run have no label list and no such run; those measured
    # before its runs at the ends of the rows, or its --checkpoint full runs, have none of those
    layers = int(base["model"]["num_layers"])
    designs = [calibration_design(layers, BATCH, 2, split_backward="design" in measured, row_span=span,
                                  per_layer_recompute=full)
               for span in (True, False) for full in (True, False)]
    labels = measured.get("design", [s.label() for s in designs[-1]])
    design = next((d for d in designs if [s.label() for s in d] == labels), None)
    assert design is not None, "the reports are of another calibration design"
    specs = design * (len(measured["design_reports"]) // len(design))
    reports = measured["design_reports"]
    speeds = [speed_factor(run_probes(r), base["speed"]["reference_s"].get(str(s.processes))) for s, r in zip(specs, reports)]
    held_out = validation_design(int(base["model"]["num_layers"]), BATCH, 2,
                                 attention_core=MeasuredWorkload(base).has_attention_core)
    assert [s.label() for s in held_out] == measured["held_out"], "the reports are of another held-out design"
    rounds = measured["held_out_reports"]
    result = {"model": base["model"], "machine": base["machine"], "design_rounds": len(specs) // len(design),
              "held_out_rounds": len(rounds) // len(held_out), "steps": STEPS, "variants": {}}
    for variant in VARIANTS:
        data = fitted(base, variant, specs, reports, speeds)
        if variant == "two-part":  # as gpipe calibrate: the fits on the odd and the even rounds beside it
            threads = {int(k): entry["threads"] for k, entry in data["pipeline"].items()}
            data["fit_halves"] = fit_halves(data, len(design), specs, reports, speeds, threads)
        comparisons = [compare(data, spec, rounds[i::len(held_out)], 2) for i, spec in enumerate(held_out)]
        table = {"runs": [c.to_dict() for c in comparisons], "summary": summarize(comparisons)}
        designs = []
        for spec in design:
            chosen = [i for i, s in enumerate(specs) if s == spec]
            designs.append(design_entry(data, spec, [reports[i] for i in chosen], [speeds[i] for i in chosen]))
        result["variants"][variant] = {"pipeline": data["pipeline"], "design": designs, **table}
        print(f"===== {variant}")
        for entry in designs:
            busy = "/".join(f"{(p - m) / m * 100:+.1f}%" for p, m in zip(entry["predicted_busy_s"], entry["measured_busy_s"]))
            step = (entry["predicted_step_s"] - entry["measured_step_s"]) / entry["measured_step_s"] * 100
            print(f"  fitted on {entry['run']}: step {step:+.1f}%, busy per stage {busy}")
        print(format_table(table))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", default="out/fit_variants_reports.json", help="measured reports (JSON)")
    parser.add_argument("--no-measure", action="store_true", help="compare on reports measured before")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "calibration_fit_variants_cpu.json"))
    args = parser.parse_args()
    if not args.no_measure:
        os.makedirs(os.path.dirname(os.path.abspath(args.reports)), exist_ok=True)
        measure(args.reports)
    result = compare_variants(args.reports)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
