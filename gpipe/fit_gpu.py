"""``gpipe fit-gpu FILE [--out EFFICIENCIES]``: fit GPU kernel fractions on a development set.

The fitted file is written where ``--out`` says (``gpu_efficiency.json`` in the current directory by
default), never into the installed package. The simulator reads the package's own fitted file,
``sim/catalog/gpu_efficiency.json``, unless the environment variable ``GPIPE_GPU_EFFICIENCY`` names
another (:func:`sim.catalog.kernel_model.efficiency_file`): ``GPIPE_GPU_EFFICIENCY=gpu_efficiency.json
gpipe simulate ...`` prices the fitted devices at the fractions just fitted. To change the catalog
itself, copy the file over the package's in a checkout and commit it with the runs it was fitted on.
"""

from __future__ import annotations

import argparse
import json
import sys

from gpipe.options import add_json_argument, add_out_argument, add_runs_file_argument, check_output_path
from gpipe.replay import resolve_run_model
from sim.catalog.kernel_model import EFFICIENCY_ENV
from sim.formats.timeline import write_json_atomic

DEFAULT_OUT = "gpu_efficiency.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_runs_file_argument(parser)
    add_out_argument(parser, f"efficiency file to write (default {DEFAULT_OUT}, in the current directory); the "
                             f"simulator reads it in place of the package's with {EFFICIENCY_ENV}=FILE in the "
                             "environment", default=DEFAULT_OUT)
    add_json_argument(parser, "print the fitted fractions and the development rows as one JSON object")


def run(args: argparse.Namespace) -> int:
    from calibrate.fit.gpu_fit import fit

    check_output_path(args.out, "--out")
    result = fit(args.file, resolve_run_model)  # the runs priced as gpipe replay prices them
    write_json_atomic(args.out, result)
    if args.json:
        json.dump({**result, "written_to": args.out}, sys.stdout)
        print()
        return 0
    for name, kernels in result["devices"].items():
        print(f"{name}: matmul {kernels['matmul']:.3f}, attention {kernels['attention']:.3f}, memory "
              f"{kernels['memory']:.3f}, collective {kernels['collective']:.3f}, optimizer "
              f"{kernels['optimizer']:.3f}, launch {kernels['matmul_launch_s'] * 1e6:.1f} us per matmul")
    print(f"{'development row':<40} {'measured':>10} {'predicted':>10} {'error':>8}")
    for row in result["development_rows"]:
        print(f"{row['id']:<40} {row['measured_s']:>10.4f} {row['predicted_s']:>10.4f} {row['error']:>+8.1%}")
    print(f"written to {args.out}; {EFFICIENCY_ENV}={args.out} makes the simulator read it")
    return 0
