"""One definition per shared flag, one validation style, one meaning per flag name, one --hardware default.

A flag two commands take is declared in gpipe/options.py alone, never with argparse ``choices``;
a bad value is one line and exit 2 on every command; ``gpipe plan``'s lists have names of their own;
every command that prints a result takes ``--json``; ``fit-gpu`` writes where it is told.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections import defaultdict

import pytest

from gpipe.main import SUBCOMMANDS, build_parser
from gpipe.options import DEFAULT_HARDWARE, RENAMED_IN_PLAN, hardware_of
from tests.helpers import in_process

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED = "options.py"


def declarations(folder: pathlib.Path) -> dict[str, list[tuple[str, int]]]:
    """Each flag written literally in an ``add_argument`` call of the modules in ``folder``: where."""
    found: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found[arg.value].append((path.name, node.lineno))
    return found


def duplicate_definitions(folder: pathlib.Path) -> list[str]:
    """Flags declared twice (in options.py, or in two places anywhere), each with where."""
    return [f"{flag}: {', '.join(f'{name}:{line}' for name, line in where)}"
            for flag, where in sorted(declarations(folder).items()) if len(where) > 1]


def flags_using_choices(folder: pathlib.Path) -> list[str]:
    """``add_argument(..., choices=...)`` calls: argparse's usage block instead of one line."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                if any(keyword.arg == "choices" for keyword in node.keywords):
                    found.append(f"{path.name}:{node.lineno}")
    return found


def test_every_flag_is_declared_once_and_shared_ones_only_in_options():
    assert duplicate_definitions(ROOT / "gpipe") == []
    shared = {flag for flag, where in declarations(ROOT / "gpipe").items() if where[0][0] == SHARED}
    assert {"--hardware", "--json", "--stages", "--replicas", "--checkpoint", "--device", "--steps"} <= shared


def test_no_flag_is_checked_by_argparse_choices():
    assert flags_using_choices(ROOT / "gpipe") == []


def test_a_planted_second_definition_is_caught(tmp_path):
    """A command re-declaring a shared flag (as gpipe train once did with --schedule and choices)."""
    for path in (ROOT / "gpipe").glob("*.py"):
        shutil.copy(path, tmp_path / path.name)
    train = tmp_path / "train.py"
    train.write_text(train.read_text() + "\n\ndef more(what):\n    what.add_argument('--schedule', "
                                         "choices=('gpipe', '1f1b'))\n")
    assert [line.split(":")[0] for line in duplicate_definitions(tmp_path)] == ["--schedule"]
    assert duplicate_definitions(tmp_path)[0].startswith("--schedule: options.py:")
    assert flags_using_choices(tmp_path) == [f"train.py:{len(train.read_text().splitlines())}"]


def parsed(*argv: str):
    return build_parser(list(argv)).parse_args(list(argv))


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_that_prints_a_result_takes_json(command):
    actions = build_parser([command])._subparsers._group_actions[0].choices[command]._option_string_actions
    assert "--json" in actions and "--quiet" in actions


@pytest.mark.parametrize("flags,message", [
    (["--checkpoint", "sometimes"], "unknown checkpoint policy 'sometimes'; choose one of"),
    (["--schedule", "zigzag"], "unknown schedule 'zigzag'; choose one of"),
    (["--placement", "scattered"], "unknown placement 'scattered'; choose one of"),
    (["--zero", "4"], "--zero must be 0, 1, 2 or 3, got 4"),
    (["--device", "tpu"], "unknown --device 'tpu' (did you mean cpu?); choose one of cpu, cuda"),
    (["--loss", "hinge"], "unknown --loss 'hinge'; choose one of mse, cross_entropy"),
    (["--init", "random"], "unknown --init 'random'; choose one of factory, meta"),
    (["--transport", "tcp"], "unknown --transport 'tcp'; choose one of auto, dist"),
    (["--hardware", "h100"], "unknown hardware 'h100' (did you mean h100-nvlink or h100-pcie?)"),
])
def test_a_bad_shared_flag_value_on_train_is_one_line_before_torch(flags, message):
    done = in_process.gpipe("train", "--model", "mlp", "--stages", "2", *flags)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("gpipe: error: "), done.stderr
    assert message in done.stderr and "usage:" not in done.stderr


@pytest.mark.parametrize("command", [["calibrate", "--out", "unused.json"], ["demo", "--data", "txt"],
                                     ["plan", "--rank-by", "speed"], ["simulate", "--partitioner", "greedy"]])
def test_a_name_from_a_list_is_one_line_on_every_command(command, tmp_path):
    flags = command + (["--device", "tpu"] if command[0] == "calibrate" else [])
    done = in_process.gpipe(*flags, cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "usage:" not in done.stderr
    assert done.stderr.startswith("gpipe: error: unknown --")
    assert not (tmp_path / "unused.json").exists()


@pytest.mark.parametrize("old", sorted(RENAMED_IN_PLAN))
def test_plan_refuses_a_single_value_flag_naming_its_list_flag(old):
    new, _ = RENAMED_IN_PLAN[old]
    done = in_process.gpipe("plan", "--model", "transformer", old, "1,2", "--quiet")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"gpipe: error: gpipe plan searches a list of {RENAMED_IN_PLAN[old][1]}: "
                                        f"write {new} 1,2 ({old} is one value, in gpipe simulate and gpipe train)"]


