"""``--hardware FILE.json``: a file equal to a catalog entry predicts what the entry does, a plan keeps
the file's system, a runs file's hardware object is modelled, and a malformed file is one line."""

import json
import pathlib
import re
import shlex

from sim.catalog.hardware import CATALOG_FILES
from sim.catalog.user_systems import resolve_system
from tests.helpers.in_process import ROOT, gpipe

SIMULATE = ("simulate", "--model", "transformer", "--layers", "8", "--stages", "2", "--microbatches", "4",
            "--batch", "8")
PLAN = ("plan", "--model", "transformer", "--layers", "8", "--batch", "16", "--top", "3")


def _untimed(printed: str) -> str:
    """What a command printed, without how long its search took."""
    return re.sub(r", [0-9.]+ s$", ", _ s", printed, flags=re.M)


def test_a_file_equal_to_a_catalog_entry_gives_the_same_predictions(tmp_path):
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(CATALOG_FILES["h100-nvlink"]))
    for command in (SIMULATE, PLAN):
        by_name, by_file = (gpipe(*command, "--hardware", hardware, "--nodes", "2")
                            for hardware in ("h100-nvlink", str(path)))
        assert by_name.returncode == by_file.returncode == 0, by_file.stderr
        assert _untimed(by_file.stdout) == _untimed(by_name.stdout)


def test_a_plan_on_a_file_keeps_its_system_and_simulates_without_it(tmp_path):
    path = tmp_path / "h100-96gb.json"
    path.write_text(json.dumps({"base": "h100-nvlink", "name": "h100-96gb", "memory_gib": 96,
                                "memory_bandwidth_tb_s": 2.4}))
    planned = gpipe(*PLAN, "--hardware", str(path), "--out", str(tmp_path / "plan.json"))
    assert planned.returncode == 0, planned.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["hardware"]["system"] == "h100-96gb" and plan["hardware"]["definition"]["memory_gib"] == 96
    path.unlink()  # the plan is priced from what it keeps
    simulated = gpipe("simulate", "--plan", str(tmp_path / "plan.json"), "--json")
    assert simulated.returncode == 0, simulated.stderr
    result = json.loads(simulated.stdout)
    assert result["step_time_s"] == plan["predicted"]["step_time_s"]
    assert result["hardware"]["system"] == "h100-96gb"


def test_a_malformed_file_is_one_line_naming_the_bad_key(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"base": "h100-nvlink", "memory_gibs": 96}))
    for command in (SIMULATE, PLAN):
        proc = gpipe(*command, "--hardware", str(path))
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == (f"gpipe: error: hardware file {str(path)!r}: unknown key 'memory_gibs' (did you mean "
                               "memory_gib?)\n")


def test_a_runs_file_with_a_hardware_object_is_modelled(tmp_path):
    run = {"id": "titan", "hardware": {"base": "h100-nvlink", "name": "h100-96gb", "memory_gib": 96,
                                       "memory_bandwidth_tb_s": 2.4},
           "nodes": 1, "model": "transformer",
           "options": {"layers": 4, "d_model": 256, "ff": 1024, "heads": 8, "seq": 128, "vocab": 1000},
           "tensor_parallel": 2, "pipeline_stages": 2, "replicas": 2, "context_parallel": 1, "virtual_stages": 1,
           "microbatch_size": 2, "global_batch": 16, "checkpoint": "full", "sequence_parallel": True,
           "precision": "bf16", "measured_step_s": 0.01}
    (tmp_path / "runs.json").write_text(json.dumps({"runs": [run]}))
    proc = gpipe("replay", str(tmp_path / "runs.json"), "--json")
    assert proc.returncode == 0, proc.stderr
    (replayed,) = json.loads(proc.stdout)["runs"]
    assert replayed["modelled"] and replayed["predicted_step_s"] > 0
    assert any(line.startswith("h100-96gb:") for line in replayed["assumed"])


def test_the_documented_files_and_commands_run(tmp_path):
    """docs/planning.md's "Your own cluster": its first file written where its commands read it,
    its second read as a whole system, its commands run."""
    page = (pathlib.Path(ROOT) / "docs" / "planning.md").read_text()
    section = page[page.index("## Your own cluster"):page.index("## Bad input")]
    files = re.findall(r"```json\n(.*?)```", section, re.S)
    (commands,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    (tmp_path / "h100-96gb.json").write_text(files[0])
    assert resolve_system(json.loads(files[1])).name == "a100-pcie-cluster"
    for command in commands.strip().splitlines():
        args = shlex.split(command)
        assert args[0] == ".venv/bin/gpipe"
        done = gpipe(*args[1:], cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["hardware"]["system"] in ("h100-nvlink", "h100-96gb")


def test_several_systems_are_ranked_by_plan_and_one_line_elsewhere(tmp_path):
    """``--hardware a,b``: gpipe plan ranks both (a catalog name and a system file alike); the
    commands that predict on one system refuse the list in one line, before any work."""
    path = tmp_path / "h100-96gb.json"
    path.write_text(json.dumps({"base": "h100-nvlink", "name": "h100-96gb", "memory_gib": 96}))
    ranked = gpipe(*PLAN, "--hardware", f"a100-nvlink,{path}", "--json")
    assert ranked.returncode == 0, ranked.stderr
    assert set(json.loads(ranked.stdout)["hardware"]) == {"a100-nvlink", "h100-96gb"}
    for command in (SIMULATE, ("train", "--model", "transformer", "--stages", "1", "--steps", "1")):
        proc = gpipe(*command, "--hardware", "a100-nvlink,h100-nvlink")
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == ("gpipe: error: --hardware 'a100-nvlink,h100-nvlink' is a list, but only gpipe plan "
                               "takes several systems (it ranks them together); give one, e.g. --hardware a100-nvlink\n")
