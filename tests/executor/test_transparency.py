"""The pipeline computes exactly what the unpipelined model computes: losses and every gradient.

For K in {1, 2, 4}, M in {1, 3, 4, 8}, every re-materialization policy and both schedules, one step
of the in-process pipeline (the same schedule walk, sends and receives as the multi-process
executor, joined by in-process mailboxes) is compared with one plain forward and backward of the
whole model on the same mini-batch. Batch 10 is uneven for M = 3, 4 and 8 (torch.chunk gives
4,4,2 / 3,3,3,1 / 2,2,2,2,2). fp32; tolerances: losses rtol 1e-6, atol 1e-6; gradients rtol 1e-5,
atol 1e-6 (micro-batch sums reorder float additions, nothing else differs).

Several steps of training compare with the unpipelined model trained by torch alone: SGD (with and
without clipping), and AdamW with weight decay, clipping by the global norm
(``torch.nn.utils.clip_grad_norm_``) at a norm small enough that every step clips, and warm-up then a
cosine learning rate built from torch's stock schedulers (``LinearLR``, ``CosineAnnealingLR``,
``SequentialLR``), for K in {1, 2, 4}, every policy and both schedules; warm-up then constant on a
slice of that grid. Tolerances there: losses and norms rtol 1e-5, parameters rtol 1e-5, atol 1e-6.
"""

import itertools

import pytest
import torch

from executor.config import RunConfig
from executor.models.build import build_model
from executor.runtime.pipeline import LocalPipeline
from tests.helpers.parity import CLIP, OPTIONS, check_adamw_steps, check_step

PARTITIONS = {
    ("mlp", 1): (8,), ("mlp", 2): (3, 5), ("mlp", 4): (2, 2, 2, 2),
    ("transformer", 1): (4,), ("transformer", 2): (2, 2), ("transformer", 4): (1, 1, 1, 1),
}
GRID = list(itertools.product(("mlp", "transformer"), (1, 2, 4), (1, 3, 4, 8),
                              ("always", "except_last", "never", "full"), ("gpipe", "1f1b")))
# the split backward (I, then W later): every policy it takes (full's per-layer recompute is refused)
GRID += list(itertools.product(("mlp", "transformer"), (2, 4), (3, 8), ("always", "except_last", "never"),
                               ("zb-h1",)))


@pytest.mark.parametrize("model,stages,microbatches,checkpoint,schedule", GRID)
def test_one_step_matches_unpipelined(model, stages, microbatches, checkpoint, schedule):
    check_step(RunConfig.of(model=model, options=OPTIONS[model], partition=PARTITIONS[(model, stages)],
                         batch_size=10, microbatches=microbatches, checkpoint=checkpoint, schedule=schedule))


@pytest.mark.parametrize("batch_size,microbatches", [(2, 4), (1, 3), (7, 7)])
def test_batch_smaller_than_or_equal_to_microbatches(batch_size, microbatches):
    check_step(RunConfig.of(model="mlp", options=OPTIONS["mlp"], partition=(2, 2, 2, 2), batch_size=batch_size,
                         microbatches=microbatches, schedule="1f1b"))


def test_several_steps_match_unpipelined_sgd():
    config = RunConfig.of(model="mlp", options=OPTIONS["mlp"], partition=(3, 5), batch_size=10, microbatches=4,
                       optimizer="sgd", lr=0.1)
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


ADAMW_STEPS = 5


# cosine over the whole grid; warm-up then constant on one policy and schedule per K
ADAMW_GRID = [(*case, "cosine") for case in itertools.product(
    ("mlp", "transformer"), (1, 2, 4), ("always", "except_last", "never", "full"), ("gpipe", "1f1b"))] + [
    (model, stages, checkpoint, schedule, "constant") for model in ("mlp", "transformer")
    for stages, checkpoint, schedule in ((1, "always", "gpipe"), (2, "except_last", "1f1b"), (4, "never", "gpipe"))]