def test_plan_takes_its_lists_under_their_own_names_and_no_abbreviation_stands_in():
    done = in_process.gpipe("plan", "--model", "transformer", "--hardware", "h100-nvlink", "--replicas-options", "1,2",
                            "--virtual-stages-options", "1,2", "--zero-options", "0,1", "--tensor-parallel-options", "1,2",
                            "--stages-options", "2", "--microbatch-options", "4", "--checkpoints", "never",
                            "--schedules", "gpipe,interleaved", "--placements", "stages_adjacent", "--json", "--quiet")
    assert done.returncode == 0, done.stderr
    ranked = json.loads(done.stdout)["ranked"]
    assert {(o["replicas"], o["tensor_parallel"], o["pipeline_stages"]) for o in ranked} <= {
        (d, t, 2) for d in (1, 2) for t in (1, 2)}
    abbreviated = in_process.gpipe("simulate", "--model", "uniform", "--stage", "2")
    assert abbreviated.returncode == 2 and "gpipe simulate takes no flag --stage (did you mean --stages?)" in abbreviated.stderr


def test_one_hardware_default_for_every_command_and_a_costs_file_s_system_wins(tmp_path):
    from sim.formats.costs import write_costs
    from tests.helpers.costs import synthetic_costs

    for argv in (["simulate", "--model", "mlp"], ["plan", "--model", "mlp"], ["train", "--model", "mlp"]):
        args = parsed(*argv)
        assert args.hardware is None and hardware_of(args) == DEFAULT_HARDWARE == "cpu"
    done = in_process.gpipe("simulate", "--model", "transformer", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["hardware"]["system"] == "cpu"
    costs = tmp_path / "costs.json"
    write_costs({**synthetic_costs(), "system": "ideal"}, costs)
    for command in (["simulate", "-K", "2", "-M", "2"], ["plan", "--stages-options", "2", "--microbatch-options", "2"]):
        done = in_process.gpipe(*command, "--costs", str(costs), "--json", "--quiet")
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        assert (data["hardware"]["system"] if command[0] == "simulate" else list(data["hardware"])) in ("ideal",
                                                                                                     ["ideal"])
    explicit = in_process.gpipe("simulate", "-K", "2", "-M", "2", "--costs", str(costs), "--hardware", "cpu", "--json")
    assert json.loads(explicit.stdout)["hardware"]["system"] == "cpu"


def test_fit_gpu_writes_where_it_is_told_and_the_simulator_reads_it_when_named(tmp_path):
    from sim.catalog.kernel_model import EFFICIENCY_ENV, EFFICIENCY_FILE

    committed = pathlib.Path(EFFICIENCY_FILE).read_bytes()
    shutil.copy(ROOT / "benchmarks" / "published_runs" / "dev.json", tmp_path / "dev.json")
    done = in_process.gpipe("fit-gpu", "dev.json", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["written_to"] == "gpu_efficiency.json"
    assert (tmp_path / "gpu_efficiency.json").exists() and pathlib.Path(EFFICIENCY_FILE).read_bytes() == committed
    fitted = json.loads((tmp_path / "gpu_efficiency.json").read_text())
    fitted["devices"]["A100-SXM-80GB"]["matmul"] = 0.5  # a value no fit gives, to see it read
    (tmp_path / "mine.json").write_text(json.dumps(fitted))
    probe = "from sim.catalog.hardware import get_system; print(get_system('a100-nvlink').device.efficiency)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    read = subprocess.run([sys.executable, "-c", probe], env={**env, EFFICIENCY_ENV: str(tmp_path / "mine.json")},
                          capture_output=True, text=True, check=True)
    assert read.stdout.strip() == "0.5"
    missing = subprocess.run([sys.executable, "-m", "gpipe.main", "simulate", "--hardware", "a100-nvlink"],
                             env={**env, EFFICIENCY_ENV: str(tmp_path / "none.json")}, capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.splitlines() == [
        f"gpipe: error: {EFFICIENCY_ENV}={tmp_path / 'none.json'} names no file; give the file gpipe fit-gpu --out "
        f"wrote, or unset {EFFICIENCY_ENV} for the package's fitted fractions"]


def test_plan_list_models_as_json():
    done = in_process.gpipe("plan", "--list-models", "--json")
    models = {row["name"]: row for row in json.loads(done.stdout)["models"]}
    assert models["llama3-8b"]["layers"] == 32 and models["llama3-8b"]["kv_heads"] == 8
    table = in_process.gpipe("plan", "--list-models").stdout
    assert f"{models['llama3-8b']['parameter_count'] / 1e9:.1f}B" in table.splitlines()[[
        line.split()[0] for line in table.splitlines()].index("llama3-8b")]
