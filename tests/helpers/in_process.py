"""``gpipe ARGS`` run inside the test process, with what a new interpreter's run would give back.

Why: a new interpreter imports torch again, 2-3 s of a core before ``gpipe train`` checks its
input and starts its ranks; the test process has torch imported already, and its fork server
(:mod:`executor.launch.agent`), started by the first launch, serves every later one. The command's exit
status, and everything it and its ranks write to the two file descriptors, come back as a
:class:`subprocess.CompletedProcess`, as ``subprocess.run(..., capture_output=True, text=True)``
returns them.

Limits: no timeout (the run's own ``--timeout`` and the agent's failure handling end a failed run;
tests of that handling, and of signals, keep their own interpreter); the command runs in ``cwd``
(the repository's directory unless given) with ``env`` added to this process's environment, both
restored after; what it leaves in module-level state (torch's global seed, caches) stays.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def _environment(env: dict[str, str] | None) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _captured_descriptors() -> Iterator[tuple[tempfile.TemporaryFile, tempfile.TemporaryFile]]:
    """File descriptors 1 and 2 (and ``sys.stdout``/``sys.stderr`` over them) into two files."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved_fds = os.dup(1), os.dup(2)
        saved_streams = sys.stdout, sys.stderr
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        try:
            yield out, err
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            sys.stdout, sys.stderr = saved_streams
            for fd, saved in zip((1, 2), saved_fds):
                os.dup2(saved, fd)
                os.close(saved)


def gpipe(*args: str, env: dict[str, str] | None = None, cwd: str | os.PathLike = ROOT) -> subprocess.CompletedProcess:
    """Run ``gpipe ARGS`` here, in ``cwd``: its exit status and its (and its subprocesses') stdout and stderr."""
    from gpipe.main import main

    here = os.getcwd()
    with _environment(env), _captured_descriptors() as (out, err):
        os.chdir(cwd)
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            os.chdir(here)
        sys.stdout.flush()
        sys.stderr.flush()
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
    return subprocess.CompletedProcess(["gpipe", *map(str, args)], code, stdout, stderr)


def train_refusal(capsys, *argv: str) -> str:
    """``gpipe train ARGV`` refused before any worker: exit 2 and one line, ``gpipe: error: ...``;
    that line."""
    from gpipe.main import main

    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("gpipe: error: "), err
    return err


def option_flags(options):
    """``--option key=value`` for each of ``options`` (booleans as true/false), as gpipe takes them."""
    return [part for key, value in options.items()
            for part in ("--option", f"{key}={str(value).lower() if isinstance(value, bool) else value}")]
