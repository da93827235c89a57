"""``gpipe validate --costs FILE [FILE ...]``: predict held-out runs, measure them, print and write the errors."""

from __future__ import annotations

import argparse
import json
import sys

from calibrate.fit.design import check_timed_steps
from gpipe.options import (add_costs_argument, add_json_argument, add_out_argument, add_rounds_argument,
                           add_steps_argument, check_output_path)
from sim.errors import GpipeInputError, require_positive


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_costs_argument(parser, several=True)
    add_steps_argument(parser, 5, "steps per run, the first a warm-up")
    add_rounds_argument(parser, 3, "measure each run this many times, interleaved, and take the median")
    parser.add_argument("--limit", type=int, default=None, help="run only the first N held-out configurations")
    add_out_argument(parser, "write the results JSON here")
    add_json_argument(parser, "print the results as one JSON object")
    parser.add_argument("--verbose", action="store_true",
                        help="add this machine's noise to the table: each run's round spread and interval, the "
                             "calibration's halves, the spread across calibrations and the after-wait probes")


def run(args: argparse.Namespace) -> int:
    from sim.formats.costs import read_costs
    from calibrate.measure.machine import machine_stamp, same_machine
    from calibrate.validate.held_out import validate
    from calibrate.validate.table import format_table

    check_output_path(args.out, "--out")
    check_timed_steps(args.steps)
    require_positive("--rounds", args.rounds, "use --rounds 1 or more")
    if args.limit is not None:
        require_positive("--limit", args.limit, "use --limit 1 or more")
    from calibrate.noise.across_calibrations import check_same_calibration

    if len(set(args.costs)) != len(args.costs):
        raise GpipeInputError(f"--costs names a file twice ({' '.join(args.costs)}); give each calibration once")
    everything = [read_costs(path) for path in args.costs]
    data = everything[0]
    device = data.get("machine", {}).get("device", "cpu")
    for path, each in zip(args.costs, everything):
        if not same_machine(each.get("machine", {}), machine_stamp(device)):
            raise GpipeInputError(f"costs file {path!r} was measured on another machine or library version; "
                                  "run gpipe calibrate here first")
        check_same_calibration(data, each, path)
    from sim.views.progress import note

    result = validate(data, args.steps, args.limit, note, args.rounds, everything[1:])
    if args.out:
        from sim.formats.timeline import write_json_atomic

        write_json_atomic(args.out, result)
    if args.json:
        json.dump(result, sys.stdout)
        print()
    else:
        print(format_table(result, verbose=args.verbose))
        if args.out:
            print(f"results written to {args.out}")
    return 0
