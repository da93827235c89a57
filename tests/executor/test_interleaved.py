"""The interleaved schedule (V chunks per device) computes exactly what the unpipelined model computes.

One step of the in-process pipeline, each device walking its one action list over its chunks
(``executor.runtime.chunks``), is compared with one plain forward and backward of the whole model, for
K in {1, 2, 3}, V in {2, 3, 4}, M a multiple of K, every re-materialization policy, on batch 11
(uneven for every M > 1: 6,5 / 4,4,3 / 3,3,3,2 / 2,2,2,2,2,1). Tied weights held by chunks of one
device and of two devices, several tensors between chunks, bf16, AdamW with clipping and a cosine
schedule, deferred batch norm and a checkpoint restored mid-run are checked the same way. fp32
tolerances as in ``test_transparency.py``: losses rtol 1e-6, atol 1e-6; gradients rtol 1e-5, atol
1e-6; several optimizer steps rtol 1e-5, atol 1e-6 (micro-batch sums reorder float additions,
nothing else differs). bf16 as ``test_transparency_bf16.py``.

The multi-process test (``slow``) trains K = 2, V = 2 with ``gpipe train`` over gloo and compares
its losses and gradient norms with the in-process pipeline: rtol 1e-6.
"""

import argparse
import copy
import json
import os

import pytest
import torch

from executor.config import RunConfig
from executor.models.build import build_model
from executor.runtime.chunks import ChunkedDevice
from executor.runtime.data import split
from executor.runtime.pipeline import LocalPipeline
from executor.state import checkpoint
from gpipe.train import add_arguments, config_from_args
from sim.errors import GpipeInputError
from sim.schedules.schedule import Kind, build_schedule
from tests.helpers.in_process import gpipe
from tests.helpers.parity import (CLIP, OPTIONS, SEVERAL, TIED, check_adamw_steps, check_bf16_step,
                                  check_step, check_tied_step)

# (model, K, V) -> V*K layers per chunk in model order; the mlp has 8 layers, the transformer 4
PARTITIONS = {
    ("mlp", 1, 2): (3, 5), ("mlp", 2, 2): (2, 2, 2, 2), ("mlp", 3, 2): (1, 1, 2, 1, 1, 2),
    ("mlp", 2, 3): (1, 1, 2, 1, 1, 2), ("mlp", 2, 4): (1,) * 8, ("mlp", 1, 3): (2, 3, 3),
    ("transformer", 1, 2): (1, 3), ("transformer", 2, 2): (1, 1, 1, 1), ("transformer", 1, 4): (1, 1, 1, 1),
}
MICROBATCHES = {1: (1, 3, 4), 2: (2, 4), 3: (3, 6)}
POLICIES = ("always", "except_last", "never", "full")
GRID = [(model, k, v, m, policy) for (model, k, v) in PARTITIONS for m in MICROBATCHES[k] for policy in POLICIES]


def interleaved(model, stages, virtual_stages, microbatches=None, checkpoint="except_last", **overrides):
    return RunConfig.of(model=model, options=OPTIONS.get(model, {}), partition=PARTITIONS[(model, stages, virtual_stages)],
                     batch_size=11, microbatches=microbatches or 2 * stages, checkpoint=checkpoint,
                     schedule="interleaved", virtual_stages=virtual_stages, **overrides)


@pytest.mark.parametrize("model,stages,virtual_stages,microbatches,checkpoint", GRID)
def test_one_step_matches_unpipelined(model, stages, virtual_stages, microbatches, checkpoint):
    check_step(interleaved(model, stages, virtual_stages, microbatches, checkpoint))


def test_each_device_walks_its_own_list_over_its_chunks():
    pipe = LocalPipeline(interleaved("mlp", 2, 2, 4, "never"))
    pipe.run_step(0)
    lists = build_schedule(2, 4, "interleaved", "never", virtual_stages=2)
    assert [device.actions for device in pipe.devices] == lists
    for d, device in enumerate(pipe.devices):
        assert isinstance(device, ChunkedDevice)
        assert [chunk.config.stage for chunk in device.chunks] == [d, d + 2]
        records = device.recorder.timeline.records
        assert {r.stage for r in records} == {d}  # one row per device
        assert all(device.chunk(a).config.stage == a.stage for a in device.actions)
        ran = [(r.virtual_stage, r.kind, r.microbatch) for r in records if r.kind in ("F", "R", "B")]
        assert ran == [(a.stage, a.kind.value, a.microbatch) for a in lists[d]]
        assert {s.stage for s in device.recorder.timeline.memory} == {d}
        assert all(chunk.counter.peak_bytes == device.counter.peak_bytes > 0 for chunk in device.chunks)
        assert device.counter.current_bytes == 0  # every micro-batch of every chunk released
    trace = pipe.devices[1].recorder.timeline.to_chrome_trace()["traceEvents"]
    assert any(e.get("name") == "forward 0 (virtual stage 3)" and e["tid"] == 1 for e in trace)


