"""Data-parallel replicas of the pipeline through ``gpipe train`` (torchrun, gloo): D x K ranks train
exactly what one process training the global batch trains.

Each run is compared with the whole model trained by torch alone on the whole global batch: losses
and global gradient norms per step, and every parameter after the last step (read from the run's
final checkpoint, which replica 0 writes). Uneven global batches (11 rows over 2 replicas: 6 and 5)
are included. Tolerances as in ``test_transparency.py``: losses and norms rtol 1e-5, parameters
rtol 1e-5, atol 1e-6. Each torchrun start costs seconds on a small machine, so every launch checks
several things.
"""

import json
import os

import pytest
import torch

from executor.models.build import build_model, default_loss, loss_function
from executor.parallel.replicas import replica_rows
from executor.runtime.data import batch_for_step
from executor.runtime.optim import OptimSettings, make_optimizer, make_scheduler
from executor.state import state_file
from tests.helpers.in_process import gpipe, train_refusal

OPTIONS = {"width": 16}
MLP = ["--model", "mlp", "--option", "width=16", "--microbatches", "2"]
SGD = dict(optimizer="sgd", lr=0.05)
# AdamW with weight decay, clipping below every step's norm, warm-up then cosine
ADAMW = dict(optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.05, lr_schedule="cosine",
             lr_warmup_steps=1)
STEPS = 3
pytestmark = pytest.mark.slow


def flags(settings):
    names = {"optimizer": "--optimizer", "lr": "--lr", "weight_decay": "--weight-decay",
             "clip_grad_norm": "--clip-grad-norm", "lr_schedule": "--lr-schedule", "lr_warmup_steps": "--lr-warmup"}
    return [part for key, value in settings.items() for part in (names[key], str(value))]


def reference(batch, settings, steps=STEPS):
    """One process, torch alone, the whole global batch: (losses, norms or None, parameters)."""
    model = build_model("mlp", OPTIONS, 0)
    optim = OptimSettings(**settings, total_steps=steps)
    optimizer = make_optimizer(optim, list(model.parameters()))
    scheduler = make_scheduler(optim, optimizer)
    loss_fn = loss_function(default_loss("mlp"))
    losses, norms = [], []
    for step in range(steps):
        inputs, targets = batch_for_step("mlp", OPTIONS, batch, 0, step)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if optim.clip_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad_norm)))
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses, norms, dict(model.named_parameters()), optimizer


def checkpoint_parameters(root, stages):
    manifest = json.loads((root / "manifest.json").read_text())
    values = {}
    for k in range(stages):
        values.update(state_file.load(str(root / manifest["dir"] / f"stage-{k}.safetensors"))["module"])
    return manifest, values


