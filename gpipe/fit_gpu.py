"""``gpipe fit-gpu FILE --out EFFICIENCIES``: fit GPU kernel fractions on a development set."""

from __future__ import annotations

import argparse
import json

from gpipe.options import check_output_path
from gpipe.replay import resolve_run_model
from sim.catalog.kernel_model import EFFICIENCY_FILE
from sim.formats.timeline import write_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="development set: benchmarks/published_runs/dev.json")
    parser.add_argument("--out", default=EFFICIENCY_FILE, metavar="FILE",
                        help=f"efficiency file to write (default {EFFICIENCY_FILE}, which the simulator reads)")


def run(args: argparse.Namespace) -> int:
    from calibrate.fit.gpu_fit import fit

    check_output_path(args.out, "--out")
    result = fit(args.file, resolve_run_model)  # the runs priced as gpipe replay prices them
    text = json.dumps(result, indent=1) + "\n"

    def write(tmp: str) -> None:
        with open(tmp, "w") as handle:
            handle.write(text)

    write_atomic(args.out, write)
    for name, kernels in result["devices"].items():
        print(f"{name}: matmul {kernels['matmul']:.3f}, attention {kernels['attention']:.3f}, memory "
              f"{kernels['memory']:.3f}, collective {kernels['collective']:.3f}, optimizer "
              f"{kernels['optimizer']:.3f}, launch {kernels['matmul_launch_s'] * 1e6:.1f} us per matmul")
    print(f"{'development row':<40} {'measured':>10} {'predicted':>10} {'error':>8}")
    for row in result["development_rows"]:
        print(f"{row['id']:<40} {row['measured_s']:>10.4f} {row['predicted_s']:>10.4f} {row['error']:>+8.1%}")
    print(f"written to {args.out}")
    return 0