def test_the_device_counts_every_chunks_live_activations():
    """One counter per device, its chunks' micro-batches kept apart: after each action the device
    holds bytes exactly while some (chunk, micro-batch) is between its forward and its backward.
    Under ``never`` with K = 1, chunk 0 still holds micro-batch 0 after chunk 1's backward of it."""
    pipe = LocalPipeline(interleaved("mlp", 1, 2, 4, "never"))
    pipe.run_step(0)
    device = pipe.devices[0]
    samples = [s.bytes for s in device.recorder.timeline.memory]  # one after every action
    assert len(samples) == len(device.actions)
    live: set[tuple[int, int]] = set()
    for action, held in zip(device.actions, samples):
        (live.add if action.kind == Kind.FORWARD else live.discard)((action.stage, action.microbatch))
        assert (held > 0) == bool(live), (action, held, live)


# ---------------------------------------------------------------- training over several steps

ADAMW_STEPS = 4


@pytest.mark.parametrize("model,stages,virtual_stages,checkpoint", [
    ("mlp", 2, 2, "except_last"), ("mlp", 3, 2, "always"), ("mlp", 1, 3, "never"), ("transformer", 2, 2, "always")])
def test_adamw_with_clipping_and_cosine_matches_unpipelined(model, stages, virtual_stages, checkpoint):
    config = interleaved(model, stages, virtual_stages, checkpoint=checkpoint, optimizer="adamw", lr=0.01,
                         weight_decay=0.1, clip_grad_norm=CLIP[model], lr_schedule="cosine", lr_warmup_steps=1,
                         steps=ADAMW_STEPS)
    check_adamw_steps(config)


def test_bf16_step_matches_unpipelined_under_autocast():
    for model, stages in (("mlp", 2), ("transformer", 2), ("mlp", 1)):
        config = interleaved(model, stages, 2, 4, precision="bf16")
        config.batch_size = 10  # the bf16 check's batch: 3,3,3,1
        check_bf16_step(config)


def test_restored_chunks_continue_exactly(tmp_path):
    config = interleaved("mlp", 2, 2, optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.05,
                         lr_schedule="cosine", lr_warmup_steps=2, steps=6)
    full = LocalPipeline(config)
    full_losses = [full.run_step(s) for s in range(6)]
    first = LocalPipeline(config)
    losses = [first.run_step(s) for s in range(3)]
    for chunk in first.stages:  # one shard per virtual stage, as the worker writes them
        checkpoint.save_shard(str(tmp_path), 2, chunk)
    checkpoint.write_manifest(str(tmp_path), 2, len(config.partition), losses, config.to_dict(), first.grad_norms)
    resumed = LocalPipeline(config)
    manifest = checkpoint.read_manifest(str(tmp_path))
    for chunk in resumed.stages:
        checkpoint.load_shard(str(tmp_path), manifest, chunk)
    losses += [resumed.run_step(s) for s in range(3, 6)]
    assert losses == full_losses
    assert manifest["grad_norms"] + resumed.grad_norms == full.grad_norms
    for p, q in zip(resumed.model().parameters(), full.model().parameters()):
        assert torch.equal(p, q)


def test_batch_norm_running_statistics_are_committed_on_every_chunk():
    """Each batch norm's running statistics equal one pass over the whole mini-batch of the inputs it
    saw: every earlier layer normalised per micro-batch, as the pipeline does (GPipe section 2.2)."""
    cnn = {"layers": 2, "channels": 8, "image": 8}  # three conv blocks and a head: 4 layers
    config = RunConfig.of(model="cnn", options=cnn, partition=(1, 1, 1, 1), batch_size=11, microbatches=4,
                       schedule="interleaved", virtual_stages=2, checkpoint="except_last")
    pipe = LocalPipeline(config)
    inputs, _ = pipe.batch(0)
    pipe.run_step(0)
    reference = build_model("cnn", cnn, 0).train()
    rows = list(split(inputs, 4))
    with torch.no_grad():
        for layer in range(3):  # virtual stages 0 and 2 on device 0, 1 on device 1
            whole = copy.deepcopy(reference[layer])
            whole(torch.cat(rows))
            ours = pipe.stages[layer].module[0][1]
            torch.testing.assert_close(ours.running_mean, whole[1].running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours.running_var, whole[1].running_var, rtol=1e-5, atol=1e-6)
            assert int(ours.num_batches_tracked) == 1
            rows = [copy.deepcopy(reference[layer])(x) for x in rows]


