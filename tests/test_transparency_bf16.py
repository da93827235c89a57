"""bf16: the pipeline computes what the unpipelined model computes under the same autocast.

For K in {1, 2, 4}, every re-materialization policy and both schedules, one step of the in-process
pipeline at ``precision="bf16"`` (layers under CPU autocast, loss in fp32 on the output cast to
fp32, fp32 weights) is compared with two unpipelined references run under the same autocast, on
batch 10 in M = 4 micro-batches (3,3,3,1):

1. the whole model on each micro-batch in turn, gradients accumulated (the pipeline's arithmetic
   without its stages): the same tolerances as fp32 (losses rtol 1e-6, atol 1e-6; gradients rtol
   1e-5, atol 1e-6). Measured here: losses equal, gradients equal for the mlp and within 1.5e-7 of
   each tensor's largest element for the transformer (fp32 sums of micro-batch gradients in the
   schedule's order). A recompute without autocast moves the transformer's gradients by 7e-3 to
   1.1e-2 of the tensor's largest element and its loss by 5e-5 to 7e-5 relative; the mlp's fails
   outright (a bf16 boundary input meets fp32 weights). ``test_the_bf16_check_can_fail`` runs it.
2. the whole model on the whole batch at once: losses rtol 1e-6 (measured 1.1e-7: bf16 matmuls give
   each row the same result whatever rows share the call); gradients within 1.5e-2 of each tensor's
   largest element (measured 7.0e-3 for the mlp, 5.6e-3 for the transformer, over K in {1, 2, 4},
   M in {1, 3, 4, 8}, every policy and schedule). A weight gradient is a bf16 matmul over the rows:
   the whole batch rounds the sum over all rows to bf16 once (2^-8 relative), the pipeline rounds
   each micro-batch's partial sum and adds them in fp32, so elements differ by a few bf16 units of
   rounding; 1.5e-2 is about two of the measured worst, four bf16 units of the largest element.

The multi-process test (``slow``) trains K=2 with ``gpipe train --precision bf16`` and compares its
losses over three SGD steps with K=1 in process: rtol 1e-6 (the stages' arithmetic is the same).
"""

import itertools
import json

import pytest
import torch

from executor.config import RunConfig
from executor.runtime.data import split
from executor.models.build import build_model
from executor.runtime.pipeline import LocalPipeline
from executor.runtime.stage import PipelineStage
from tests import in_process

PARTITIONS = {
    ("mlp", 1): (8,), ("mlp", 2): (3, 5), ("mlp", 4): (2, 2, 2, 2),
    ("transformer", 1): (4,), ("transformer", 2): (2, 2), ("transformer", 4): (1, 1, 1, 1),
}
OPTIONS = {"mlp": {"width": 32}, "transformer": {"layers": 2, "d_model": 32, "ff": 64, "seq": 8, "vocab": 64}}
BATCH, MICROBATCHES = 10, 4
WHOLE_BATCH_GRAD_TOLERANCE = 1.5e-2  # of each gradient's largest element; see the module docstring
GRID = list(itertools.product(("mlp", "transformer"), (1, 2, 4), ("always", "except_last", "never", "full"),
                              ("gpipe", "1f1b")))


def bf16_config(model: str, stages: int, checkpoint: str = "except_last", schedule: str = "gpipe") -> RunConfig:
    return RunConfig(model=model, options=OPTIONS[model], partition=PARTITIONS[(model, stages)],
                     batch_size=BATCH, microbatches=MICROBATCHES, checkpoint=checkpoint, schedule=schedule,
                     precision="bf16")


def unpipelined(config: RunConfig, inputs, targets, loss_fn, microbatches: int):
    """The whole model under CPU autocast on ``microbatches`` chunks in turn (1: the whole batch),
    each loss scaled to the mini-batch mean, gradients accumulated; (loss, named parameters)."""
    model = build_model(config.model, config.options, config.seed)
    total = torch.zeros(())
    for x, t in zip(split(inputs, microbatches), split(targets, microbatches)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        loss = loss_fn(y.float(), t) * (x.shape[0] / config.batch_size)
        loss.backward()
        total += loss.detach()
    return total, dict(model.named_parameters())


def pipelined(config: RunConfig):
    pipe = LocalPipeline(config)
    inputs, targets = pipe.batch(0)
    loss = pipe.run_step(0, update=False)
    return pipe, torch.tensor(loss), dict(pipe.model().named_parameters()), inputs, targets


def check_bf16_step(config: RunConfig) -> None:
    pipe, loss, params, inputs, targets = pipelined(config)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params.values())
    ref_loss, ref_params = unpipelined(config, inputs, targets, pipe.prepared.loss_fn, MICROBATCHES)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name].grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    whole_loss, whole_params = unpipelined(config, inputs, targets, pipe.prepared.loss_fn, 1)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=1e-6)
    for name, ref in whole_params.items():
        scale = float(ref.grad.abs().max())
        torch.testing.assert_close(params[name].grad, ref.grad, rtol=0.0,
                                   atol=WHOLE_BATCH_GRAD_TOLERANCE * scale, msg=name)


