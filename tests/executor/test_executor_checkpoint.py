"""Shards carry the optimizer and the schedule: a pipeline restored mid-run takes the same steps."""

import pytest
import torch

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from executor.state import checkpoint
from sim.errors import GpipeInputError

ADAMW = dict(model="mlp", options={"width": 32}, partition=(3, 5), batch_size=10, microbatches=3,
             optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.05, lr_schedule="cosine",
             lr_warmup_steps=2, steps=6)


def test_restored_stages_continue_exactly(tmp_path):
    config = RunConfig.of(**ADAMW)
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
    config = RunConfig.of(**ADAMW)
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
    manifest = {"config": RunConfig.of(**ADAMW).to_dict()}
    with pytest.raises(GpipeInputError, match=f"trained with {flag} but") as info:
        checkpoint.check_resumable(manifest, RunConfig.of(**{**ADAMW, **change}).to_dict())
    assert "\n" not in str(info.value)


def test_a_constant_schedule_may_resume_for_more_steps():
    saved = RunConfig.of(**{**ADAMW, "lr_schedule": "constant"}).to_dict()
    checkpoint.check_resumable({"config": saved}, {**saved, "steps": 20})


def _save(pipeline, config, root, step, losses):
    for stage in pipeline.stages:
        checkpoint.save_shard(str(root), step, stage)
    checkpoint.write_manifest(str(root), step, len(config.partition), losses, config.to_dict(), pipeline.grad_norms)


@pytest.mark.parametrize("settings,saved,resumed", [
    (ADAMW, (3, 5), (8,)),  # K = 2 -> 1
    (ADAMW, (3, 5), (2, 3, 3)),  # K = 2 -> 3
    (ADAMW, (3, 5), (5, 3)),  # the same K, the layers split otherwise
    # the embedding and the head tie one weight: one stage's parameter, then two stages' copies
    (dict(ADAMW, model="tests.helpers.sample_models:tied_lm", options={}, data="tests.helpers.sample_models:tied_lm_data",
          loss="cross_entropy"),
     (4,), (1, 2, 1)),
    (dict(ADAMW, model="tests.helpers.sample_models:tied_lm", options={}, data="tests.helpers.sample_models:tied_lm_data",
          loss="cross_entropy"),
     (1, 3), (3, 1)),
])
def test_a_checkpoint_resumes_under_another_partition(tmp_path, settings, saved, resumed):
    """Each new stage takes its layers from the shards that held them and each parameter's AdamW
    state by its names: the continued run is the uninterrupted one, to float rounding (the clipping
    norm and tied gradients add in another order)."""
    config = RunConfig.of(**{**settings, "partition": saved})
    full = LocalPipeline(config)
    full_losses = [full.run_step(s) for s in range(6)]
    first = LocalPipeline(config)
    losses = [first.run_step(s) for s in range(3)]
    _save(first, config, tmp_path, 2, losses)
    other = RunConfig.of(**{**settings, "partition": resumed})
    checkpoint.check_resumable(checkpoint.read_manifest(str(tmp_path)), other.to_dict())
    again = LocalPipeline(other)
    manifest = checkpoint.read_manifest(str(tmp_path))
    for stage in again.stages:
        checkpoint.load_shard(str(tmp_path), manifest, stage)
    assert again.stages[-1].scheduler.last_epoch == 3
    losses += [again.run_step(s) for s in range(3, 6)]
    assert losses == pytest.approx(full_losses, rel=1e-6)
    ours, theirs = again.model().state_dict(), full.model().state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.allclose(value, theirs[name], rtol=1e-5, atol=1e-7), name


def test_a_zero_checkpoint_resumes_on_its_own_partition_only():
    saved = RunConfig.of(**{**ADAMW, "replicas": 2, "zero": 1}).to_dict()
    checkpoint.check_resumable({"config": saved}, dict(saved))
    with pytest.raises(GpipeInputError, match=r"--zero 1 on partition \[3, 5\], not \[8\]"):
        checkpoint.check_resumable({"config": saved}, {**saved, "partition": [8]})


def test_a_checkpoint_whose_shards_do_not_name_their_parameters_refuses_another_partition(tmp_path):
    config = RunConfig.of(**ADAMW)
    first = LocalPipeline(config)
    losses = [first.run_step(0)]
    _save(first, config, tmp_path, 0, losses)
    from executor.state import state_file

    directory = tmp_path / "step-000000"
    for path in directory.iterdir():  # as written before the names were recorded
        state = state_file.load(str(path))
        del state["param_names"]
        state_file.save(str(path), state)
    again = LocalPipeline(RunConfig.of(**{**ADAMW, "partition": (8,)}))
    with pytest.raises(GpipeInputError, match="did not name the optimizer's parameters; resume with its own plan"):
        checkpoint.load_shard(str(tmp_path), checkpoint.read_manifest(str(tmp_path)), again.stages[0])
