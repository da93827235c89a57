"""``gpipe train`` runs of the built-in mixture-of-experts transformer under expert parallelism, and the
one process each must equal (:mod:`tests.helpers.moe_parity`): shared by the expert-parallel tests
(tests/executor/test_expert_parallel*.py)."""

from __future__ import annotations

import json

import pytest

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from tests.helpers.in_process import gpipe, option_flags
from tests.helpers.moe_parity import assert_parameters_equal, one_process
from tests.helpers.parity import checkpoint_parameters

ADAMW = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--clip-grad-norm", "0.5"]


def reference(options, batch, replicas, microbatches, steps, precision="fp32", absent=None, absent_by_step=None):
    config = RunConfig.of(model="transformer", options=options, partition=(options["layers"] + 2,), batch_size=batch,
                          microbatches=4, optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.5,
                          precision=precision)
    pipe = LocalPipeline(config)  # its batches and loss
    return one_process(config, pipe.batch, pipe.prepared.loss_fn, microbatches, steps, replicas, absent,
                       absent_by_step)


def train(tmp_path, name, options, *argv):
    root, report = tmp_path / name, tmp_path / f"{name}.json"
    result = gpipe("train", "--model", "transformer", *option_flags(options), *ADAMW, *argv,
                   "--checkpoint-dir", str(root), "--report", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(report.read_text()), root


def assert_trains_as_one_process(report, root, chunks, expected, steps, precision="fp32"):
    losses, auxes, norms, model, near_zero = expected
    rel = 1e-5 if precision == "fp32" else 1e-3
    assert report["losses"] == pytest.approx(losses, rel=rel)
    measured = [aux for aux in report["aux_losses"] if aux is not None]  # a resumed run's: from its first step
    assert measured == pytest.approx(auxes[-len(measured):], rel=rel) and min(auxes) > 0
    assert report["grad_norms"] == pytest.approx(norms, rel=rel) and min(norms) > 0.5
    atol = 1e-4 if precision == "fp32" else 2e-3
    assert_parameters_equal(checkpoint_parameters(root, chunks), model, near_zero, 0.01 * steps, atol)


def assert_bytes_as_simulated(report, options, argv, fields):
    """Each rank's ``fields`` in ``report`` equal what ``gpipe simulate`` predicts for the run of ``argv``
    (the layout's flags as the run was trained with them), rank by rank in replica order."""
    predicted = gpipe("simulate", "--model", "transformer", *option_flags(options), *argv, "--optimizer", "adamw",
                      "--json")
    assert predicted.returncode == 0, predicted.stderr
    devices = json.loads(predicted.stdout)["stages"]
    assert len(devices) == len(report["ranks"])
    for device, entry in zip(sorted(devices, key=lambda d: d["replica"]),
                             sorted(report["ranks"], key=lambda r: r.get("replica", 0))):
        for field in fields:
            assert device[field] == entry[field], (field, device["replica"])
