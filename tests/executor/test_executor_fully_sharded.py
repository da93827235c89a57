"""ZeRO-2, ZeRO-3 and HSDP in the executor (FSDP2 over gloo, torchrun): D x K x T ranks train what one
process trains.

Each launch is compared with the in-process pipeline at D = 1 (the transparency tests hold that to
the unpipelined model) on the whole global batch: losses and gradient norms rtol 1e-5, every
parameter (the final checkpoint, gathered from the shards) rtol 1e-5 and atol 1e-4 with AdamW (Adam
scales a gradient that is zero up to rounding to a step of about lr: test_executor_tensor_parallel.py
says why), 1e-6 with SGD. bf16 (with SGD: Adam would turn the rounding of a rarely used
embedding row's gradient into a step of about lr) losses rtol 1e-3, parameters atol 1e-3: the
replicas' micro-batches hold other rows than one process's, and autocast rounds each micro-batch's
weight gradient to bf16 before they are added. The launches share the matrix between them (K in {1, 2}, T in {1, 2}, gpipe,
1F1B and interleaved, every recompute policy, AdamW with clipping, bf16, a tied embedding and head,
HSDP, gradients reduce-scattered once per step and after every micro-batch), and the first also saves
a ZeRO-3 checkpoint that is resumed at D = 1, at ZeRO-1 and at ZeRO-2 on two stages; a ZeRO-2 and a
ZeRO-3 run at T = 2 resume at their own layout and at another D, ZeRO stage or T.
"""

import json
import shutil

import pytest
import torch

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline
from executor.state import state_file
from tests.helpers.in_process import gpipe, train_refusal

MLP = {"width": 16}
TRANSFORMER = {"layers": 4, "d_model": 32, "ff": 64, "heads": 4, "kv_heads": 2, "activation": "swiglu", "seq": 8,
               "vocab": 64}
ADAMW = dict(optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.05)
SGD = dict(optimizer="sgd", lr=0.05, weight_decay=0.0, clip_grad_norm=0.05)
TIED = "tests.helpers.sample_models:tied_lm"
TIED_DATA = "tests.helpers.sample_models:tied_lm_data"


def optimizer_flags(settings):
    return ["--optimizer", settings["optimizer"], "--lr", str(settings["lr"]), "--weight-decay",
            str(settings["weight_decay"]), "--clip-grad-norm", str(settings["clip_grad_norm"])]


def option_flags(options):
    return [part for key, value in options.items() for part in ("--option", f"{key}={value}")]


def one_process(model, options, partition, batch, microbatches, steps, optim, **settings):
    pipe = LocalPipeline(RunConfig.of(model=model, options=options, partition=partition, batch_size=batch,
                                   microbatches=microbatches, steps=steps, **{**optim, **settings}))
    losses = [pipe.run_step(step) for step in range(steps)]
    return losses, pipe.grad_norms, {name: p.detach() for name, p in pipe.model().named_parameters()}


def checkpoint_parameters(root):
    manifest = json.loads((root / "manifest.json").read_text())
    values = {}
    for k in range(manifest["stages"]):
        values.update(state_file.load(str(root / manifest["dir"] / f"stage-{k}.safetensors"))["module"])
    return manifest, values


