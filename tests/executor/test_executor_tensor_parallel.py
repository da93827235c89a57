"""Tensor parallelism in the executor: D x K x T ranks train what one process trains.

``gpipe train --tensor-parallel 2`` (gloo, torchrun) against the in-process pipeline at T = 1 (the
transparency tests hold that to the unpipelined model): losses and gradient norms rtol 1e-5, every
parameter (the stages' checkpoint shards, gathered from the T ranks into the model's own layout)
rtol 1e-5, atol 1e-6 with SGD, as the fp32 transparency tests. With AdamW parameters are held to
atol 1e-4: a row-parallel layer sums its ranks' partial products in another order than one matmul,
so gradients differ by float rounding, and Adam scales every update to about the learning rate
whatever the gradient's size; a gradient that is zero up to rounding (the key bias, which softmax
ignores) then moves by rounding-driven steps (measured: 3.8e-5 on a key bias, 1.1e-5 on a norm's
weight, after three steps at lr 0.01; losses and norms still agree to 1e-6). Grouped-query attention and the gated MLP,
whose fused rows are put in rank order, are in every built-in case. bf16: a row-parallel matmul
rounds each rank's partial sum to bf16 before DTensor adds them, where one process rounds the whole
sum once, so losses are held to rtol 1e-3 against one process in bf16 (measured 1.3e-4 after three
AdamW steps). A T = 2 run killed mid-step resumes at K = 2, T = 1 and continues the uninterrupted run's losses.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from gpipe.main import main
from sim.formats.plan import load_plan
from tests.helpers.in_process import gpipe, option_flags
from tests.helpers.parity import checkpoint_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIONS = {"layers": 4, "d_model": 32, "ff": 64, "heads": 4, "kv_heads": 2, "activation": "swiglu", "seq": 8,
           "vocab": 64}
ADAMW = dict(optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.05)
SGD = dict(optimizer="sgd", lr=0.05, weight_decay=0.0, clip_grad_norm=0.05)
FLAGS = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--clip-grad-norm", "0.05"]


def optimizer_flags(settings):
    return ["--optimizer", settings["optimizer"], "--lr", str(settings["lr"]), "--weight-decay",
            str(settings["weight_decay"]), "--clip-grad-norm", str(settings["clip_grad_norm"])]
LLAMA = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "vocab_size": 64, "seq": 16, "tie_word_embeddings": True}
GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 64, "seq": 16, "attn_pdrop": 0.0}
STEPS = 3


def one_process(model, options, partition, batch, microbatches, steps=STEPS, optim=ADAMW, **settings):
    pipe = LocalPipeline(RunConfig.of(model=model, options=options, partition=partition, batch_size=batch,
                                   microbatches=microbatches, steps=steps, **{**optim, **settings}))
    losses = [pipe.run_step(step) for step in range(steps)]
    return losses, pipe.grad_norms, {name: p.detach() for name, p in pipe.model().named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("stages,replicas,schedule,checkpoint,model,optim,sequence", [
    (2, 1, "interleaved", "selective", "transformer", ADAMW, True),
    (2, 2, "gpipe", "full", "transformer", SGD, True),
    (2, 1, "gpipe", "never", "tests.helpers.sample_models:tied_split_lm", ADAMW, False),  # a user's own plan, tied weights
    (1, 1, "1f1b", "except_last", "hf:llama", ADAMW, False),  # grouped-query attention, tied embedding and head
    (2, 1, "1f1b", "always", "hf:gpt2", SGD, False),  # Conv1D projections, fused c_attn columns, dropout
])
def test_tensor_parallel_trains_what_one_process_trains(tmp_path, stages, replicas, schedule, checkpoint, model,
                                                        optim, sequence):
    builtin = model == "transformer"
    options = {"transformer": OPTIONS, "hf:llama": LLAMA, "hf:gpt2": GPT2}.get(model, {})
    layers = {"transformer": 6, "hf:llama": 4, "hf:gpt2": 4}.get(model, 4)  # embedding, blocks, head (final norm)
    builtin = builtin or model.startswith("hf:")  # its own data
    chunks = 2 * stages if schedule == "interleaved" else stages
    partition = tuple([layers // chunks + (1 if i < layers % chunks else 0) for i in range(chunks)])
    data = [] if builtin else ["--data", "tests.helpers.sample_models:tied_lm_data", "--loss", "cross_entropy"]
    root, report_path, trace_path = tmp_path / "ck", tmp_path / "r.json", tmp_path / "t.json"
    result = gpipe("train", "--model", model, *option_flags(options), *data, *optimizer_flags(optim), "--partition",
                   ",".join(map(str, partition)), "--stages", str(stages), "--replicas", str(replicas),
                   "--tensor-parallel", "2", "--schedule", schedule, "--checkpoint", checkpoint, "--batch", "8",
                   "--microbatches", "4", "--steps", str(STEPS), "--save-every", str(STEPS), "--checkpoint-dir",
                   str(root), "--report", str(report_path), "--trace", str(trace_path),
                   *(["--sequence-parallel"] if sequence else []))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("gpipe: step 0 loss") == 1  # one rank of 2 x K x D prints
    report = json.loads(report_path.read_text())
    settings = {} if builtin else {"data": "tests.helpers.sample_models:tied_lm_data", "loss": "cross_entropy"}
    losses, norms, expected = one_process(model, options, partition, 8, 4, optim=optim, schedule=schedule,
                                          checkpoint=checkpoint,
                                          virtual_stages=2 if schedule == "interleaved" else 1, **settings)
    assert report["losses"] == pytest.approx(losses, rel=1e-5)
    assert report["grad_norms"] == pytest.approx(norms, rel=1e-5)
    assert min(norms) > optim["clip_grad_norm"]  # every step clipped: the norm over shards matters
    parameters = checkpoint_parameters(root, chunks)
    assert set(parameters) >= set(expected)
    atol = 1e-6 if optim is SGD else 1e-4  # see the module docstring
    for name, value in expected.items():
        torch.testing.assert_close(parameters[name], value, rtol=1e-5, atol=atol, msg=name)
    assert report["config"]["tensor_parallel"] == 2 and report["config"]["sequence_parallel"] is sequence
    # a timeline row per rank: every (replica, stage, tensor-parallel rank) ran forwards and backwards
    rows = {(r.get("replica", 0), r["stage"], r.get("tp", 0)) for r in report["timeline"]["records"] if r["kind"] == "F"}
    assert rows == {(d, k, t) for d in range(replicas) for k in range(stages) for t in range(2)}
    names = {e["args"]["name"] for e in json.loads(trace_path.read_text())["traceEvents"]
             if e.get("name") == "thread_name"}
    assert f"stage {stages - 1} tp 1" in " ".join(names)
    # the traced run's tensor-parallel collectives: spans of their own, each inside a compute span of its row
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"]
    collectives = [e for e in events if e["cat"].startswith("tp_")]
    expected_kinds = {"tp_all_gather", "tp_reduce_scatter"} if sequence else {"tp_all_reduce"}
    assert expected_kinds <= {e["cat"] for e in collectives}
    collective_rows = {e["tid"] for e in collectives}
    assert {0, 1} <= collective_rows <= {e["tid"] for e in events if e["cat"] == "F"}  # stage 0's ranks hold blocks
    compute = [e for e in events if e["cat"] in ("F", "R", "B")]
    for e in collectives:
        assert any(c["tid"] == e["tid"] and c["ts"] <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"] + 1e-3
                   for c in compute), e
    assert len(report["stages"]) == stages  # a stage's figures: its rank 0's


@pytest.mark.slow
def test_bf16_under_tensor_parallelism_and_a_killed_run_resumed_on_another_layout(tmp_path):
    common = ["--model", "transformer", *option_flags(OPTIONS), *FLAGS, "--batch", "8", "--microbatches", "4"]
    split = gpipe("train", *common, "--stages", "1", "--precision", "bf16", "--steps", "3", "--tensor-parallel", "2",
                  "--report", str(tmp_path / "bf16.json"))
    assert split.returncode == 0, split.stderr[-3000:]
    whole, _, _ = one_process("transformer", OPTIONS, (6,), 8, 4, precision="bf16")
    assert json.loads((tmp_path / "bf16.json").read_text())["losses"] == pytest.approx(whole, rel=1e-3)
    # a K = 1 x T = 2 run saved after two steps and killed in its fourth (rank 1), resumed at K = 2 x T = 1:
    # every rank ended; the whole stage's values and AdamW state gathered from the shards (fused rows
    # back in the model's order) and taken by the two new stages by name
    root = tmp_path / "ck"
    first = gpipe("train", *common, "--stages", "1", "--tensor-parallel", "2", "--steps", "4", "--save-every", "2",
                  "--checkpoint-dir", str(root), env={"GPIPE_FAULT_RANK": "1", "GPIPE_FAULT_STEP": "3"})
    assert first.returncode != 0
    assert first.stderr.strip().splitlines()[-1] == "gpipe: error: training failed: rank 1: killed by signal 9 (SIGKILL)"
    assert json.loads((root / "manifest.json").read_text())["step"] == 1
    resumed = gpipe("train", *common, "--stages", "2", "--partition", "3,3", "--tensor-parallel", "1", "--steps", "4",
                    "--checkpoint-dir", str(root), "--resume", "--report", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "gpipe: step 2 loss" in resumed.stdout and "gpipe: step 1 loss" not in resumed.stdout
    losses, _, _ = one_process("transformer", OPTIONS, (6,), 8, 4, steps=4)
    assert json.loads((tmp_path / "resumed.json").read_text())["losses"] == pytest.approx(losses, rel=1e-5)


def one_line_error(capsys, *argv):
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags,message", [
    (["--model", "transformer", "--option", "heads=6", "--option", "d_model=48", "--tensor-parallel", "4"],
     "--tensor-parallel 4 does not divide heads=6"),
    (["--model", "tests.helpers.sample_models:tied_lm", "--tensor-parallel", "2"],
     "layer 0 (TokenEmbedding) has no tensor-parallel plan: give it a tensor_parallel_plan(parts) method"),
    (["--model", "hf:gpt2", "--option", "n_layer=2", "--option", "n_embd=32", "--option", "n_head=4",
      "--tensor-parallel", "2"], "--tensor-parallel 2 with attn_pdrop=0.1: the split heads would draw other masks"),
    (["--model", "hf:gpt2", "--option", "n_layer=2", "--option", "n_embd=32", "--option", "n_head=4",
      "--option", "n_inner=50", "--option", "attn_pdrop=0", "--tensor-parallel", "4"],
     "--tensor-parallel 4 does not divide n_inner=50"),
    (["--model", "hf:llama", "--option", "num_hidden_layers=2", "--option", "hidden_size=48",
      "--option", "num_attention_heads=6", "--option", "num_key_value_heads=3", "--option", "intermediate_size=64",
      "--tensor-parallel", "2"], "--tensor-parallel 2 does not divide num_key_value_heads=3"),
    (["--model", "transformer", "--replicas", "2", "--zero", "1", "--batch", "8", "--tensor-parallel", "2"],
     "--tensor-parallel 2 with --zero 1 is not supported yet"),
    (["--model", "transformer", "--tensor-parallel", "0"], "tensor_parallel (T) must be a positive integer, got 0"),
    (["--model", "transformer", "--sequence-parallel"], "--sequence-parallel splits the sequence over a stage's"),
    (["--model", "transformer", "--stages", "3", "--tensor-parallel", "2", "--nnodes", "2"],
     "3 ranks per node do not hold whole groups of --tensor-parallel 2"),
    (["--model", "transformer", "--option", "seq=9", "--tensor-parallel", "2", "--sequence-parallel"],
     "does not divide seq=9"),
    (["--model", "transformer", "--option", "dropout=0.1", "--tensor-parallel", "2", "--sequence-parallel"],
     "--sequence-parallel with dropout=0.1"),
    (["--model", "tests.helpers.sample_models:tied_split_lm", "--data", "tests.helpers.sample_models:tied_lm_data", "--loss",
      "cross_entropy", "--tensor-parallel", "2", "--sequence-parallel"], "--sequence-parallel splits the built-in"),
])
def test_tensor_parallel_refusals_are_one_line_before_any_worker(capsys, flags, message):
    stages = [] if "--stages" in flags else ["--stages", "1"]
    assert message in one_line_error(capsys, "train", *flags, *stages, "--steps", "1")


@pytest.mark.slow
def test_a_tensor_parallel_plan_is_trained(tmp_path):
    """What the planner proposes with T = 2 on this machine (sequence parallelism on), gpipe train runs,
    and trains what one process trains."""
    plan_path, report_path = tmp_path / "plan.json", tmp_path / "r.json"
    planned = gpipe("plan", "--model", "transformer", *option_flags(OPTIONS), "--batch", "8", "--hardware", "cpu",
                    "--tensor-parallel-options", "2", "--quiet", "--out", str(plan_path))
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(plan_path.read_text())
    assert plan["tensor_parallel"] == 2 and plan["sequence_parallel"] is True
    trained = gpipe("train", "--plan", str(plan_path), "--steps", "2", "--report", str(report_path))
    assert trained.returncode == 0, trained.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["config"]["tensor_parallel"] == 2 and report["config"]["sequence_parallel"] is True
    pipe = LocalPipeline(RunConfig.from_plan(load_plan(str(plan_path)), steps=2))  # the plan's run, T ranks as one
    assert report["losses"] == pytest.approx([pipe.run_step(step) for step in range(2)], rel=1e-5)


@pytest.mark.slow
def test_two_nodes_each_hold_a_stages_tensor_parallel_ranks(tmp_path):
    """K = 2 stages of T = 2 ranks on two nodes (one stage per node, its T ranks together), 1F1B with
    every stage re-materialised, without sequence parallelism: what one process trains, every
    parameter included."""
    from tests.helpers.nodes import free_port

    port, root = free_port(), tmp_path / "ck"
    flags = ["--model", "transformer", *option_flags(OPTIONS), *optimizer_flags(SGD), "--stages", "2",
             "--tensor-parallel", "2", "--batch", "8", "--microbatches", "4", "--steps", str(STEPS), "--nnodes", "2",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "90", "--checkpoint", "always",
             "--schedule", "1f1b", "--partition", "3,3", "--save-every", str(STEPS), "--checkpoint-dir", str(root)]
    nodes = [subprocess.Popen([sys.executable, "-m", "gpipe.main", "train", *flags, "--node-rank", str(rank),
                               *(["--report", str(tmp_path / "r.json")] if rank == 0 else [])],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (1, 0)]
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in outputs]
    report = json.loads((tmp_path / "r.json").read_text())
    losses, norms, expected = one_process("transformer", OPTIONS, (3, 3), 8, 4, optim=SGD, checkpoint="always",
                                          schedule="1f1b")
    assert report["losses"] == pytest.approx(losses, rel=1e-5) and report["grad_norms"] == pytest.approx(norms, rel=1e-5)
    parameters = checkpoint_parameters(root, 2)  # gathered from both nodes' shards
    for name, value in expected.items():
        torch.testing.assert_close(parameters[name], value, rtol=1e-5, atol=1e-6, msg=name)