@pytest.mark.parametrize("model,stages,checkpoint,schedule", GRID)
def test_bf16_step_matches_unpipelined_under_autocast(model, stages, checkpoint, schedule):
    check_bf16_step(bf16_config(model, stages, checkpoint, schedule))


@pytest.mark.parametrize("stages,schedule", [(2, "gpipe"), (4, "1f1b")])
def test_bf16_selective_recompute_matches_unpipelined_under_autocast(stages, schedule):
    """The attention core rerun in the backward at the forward's autocast state."""
    check_bf16_step(bf16_config("transformer", stages, "selective", schedule))


def test_the_bf16_check_can_fail(monkeypatch):
    """A recompute that forgets autocast: the transformer's gradients (and its recomputed loss)
    leave the tolerances, the mlp's bf16 boundary input meets fp32 weights and fails."""
    original = PipelineStage._recompute

    def recompute_in_fp32(self, m):
        self._layers = self.module  # shadows the autocast wrapper for this call only
        try:
            original(self, m)
        finally:
            del self._layers

    monkeypatch.setattr(PipelineStage, "_recompute", recompute_in_fp32)
    with pytest.raises(AssertionError):
        check_bf16_step(bf16_config("transformer", 2, "always"))
    with pytest.raises(RuntimeError, match="dtype"):
        check_bf16_step(bf16_config("mlp", 2, "always"))


def test_boundaries_cross_in_the_dtype_autocast_produced():
    """The mlp sends bf16 (Linear + ReLU under autocast: half the bytes of fp32) and gets bf16
    gradients back; the transformer's residual stream stays fp32 (a bf16 branch added onto fp32
    promotes), so its blocks exchange fp32 under bf16 too."""
    mlp = LocalPipeline(bf16_config("mlp", 2))
    assert [[leaf.dtype for leaf in b.leaves] for b in mlp.prepared.boundaries] == [
        [torch.float32], [torch.bfloat16], [torch.bfloat16]]
    sent = []
    transport = mlp.stages[0].transport
    send = transport.send
    transport.send = lambda channel, m, tensors: (sent.extend((channel, t.dtype) for t in tensors),
                                                  send(channel, m, tensors))
    grads = []
    back = mlp.stages[1].transport
    back_send = back.send
    back.send = lambda channel, m, tensors: (grads.extend((channel, t.dtype) for t in tensors),
                                             back_send(channel, m, tensors))
    mlp.run_step(0)
    assert set(sent) == {("act", torch.bfloat16)} and set(grads) == {("grad", torch.bfloat16)}
    transformer = LocalPipeline(bf16_config("transformer", 2))
    assert [leaf.dtype for leaf in transformer.prepared.boundaries[1].leaves] == [torch.float32]
    assert [leaf.dtype for leaf in transformer.prepared.boundaries[-1].leaves] == [torch.bfloat16]  # logits


def test_several_bf16_steps_keep_fp32_master_weights_and_optimizer_state():
    """Adam over three steps: the pipeline's fp32 weights and moments follow the micro-batched
    unpipelined run's under the same autocast."""
    config = RunConfig(model="mlp", options=OPTIONS["mlp"], partition=(3, 5), batch_size=BATCH,
                       microbatches=MICROBATCHES, optimizer="adam", lr=1e-3, precision="bf16")
    pipe = LocalPipeline(config)
    model = build_model("mlp", OPTIONS["mlp"], 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(3):
        inputs, targets = pipe.batch(step)
        loss = pipe.run_step(step)
        optimizer.zero_grad()
        total = 0.0
        for x, t in zip(split(inputs, MICROBATCHES), split(targets, MICROBATCHES)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            part = pipe.prepared.loss_fn(y.float(), t) * (x.shape[0] / BATCH)
            part.backward()
            total += float(part.detach())
        optimizer.step()
        assert loss == pytest.approx(total, rel=1e-6, abs=1e-7)
    for (name, p), q in zip(pipe.model().named_parameters(), model.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    states = [s for stage in pipe.stages for s in stage.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)


@pytest.mark.slow
def test_two_processes_in_bf16_match_one_stage(tmp_path):
    report = tmp_path / "report.json"
    result = in_process.gpipe("train", "--model", "mlp", "--option", "width=32",
                              "--batch", str(BATCH), "--microbatches", str(MICROBATCHES), "--stages", "2",
                              "--checkpoint", "always", "--schedule", "1f1b", "--steps", "3", "--precision", "bf16",
                              "--report", str(report))
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["config"]["precision"] == "bf16" and data["plan"]["precision"] == "bf16"
    one_stage = LocalPipeline(RunConfig(model="mlp", options=OPTIONS["mlp"], partition=(8,), batch_size=BATCH,
                                        microbatches=MICROBATCHES, precision="bf16"))
    expected = [one_stage.run_step(step) for step in range(3)]
    assert data["losses"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    fp32 = LocalPipeline(RunConfig(model="mlp", options=OPTIONS["mlp"], partition=(8,), batch_size=BATCH,
                                   microbatches=MICROBATCHES))
    assert data["losses"][0] != pytest.approx(fp32.run_step(0), rel=1e-6)  # it did train in bf16
