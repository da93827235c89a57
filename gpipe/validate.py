"""``gpipe validate --costs FILE [FILE ...]``: predict held-out runs, measure them, print and write the errors."""

from __future__ import annotations

import argparse
import json
import sys

from calibrate.fit.design import check_timed_steps
from gpipe.options import check_output_path
from sim.errors import GpipeInputError, require_positive


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--costs", required=True, metavar="FILE", nargs="+",
                        help="costs file from gpipe calibrate; more files (calibrations of the same model taken "
                             "at other moments) each predict the same measured runs: how far the moment of "
                             "calibration moves an error")
    parser.add_argument("--steps", type=int, default=5, help="steps per run, the first is warm-up (default 5)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure each run this many times, interleaved, and take the median (default 3)")
    parser.add_argument("--limit", type=int, default=None, help="run only the first N held-out configurations")
    parser.add_argument("--out", default=None, metavar="FILE", help="write the results JSON here")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
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
