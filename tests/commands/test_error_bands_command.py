"""gpipe error-bands builds the bands from the validation set; simulate prints them."""

import json
import os
import shutil

from gpipe.main import main
from sim.evidence.error_bands import bands_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV = os.path.join(ROOT, "benchmarks", "published_runs", "dev.json")
VALIDATION = os.path.join(ROOT, "benchmarks", "published_runs", "validation.json")


def test_building_gives_the_shipped_file_and_the_development_set_is_refused(tmp_path, capsys, monkeypatch):
    """A build equals the shipped file, built by another process before: the bands are reproducible."""
    monkeypatch.chdir(ROOT)  # the file records the runs file's path as given
    first = tmp_path / "a.json"
    assert main(["error-bands", "benchmarks/published_runs/validation.json",
                 "benchmarks/published_runs/validation_moe.json", "--out", str(first)]) == 0
    with open(bands_path()) as handle:
        assert json.loads(first.read_text()) == json.load(handle)
    copy = tmp_path / "dev.json"
    shutil.copy(DEV, copy)
    capsys.readouterr()
    assert main(["error-bands", str(copy), "--out", str(tmp_path / "c.json")]) == 2
    assert "development set" in capsys.readouterr().err


def test_simulate_prints_the_h100_band_and_mi300x_unknown(capsys):
    args = ["simulate", "--model", "llama3-8b", "--stages", "4", "--microbatches", "32", "--batch", "64", "--hardware"]
    assert main([*args, "h100-nvlink"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error band")]
    assert len(lines) == 1
    assert "published H100-SXM-80GB bf16 pipelined runs replayed within" in lines[0] and "(90% of " in lines[0]
    assert main([*args, "mi300x", "--json"]) == 0
    band = json.loads(capsys.readouterr().out)["error_band"]
    assert band == {"known": False, "device": "MI300X-192GB", "text": "no published run replayed: error unknown"}


def test_cpu_simulate_prints_no_band(capsys):
    assert main(["simulate", "--model", "transformer", "--layers", "4", "--stages", "2", "--microbatches", "4",
                 "--hardware", "cpu"]) == 0
    assert "error band" not in capsys.readouterr().out


def test_plan_json_carries_the_band_on_each_plan_and_hardware(capsys):
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100-nvlink,mi300x", "--nodes", "1", "--batch", "64",
                 "--top", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["h100-nvlink"]["error_band"]["device"] == "H100-SXM-80GB"
    assert data["hardware"]["h100-nvlink"]["error_band"]["known"] is True
    assert data["hardware"]["mi300x"]["error_band"]["known"] is False
    assert all(plan["error_band"]["text"] for plan in data["ranked"])


def test_a_mixture_of_experts_prints_the_band_of_its_own_runs(capsys):
    """A MoE prediction on an H100 is banded by the published MoE runs replayed on H100s, not by the
    dense ones, which would flatter it; a device without MoE runs says its error is unknown."""
    args = ["simulate", "--model", "hf:mixtral", "--option", "num_hidden_layers=4", "--stages", "2",
            "--microbatches", "4", "--batch", "8", "--json", "--hardware"]
    assert main([*args, "h100-nvlink"]) == 0
    band = json.loads(capsys.readouterr().out)["error_band"]
    assert band["known"] and band["device"] == "H100-SXM-80GB mixture-of-experts"
    assert "published H100-SXM-80GB mixture-of-experts" in band["text"]
    assert main([*args, "a100-nvlink"]) == 0
    band = json.loads(capsys.readouterr().out)["error_band"]
    assert band == {"known": False, "device": "A100-SXM-80GB mixture-of-experts",
                    "text": "no published run replayed: error unknown"}