@pytest.mark.parametrize("model,stages,checkpoint,schedule,lr_schedule", ADAMW_GRID)
def test_adamw_with_clipping_and_lr_schedule_matches_unpipelined(model, stages, checkpoint, schedule, lr_schedule):
    config = RunConfig.of(model=model, options=OPTIONS[model], partition=PARTITIONS[(model, stages)], batch_size=10,
                       microbatches=3, checkpoint=checkpoint, schedule=schedule, optimizer="adamw", lr=0.01,
                       weight_decay=0.1, clip_grad_norm=CLIP[model], lr_schedule=lr_schedule, lr_warmup_steps=2,
                       steps=ADAMW_STEPS)
    check_adamw_steps(config)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_sgd_clipping_uses_the_norm_over_all_stages(stages):
    """SGD's update is proportional to the clip coefficient (Adam's is nearly blind to a common scale),
    so a stage clipped by its own, smaller norm would move differently from torch's whole-model clip."""
    config = RunConfig.of(model="mlp", options=OPTIONS["mlp"], partition=PARTITIONS[("mlp", stages)], batch_size=10,
                       microbatches=3, optimizer="sgd", lr=0.5, weight_decay=0.01, clip_grad_norm=CLIP["mlp"],
                       steps=3)
    pipe = LocalPipeline(config)
    reference = build_model("mlp", OPTIONS["mlp"], 0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, weight_decay=0.01)
    for step in range(3):
        inputs, targets = pipe.batch(step)
        pipe.run_step(step)
        optimizer.zero_grad()
        pipe.prepared.loss_fn(reference(inputs), targets).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP["mlp"])
        optimizer.step()
        assert norm > CLIP["mlp"]
    for (name, p), q in zip(pipe.model().named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stages,checkpoint,schedule", [(2, "always", "gpipe"), (4, "except_last", "1f1b")])
def test_grouped_query_attention_matches_unpipelined(stages, checkpoint, schedule):
    """Two key/value heads for four query heads (``kv_heads``): one step against the whole model."""
    options = {**OPTIONS["transformer"], "heads": 4, "kv_heads": 2}
    check_step(RunConfig.of(model="transformer", options=options, partition=PARTITIONS[("transformer", stages)],
                         batch_size=10, microbatches=3, checkpoint=checkpoint, schedule=schedule))


def test_kv_heads_that_do_not_divide_heads_are_one_line_in_both_halves():
    from executor.models.build import build_model
    from sim.errors import GpipeInputError
    from sim.workloads.models import get_workload

    for build in (lambda o: get_workload("transformer", o), lambda o: build_model("transformer", o)):
        with pytest.raises(GpipeInputError, match="kv_heads=3 does not divide heads=4"):
            build({**OPTIONS["transformer"], "heads": 4, "kv_heads": 3})


SELECTIVE_GRID = list(itertools.product((1, 2, 4), (1, 3, 8), ("gpipe", "1f1b"))) + [(2, 3, "zb-h1"), (4, 8, "zb-h1")]


@pytest.mark.parametrize("stages,microbatches,schedule", SELECTIVE_GRID)
def test_selective_recompute_matches_unpipelined(stages, microbatches, schedule):
    """``--checkpoint selective``: the attention cores rerun inside the backward; the transformer only."""
    check_step(RunConfig.of(model="transformer", options=OPTIONS["transformer"], partition=PARTITIONS[("transformer", stages)],
                         batch_size=10, microbatches=microbatches, checkpoint="selective", schedule=schedule))


def test_selective_recompute_with_adamw_and_grouped_attention():
    config = RunConfig.of(model="transformer", options={**OPTIONS["transformer"], "heads": 4, "kv_heads": 2},
                       partition=PARTITIONS[("transformer", 2)], batch_size=10, microbatches=3, checkpoint="selective",
                       schedule="1f1b", optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=CLIP["transformer"],
                       lr_schedule="cosine", lr_warmup_steps=2, steps=ADAMW_STEPS)
    check_adamw_steps(config)


def test_selective_recompute_is_refused_where_there_is_no_attention_core():
    from sim.errors import GpipeInputError

    with pytest.raises(GpipeInputError, match="--checkpoint selective recomputes the attention core of the built-in "
                                              "transformer only, not mlp; use full"):
        RunConfig.of(model="mlp", options=OPTIONS["mlp"], partition=(8,), checkpoint="selective").validate()


def test_squared_relu_and_swiglu_match_unpipelined_and_an_unknown_activation_is_one_line():
    from executor.models.build import build_model
    from sim.errors import GpipeInputError
    from sim.workloads.models import get_workload

    for activation, checkpoint in (("squared_relu", "full"), ("swiglu", "selective")):
        options = {**OPTIONS["transformer"], "activation": activation}
        check_step(RunConfig.of(model="transformer", options=options, partition=PARTITIONS[("transformer", 2)],
                             batch_size=10, microbatches=3, checkpoint=checkpoint, schedule="1f1b"))
    for build in (lambda o: get_workload("transformer", o), lambda o: build_model("transformer", o)):
        with pytest.raises(GpipeInputError, match="activation='swish'"):
            build({**OPTIONS["transformer"], "activation": "swish"})


@pytest.mark.parametrize("checkpoint,kv_heads", [("never", 0), ("full", 2), ("selective", 0)])
def test_flash_attention_matches_unpipelined(checkpoint, kv_heads):
    """``attention=flash``: ``scaled_dot_product_attention`` in place of the explicit scores."""
    options = {**OPTIONS["transformer"], "heads": 4, "kv_heads": kv_heads, "attention": "flash"}
    check_step(RunConfig.of(model="transformer", options=options, partition=PARTITIONS[("transformer", 2)], batch_size=10,
                         microbatches=3, checkpoint=checkpoint, schedule="1f1b"))