def train(tmp_path, name, *argv):
    report, root = tmp_path / f"{name}.json", tmp_path / name
    result = gpipe("train", *argv, "--checkpoint-dir", str(root), "--report", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(report.read_text()), root


def assert_parameters(root, expected, atol):
    _, parameters = checkpoint_parameters(root)
    assert set(expected) <= set(parameters)
    for name in set(parameters) - set(expected):  # a tied weight's second name in its stage's state dict
        assert any(torch.equal(parameters[name], parameters[other]) for other in expected), name
    for name, value in expected.items():
        torch.testing.assert_close(parameters[name], value, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_zero3_saves_from_the_shards_and_resumes_at_one_replica_and_at_zero1(tmp_path):
    """ZeRO-3 at K = 1 (gathered per unit, resharded after each forward and backward), D = 2 on an
    uneven batch (6 + 5 rows), AdamW with clipping, each of the M = 2 micro-batches' gradients
    reduce-scattered after its backward (--gradient-sync microbatch); the checkpoint after 2 steps
    resumes at D = 1, at ZeRO-1 and at ZeRO-2 on two stages (also reducing every micro-batch), each
    continuing the uninterrupted run; the report counts the shards' bytes, and no unsharded gradient
    held across micro-batches, as the simulator predicts."""
    common = ["--model", "mlp", *option_flags(MLP), "--microbatches", "2", "--batch", "11", "--stages", "1",
              *optimizer_flags(ADAMW)]
    report, root = train(tmp_path, "zero3", *common, "--replicas", "2", "--zero", "3", "--steps", "2",
                         "--gradient-sync", "microbatch", "--save-every", "2", "--trace", str(tmp_path / "t.json"))
    losses, norms, expected = one_process("mlp", MLP, (8,), 11, 2, 4, ADAMW)
    assert report["losses"] == pytest.approx(losses[:2], rel=1e-5)
    assert report["grad_norms"] == pytest.approx(norms[:2], rel=1e-5)
    assert_parameters(root, one_process("mlp", MLP, (8,), 11, 2, 2, ADAMW)[2], 1e-4)
    # every rank: its padded shards (dim 0 rounded up to a multiple of D = 2) and the peak of gathered
    # units (the layers with parameters, fp32): the current one and the one prefetched
    shard_bytes = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * 4 for p in expected.values())
    units: dict[int, int] = {}
    for name, p in expected.items():
        units[int(name.split(".")[0])] = units.get(int(name.split(".")[0]), 0) + p.numel() * 4
    sizes = [units[i] for i in sorted(units)]
    for entry in report["ranks"]:
        assert entry["parameter_bytes"] == entry["gradient_bytes"] == shard_bytes
        assert entry["optimizer_state_bytes"] == 2 * shard_bytes
        assert entry["gathered_parameter_bytes_peak"] == max(a + b for a, b in zip(sizes, sizes[1:]))
        assert entry["accumulated_gradient_bytes"] == 0  # each micro-batch's reduced and freed after its backward
        assert entry["gradient_sum"] == "reduce-scatter (gloo)"
    kinds = {r["kind"] for r in report["timeline"]["records"]}
    assert {"all_gather_dp", "reduce_scatter_dp"} <= kinds and "allreduce_dp" not in kinds
    scatters = [r for r in report["timeline"]["records"] if r["kind"] == "reduce_scatter_dp" and r["stage"] == 0
                and r.get("replica", 0) == 0 and r.get("step", 0) == 0]
    assert len(scatters) == 2 * len(units)  # every unit's, after each of the 2 micro-batches' backwards
    # the simulator's sharded memory of the same run, rank by rank: the shards and the gathered units in
    # flight (activations: the calibrated costs file's, held to the executor's count by gpipe validate)
    predicted = gpipe("simulate", "--model", "mlp", *option_flags(MLP), "--microbatches", "2", "--batch", "11",
                      "--optimizer", "adamw", "--replicas", "2", "--zero", "3", "--partition", "8", "--json",
                      "--gradient-sync", "microbatch")
    assert predicted.returncode == 0, predicted.stderr
    devices = json.loads(predicted.stdout)["stages"]
    assert len(devices) == len(report["ranks"]) == 2
    for device, entry in zip(devices, report["ranks"]):
        for field in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "gathered_parameter_bytes_peak",
                      "accumulated_gradient_bytes"):
            assert device[field] == entry[field], (field, device["replica"])
    for other, flags in (("one", ["--replicas", "1"]), ("zero1", ["--replicas", "2", "--zero", "1"]),
                         ("pipelined", ["--replicas", "2", "--zero", "2", "--stages", "2", "--gradient-sync",
                                        "microbatch"])):
        shutil.copytree(root, tmp_path / other)
        resumed, _ = train(tmp_path, other, *common, *flags, "--steps", "4", "--resume", "--save-every", "4")
        assert resumed["losses"] == pytest.approx(losses, rel=1e-5), other
        assert_parameters(tmp_path / other, expected, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("zero,other", [
    ("3", ["--replicas", "1", "--zero", "0"]),  # the whole stage on each of its T ranks, no sharding
    ("2", ["--zero", "3", "--tensor-parallel", "1"]),  # another ZeRO stage and T, the same D
])
def test_a_tensor_parallel_sharded_run_resumes_at_its_layout_and_at_another(tmp_path, zero, other):
    """T = 2, D = 2 under ZeRO-2/3 (each parameter a DTensor over the (dp, tp) mesh, FSDP's shards
    strided over TP's, uneven: an FFN width whose TP parts split 10 + 9 rows over D, and the embedding
    and head, whole on each TP rank, 32 + 31), AdamW with clipping: saved after 2 steps, resumed at
    the same layout and at another D, ZeRO stage or T, each continues the uninterrupted run (losses,
    gradient norms and every parameter)."""
    options = {**TRANSFORMER, "ff": 38, "vocab": 63}
    common = ["--model", "transformer", *option_flags(options), "--partition", "6", "--stages", "1",
              "--microbatches", "2", "--batch", "8", *optimizer_flags(ADAMW)]
    layout = ["--replicas", "2", "--zero", zero, "--tensor-parallel", "2"]
    report, root = train(tmp_path, "saved", *common, *layout, "--steps", "2", "--save-every", "2")
    losses, norms, expected = one_process("transformer", options, (6,), 8, 2, 4, ADAMW)
    assert report["losses"] == pytest.approx(losses[:2], rel=1e-5)
    for name, flags in (("same", layout), ("other", [*layout, *other])):
        shutil.copytree(root, tmp_path / name)
        resumed, _ = train(tmp_path, name, *common, *flags, "--steps", "4", "--resume", "--save-every", "4")
        assert resumed["losses"] == pytest.approx(losses, rel=1e-5), name
        assert resumed["grad_norms"] == pytest.approx(norms, rel=1e-5), name
        assert_parameters(tmp_path / name, expected, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("argv,model,options,partition,microbatches,optim,settings", [
    # ZeRO-3 under a pipeline runs as ZeRO-2; interleaved chunks, layer-by-layer recompute, bf16
    (["--zero", "3", "--stages", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--checkpoint", "full",
      "--precision", "bf16"], "transformer", TRANSFORMER, (2, 1, 1, 2), 4, SGD,
     dict(schedule="interleaved", virtual_stages=2, checkpoint="full", precision="bf16")),
    # ZeRO-2 with tensor parallelism (FSDP over dp of the (dp, pp, tp) mesh), selective recompute
    (["--zero", "2", "--stages", "2", "--tensor-parallel", "2", "--schedule", "1f1b", "--checkpoint", "selective"],
     "transformer", TRANSFORMER, (3, 3), 2, ADAMW, dict(schedule="1f1b", checkpoint="selective")),
    # ZeRO-2 on two stages, each micro-batch's gradients reduce-scattered after its backward (not a
    # pipeline's default), the units kept gathered until the step's last backward
    (["--zero", "2", "--stages", "2", "--schedule", "1f1b", "--gradient-sync", "microbatch"], "mlp", MLP, (4, 4), 2,
     ADAMW, dict(schedule="1f1b")),
    # a tied embedding and head on two stages, their shards summed; no recompute
    (["--zero", "2", "--stages", "2", "--schedule", "gpipe", "--checkpoint", "never", "--data", TIED_DATA, "--loss",
      "cross_entropy"],
     TIED, {}, (2, 2), 2, SGD, dict(checkpoint="never", data=TIED_DATA, loss="cross_entropy")),
    # the same on one stage: the tied weight in the stage's root unit, gathered and resharded with ZeRO-3;
    # the micro-batches' gradients accumulated unsharded and reduce-scattered once (not one stage's default)
    (["--zero", "3", "--stages", "1", "--schedule", "1f1b", "--data", TIED_DATA, "--loss", "cross_entropy",
      "--gradient-sync", "step"],
     TIED, {}, (4,), 2, ADAMW, dict(schedule="1f1b", data=TIED_DATA, loss="cross_entropy")),
    # HSDP: shard within groups of 2 of D = 4, all-reduce across them after every micro-batch (one
    # stage's default); recompute of every micro-batch
    (["--zero", "3", "--replicas", "4", "--shard-group", "2", "--stages", "1", "--checkpoint", "always"],
     "mlp", MLP, (8,), 2, SGD, dict(checkpoint="always")),
])
def test_sharded_replicas_train_what_one_process_trains(tmp_path, argv, model, options, partition, microbatches,
                                                        optim, settings):
    batch = 8
    replicas = [] if "--replicas" in argv else ["--replicas", "2"]
    report, root = train(tmp_path, "run", "--model", model, *option_flags(options), "--partition",
                         ",".join(map(str, partition)), "--microbatches", str(microbatches), "--batch", str(batch),
                         *optimizer_flags(optim), *replicas, *argv, "--steps", "3", "--save-every", "3")
    losses, norms, expected = one_process(model, options, partition, batch, microbatches, 3, optim, **settings)
    bf16 = settings.get("precision") == "bf16"
    assert report["losses"] == pytest.approx(losses, rel=1e-3 if bf16 else 1e-5)
    assert report["grad_norms"] == pytest.approx(norms, rel=1e-2 if bf16 else 1e-5)
    assert_parameters(root, expected, 1e-3 if bf16 else 1e-4 if optim is ADAMW else 1e-6)
    assert all(entry["gradient_sum"] == "reduce-scatter (gloo)" for entry in report["ranks"])
    # unsharded gradients outlast a backward only where they accumulate until the step's reduce-scatter
    pipelined = argv[argv.index("--stages") + 1] != "1"
    once = "step" in argv or ("microbatch" not in argv and pipelined)
    assert all((entry["accumulated_gradient_bytes"] > 0) == once for entry in report["ranks"])


@pytest.mark.parametrize("flags,message", [
    (["--zero", "3", "--replicas", "4", "--shard-group", "3", "--batch", "8"], "does not divide --replicas 4"),
    (["--zero", "2", "--replicas", "2", "--schedule", "zb-h1", "--stages", "2"], "split backward"),
    (["--zero", "3", "--replicas", "2", "--model", TIED, "--data", TIED_DATA, "--stages", "1", "--checkpoint",
      "full"], "share a parameter"),
    (["--zero", "1", "--replicas", "2", "--tensor-parallel", "2", "--model", "transformer"], "--zero 2 or 3"),
    (["--zero", "3", "--replicas", "2", "--model", "tests.helpers.sample_models:scalar_gain_mlp"], "is a scalar"),
    (["--zero", "1", "--replicas", "2", "--gradient-sync", "step"], "--gradient-sync step says when sharded"),
    (["--replicas", "2", "--gradient-sync", "microbatch"], "needs --zero 2 or 3 (got --zero 0)"),
])
def test_what_zero2_and_zero3_cannot_run_is_one_line_before_any_worker(capsys, flags, message):
    argv = ["--model", "mlp", "--stages", "1", "--batch", "8", "--steps", "1"]
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert message in train_refusal(capsys, *argv)
