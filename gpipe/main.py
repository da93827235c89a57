"""The ``gpipe`` command. Each subcommand is a module of this package, imported lazily.

Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int`` and must not
import torch at module level, so ``gpipe simulate`` and ``gpipe plan`` stay fast. Only this package
wires ``sim``, ``executor`` and ``calibrate`` together (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import signal
import sys
import threading

from sim.errors import GpipeInputError

# name -> (module, one-line help)
SUBCOMMANDS = {
    "simulate": ("gpipe.simulate", "predict one plan's timeline, bubble and memory"),
    "plan": ("gpipe.plan", "search for the fastest plan that fits memory"),
    "train": ("gpipe.train", "train a plan with the real pipeline executor (torchrun)"),
    "calibrate": ("gpipe.calibrate", "profile this machine and fit the simulator's costs"),
    "validate": ("gpipe.validate", "compare predictions with measured runs the fit never saw"),
    "paper": ("gpipe.paper", "replay the GPipe paper's Table 2 (Transformer-48 on TPUv3) in simulation"),
    "replay": ("gpipe.replay", "predict published GPU runs of a runs file against their measured step times"),
    "fit-gpu": ("gpipe.fit_gpu", "fit GPU kernel efficiencies on a development set of published runs"),
    "error-bands": ("gpipe.error_bands", "build the error bands GPU predictions print from a validation set"),
    "demo": ("gpipe.demo", "the main job: calibrate, plan, simulate, train and report"),
}


# One command per capability, shown by ``gpipe`` without arguments: what a newcomer would try first.
TOUR = """\
gpipe plans, simulates, trains and calibrates GPipe pipeline-parallel training.

A tour, one command each (all run on a CPU; add --help to any of them):
  gpipe demo                                      calibrate this machine, plan, simulate, train on Shakespeare, report
  gpipe simulate --model transformer --layers 8 --stages 4 --microbatches 8 --hardware a100-nvlink
                                                  predict one plan's timeline, bubble and memory
  gpipe plan --model llama3-8b --hardware h100-nvlink --nodes 2 --batch 256
                                                  search every layout for the fastest plan that fits
  gpipe train --model transformer --vocab 256 --stages 2 --data text --steps 20
                                                  train a pipeline for real (torchrun, one process per stage)
  gpipe calibrate --out costs.json && gpipe validate --costs costs.json
                                                  measure this machine, fit the simulator, check it on held-out runs
  gpipe paper                                     the GPipe paper's Table 2, replayed in simulation
  gpipe replay benchmarks/published_runs/validation.json
                                                  published GPU runs against the simulator's predictions
"""


def version() -> str:
    """The installed distribution's version; pyproject.toml's in a checkout that is not installed."""
    from importlib import metadata

    try:
        return metadata.version("gpipe")
    except metadata.PackageNotFoundError:
        return _pyproject_version()


def _pyproject_version() -> str:
    import re

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(path) as handle:
            found = re.search(r'^version\s*=\s*"([^"]+)"', handle.read(), re.MULTILINE)
    except OSError:
        found = None
    return found.group(1) if found else "unknown"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    # no abbreviations: a flag is the name written in full, so no prefix of another command's flag
    # (plan's --stages-options for simulate's --stages) stands in for it unseen
    parser = argparse.ArgumentParser(prog="gpipe", description="GPipe pipeline planning, simulation and training",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"gpipe {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        sub_parser.set_defaults(module=module_name)
        if name == wanted:  # only the chosen subcommand's module is imported
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name and module_name.startswith(exc.name):
                    continue
                raise
            module.add_arguments(sub_parser)
            from gpipe.options import add_quiet_argument

            add_quiet_argument(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # a flag's value is checked as it is parsed (gpipe.options.Checked): one line
        parser = build_parser(argv)
        if not argv:  # a newcomer's first try: what it does, then how to ask
            print(TOUR)
            parser.print_help()
            return 0
        args = parser.parse_args(argv)
    except GpipeInputError as exc:
        print(f"gpipe: error: {exc}", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 2
    from sim.views import progress

    progress.configure(quiet=getattr(args, "quiet", False), json_output=getattr(args, "json", False))
    try:
        module = importlib.import_module(args.module)
    except ModuleNotFoundError:
        print(f"gpipe: error: '{args.command}' is not available in this installation", file=sys.stderr)
        return 2
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at exit
        return code
    except GpipeInputError as exc:
        print(f"gpipe: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpipe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_went_away()


def _reader_went_away() -> int:
    """End quietly, as Unix tools do, when the reader of our output closed it (``gpipe ... | head``).

    Python would print a BrokenPipeError traceback, and another one when it flushes stdout at exit;
    pointing stdout at /dev/null stops the second. The exit status is the shell's for SIGPIPE.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def command() -> None:
    """The ``gpipe`` executable: :func:`main`, then an exit without the interpreter's teardown.

    Why: a process that imported torch spends most of a second after its work is done freeing its
    modules one by one (most of a short ``gpipe train``'s time from its last step's line to the exit:
    docs/notes/2026-11-26-launch-time.md).
    What the teardown is for runs first, in its order: other non-daemon threads are joined, the
    exit handlers run (logging's flush, the fork server's shutdown, temporary directories' removal),
    stdout and stderr are flushed; then the process ends with ``os._exit`` and ``main``'s status. An
    exception escaping ``main`` exits the usual way, traceback and all. Limits: a file some library
    left open and unflushed (not closed by a ``with``) loses what it buffered; gpipe's own are closed.
    """
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, or the stream closed: nothing left to save
            pass
    os._exit(code)


if __name__ == "__main__":
    command()
