"""What argparse itself refuses (a value of the wrong type, an unknown flag or command, a flag without
its value, a missing argument) is one line naming the value and the fix, exit 2, on every command."""

from __future__ import annotations

import pytest

from gpipe.main import SUBCOMMANDS, OneLineParser, build_parser
from tests.helpers import in_process


@pytest.mark.parametrize("argv,line", [
    (["simulate", "--stages", "x"], "--stages takes a whole number, got 'x'; see gpipe simulate --help"),
    (["plan", "--top", "1.5"], "--top takes a whole number, got '1.5'; see gpipe plan --help"),
    (["train", "--model", "mlp", "--lr", "fast"], "--lr takes a number, got 'fast'; see gpipe train --help"),
    (["calibrate", "--max-stages", "two"], "--max-stages takes a whole number, got 'two'; see gpipe calibrate --help"),
    (["simulate", "--stages"], "--stages needs a value after it; see gpipe simulate --help"),
    (["simulate", "--stage", "2"], "gpipe simulate takes no flag --stage (did you mean --stages?); "
                                   "see gpipe simulate --help"),
    (["paper", "--no-such-flag"], "gpipe paper takes no flag --no-such-flag; see gpipe paper --help"),
    (["validate"], "gpipe validate needs --costs (costs file from gpipe calibrate); see gpipe validate --help"),
    (["simulate", "transformer"], "gpipe simulate takes no argument 'transformer' here (a value follows the flag "
                                  "it is for); see gpipe simulate --help"),
    (["simulate", "--json=yes"], "--json takes no value, got 'yes'; write --json alone"),
    (["replay"], "gpipe replay needs FILE (runs file, e.g. benchmarks/published_runs/dev.json); "
                 "see gpipe replay --help"),
    (["simulat"], "unknown command 'simulat' (did you mean simulate?); choose one of " + ", ".join(SUBCOMMANDS)),
    (["--bogus"], "gpipe takes no flag --bogus; see gpipe --help"),
])
def test_argparse_refusals_are_one_line_with_exit_2(argv, line, tmp_path):
    done = in_process.gpipe(*argv, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"gpipe: error: {line}"]


def test_every_subcommand_parser_is_the_one_line_parser():
    for name in SUBCOMMANDS:
        parser = build_parser([name])
        assert isinstance(parser, OneLineParser) and isinstance(parser.subcommands[name], OneLineParser), name


def test_help_and_version_are_left_to_argparse(capsys):
    from gpipe.main import main

    with pytest.raises(SystemExit) as done:
        main(["simulate", "--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: gpipe simulate")
