"""``--data text``: byte-level windows of the shipped text, the same for the pipeline and the model alone.

The windows are checked against the file read with plain Python; the pipeline trained on them is
compared with the unpipelined model trained by torch alone on the same windows (AdamW, fp32;
losses rtol 1e-5, atol 1e-6; parameters as ``tests.helpers.parity.assert_adam_close``), and its loss must fall
well below ln(256), where a model that guesses uniformly over bytes sits.
"""

import math

import pytest
import torch

from executor.config import RunConfig
from executor.models.build import build_model
from executor.runtime.data import batch_for_step
from executor.runtime.pipeline import LocalPipeline
from executor.runtime.text_data import SHIPPED_TEXT, is_text_data, text_path
from sim.errors import GpipeInputError
from tests.helpers.parity import NEAR_ZERO_GRADIENT, assert_adam_close

OPTIONS = {"layers": 2, "d_model": 32, "ff": 64, "heads": 4, "seq": 16, "vocab": 256}


def test_rows_are_windows_of_the_file_and_targets_the_next_byte():
    raw = open(SHIPPED_TEXT, "rb").read()
    inputs, targets = batch_for_step("transformer", OPTIONS, 6, seed=3, step=2, data="text")
    assert inputs.shape == targets.shape == (6, 16) and inputs.dtype == torch.int64
    for row, target in zip(inputs.tolist(), targets.tolist()):
        start = raw.find(bytes(row))
        assert start >= 0, "a row is not a window of the text"
        assert bytes(target) == raw[start + 1:start + 17]


def test_batches_are_a_pure_function_of_seed_and_step():
    a = batch_for_step("transformer", OPTIONS, 4, seed=1, step=5, data="text")
    b = batch_for_step("transformer", OPTIONS, 4, seed=1, step=5, data="text")
    c = batch_for_step("transformer", OPTIONS, 4, seed=1, step=6, data="text")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])


def test_the_shipped_text_is_small_and_says_where_it_comes_from():
    import os

    assert 50_000 < os.path.getsize(SHIPPED_TEXT) <= 300_000
    readme = open(os.path.join(os.path.dirname(SHIPPED_TEXT), "README.md")).read()
    assert "karpathy/char-rnn" in readme and "public domain" in readme


def test_a_users_file_and_the_names_that_select_text(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"abcdefghijklmnopqrstuvwxyz" * 4)
    inputs, targets = batch_for_step("transformer", OPTIONS, 2, seed=0, step=0, data=f"text:{path}")
    assert bytes(inputs[0].tolist()) in path.read_bytes()
    assert is_text_data("text") and is_text_data(f"text:{path}") and not is_text_data("my_pkg.data:batches")
    assert text_path("text") == SHIPPED_TEXT


@pytest.mark.parametrize("model,options,words", [
    ("mlp", {"width": 8}, "not one"),
    ("transformer", {**OPTIONS, "vocab": 64}, "vocabulary is 64"),
    ("transformer", {**OPTIONS, "seq": 10**7}, "fewer than one row"),
])
def test_refused_in_one_line(model, options, words):
    with pytest.raises(GpipeInputError, match=words):
        batch_for_step(model, options, 2, seed=0, step=0, data="text")


def test_pipelined_training_on_text_equals_the_model_alone_and_learns():
    steps = 6
    config = RunConfig.of(model="transformer", options=OPTIONS, partition=(2, 2), batch_size=8, microbatches=4,
                       schedule="1f1b", checkpoint="except_last", optimizer="adamw", lr=0.01, steps=steps,
                       data="text")
    pipe = LocalPipeline(config)
    reference = build_model("transformer", OPTIONS, 0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)
    losses = []
    near_zero = [torch.zeros_like(p, dtype=torch.bool) for p in reference.parameters()]
    for step in range(steps):
        inputs, targets = batch_for_step("transformer", OPTIONS, 8, seed=0, step=step, data="text")
        loss = pipe.run_step(step)
        optimizer.zero_grad()
        ref = pipe.prepared.loss_fn(reference(inputs), targets)
        ref.backward()
        for mask, p in zip(near_zero, reference.parameters()):
            mask |= p.grad.abs() < NEAR_ZERO_GRADIENT
        optimizer.step()
        torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")
        losses.append(loss)
    atol = 1e-5 if any(mask.any() for mask in near_zero) else 1e-6
    for (name, p), q, mask in zip(pipe.model().named_parameters(), reference.parameters(), near_zero):
        assert_adam_close(name, p, q, mask, config.lr * steps, atol)
    assert losses[0] > math.log(256) - 0.5 and losses[-1] < math.log(256) - 1.0, losses