# ---------------------------------------------------------------- tied weights, several tensors

TIED_PARTITIONS = {(1, 2): (2, 2), (2, 2): (1, 1, 1, 1), (1, 4): (1, 1, 1, 1)}  # embedding, 2 blocks, head


def tied(stages, virtual_stages, microbatches, checkpoint="except_last", **overrides):
    return RunConfig.of(model=TIED, data="tests.helpers.sample_models:tied_lm_data", loss="cross_entropy",
                     partition=TIED_PARTITIONS[(stages, virtual_stages)], batch_size=11, microbatches=microbatches,
                     checkpoint=checkpoint, schedule="interleaved", virtual_stages=virtual_stages, **overrides)


@pytest.mark.parametrize("stages,virtual_stages", sorted(TIED_PARTITIONS))
@pytest.mark.parametrize("checkpoint", POLICIES)
def test_tied_weights_across_chunks_match_unpipelined(stages, virtual_stages, checkpoint):
    """The embedding (virtual stage 0) and the head (the last) share a weight: on two chunks of one
    device (K = 1) or on two devices (K = 2); each copy gets the summed gradient."""
    layers, model = check_tied_step(LocalPipeline(tied(stages, virtual_stages, 2 * stages, checkpoint)))
    assert layers[-1].weight is not layers[0].embedding.weight  # each chunk holds its own copy
    torch.testing.assert_close(layers[-1].weight.grad, model[0].embedding.weight.grad, rtol=1e-5, atol=1e-6)


def test_the_worker_sums_copies_on_chunks_of_one_process_before_the_others():
    """``chunk_reducer`` with K = 1: both copies on one process, no process group; each copy ends
    with the sum of the two gradients."""
    from executor.runtime.interleaved import chunk_reducer

    pipe = LocalPipeline(tied(1, 2, 2))
    embedding = pipe.stages[0].module[0].embedding.weight
    head = pipe.stages[1].module[-1].weight
    embedding.grad, head.grad = torch.full_like(embedding, 1.0), torch.full_like(head, 2.0)
    reduce = chunk_reducer(pipe.stages, pipe.prepared.shared, [None])
    reduce()
    assert torch.equal(embedding.grad, torch.full_like(embedding, 3.0))
    assert torch.equal(head.grad, torch.full_like(head, 3.0))
    assert chunk_reducer(pipe.stages[1:], [], []) is None


