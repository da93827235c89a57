"""Progress on long work as people expect it: one tqdm bar per phase, with counts and an ETA.

A bar is for a person watching a terminal, so bars are drawn on stderr only when both stdout and
stderr are terminals, and never with ``--json`` or ``--quiet``: piped, redirected or machine-read
output stays exactly the command's result. The command line decides once, after parsing its
arguments (:func:`configure`, called by :mod:`gpipe.main`); every phase then asks :func:`phase` for
its bar, which is a silent stand-in when bars are off, so the code that counts never branches.

Limits: one bar at a time is assumed (a phase that starts inside another draws below it, as tqdm
nests); a phase whose end is not known in advance (a search that stops early) gives its bound as
the total and is closed at the count it reached.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

_shown = False  # set by configure(): draw bars in this process


def configure(quiet: bool = False, json_output: bool = False, stdout: TextIO | None = None,
              stderr: TextIO | None = None) -> bool:
    """Decide for the whole process whether phases draw bars; returns the decision."""
    global _shown
    _shown = (not quiet and not json_output and _is_terminal(stdout or sys.stdout)
              and _is_terminal(stderr or sys.stderr))
    return _shown


def bars_shown() -> bool:
    """True when :func:`configure` decided to draw bars (a person is watching a terminal)."""
    return _shown


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class _Silent:
    """What :func:`phase` gives when bars are off: accepts the calls a tqdm bar does, draws nothing."""

    n = 0
    total = None

    def update(self, count: int = 1) -> None:
        self.n += count

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        pass

    def set_description_str(self, text: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def phase(description: str, total: int | None = None, unit: str = "it", initial: int = 0,
          shown: bool | None = None) -> Any:
    """A bar for one phase of ``total`` ``unit``s (a tqdm bar on stderr, or a silent stand-in).

    ``shown`` overrides the process's decision (a worker process told by its launcher).
    Use it as a context manager, or call ``close()``.
    """
    if not (_shown if shown is None else shown):
        return _Silent()
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit=unit, initial=initial, file=sys.stderr, leave=True,
                dynamic_ncols=True, mininterval=0.2)


def say(line: str, bar_shown: bool | None = None) -> None:
    """Print ``line`` on stdout without breaking a bar that is being drawn on stderr."""
    if _shown if bar_shown is None else bar_shown:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(line, flush=True)


def note(message: str) -> None:
    """A progress line (what a long phase is doing now): written above the bars to stderr when bars
    are shown, dropped otherwise, so piped and ``--json`` output carries results only."""
    if _shown:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)
