"""Experts under tensor and data parallelism: ``gpipe train`` (gloo, torchrun) against one process.

One process accumulates over the same micro-batches (:mod:`tests.helpers.moe_parity`): with D = 2 each
replica's M = 2 micro-batches of a batch of 8 are one process's four micro-batches of 2 rows. Losses,
the routers' auxiliary losses (the report's ``aux_losses``, summed over stages, micro-batches and
replicas) and gradient norms rtol 1e-5 (bf16: 1e-3, as the tensor-parallel tests hold bf16); every
parameter, from the checkpoint, as :func:`tests.helpers.parity.assert_adam_close` holds them, at atol
1e-4 under T = 2 (a row-parallel expert sums its ranks' partial products in another order; see
tests/executor/test_executor_tensor_parallel.py) and bf16 at 2e-3. A run saved after two steps resumes
at another layout and continues one process's losses.
"""

import json

import pytest
import torch

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from tests.helpers.in_process import option_flags
from tests.helpers.parity import checkpoint_parameters
from tests.helpers.in_process import gpipe
from tests.helpers.moe_parity import MOE, assert_parameters_equal, one_process

pytestmark = pytest.mark.slow
ADAMW = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--clip-grad-norm", "0.5"]
STEPS = 3


def reference(options, precision="fp32"):
    config = RunConfig.of(model="transformer", options=options, partition=(4,), batch_size=8, microbatches=4,
                       optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.5, precision=precision)
    pipe = LocalPipeline(config)  # its batches and loss
    return one_process(config, pipe.batch, pipe.prepared.loss_fn, 4, STEPS)


@pytest.mark.parametrize("layout,options,precision", [
    (["--stages", "2", "--partition", "2,2", "--tensor-parallel", "2", "--schedule", "1f1b", "--microbatches", "4"],
     {"top_k": 2, "shared_experts": 1, "activation": "swiglu"}, "fp32"),
    (["--stages", "2", "--partition", "2,2", "--replicas", "2", "--schedule", "gpipe", "--microbatches", "2"],
     {"top_k": 1, "shared_experts": 0, "activation": "gelu"}, "bf16"),
])
def test_experts_under_tensor_and_data_parallelism_train_as_one_process(tmp_path, layout, options, precision):
    options = {**MOE, **options}
    root, report_path = tmp_path / "ck", tmp_path / "r.json"
    result = gpipe("train", "--model", "transformer", *option_flags(options), *ADAMW, *layout, "--batch", "8",
                   "--steps", str(STEPS), "--precision", precision, "--save-every", str(STEPS),
                   "--checkpoint-dir", str(root), "--report", str(report_path))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    losses, auxes, norms, model, near_zero = reference(options, precision)
    rel = 1e-5 if precision == "fp32" else 1e-3
    assert report["losses"] == pytest.approx(losses, rel=rel)
    assert report["aux_losses"] == pytest.approx(auxes, rel=rel) and min(auxes) > 0
    assert report["grad_norms"] == pytest.approx(norms, rel=rel) and min(norms) > 0.5
    atol = 1e-4 if precision == "fp32" else 2e-3
    assert_parameters_equal(checkpoint_parameters(root, 2), model, near_zero, 0.01 * STEPS, atol)


def test_a_run_with_experts_resumes_at_another_layout(tmp_path):
    options = {**MOE, "shared_experts": 1}
    root = tmp_path / "ck"
    common = ["--model", "transformer", *option_flags(options), *ADAMW, "--batch", "8", "--microbatches", "4",
              "--checkpoint-dir", str(root)]
    first = gpipe("train", *common, "--stages", "2", "--partition", "2,2", "--tensor-parallel", "2", "--steps", "2",
                  "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = gpipe("train", *common, "--stages", "1", "--steps", str(STEPS), "--resume",
                    "--report", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "gpipe: step 2 loss" in resumed.stdout and "gpipe: step 1 loss" not in resumed.stdout
    losses, auxes, _, _, _ = reference(options)
    report = json.loads((tmp_path / "resumed.json").read_text())
    assert report["losses"] == pytest.approx(losses, rel=1e-5)
    assert report["aux_losses"][:2] == [None, None] and report["aux_losses"][2] == pytest.approx(auxes[2], rel=1e-5)


def test_hugging_face_mixtral_under_data_parallelism_trains_as_one_process(tmp_path):
    """K = 2 x D = 2 against the in-process pipeline on one replica's micro-batches (which
    tests/executor/test_hf_moe.py holds to the model's own): the routers' sums cross the stage boundary."""
    from tests.helpers.moe_parity import HF_MOE_CONFIGS as CONFIGS

    options = {**CONFIGS["mixtral"], "seq": 8}
    result = gpipe("train", "--model", "hf:mixtral", *option_flags(options), *ADAMW, "--stages", "2", "--replicas",
                   "2", "--batch", "8", "--microbatches", "2", "--steps", "2", "--report", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    pipe = LocalPipeline(RunConfig.of(model="hf:mixtral", options=options, partition=(4,), batch_size=8, microbatches=4,
                                   optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.5, steps=2))
    from executor.models.moe_aux_loss import take_aux_loss

    take_aux_loss()
    losses, auxes = [], []
    for step in range(2):
        losses.append(pipe.run_step(step))
        auxes.append(take_aux_loss())
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["losses"] == pytest.approx(losses, rel=1e-5)
    assert report["aux_losses"] == pytest.approx(auxes, rel=1e-5) and min(auxes) > 0
    assert report["grad_norms"] == pytest.approx(pipe.grad_norms, rel=1e-5)
