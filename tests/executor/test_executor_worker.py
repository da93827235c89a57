"""Multi-process runs over gloo through ``gpipe train`` (torchrun): results, failures, restarts.

Several nodes are in ``test_executor_nodes.py``."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from tests.helpers import in_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = ["--model", "mlp", "--option", "width=32", "--batch", "10", "--microbatches", "4"]
pytestmark = pytest.mark.slow


def gpipe(*args, env=None):
    started = time.monotonic()
    result = in_process.gpipe(*args, env=env)
    return result, time.monotonic() - started


def local_losses(steps, **overrides):
    config = RunConfig.of(model="mlp", options={"width": 32}, batch_size=10, microbatches=4, **overrides)
    pipe = LocalPipeline(config)
    return [pipe.run_step(s) for s in range(steps)]


@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", "except_last"), ("1f1b", "always"), ("zb-h1", "never")])
def test_two_processes_match_the_in_process_pipeline(tmp_path, schedule, checkpoint):
    report = tmp_path / "report.json"
    result, _ = gpipe("train", *MLP, "--stages", "2", "--steps", "3", "--schedule", schedule,
                      "--checkpoint", checkpoint, "--report", str(report), "--trace", str(tmp_path / "t.json"))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"gpipe: trained 3 steps, median step [0-9.]+ ms", result.stdout.strip().splitlines()[-1])
    data = json.loads(report.read_text())
    expected = local_losses(3, partition=(4, 4), schedule=schedule, checkpoint=checkpoint)
    assert data["losses"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert data["step_time_s"] > 0 and len(data["stages"]) == 2
    assert all(s["peak_activation_bytes"] > 0 and s["busy_s"] > 0 for s in data["stages"])
    kinds = {r["kind"] for r in data["timeline"]["records"]}
    backward = {"I", "W"} if schedule == "zb-h1" else {"B"}  # split: input gradient, then weight gradients
    assert {"F", "recv_wait", "send_act", "send_grad", "optimizer"} | backward <= kinds
    assert not ({"B", "I", "W"} - backward) & kinds
    assert data["plan"]["partition"] == [4, 4]
    trace = json.loads((tmp_path / "t.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])


def test_four_processes_transformer(tmp_path):
    report = tmp_path / "report.json"
    result, _ = gpipe("train", "--model", "transformer", "--option", "d_model=32", "--option", "ff=64",
                      "--option", "seq=8", "--option", "vocab=64", "--layers", "2", "--stages", "4",
                      "--batch", "6", "--microbatches", "3", "--steps", "2", "--report", str(report))
    assert result.returncode == 0, result.stderr
    expected = LocalPipeline(RunConfig.of(model="transformer", options={"d_model": 32, "ff": 64, "seq": 8,
                                                                      "vocab": 64, "layers": 2},
                                       partition=(1, 1, 1, 1), batch_size=6, microbatches=3))
    losses = [expected.run_step(s) for s in range(2)]
    assert json.loads(report.read_text())["losses"] == pytest.approx(losses, rel=1e-6, abs=1e-7)


def test_a_step_time_with_its_warm_up_in_it_says_so():
    """With no step after the warm-up the report times every step, the cold first one too; the
    summary line says so and how many steps leave it out."""
    result, _ = gpipe("train", *MLP, "--stages", "1", "--steps", "1", "--quiet")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"gpipe: trained 1 step, median step [0-9.]+ ms \(warm-up included: --steps 2 or more "
                        r"leaves it out\)", result.stdout.strip().splitlines()[-1])


def test_bad_partition_fails_before_training_with_one_line():
    result, elapsed = gpipe("train", *MLP, "--partition", "3,4", "--steps", "1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpipe: error: partition 3,4 sums to 7 layers but the model has 8; make the entries add up to 8"]


def test_wrong_number_of_processes_fails_on_every_rank(tmp_path):
    config = RunConfig.of(model="mlp", options={"width": 32}, partition=(4, 4), batch_size=10, steps=1)
    path = tmp_path / "config.json"
    config.save(path)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             "3", "-m", "executor.launch.worker", str(path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    message = "the plan has 2 stages but torchrun started 3 processes"
    assert result.returncode != 0
    # torchrun ends the others once one rank exits, possibly before they print: at least one says why
    assert result.stderr.count(message) >= 1
    # each rank refuses on its own, before any communication: started as torchrun would, none waits
    ranks = [subprocess.Popen([sys.executable, "-m", "executor.launch.worker", str(path)], cwd=ROOT, text=True,
                              stderr=subprocess.PIPE,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r),
                                       LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"))
             for r in range(3)]
    for process in ranks:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2 and message in stderr, stderr


@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_a_failing_rank_ends_every_rank_quickly(mode):
    result, elapsed = gpipe("train", *MLP, "--stages", "4", "--steps", "50",
                            env={"GPIPE_FAULT_RANK": "2", "GPIPE_FAULT_STEP": "2", "GPIPE_FAULT": mode})
    assert result.returncode != 0
    assert elapsed < 120  # ended by the failure, well before the 300 s receive timeout would end it (slow machines)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gpipe: error: training failed")
    if mode == "raise":
        assert "rank 2: RuntimeError: injected fault on rank 2 at step 2" in last
    else:  # the killed rank itself, not a neighbour's lost connection
        assert last == "gpipe: error: training failed: rank 2: killed by signal 9 (SIGKILL)"
    assert "step 49" not in result.stdout


# AdamW with weight decay, clipping below every step's norm (about 0.1 here) and warm-up then cosine
ADAMW_CLIP_COSINE = ["--optimizer", "adamw", "--weight-decay", "0.1", "--clip-grad-norm", "0.05",
                     "--lr-schedule", "cosine", "--lr-warmup", "2"]


def test_killed_run_resumes_with_identical_losses(tmp_path):
    run = [*MLP, *ADAMW_CLIP_COSINE, "--stages", "2", "--steps", "6"]
    full, _ = gpipe("train", *run, "--report", str(tmp_path / "full.json"))
    assert full.returncode == 0, full.stderr
    common = [*run, "--save-every", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    killed, _ = gpipe("train", *common, env={"GPIPE_FAULT_RANK": "1", "GPIPE_FAULT_STEP": "3"})
    assert killed.returncode != 0
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["step"] == 1  # steps 0-1 saved; the kill came during step 3, before the next save
    resumed, _ = gpipe("train", *common, "--resume", "--report", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr
    assert "gpipe: step 2 loss" in resumed.stdout and "gpipe: step 1 loss" not in resumed.stdout
    ours, theirs = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("resumed", "full"))
    assert ours["losses"] == theirs["losses"]
    assert ours["grad_norms"] == theirs["grad_norms"] and min(theirs["grad_norms"]) > 0.05  # every step clipped
    other, _ = gpipe("train", *common, "--resume", "--lr", "0.1")
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [
        "gpipe: error: the checkpoint was trained with --lr 0.01 but this run asks for 0.1; resume with "
        "--lr 0.01 or use a new --checkpoint-dir"]


def test_two_stages_train_as_one_with_adamw_clipping_and_cosine(tmp_path):
    reports = {}
    for stages in (1, 2):
        path = tmp_path / f"k{stages}.json"
        result, _ = gpipe("train", *MLP, *ADAMW_CLIP_COSINE, "--stages", str(stages), "--steps", "5",
                          "--report", str(path))
        assert result.returncode == 0, result.stderr
        assert "grad norm" in result.stdout and " lr " in result.stdout
        reports[stages] = json.loads(path.read_text())
    assert len(reports[2]["losses"]) == 5
    assert reports[2]["losses"] == pytest.approx(reports[1]["losses"], rel=1e-5)
    assert reports[2]["grad_norms"] == pytest.approx(reports[1]["grad_norms"], rel=1e-5)
    assert min(reports[1]["grad_norms"]) > 0.05  # so every step clipped
    assert reports[2]["plan"]["optimizer"] == "adamw"
    waits = [r for r in reports[2]["timeline"]["records"] if r["kind"] == "recv_wait" and r["microbatch"] == -1]
    assert {r["stage"] for r in waits} == {0, 1}  # each rank waited once a step for the other's norm


def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path):
    full = local_losses(5, partition=(4, 4))
    result, _ = gpipe("train", *MLP, "--stages", "2", "--steps", "5", "--save-every", "1", "--checkpoint-dir",
                      str(tmp_path / "ck"), "--max-restarts", "1", "--report", str(tmp_path / "r.json"),
                      env={"GPIPE_FAULT_RANK": "0", "GPIPE_FAULT_STEP": "3"})
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["losses"] == pytest.approx(full, rel=1e-6, abs=1e-7)
