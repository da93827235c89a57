"""The pipeline computes exactly what the unpipelined model computes: losses and every gradient.

For K in {1, 2, 4}, M in {1, 3, 4, 8}, every re-materialization policy and both schedules, one step
of the in-process pipeline (the same schedule walk, sends and receives as the multi-process
executor, joined by in-process mailboxes) is compared with one plain forward and backward of the
whole model on the same mini-batch. Batch 10 is uneven for M = 3, 4 and 8 (torch.chunk gives
4,4,2 / 3,3,3,1 / 2,2,2,2,2). fp32; tolerances: losses rtol 1e-6, atol 1e-6; gradients rtol 1e-5,
atol 1e-6 (micro-batch sums reorder float additions, nothing else differs).
"""

import itertools

import pytest
import torch

from executor.config import RunConfig
from executor.models import build_model
from executor.pipeline import LocalPipeline

PARTITIONS = {
    ("mlp", 1): (8,), ("mlp", 2): (3, 5), ("mlp", 4): (2, 2, 2, 2),
    ("transformer", 1): (4,), ("transformer", 2): (2, 2), ("transformer", 4): (1, 1, 1, 1),
}
OPTIONS = {"mlp": {"width": 32}, "transformer": {"layers": 2, "d_model": 32, "ff": 64, "seq": 8, "vocab": 64}}
GRID = list(itertools.product(("mlp", "transformer"), (1, 2, 4), (1, 3, 4, 8),
                              ("always", "except_last", "never"), ("gpipe", "1f1b")))


def reference(config: RunConfig, inputs, targets, loss_fn):
    model = build_model(config.model, config.options, config.seed)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.detach(), dict(model.named_parameters())


def check_step(config: RunConfig) -> None:
    pipe = LocalPipeline(config)
    inputs, targets = pipe.batch(0)
    loss = pipe.run_step(0, update=False)
    ref_loss, ref_params = reference(config, inputs, targets, pipe.prepared.loss_fn)
    torch.testing.assert_close(torch.tensor(loss), ref_loss, rtol=1e-6, atol=1e-6)
    params = dict(pipe.model().named_parameters())
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name].grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("model,stages,microbatches,checkpoint,schedule", GRID)
def test_one_step_matches_unpipelined(model, stages, microbatches, checkpoint, schedule):
    check_step(RunConfig(model=model, options=OPTIONS[model], partition=PARTITIONS[(model, stages)],
                         batch_size=10, microbatches=microbatches, checkpoint=checkpoint, schedule=schedule))


@pytest.mark.parametrize("batch_size,microbatches", [(2, 4), (1, 3), (7, 7)])
def test_batch_smaller_than_or_equal_to_microbatches(batch_size, microbatches):
    check_step(RunConfig(model="mlp", options=OPTIONS["mlp"], partition=(2, 2, 2, 2), batch_size=batch_size,
                         microbatches=microbatches, schedule="1f1b"))


def test_several_steps_match_unpipelined_sgd():
    config = RunConfig(model="mlp", options=OPTIONS["mlp"], partition=(3, 5), batch_size=10, microbatches=4,
                       lr=0.1)
    pipe = LocalPipeline(config)
    model = build_model("mlp", OPTIONS["mlp"], 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        inputs, targets = pipe.batch(step)
        loss = pipe.run_step(step)
        optimizer.zero_grad()
        ref = pipe.prepared.loss_fn(model(inputs), targets)
        ref.backward()
        optimizer.step()
        torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(pipe.model().named_parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
