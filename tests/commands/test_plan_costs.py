"""A plan records what it was priced with, so ``gpipe simulate --plan`` gives its step or says why not."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from gpipe.main import main
from sim.formats.costs import write_costs
from sim.formats.plan import load_plan, plan_from_dict
from tests.helpers.costs import synthetic_costs

FAST = ["--microbatch-options", "1,2,4", "--quiet"]


@pytest.fixture
def priced(tmp_path, capsys):
    """A costs file and the plan ``gpipe plan --costs`` wrote with it: (costs path, plan path)."""
    costs, plan = tmp_path / "costs.json", tmp_path / "priced.json"
    write_costs(synthetic_costs(), costs)
    assert main(["plan", "--costs", str(costs), *FAST, "--out", str(plan)]) == 0
    capsys.readouterr()
    return costs, plan


def simulated(capsys, *args: str) -> dict:
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def one_line_error(capsys, *args: str) -> str:
    assert main(["simulate", *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert not captured.out and len(err.splitlines()) == 1, err
    return err


def test_a_plan_priced_with_costs_is_simulated_with_them_to_the_microsecond(priced, capsys):
    costs, plan = priced
    recorded = json.loads(plan.read_text())
    assert recorded["costs"] == {"path": str(costs), "absolute_path": os.path.abspath(costs),
                                 "sha256": hashlib.sha256(costs.read_bytes()).hexdigest()}
    assert recorded["hardware"] == {"system": "cpu", "nodes": 1}
    out = simulated(capsys, "--plan", str(plan))
    assert out["step_time_s"] == pytest.approx(recorded["predicted"]["step_time_s"], abs=1e-6)
    assert out["plan_note"] is None and out["costs"]["sha256"] == recorded["costs"]["sha256"]
    # the catalog's models price this plan far from the costs file: the test tells the two apart
    catalog = plan.with_name("catalog.json")
    catalog.write_text(json.dumps({k: v for k, v in recorded.items() if k != "costs"}))
    assert abs(simulated(capsys, "--plan", str(catalog))["step_time_s"] - out["step_time_s"]) > 1e-3


def test_a_missing_costs_file_is_one_line_naming_it_and_the_ways_on(priced, capsys):
    costs, plan = priced
    costs.unlink()
    err = one_line_error(capsys, "--plan", str(plan))
    assert f"priced with costs file {costs}" in err and "missing" in err
    assert "re-plan" in err and "--costs FILE" in err


def test_a_changed_costs_file_is_one_line_naming_it_and_the_ways_on(priced, capsys):
    costs, plan = priced
    data = synthetic_costs()
    data["pipeline"]["2"]["step_overhead_s"] *= 2
    write_costs(data, costs)
    err = one_line_error(capsys, "--plan", str(plan))
    assert f"costs file {costs} changed since plan {plan} was priced with it" in err
    assert f"--costs {costs}" in err and "re-plan" in err


def test_explicit_costs_win_over_the_recorded_ones_with_a_note(priced, capsys):
    costs, plan = priced
    other = costs.with_name("costs_b.json")
    data = synthetic_costs()
    data["pipeline"] = {k: {**fit, "step_overhead_s": 0.05} for k, fit in data["pipeline"].items()}
    write_costs(data, other)
    costs.unlink()  # what the plan recorded is not needed when --costs says otherwise
    planned_s = json.loads(plan.read_text())["predicted"]["step_time_s"]
    assert main(["simulate", "--plan", str(plan), "--costs", str(other)]) == 0
    out = capsys.readouterr().out
    assert (f"note: the plan predicted {planned_s * 1e3:.3f} ms (costs file {costs}); this simulation, with "
            f"--costs {other}, gives ") in out
    assert simulated(capsys, "--plan", str(plan), "--costs", str(other))["step_time_s"] > planned_s + 0.04


def test_a_plan_moved_with_its_costs_finds_them_by_the_path_given(tmp_path, capsys, monkeypatch):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    monkeypatch.chdir(here)
    write_costs(synthetic_costs(), "costs.json")
    assert main(["plan", "--costs", "costs.json", *FAST, "--out", "plan.json"]) == 0
    capsys.readouterr()
    shutil.move(str(here), str(there))
    monkeypatch.chdir(there)
    planned_s = json.loads((there / "plan.json").read_text())["predicted"]["step_time_s"]
    assert simulated(capsys, "--plan", "plan.json")["step_time_s"] == pytest.approx(planned_s, abs=1e-6)


def test_a_given_efficiency_is_recorded_and_reproduced(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "transformer", "--layers", "4", "--batch", "16", "--hardware", "h100-nvlink",
                 "--efficiency", "0.3", "--stages-options", "1,2", "--microbatch-options", "1,4", "--quiet",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    recorded = json.loads(plan.read_text())
    assert recorded["hardware"] == {"system": "h100-nvlink", "nodes": 1, "efficiency": 0.3}
    assert recorded["costs"] is None
    out = simulated(capsys, "--plan", str(plan))
    assert out["step_time_s"] == pytest.approx(recorded["predicted"]["step_time_s"], abs=1e-6)
    assert out["plan_note"] is None


def test_older_plan_files_load_as_priced_with_the_catalog_and_bad_records_are_one_line(priced):
    from executor.config import RunConfig
    from sim.errors import GpipeInputError

    _, plan = priced
    data = json.loads(plan.read_text())
    older = {k: v for k, v in data.items() if k != "costs"}
    assert plan_from_dict(older).costs is None and plan_from_dict(older) == plan_from_dict({**data, "costs": None})
    assert RunConfig.from_plan(load_plan(plan)).hardware == data["hardware"]  # what gpipe train reads
    for bad, says in (({**data, "costs": {"path": "c.json"}}, "plan's costs must be an object with path"),
                      ({**data, "hardware": {"system": "cpu", "nodes": 1, "efficiency": 2.0}},
                       "plan's hardware efficiency 2.0 is not a fraction of peak")):
        with pytest.raises(GpipeInputError, match=says):
            plan_from_dict(bad)
