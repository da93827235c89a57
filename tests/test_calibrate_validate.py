"""End to end on a tiny model: gpipe calibrate (then its cache), gpipe validate, the table's content."""

from __future__ import annotations

import json

import pytest

from calibrate.calibration import calibration_design
from calibrate.validate import validation_design
from sim.cli import main

TINY = ["--model", "transformer", "--layers", "2", "--d-model", "16", "--ff", "32", "--heads", "2",
        "--seq", "8", "--vocab", "32", "--batch", "8"]


def test_held_out_design_never_repeats_a_calibration_run():
    for layers in (3, 6, 10):
        held_out = validation_design(layers, 32)
        assert held_out and not set(held_out) & set(calibration_design(layers, 32))
        assert {s.stages for s in held_out} == {1, 2}
        assert {s.checkpoint for s in held_out} == {"always", "except_last", "never"}
        assert {s.schedule for s in held_out} == {"gpipe", "1f1b"}
        assert any(32 % s.microbatches for s in held_out)  # M that does not divide the batch
        assert len({s.partition for s in held_out if s.stages == 2}) == 2  # balanced and skewed


@pytest.mark.slow
def test_calibrate_then_validate_end_to_end(tmp_path, capsys):
    costs = str(tmp_path / "costs.json")
    assert main(["calibrate", *TINY, "--out", costs, "--quick", "--steps", "3"]) == 0
    first = capsys.readouterr().out
    assert "costs written to" in first
    data = json.load(open(costs))
    assert data["machine"]["cpu_cores"] >= 1 and data["machine"]["torch"]
    assert set(data["pipeline"]) >= {"1"}
    assert data["model"]["num_layers"] == 4
    assert set(data["speed"]["reference_s"]) == set(data["pipeline"])  # a reference pace per K
    assert all(v > 0 for v in data["speed"]["reference_s"].values())
    assert main(["calibrate", *TINY, "--out", costs, "--quick"]) == 0
    assert "reusing" in capsys.readouterr().out

    results = str(tmp_path / "validation.json")
    assert main(["validate", "--costs", costs, "--limit", "2", "--steps", "3", "--json", "--out", results]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.load(open(results))
    assert printed["summary"]["runs"] == 2
    for run in printed["runs"]:
        assert run["measured_step_s"] > 0 and run["predicted_step_s"] > 0
        assert len(run["round_speeds"]) == printed["rounds"] and all(v > 0 for v in run["round_speeds"])
        assert run["measured_at_reference_s"] > 0
        assert len(run["predicted_peak_activation_bytes"]) == len(run["measured_peak_activation_bytes"])


def test_validate_refuses_a_missing_costs_file(tmp_path, capsys):
    assert main(["validate", "--costs", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
