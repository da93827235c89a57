"""Expert parallelism on Hugging Face mixtures of experts (``--model hf:mixtral``, ``hf:qwen3_moe``,
``--expert-parallel 2 --replicas 2``, gloo, torchrun) against one process.

Each rank keeps half of every block's 3-D expert tensors and routes with the block's own router
(:mod:`executor.parallel.hf_experts`). One process accumulates over the micro-batches the replicas
train (:mod:`tests.helpers.moe_parity`). Losses, the routers' auxiliary losses and gradient norms
rtol 1e-5, every parameter from the checkpoint (the experts gathered whole) as
:func:`tests.helpers.parity.assert_adam_close` holds them at atol 1e-4, as
tests/executor/test_expert_parallel.py holds the built-in's; bf16 at rtol 1e-3 and atol 2e-3. Three
launches: Mixtral (top-2) on one stage in fp32 and in bf16, Qwen3-MoE (top-1, a dense layer between
MoE layers) on two stages under 1F1B; two more save Mixtral at E = 1 and resume it at E = 2, which
continues one process's run.
"""

import json

import pytest

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from tests.helpers.in_process import option_flags
from tests.helpers.parity import checkpoint_parameters
from tests.helpers.moe_parity import HF_MOE_CONFIGS as CONFIGS
from tests.helpers.moe_parity import assert_parameters_equal, one_process

pytestmark = pytest.mark.slow
ADAMW = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--clip-grad-norm", "0.5"]
STEPS = 3


def reference(family, options, layers, precision="fp32"):
    config = RunConfig.of(model=f"hf:{family}", options=options, partition=(layers,), batch_size=8, microbatches=4,
                          optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.5, precision=precision)
    pipe = LocalPipeline(config)  # its batches and loss
    return one_process(config, pipe.batch, pipe.prepared.loss_fn, 2, STEPS, 2)


def train(tmp_path, name, family, options, *argv):
    from tests.helpers.in_process import gpipe

    root, report = tmp_path / "ck", tmp_path / f"{name}.json"
    result = gpipe("train", "--model", f"hf:{family}", *option_flags(options), *ADAMW, "--replicas", "2",
                   "--batch", "8", "--microbatches", "2", "--checkpoint-dir", str(root), "--report", str(report), *argv)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(report.read_text()), root


def assert_as_one_process(report, expected, root, chunks, precision="fp32"):
    losses, auxes, norms, model, near_zero = expected
    rel, atol = (1e-5, 1e-4) if precision == "fp32" else (1e-3, 2e-3)
    assert report["losses"] == pytest.approx(losses, rel=rel)
    measured = [aux for aux in report["aux_losses"] if aux is not None]  # a resumed run's: from its first step
    assert measured == pytest.approx(auxes[-len(measured):], rel=rel) and min(auxes) > 0
    assert report["grad_norms"] == pytest.approx(norms[-len(report["grad_norms"]):], rel=rel)
    assert_parameters_equal(checkpoint_parameters(root, chunks), model, near_zero, 0.01 * STEPS, atol)


@pytest.mark.parametrize("family,layers,layout,chunks,precision", [
    ("mixtral", 4, ["--stages", "1"], 1, "fp32"),
    ("mixtral", 4, ["--stages", "1"], 1, "bf16"),  # the experts multiply in fp32 as grouped_mm does
    ("qwen3_moe", 5, ["--stages", "2", "--partition", "2,3", "--schedule", "1f1b"], 2, "fp32"),
])
def test_hugging_face_experts_sharded_over_two_replicas_train_as_one_process(tmp_path, family, layers, layout, chunks,
                                                                            precision):
    options = {**CONFIGS[family], "seq": 8}
    report, root = train(tmp_path, "ep", family, options, *layout, "--expert-parallel", "2", "--steps", str(STEPS),
                         "--save-every", str(STEPS), "--precision", precision)
    assert_as_one_process(report, reference(family, options, layers, precision), root, chunks, precision)


def test_a_hugging_face_run_saved_without_expert_parallelism_resumes_under_it(tmp_path):
    """Mixtral saved at E = 1 after two steps, resumed at E = 2 for the third: each rank takes its rows
    of the whole expert tensors and their optimizer state, and the checkpoint it writes gathers them."""
    options = {**CONFIGS["mixtral"], "seq": 8}
    train(tmp_path, "first", "mixtral", options, "--stages", "1", "--steps", "2", "--save-every", "2")
    report, root = train(tmp_path, "resumed", "mixtral", options, "--stages", "1", "--expert-parallel", "2",
                         "--steps", str(STEPS), "--save-every", str(STEPS), "--resume")
    assert report["aux_losses"][:2] == [None, None]
    assert_as_one_process(report, reference("mixtral", options, 4), root, 1)
