"""Progress bars only for a person at a terminal; ``--quiet`` on every command; ``--version``; the tour.

A pseudo-terminal stands in for the person: bars must appear there and nowhere else (piped output,
``--json``, ``--quiet``).
"""

import os
import pty
import subprocess
import sys

import pytest

from gpipe.main import SUBCOMMANDS, TOUR, build_parser, main, version
from sim.views import progress

GPIPE = [sys.executable, "-m", "gpipe.main"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# two of the development set's runs that replay in well under a second (the set's others search
# what their source left unsaid): a command long enough to draw a bar with counts
QUICK_RUNS = ("korth-22b-full", "nemotron4-15b-h100")


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """``gpipe replay`` of a runs file holding :data:`QUICK_RUNS` of ``dev.json``, as argv."""
    import json

    with open(os.path.join(ROOT, "benchmarks", "published_runs", "dev.json")) as handle:
        runs = json.load(handle)
    runs["runs"] = [run for run in runs["runs"] if run["id"] in QUICK_RUNS]
    assert len(runs["runs"]) == len(QUICK_RUNS)
    path = tmp_path_factory.mktemp("runs") / "quick.json"
    path.write_text(json.dumps(runs))
    return ["replay", str(path)]


class Terminal:
    def isatty(self) -> bool:
        return True


class Pipe:
    def isatty(self) -> bool:
        return False


@pytest.fixture(autouse=True)
def bars_off_afterwards():
    yield
    progress.configure(quiet=True)


@pytest.mark.parametrize("quiet,json_output,stdout,stderr,shown", [
    (False, False, Terminal(), Terminal(), True),
    (True, False, Terminal(), Terminal(), False),
    (False, True, Terminal(), Terminal(), False),
    (False, False, Pipe(), Terminal(), False),
    (False, False, Terminal(), Pipe(), False),
])
def test_bars_only_for_a_person_at_a_terminal(quiet, json_output, stdout, stderr, shown):
    assert progress.configure(quiet, json_output, stdout, stderr) is shown
    bar = progress.phase("work", total=3)
    assert (type(bar).__name__ == "tqdm") is shown
    bar.update(3)
    bar.close()


def test_a_silent_bar_counts_and_draws_nothing(capsys):
    progress.configure(quiet=True)
    with progress.phase("work", total=2) as bar:
        bar.update(2)
        bar.set_postfix_str("loss 1.0")
    progress.note("measuring")
    assert bar.n == 2 and capsys.readouterr() == ("", "")


def run_in_terminal(args: list[str]) -> str:
    """Run ``gpipe args`` with stdout and stderr on a pseudo-terminal 100 columns wide; all it wrote."""
    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen(GPIPE + args, stdout=follower, stderr=follower, cwd=ROOT)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=120)
    os.close(leader)
    assert proc.returncode == 0
    return b"".join(chunks).decode(errors="replace")


def test_a_long_command_draws_one_bar_with_counts_at_a_terminal_and_none_when_piped(replay):
    drawn = run_in_terminal(replay)
    assert "replaying runs" in drawn and "2/2" in drawn and "run/s" in drawn
    piped = subprocess.run(GPIPE + replay, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert piped.returncode == 0 and "replaying runs" not in piped.stdout + piped.stderr
    quiet = run_in_terminal(replay + ["--quiet"])
    assert "replaying runs" not in quiet and "median |error|" in quiet


def test_every_command_takes_quiet():
    for name in SUBCOMMANDS:
        parser = build_parser([name])
        sub = parser._subparsers._group_actions[0].choices[name]
        assert "--quiet" in sub._option_string_actions, name


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert printed == f"gpipe {version()}" and version()[0].isdigit()


def test_no_arguments_print_the_tour_then_usage(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith(TOUR) and "usage: gpipe" in out
    for command in ("gpipe demo", "gpipe simulate", "gpipe plan", "gpipe train", "gpipe calibrate",
                    "gpipe paper", "gpipe replay"):
        assert command in TOUR, command
