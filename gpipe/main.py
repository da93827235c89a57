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
import re
import signal
import sys
import threading
from typing import Any, NoReturn

from sim.errors import GpipeInputError, did_you_mean

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


class OneLineParser(argparse.ArgumentParser):
    """The parser of ``gpipe`` and of every subcommand (a subparser takes its parent's class): what
    argparse itself refuses (a value of the wrong type, an unknown flag or command, a flag without its
    value, a missing argument) becomes one line naming the value and the fix, a GpipeInputError that
    :func:`main` prints with exit status 2, where argparse would print its usage block.

    argparse's refusals are told apart by its messages (:func:`refusal`); one it words in a way not
    known here keeps its words and points at ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subcommands: dict[str, argparse.ArgumentParser] = {}  # name -> parser, filled by build_parser

    def error(self, message: str) -> NoReturn:
        raise GpipeInputError(refusal(self, message))

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # argparse reports them on the root parser; the subcommand's flags say what was meant
            raise GpipeInputError(unknown_arguments(self.subcommands.get(getattr(parsed, "command", None), self),
                                                    extras))
        return parsed


# argparse's words for a value of the wrong type, one left out, an unknown subcommand, a required argument
_INVALID = re.compile(r"argument (?P<flag>[^:]+): invalid (?P<kind>\S+) value: (?P<value>.*)$")
_NO_VALUE = re.compile(r"argument (?P<flag>[^:]+): expected (?:one|at least one|at most one|\d+) arguments?$")
_CHOICE = re.compile(r"argument (?P<flag>[^:]+): invalid choice: '?(?P<value>[^' ]*)'?")
_REQUIRED = re.compile(r"the following arguments are required: (?P<names>.+)$")
_EXPLICIT = re.compile(r"argument (?P<flag>[^:]+): ignored explicit argument (?P<value>.*)$")
_KINDS = {"int": "a whole number", "float": "a number"}


def refusal(parser: argparse.ArgumentParser, message: str) -> str:
    """One line for argparse's ``message`` about ``parser``'s arguments: the value and the fix."""
    see = f"see {parser.prog} --help"
    if found := _INVALID.match(message):
        flag = found["flag"].split("/")[0]
        return f"{flag} takes {_KINDS.get(found['kind'], 'a ' + found['kind'])}, got {found['value']}; {see}"
    if found := _NO_VALUE.match(message):
        return f"{found['flag'].split('/')[0]} needs a value after it; {see}"
    if (found := _CHOICE.match(message)) and isinstance(parser, OneLineParser) and parser.subcommands:
        names = list(parser.subcommands)
        return (f"unknown command {found['value']!r}{did_you_mean(found['value'], names)}; choose one of "
                f"{', '.join(names)}")
    if found := _REQUIRED.match(message):
        return f"{parser.prog} needs {_named(parser, found['names'])}; {see}"
    if found := _EXPLICIT.match(message):
        flag = found["flag"].split("/")[0]
        return f"{flag} takes no value, got {found['value']}; write {flag} alone"
    return f"{message}; {see}"


def _named(parser: argparse.ArgumentParser, names: str) -> str:
    """The required arguments argparse names, each with its help where it has one."""
    helps = {("/".join(a.option_strings) or a.metavar or a.dest): (a.help or "").split(";")[0]  # its first clause
             for a in parser._actions}  # by argparse's names for them
    return " and ".join(f"{name} ({helps[name]})" if helps.get(name) else name for name in names.split(", "))


def unknown_arguments(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """One line for what ``parser`` (a subcommand's, or the root's) did not take: the first unknown
    flag with the flags it may have meant, else the first stray word."""
    see = f"see {parser.prog} --help"
    flags = [word for word in extras if word.startswith("-") and not _is_number(word)]
    if flags:
        flag = flags[0].split("=")[0]
        known = sorted(o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings
                       if o.startswith("--"))
        return f"{parser.prog} takes no flag {flag}{did_you_mean(flag, known)}; {see}"
    return f"{parser.prog} takes no argument {extras[0]!r} here (a value follows the flag it is for); {see}"


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    # no abbreviations: a flag is the name written in full, so no prefix of another command's flag
    # (plan's --stages-options for simulate's --stages) stands in for it unseen
    parser = OneLineParser(prog="gpipe", description="GPipe pipeline planning, simulation and training",
                           allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"gpipe {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        sub_parser.set_defaults(module=module_name)
        parser.subcommands[name] = sub_parser
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
    try:  # a flag's value is checked as it is parsed (gpipe.options.Checked), argparse's own refusals
        # by OneLineParser: one line each
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