@pytest.mark.parametrize("stages,virtual_stages", [(1, 2), (2, 2)])
def test_tied_weights_train_as_one_with_clipping(stages, virtual_stages):
    """The copies stay equal, and the global norm counts the shared weight once."""
    pipe = LocalPipeline(tied(stages, virtual_stages, 2 * stages, optimizer="adam", lr=0.05, clip_grad_norm=0.1))
    model = build_model(TIED, {}, 0)
    reference = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(3):
        inputs, targets = pipe.batch(step)
        loss = pipe.run_step(step)
        reference.zero_grad()
        ref = pipe.prepared.loss_fn(model(inputs), targets)
        ref.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        reference.step()
        torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-5, atol=1e-6)
        assert pipe.grad_norms[step] == pytest.approx(float(norm), rel=1e-5)
    layers = list(pipe.model())
    for name, p in model.named_parameters():
        index, rest = name.split(".", 1)
        torch.testing.assert_close(layers[int(index)].get_parameter(rest), p, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(layers[-1].weight, layers[0].embedding.weight, rtol=0, atol=0)


SEVERAL_PARTITIONS = {(1, 2): (2, 4), (2, 2): (1, 2, 1, 2), (3, 2): (1,) * 6, (2, 3): (1,) * 6}


@pytest.mark.parametrize("stages,virtual_stages", sorted(SEVERAL_PARTITIONS))
@pytest.mark.parametrize("checkpoint", POLICIES)
def test_several_tensors_between_chunks_match_unpipelined(stages, virtual_stages, checkpoint):
    """Dicts and tuples of tensors (one whose gradient crosses back, integer ids, a gate without a
    gradient) cross every chunk boundary, the wrap from device K-1 to device 0 included."""
    check_step(RunConfig.of(model=SEVERAL, partition=SEVERAL_PARTITIONS[(stages, virtual_stages)], batch_size=11,
                         microbatches=2 * stages, checkpoint=checkpoint, loss="mse", schedule="interleaved",
                         virtual_stages=virtual_stages))


# ---------------------------------------------------------------- the check can fail


def test_chunks_in_the_wrong_place_break_the_step(monkeypatch):
    """Adjacent chunks on one device (device d holding virtual stages dV..dV+V-1, the classic mix-up
    of c*K + d) swap virtual stages 1 and 2 for K = V = 2: the transparency check catches it."""
    import executor.runtime.pipeline

    original = executor.runtime.pipeline.stage_layers
    monkeypatch.setattr(executor.runtime.pipeline, "stage_layers",
                        lambda config, prepared, stage: original(config, prepared, {1: 2, 2: 1}.get(stage, stage)))
    with pytest.raises(AssertionError):
        check_step(interleaved("mlp", 2, 2, 4, "never"))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("overrides,message", [
    (dict(schedule="1f1b", virtual_stages=2), "--virtual-stages 2 needs --schedule interleaved"),
    (dict(virtual_stages=1), "--schedule interleaved needs --virtual-stages 2 or more, got 1"),
    (dict(microbatches=3), r"needs micro-batches \(M=3\) to be a multiple of stages \(K=2\); use --microbatches 4"),
    (dict(batch_size=9, microbatches=4), "--batch 9 splits into 3 micro-batches of up to 3 rows, not the 4 asked"),
    (dict(partition=(3, 2, 3)), "partition has 3 entries, not a multiple of --virtual-stages 2"),
])
def test_bad_runs_are_refused_in_one_line(overrides, message):
    settings = dict(model="mlp", options=OPTIONS.get("mlp", {}), partition=PARTITIONS[("mlp", 2, 2)], batch_size=11,
                    microbatches=4, schedule="interleaved", virtual_stages=2)
    with pytest.raises(GpipeInputError, match=message):
        LocalPipeline(RunConfig.of(**{**settings, **overrides}))


def test_a_small_batch_is_checked_as_executed():
    """Batch 3 asked in 4 micro-batches runs as 3 (torch.chunk): a multiple of K = 3, so it runs."""
    check_step(RunConfig.of(model="mlp", options=OPTIONS["mlp"], partition=(1, 1, 2, 1, 1, 2), batch_size=3,
                         microbatches=4, schedule="interleaved", virtual_stages=2))




def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "mlp", "--batch", "8", "--microbatches", "4", *argv])