def assert_trains_as_one_process(report, parameters, batch, settings):
    losses, norms, expected, _ = reference(batch, settings)
    assert report["losses"] == pytest.approx(losses, rel=1e-5)
    assert report["grad_norms"] == pytest.approx(norms, rel=1e-5)
    if norms:
        assert min(norms) > settings["clip_grad_norm"]  # so every step clipped
    assert set(parameters) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(parameters[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("replicas,stages,batch,settings,placement,schedule,virtual", [
    (1, 1, 10, SGD, "stages_adjacent", "gpipe", 1),
    (1, 2, 11, ADAMW, "stages_adjacent", "gpipe", 1),
    (2, 1, 10, SGD, "stages_adjacent", "gpipe", 1),
    # zb-h1: averaged after each rank's last weight gradients (gpipe at D = K = 2: the ZeRO-1 test below)
    (2, 2, 11, ADAMW, "replicas_adjacent", "zb-h1", 1),
    (2, 1, 11, SGD, "stages_adjacent", "interleaved", 2),  # chunks hand over in process
    (2, 2, 12, ADAMW, "stages_adjacent", "interleaved", 2),  # chunks across processes, per replica
    (2, 2, 11, SGD, "replicas_adjacent", "zbv", 2),  # a V per replica, its turn in process
])
def test_replicas_of_the_pipeline_train_as_one_process(tmp_path, replicas, stages, batch, settings, placement,
                                                       schedule, virtual):
    report_path, trace_path, root = tmp_path / "r.json", tmp_path / "t.json", tmp_path / "ck"
    schedule_flags = ["--schedule", schedule] + (["--virtual-stages", str(virtual)] if virtual > 1 else [])
    result = gpipe("train", *MLP, *flags(settings), "--batch", str(batch), "--stages", str(stages),
                   "--replicas", str(replicas), "--placement", placement, "--steps", str(STEPS),
                   "--save-every", str(STEPS), "--checkpoint-dir", str(root), "--report", str(report_path),
                   "--trace", str(trace_path), *schedule_flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("gpipe: step 0 loss") == 1  # one rank prints, the global loss
    report = json.loads(report_path.read_text())
    manifest, parameters = checkpoint_parameters(root, stages * virtual)  # one shard per chunk
    assert manifest["replicas"] == replicas and manifest["stages"] == stages * virtual
    assert_trains_as_one_process(report, parameters, batch, settings)
    records = report["timeline"]["records"]
    ranks = {(r.get("replica", 0), r["stage"]) for r in records}
    assert ranks == {(d, k) for d in range(replicas) for k in range(stages)}
    reduces = [r for r in records if r["kind"] == "allreduce_dp"]
    if replicas == 1:
        assert not reduces and "ranks" not in report
        return
    # every rank averaged its gradients once a step, after its last backward of the step
    assert sorted((r.get("replica", 0), r["stage"], r["step"]) for r in reduces) == sorted(
        (d, k, s) for d in range(replicas) for k in range(stages) for s in range(STEPS))
    for r in reduces:
        last_backward = max(b["end_s"] for b in records if b["kind"] in ("B", "I", "W") and b["step"] == r["step"]
                            and b["stage"] == r["stage"] and b.get("replica", 0) == r.get("replica", 0))
        assert r["start_s"] >= last_backward
    assert [(e["replica"], e["stage"]) for e in report["ranks"]] == sorted(ranks)
    rows = replica_rows(batch, replicas)[0]
    assert {a["rows"] for a in report["actions"]} <= {-(-rows // 2), rows // 2}  # replica 0's micro-batches
    names = {e["args"]["name"] for e in json.loads(trace_path.read_text())["traceEvents"]
             if e.get("name") == "thread_name"}
    assert names == {f"replica {d} stage {k}" for d in range(replicas) for k in range(stages)}


def test_zero_equals_plain_and_resumes_exactly_after_a_kill(tmp_path, capsys):
    run = [*MLP, *flags(ADAMW), "--batch", "10", "--stages", "1", "--replicas", "2", "--zero", "1", "--steps", "4"]
    full = gpipe("train", *run, "--save-every", "4", "--checkpoint-dir", str(tmp_path / "full"),
                 "--report", str(tmp_path / "full.json"))
    assert full.returncode == 0, full.stderr[-3000:]
    theirs = json.loads((tmp_path / "full.json").read_text())
    _, parameters = checkpoint_parameters(tmp_path / "full", 1)
    losses, norms, expected, optimizer = reference(10, ADAMW, steps=4)
    assert theirs["losses"] == pytest.approx(losses, rel=1e-5)
    assert theirs["grad_norms"] == pytest.approx(norms, rel=1e-5)
    for name, value in expected.items():
        torch.testing.assert_close(parameters[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
    # each replica holds its shard of the AdamW state: together, one optimizer's
    shards = [rank["optimizer_state_bytes"] for rank in theirs["ranks"]]
    whole = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values())
    assert len(shards) == 2 and min(shards) > 0 and sum(shards) == whole
    common = [*run, "--save-every", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    killed = gpipe("train", *common, env={"GPIPE_FAULT_RANK": "1", "GPIPE_FAULT_STEP": "3"})
    assert killed.returncode != 0
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["step"] == 1
    resumed = gpipe("train", *common, "--resume", "--report", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "gpipe: step 2 loss" in resumed.stdout and "gpipe: step 1 loss" not in resumed.stdout
    ours = json.loads((tmp_path / "resumed.json").read_text())
    assert ours["losses"] == theirs["losses"] and ours["grad_norms"] == theirs["grad_norms"]
    assert train_refusal(capsys, *common, "--resume", "--replicas", "1", "--zero", "0") == (
        "gpipe: error: the checkpoint was trained with --replicas 2 but this run asks for 1; resume with "
        "--replicas 2 or use a new --checkpoint-dir")


def test_bad_replica_settings_are_refused_in_one_line_before_any_worker(tmp_path, capsys):
    base = [*MLP, "--stages", "2", "--steps", "1"]
    cores = os.cpu_count() or 1
    assert "cores" in train_refusal(capsys, *base, "--batch", str(64 * cores), "--replicas", str(4 * cores))
    assert "--zero 1 shards optimizer state" in train_refusal(capsys, *base, "--batch", "8", "--zero", "1")
    assert "fewer rows than --replicas 4" in train_refusal(capsys, *base, "--batch", "3", "--replicas", "4")
    assert "splits by torch.chunk into 3 chunks" in train_refusal(capsys, *base, "--batch", "5", "--replicas", "4")
    empty = tmp_path / "empty"
    empty.mkdir()
    line = train_refusal(capsys, *base, "--batch", "8", "--resume", "--checkpoint-dir", str(empty))
    assert f"--checkpoint-dir {empty} holds no checkpoint" in line and "drop --resume" in line
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    line = train_refusal(capsys, *base, "--batch", "8", "--save-every", "1", "--checkpoint-dir",
                          str(blocked / "ck"))
    assert f"--checkpoint-dir {blocked / 'ck'} cannot be written" in line


def test_two_nodes_run_one_replica_each(tmp_path):
    from tests.helpers.nodes import Node, free_port

    port = free_port()
    common = ["--stages", "1", "--replicas", "2", "--steps", str(STEPS), *flags(SGD)]
    nodes = [Node(tmp_path, 0, port, *common, "--report", str(tmp_path / "r.json")),
             Node(tmp_path, 1, port, *common)]
    codes = [node.wait() for node in nodes]
    assert codes == [0, 0], [node.stderr[-3000:] for node in nodes]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["losses"] == pytest.approx(reference(10, SGD)[0], rel=1e-5)
    # replica 0 (node 0) prints the global losses; each node ran its replica's only stage
    assert "gpipe: step 2 loss" in nodes[0].stdout and "gpipe: step" not in nodes[1].stdout
    assert {(r.get("replica", 0), r["stage"]) for r in report["timeline"]["records"]} == {(0, 0), (1, 0)}


def test_a_plan_file_carries_replicas_zero_and_placement(tmp_path):
    import argparse

    from gpipe.train import add_arguments, config_from_args
    from executor.models.build import model_ref
    from sim.formats.plan import Plan, save_plan

    plan = Plan.of(model=model_ref("mlp", OPTIONS), partition=(4, 4), batch_size=12, microbatches=2, replicas=2,
                zero=1, placement="replicas_adjacent")
    save_plan(plan, tmp_path / "plan.json")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--plan", str(tmp_path / "plan.json")]))
    assert (config.layout.replicas, config.layout.zero, config.layout.placement, config.world_size) == (2, 1, "replicas_adjacent", 4)
    config = config_from_args(parser.parse_args(["--plan", str(tmp_path / "plan.json"), "--replicas", "3"]))
    assert config.layout.replicas == 3 and config.world_size == 6
