"""Shards carry the optimizer and the schedule: a pipeline restored mid-run takes the same steps."""

import pytest
import torch

from executor import checkpoint
from executor.config import RunConfig
from executor.pipeline import LocalPipeline
from sim.errors import GpipeInputError

ADAMW = dict(model="mlp", options={"width": 32}, partition=(3, 5), batch_size=10, microbatches=3,
             optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.05, lr_schedule="cosine",
             lr_warmup_steps=2, steps=6)


def test_restored_stages_continue_exactly(tmp_path):
    config = RunConfig(**ADAMW)
    full = LocalPipeline(config)
    full_losses = [full.run_step(s) for s in range(6)]

    first = LocalPipeline(config)
    losses = [first.run_step(s) for s in range(3)]
    for stage in first.stages:
        checkpoint.save_shard(str(tmp_path), 2, stage)
    checkpoint.write_manifest(str(tmp_path), 2, 2, losses, config.to_dict(), first.grad_norms)

    resumed = LocalPipeline(config)  # fresh weights, optimizer state and schedule
    manifest = checkpoint.read_manifest(str(tmp_path))
    for stage in resumed.stages:
        checkpoint.load_shard(str(tmp_path), manifest, stage)
    assert resumed.stages[0].scheduler.last_epoch == 3
    assert resumed.stages[0].optimizer.param_groups[0]["lr"] == config.optim_settings().lr_at(3)
    losses += [resumed.run_step(s) for s in range(3, 6)]
    assert losses == full_losses
    assert manifest["grad_norms"] + resumed.grad_norms == full.grad_norms
    for p, q in zip(resumed.model().parameters(), full.model().parameters()):
        assert torch.equal(p, q)


def test_without_the_optimizer_state_the_run_differs(tmp_path):
    """The check above can fail: restoring the layers alone (fresh Adam moments, schedule at step 0)
    does not continue the run."""
    config = RunConfig(**ADAMW)
    full = LocalPipeline(config)
    full_losses = [full.run_step(s) for s in range(5)]
    first = LocalPipeline(config)
    for s in range(3):
        first.run_step(s)
    resumed = LocalPipeline(config)
    for ours, theirs in zip(resumed.stages, first.stages):
        ours.module.load_state_dict(theirs.module.state_dict())
    assert [resumed.run_step(s) for s in (3, 4)][1] != full_losses[4]


@pytest.mark.parametrize("change,flag", [
    (dict(optimizer="sgd"), "--optimizer adamw"), (dict(lr=0.1), "--lr 0.01"),
    (dict(weight_decay=0.0), "--weight-decay 0.1"), (dict(lr_schedule="constant"), "--lr-schedule cosine"),
    (dict(lr_warmup_steps=0), "--lr-warmup 2"), (dict(steps=10), "--steps 6"),
])
def test_resuming_with_other_optimizer_settings_is_refused(change, flag):
    manifest = {"config": RunConfig(**ADAMW).to_dict()}
    with pytest.raises(GpipeInputError, match=f"trained with {flag} but") as info:
        checkpoint.check_resumable(manifest, RunConfig(**{**ADAMW, **change}).to_dict())
    assert "\n" not in str(info.value)


def test_a_constant_schedule_may_resume_for_more_steps():
    saved = RunConfig(**{**ADAMW, "lr_schedule": "constant"}).to_dict()
    checkpoint.check_resumable({"config": saved}, {**saved, "steps": 20})
