"""``gpipe replay FILE``: predict every published run of a runs file against its measured step time.

The table lists each run, then what the replay assumed: a line every modelled run shares once, any
other followed by the runs it holds for.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpipe.options import add_html_argument, add_json_argument, add_runs_file_argument, check_output_path
from gpipe.workload_flags import resolve_workload
from sim.evidence.replay import Replayed, load_runs, replay, summary
from sim.views.progress import phase
from sim.workloads.workload import Workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_runs_file_argument(parser)
    add_json_argument(parser, "print the runs, errors and summary as one JSON object")
    add_html_argument(parser, "write predicted against measured as HTML")


def run(args: argparse.Namespace) -> int:
    check_output_path(args.html, "--html")
    runs = load_runs(args.file)
    with phase("replaying runs", total=len(runs), unit="run") as bar:
        results = []
        for published in runs:
            results.append(replay(published, resolve_run_model))
            bar.update(1)
    report = summary(results)
    bands = [run_band(published) for published in runs]
    for entry, band in zip(report["runs"], bands):
        entry["error_band"] = band
    if args.json:
        json.dump(report, sys.stdout)
        print()
    else:
        print(format_table(results, report))
        for line in dict.fromkeys(f"error band: {b['text']}" for r, b in zip(results, bands) if r.modelled and b):
            print(line)
    if args.html:
        from sim.views.figures import replay_figure, write_html

        write_html(replay_figure(results), args.html)
        if not args.json:
            print(f"predicted against measured written to {args.html}")
    return 0


def run_band(published: dict[str, Any]) -> dict | None:
    """The error band a prediction of this run's device and regime is printed with
    (:mod:`sim.evidence.error_bands`); None off accelerators or where the hardware is not known."""
    from sim.catalog.hardware import get_system
    from sim.catalog.user_systems import catalog_name
    from sim.errors import GpipeInputError
    from sim.evidence.error_bands import band_field

    try:
        system = get_system(catalog_name(published["hardware"]))
    except (GpipeInputError, TypeError):
        return None
    from sim.workloads.moe.config import names_experts

    return band_field(system.name, system.device.name, str(published["precision"]),
                      int(published["pipeline_stages"] or 1),
                      experts=names_experts(str(published["model"]), published.get("options") or {}))


def resolve_run_model(model: str, options: dict[str, Any]) -> Workload:
    """A run's workload: a Hugging Face model planned by its config's shape, as the built-in
    transformer (which prices every precision, attention kernel, compilation and split a published
    run names); anything else as ``gpipe simulate`` resolves it."""
    return resolve_workload(model, options, by_shape=True)


def format_table(results: list[Replayed], report: dict) -> str:
    rows = [f"{'run':<28} {'measured s':>10} {'predicted s':>11} {'error':>8}  layout / why not modelled"]
    for r in results:
        if r.modelled:
            layout = r.layout
            experts = f" E={layout['expert_parallel']}" if layout.get("expert_parallel", 1) > 1 else ""
            shape = (f"T={layout['tensor_parallel']}{'s' if layout['sequence_parallel'] else ''} "
                     f"D={layout['replicas']}{experts} K={layout['pipeline_stages']} V={layout['virtual_stages']} "
                     f"M={layout['microbatches']}")
            rows.append(f"{r.id:<28} {r.measured_step_s:>10.3f} {r.predicted_step_s:>11.3f} {r.error:>+8.1%}  {shape}")
        else:
            rows.append(f"{r.id:<28} {r.measured_step_s:>10.3f} {'-':>11} {'-':>8}  not modelled: {r.reason}")
    modelled = sum(r.modelled for r in results)
    if report["median_abs_error"] is None:
        rows.append(f"{modelled} of {len(results)} runs modelled")
    else:
        rows.append(f"{modelled} of {len(results)} runs modelled: median |error| {report['median_abs_error']:.1%}, "
                    f"worst {report['worst_abs_error']:.1%}")
    rows += assumed_lines([r for r in results if r.modelled])
    return "\n".join(rows)


def assumed_lines(results: list[Replayed]) -> list[str]:
    """Each assumption once: alone where every run holds it, else with the runs that do."""
    holders: dict[str, list[str]] = {}
    for r in results:
        for line in dict.fromkeys(r.assumed):
            holders.setdefault(line, []).append(r.id)
    return [f"assumed: {line}" if len(ids) == len(results) else f"assumed: {line} ({', '.join(ids)})"
            for line, ids in sorted(holders.items())]