@pytest.mark.parametrize("argv,message", [
    (("--stages", "2", "--virtual-stages", "2"), "--virtual-stages 2 needs --schedule interleaved"),
    (("--stages", "2", "--schedule", "interleaved", "--virtual-stages", "1"),
     "--schedule interleaved needs --virtual-stages 2 or more"),
    (("--stages", "2", "--schedule", "interleaved", "--virtual-stages", "5"),
     r"5 virtual stages x 2 stages = 10 chunks but the model has 8 layers"),
    (("--stages", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "3"),
     r"\(M=3\) to be a multiple of stages \(K=2\)"),
    (("--stages", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--batch", "9"),
     "--batch 9 splits into 3 micro-batches"),
    (("--stages", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--partition", "4,4"),
     "--partition has 2 chunks but --stages 2 x --virtual-stages 2 needs 4"),
])
def test_gpipe_train_flags_are_checked(argv, message):
    with pytest.raises(GpipeInputError, match=message):
        config_from_args(parse(*argv))


def test_the_interleaved_schedule_defaults_to_two_chunks_per_process_as_the_simulator_does():
    config = config_from_args(parse("--stages", "2", "--schedule", "interleaved"))
    assert config.layout.virtual_stages == 2 and len(config.partition) == 4


def test_gpipe_train_refuses_with_one_line_and_exit_2():
    result = gpipe("train", "--model", "mlp", "--stages", "2", "--schedule", "interleaved", "--virtual-stages", "5")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpipe: error: 5 virtual stages x 2 stages = 10 chunks but the model has 8 layers; use fewer "
        "--virtual-stages or --stages"]


def test_gpipe_train_splits_the_layers_into_v_times_k_chunks():
    config = config_from_args(parse("--stages", "2", "--schedule", "interleaved", "--virtual-stages", "2"))
    assert config.partition == (2, 2, 2, 2) and config.stages == 2 and config.layout.virtual_stages == 2
    config = config_from_args(parse("--stages", "1", "--schedule", "interleaved", "--virtual-stages", "3"))
    assert sum(config.partition) == 8 and len(config.partition) == 3 and config.stages == 1


@pytest.mark.slow
def test_two_processes_two_chunks_each_match_in_process_and_resume_exactly(tmp_path):
    """K = 2, V = 2 over gloo: the losses and norms of the in-process pipeline; a run killed after its
    step-1 checkpoint and resumed gives the uninterrupted run's losses and norms exactly."""
    run = ["--model", "mlp", "--option", "width=32", "--batch", "11", "--microbatches", "4", "--stages", "2",
           "--schedule", "interleaved", "--virtual-stages", "2", "--checkpoint", "always", "--optimizer", "adam",
           "--clip-grad-norm", "0.05", "--steps", "4"]
    result = gpipe("train", *run, "--report", str(tmp_path / "full.json"))
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "full.json").read_text())
    pipe = LocalPipeline(interleaved("mlp", 2, 2, 4, "always", optimizer="adam", clip_grad_norm=0.05, steps=4))
    expected = [pipe.run_step(s) for s in range(4)]
    assert data["losses"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert data["grad_norms"] == pytest.approx(pipe.grad_norms, rel=1e-6)
    assert [s["layers"] for s in data["stages"]] == [4, 4]
    assert [s["chunk_layers"] for s in data["stages"]] == [[2, 2], [2, 2]]
    assert all(s["peak_activation_bytes"] > 0 for s in data["stages"])
    records = data["timeline"]["records"]
    assert {(r["stage"], r["virtual_stage"]) for r in records if r["kind"] == "F"} == {(0, 0), (1, 1), (0, 2), (1, 3)}
    assert {(a["stage"], a["virtual_stage"]) for a in data["actions"]} == {(0, 0), (1, 1), (0, 2), (1, 3)}

    saving = [*run, "--save-every", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    killed = gpipe("train", *saving, env={"GPIPE_FAULT_RANK": "1", "GPIPE_FAULT_STEP": "3"})
    assert killed.returncode != 0
    assert sorted(os.listdir(tmp_path / "ck" / "step-000001")) == [f"stage-{s}.safetensors" for s in range(4)]
    resumed = gpipe("train", *saving, "--resume", "--report", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr
    assert "gpipe: step 2 loss" in resumed.stdout and "gpipe: step 1 loss" not in resumed.stdout
    ours = json.loads((tmp_path / "resumed.json").read_text())
    assert ours["losses"] == data["losses"] and ours["grad_norms"] == data["grad_norms"]


@pytest.mark.slow
@pytest.mark.parametrize("partition", ["1,1,1,1", "2,2"])
def test_tied_weights_over_torchrun_train_as_one_model(tmp_path, partition):
    """K = 2 (the head's copy on the other process, summed over a process group) and K = 1 (both
    copies on chunks of the one process, summed there, hand-offs in process), V = 2, against the
    in-process pipeline; the copies' sum is recorded as its own span."""
    report = tmp_path / "report.json"
    result = gpipe("train", "--model", TIED, "--data", "tests.helpers.sample_models:tied_lm_data", "--loss", "cross_entropy",
                   "--partition", partition, "--schedule", "interleaved", "--virtual-stages", "2", "--batch", "11",
                   "--microbatches", "4", "--steps", "3", "--optimizer", "adam", "--lr", "0.05",
                   "--clip-grad-norm", "0.1", "--report", str(report))
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    stages = len(partition.split(",")) // 2  # K = chunks / V
    pipe = LocalPipeline(tied(stages, 2, 4, optimizer="adam", lr=0.05, clip_grad_norm=0.1, steps=3))
    assert data["losses"] == pytest.approx([pipe.run_step(s) for s in range(3)], rel=1e-6, abs=1e-7)
    assert data["grad_norms"] == pytest.approx(pipe.grad_norms, rel=1e-6)
    assert "allreduce_shared" in {r["kind"] for r in data["timeline"]["records"]}
