"""The costs file's versions: version 1 files read into the current record and predict exactly what
the same data written as version 2 does; version 2 is read strictly."""

from __future__ import annotations

import copy
import glob
import json
import os

import pytest

from calibrate.fit.design import RunSpec
from calibrate.fit.step_fit import predict
from sim.errors import GpipeInputError
from sim.formats.costs import COSTS_VERSION, read_costs, write_costs
from sim.formats.costs_v1 import upgrade
from tests.helpers.costs import synthetic_costs, write_v1_costs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO_COSTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*costs*.json")))
# K=1 and 2, 1F1B waiting (the warm-up after waits), interleaved, a split backward and two replicas
SPECS = [RunSpec.of((6,), 4, "except_last", "gpipe", 16), RunSpec.of((3, 3), 8, "never", "1f1b", 16),
         RunSpec.of((2, 1, 1, 2), 4, "always", "interleaved", 16, virtual_stages=2),
         RunSpec.of((3, 3), 6, "never", "zb-h1", 16), RunSpec.of((6,), 2, "never", "gpipe", 16, replicas=2)]


def _version(path: str) -> int:
    with open(path) as handle:
        return json.load(handle)["version"]


def _figures(result) -> tuple:
    return (result.step_time_s, result.bubble_fraction, [s.to_dict() for s in result.stages],
            [tuple(r) for r in result.timeline.records])


def test_the_repository_holds_version_1_costs_files():
    assert len(REPO_COSTS) >= 5 and {_version(p) for p in REPO_COSTS} == {1}


@pytest.mark.parametrize("path", REPO_COSTS, ids=os.path.basename)
def test_a_version_1_file_predicts_what_the_same_data_written_as_version_2_does(path, tmp_path):
    old = read_costs(path, warn=False)
    assert old["version"] == COSTS_VERSION
    write_costs(old, tmp_path / "v2.json")
    assert _version(str(tmp_path / "v2.json")) == 2
    new = read_costs(tmp_path / "v2.json", warn=False)
    assert new == old
    with open(path) as handle:
        raw = json.load(handle)
    for spec in SPECS:
        if sum(spec.partition) != raw["model"]["num_layers"]:
            continue
        assert _figures(predict(old, spec)) == _figures(predict(new, spec)), spec.label()


def test_version_1_defaults_are_the_ones_its_reader_guessed(tmp_path):
    """A version 1 file from before most fields: every default filled in, the warm-up moved to host."""
    data = json.loads(json.dumps(synthetic_costs()))  # each K's lines apart
    for key in ("precision", "optimizer", "optimizer_slots", "shared_parameters", "catalog_device", "system"):
        del data[key]
    for fit in data["pipeline"].values():
        del fit["gap_after_s"]
        for line in fit["actions"].values():
            del line["cold_start_s"]
    data["pipeline"]["2"]["warm_up_s"] = 3e-4
    write_v1_costs(data, tmp_path / "old.json")
    record = read_costs(tmp_path / "old.json")
    assert (record["precision"], record["optimizer"], record["optimizer_slots"], record["shared_parameters"],
            record["system"]) == ("fp32", "sgd", 0, [], "cpu")
    assert record["pipeline"]["2"]["host"] == {"warm_up_s": 3e-4} and "warm_up_s" not in record["pipeline"]["2"]
    assert record["pipeline"]["1"]["host"] == {"warm_up_s": 0.0}
    assert record["pipeline"]["2"]["gap_after_s"] == {} and record["pipeline"]["2"]["first_input_s"] == 0.0
    assert all(line["cold_start_s"] == 0.0 for line in record["pipeline"]["2"]["actions"].values())
    raw = {"kind": "gpipe-costs", "version": 1, **data}
    as_read = json.dumps(raw)
    assert upgrade(raw) == record and json.dumps(raw) == as_read  # what was read is left as it was


@pytest.mark.parametrize("where", ["precision", "model.num_layers", "profile.memory", "pipeline.2.gap_after_s",
                                   "pipeline.2.actions.F.cold_start_s", "pipeline.1.send.slope",
                                   "pipeline.2.host.warm_up_s"])
def test_version_2_refuses_a_file_without_a_key_naming_it_and_the_fix(where, tmp_path):
    data = synthetic_costs()
    data["pipeline"]["2"]["host"] = {"warm_up_s": 1e-4}
    path = tmp_path / "costs.json"
    write_costs(data, path)
    with open(path) as handle:
        written = json.load(handle)
    broken = copy.deepcopy(written)
    *parents, key = where.split(".")
    entry = broken
    for part in parents:
        entry = entry[part]
    del entry[key]
    with open(path, "w") as handle:
        json.dump(broken, handle)
    with pytest.raises(GpipeInputError) as error:
        read_costs(path)
    message = str(error.value)
    assert f"has no {where};" in message and "gpipe calibrate --force" in message and "\n" not in message


def test_a_version_this_gpipe_does_not_know_is_one_line(tmp_path):
    path = tmp_path / "costs.json"
    with open(path, "w") as handle:
        json.dump({**synthetic_costs(), "kind": "gpipe-costs", "version": 3}, handle)
    with pytest.raises(GpipeInputError, match=r"costs file version 3 is not supported; this gpipe reads versions "
                                              r"1, 2 \(re-run gpipe calibrate --force\)"):
        read_costs(path)


def test_writing_an_incomplete_record_is_a_bug_not_a_file(tmp_path):
    data = synthetic_costs()
    del data["pipeline"]["2"]["send"]
    with pytest.raises(ValueError, match="has no pipeline.2.send"):
        write_costs(data, tmp_path / "costs.json")
    assert not (tmp_path / "costs.json").exists()
