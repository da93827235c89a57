"""The first thing a rank runs: become what ``python -u -m MODULE ARGV`` started by the launcher would be.

Why: torchrun starts every rank as a new interpreter, and each one imports torch and the executor
again before it does any work (seconds of a core each, which ranks sharing the cores wait out in
wall time), after torchrun itself has imported torch (docs/notes/2026-11-26-launch-time.md).
``executor.launch.agent`` runs
torchrun's agent in the launching process instead and has it fork each rank from a fork server
that imported the executor once (``multiprocessing``'s ``forkserver``, preloaded). A fork is
not a new interpreter, so this module restores what a new one would have had:

- the launching process's environment at the launch (the fork server's is that of its own start,
  possibly an earlier launch's), plus the variables the agent set for this rank;
- its working directory, with that directory and ``PYTHONPATH`` first on ``sys.path`` (as
  ``python -m`` puts them), so the user's own modules import as they would;
- its standard output and error (file descriptors handed over at the fork, so a terminal stays a
  terminal and captured output stays captured), unbuffered as under ``python -u``;
- ``sys.argv``, and the module run as ``__main__``, its exit code the process's.

Limits: modules the fork server imported are not imported again, so environment variables read
only at import (torch's own, say) keep the fork server's values; the ranks set their thread counts
explicitly (``torch.set_num_threads``) rather than through ``OMP_NUM_THREADS`` for this reason.
"""

from __future__ import annotations

import faulthandler
import importlib
import io
import os
import runpy
import sys
import warnings
from multiprocessing import reduction

# Taken when this module is imported: in the fork server, or in a spawned rank while its arguments
# are unpickled; either way before the agent sets the rank's own variables (RANK, MASTER_PORT, ...).
ENVIRON_BEFORE_RANK = dict(os.environ)


class InheritedFd:
    """A file descriptor of the launching process that the rank receives as its own at its start
    (``multiprocessing`` passes it over the fork server's socket when the rank's arguments are sent)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(duplicate) -> int:
    return duplicate.detach()


def _use_as_standard_stream(fd: int, number: int, name: str) -> None:
    """Point file descriptor ``number`` (1 or 2) at ``fd`` and ``sys.<name>`` at it, unbuffered."""
    stream = getattr(sys, name)
    if stream is not None:
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if fd != number:
        os.dup2(fd, number)
        os.close(fd)
    encoding = getattr(stream, "encoding", None) or "utf-8"
    errors = getattr(stream, "errors", None) or "backslashreplace"
    unbuffered = io.TextIOWrapper(io.FileIO(number, "w", closefd=False), encoding=encoding, errors=errors,
                                  write_through=True)
    setattr(sys, name, unbuffered)
    setattr(sys, f"__{name}__", unbuffered)


def run_module(module: str, argv: list[str], environ: dict[str, str], cwd: str, stdout: int, stderr: int,
               timeout_s: float | None = None) -> None:
    """Run ``module`` as ``__main__`` with ``argv``, as a rank started by ``python -u -m`` in ``cwd``
    with ``environ`` would (see the module docstring); ``stdout`` and ``stderr`` are received file
    descriptors. With ``timeout_s`` the rank prints every thread's stack and exits with code 1 once
    it has run that long (a hung measurement ends instead of holding its launcher)."""
    _use_as_standard_stream(stdout, 1, "stdout")
    _use_as_standard_stream(stderr, 2, "stderr")
    for_this_rank = {key: value for key, value in os.environ.items() if ENVIRON_BEFORE_RANK.get(key) != value}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(for_this_rank)
    os.chdir(cwd)
    first = [cwd] + [path for path in environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    sys.path[:] = first + [path for path in sys.path if path not in first and path not in ("", ".")]
    importlib.invalidate_caches()
    if timeout_s:
        faulthandler.dump_traceback_later(timeout_s, exit=True)
    sys.argv = [module, *argv]
    try:
        with warnings.catch_warnings():  # the fork server imported it; ``python -m`` runs a fresh copy as well
            warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
