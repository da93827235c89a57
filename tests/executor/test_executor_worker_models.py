"""Multi-process runs of models that pass several tensors between stages and share parameters."""

import json

import pytest

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from tests.helpers import in_process

pytestmark = pytest.mark.slow


def train(tmp_path, *args):
    report = tmp_path / "report.json"
    result = in_process.gpipe("train", *args, "--report", str(report))
    assert result.returncode == 0, result.stderr
    return json.loads(report.read_text())


def test_dicts_and_tuples_cross_three_processes(tmp_path):
    data = train(tmp_path, "--model", "tests.helpers.sample_models:several_tensors", "--loss", "mse", "--partition",
                 "1,2,3", "--batch", "10", "--microbatches", "3", "--steps", "3", "--lr", "0.1")
    pipe = LocalPipeline(RunConfig.of(model="tests.helpers.sample_models:several_tensors", loss="mse", partition=(6,),
                                   batch_size=10, microbatches=3, lr=0.1))
    assert data["losses"] == pytest.approx([pipe.run_step(s) for s in range(3)], rel=1e-5, abs=1e-6)


def test_a_tied_head_on_another_process_trains_as_one_model(tmp_path):
    common = ["--model", "tests.helpers.sample_models:tied_lm", "--data", "tests.helpers.sample_models:tied_lm_data", "--loss",
              "cross_entropy", "--batch", "8", "--microbatches", "4", "--steps", "4", "--optimizer", "adam",
              "--lr", "0.05"]
    data = train(tmp_path, *common, "--partition", "2,2", "--schedule", "1f1b")
    pipe = LocalPipeline(RunConfig.of(model="tests.helpers.sample_models:tied_lm", data="tests.helpers.sample_models:tied_lm_data",
                                   loss="cross_entropy", partition=(4,), batch_size=8, microbatches=4,
                                   optimizer="adam", lr=0.05))
    assert data["losses"] == pytest.approx([pipe.run_step(s) for s in range(4)], rel=1e-5, abs=1e-6)
    kinds = {r["kind"] for r in data["timeline"]["records"]}
    assert "allreduce_shared" in kinds
