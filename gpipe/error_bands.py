"""``gpipe error-bands FILE [FILE ...] [--out BANDS]``: the error bands every GPU prediction is printed with.

Replays every run of the runs files (``benchmarks/published_runs/validation.json`` and
``validation_moe.json``, never the development set the kernel fractions were fitted on) and writes,
per device and regime, the spread of the errors, a device's mixtures of experts apart
(:mod:`sim.evidence.error_bands`). The file is written where ``--out`` says
(``error_bands.json`` in the current directory by default); to change the bands the commands print,
copy it over the package's ``sim/evidence/error_bands.json`` in a
checkout and commit it with the runs it was built from.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpipe.options import add_json_argument, add_out_argument, check_output_path
from gpipe.replay import resolve_run_model
from sim.catalog.hardware import get_system
from sim.catalog.user_systems import catalog_name
from sim.errors import GpipeInputError
from sim.evidence.error_bands import BANDS_FILE, build_bands, device_key, regime_key
from sim.evidence.replay import load_runs, replay
from sim.formats.timeline import write_json_atomic
from sim.workloads.moe.config import names_experts
from sim.views.progress import phase


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="validation runs files, e.g. benchmarks/published_runs/validation.json "
                             "benchmarks/published_runs/validation_moe.json")
    add_out_argument(parser, f"bands file to write (default {BANDS_FILE}, in the current directory)",
                     default=BANDS_FILE)
    add_json_argument(parser, "print the bands as one JSON object")


def bands_of(paths: list[str]) -> dict[str, Any]:
    """The bands file's content for the runs of ``paths``; a development file is refused."""
    for path in paths:
        if _is_development_set(path):
            raise GpipeInputError(f"{path!r} is a development set (it has layer_times): error bands come from the "
                                  "validation set, never from the rows the kernel fractions were fitted on")
    runs = [run for path in paths for run in load_runs(path)]
    rows, used = [], []
    with phase("replaying runs", total=len(runs), unit="run") as bar:
        for run in runs:
            result = replay(run, resolve_run_model)
            if result.modelled and result.error is not None:
                device = get_system(catalog_name(run["hardware"])).device.name
                experts = names_experts(str(run["model"]), run.get("options") or {})
                rows.append((device_key(device, experts), regime_key(run["precision"], run["pipeline_stages"]),
                             result.error))
                used.append(run["id"])
            bar.update(1)
    return {**build_bands(rows, " ".join(paths)), "runs": used}


def _is_development_set(path: str) -> bool:
    with open(path) as handle:
        data = json.load(handle)
    return "layer_times" in data


def run(args: argparse.Namespace) -> int:
    check_output_path(args.out, "--out")
    result = bands_of(args.files)
    write_json_atomic(args.out, result)
    if args.json:
        json.dump({**result, "written_to": args.out}, sys.stdout)
        print()
        return 0
    print(f"{'device':<41} {'regime':<16} {'5th pct':>8} {'95th pct':>9} {'runs':>5}")
    for device, entry in result["devices"].items():
        for regime, cell in [("all", entry["all"]), *entry["regimes"].items()]:
            print(f"{device:<41} {regime:<16} {cell['low']:>+8.1%} {cell['high']:>+9.1%} {cell['count']:>5}")
    print(f"written to {args.out}; from {len(result['runs'])} modelled runs of {' '.join(args.files)}")
    return 0
