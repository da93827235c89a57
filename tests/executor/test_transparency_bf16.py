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
from executor.models.build import build_model
from executor.runtime.data import split
from executor.runtime.pipeline import LocalPipeline
from executor.runtime.stage import PipelineStage
from tests.helpers import in_process
from tests.helpers.parity import BF16_MICROBATCHES, OPTIONS, check_bf16_step

PARTITIONS = {
    ("mlp", 1): (8,), ("mlp", 2): (3, 5), ("mlp", 4): (2, 2, 2, 2),
    ("transformer", 1): (4,), ("transformer", 2): (2, 2), ("transformer", 4): (1, 1, 1, 1),
}
BATCH, MICROBATCHES = 10, BF16_MICROBATCHES
GRID = list(itertools.product(("mlp", "transformer"), (1, 2, 4), ("always", "except_last", "never", "full"),
                              ("gpipe", "1f1b")))


def bf16_config(model: str, stages: int, checkpoint: str = "except_last", schedule: str = "gpipe") -> RunConfig:
    return RunConfig.of(model=model, options=OPTIONS[model], partition=PARTITIONS[(model, stages)],
                     batch_size=BATCH, microbatches=MICROBATCHES, checkpoint=checkpoint, schedule=schedule,
                     precision="bf16")


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
    config = RunConfig.of(model="mlp", options=OPTIONS["mlp"], partition=(3, 5), batch_size=BATCH,
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
    one_stage = LocalPipeline(RunConfig.of(model="mlp", options=OPTIONS["mlp"], partition=(8,), batch_size=BATCH,
                                        microbatches=MICROBATCHES, precision="bf16"))
    expected = [one_stage.run_step(step) for step in range(3)]
    assert data["losses"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    fp32 = LocalPipeline(RunConfig.of(model="mlp", options=OPTIONS["mlp"], partition=(8,), batch_size=BATCH,
                                   microbatches=MICROBATCHES))
    assert data["losses"][0] != pytest.approx(fp32.run_step(0), rel=1e-6)  # it did train in bf16
