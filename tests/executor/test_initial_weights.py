"""Runs start from the user's own weights: exactly what ``factory()`` gives, whatever its modules.

The reference is the user's own code: ``torch.manual_seed(seed); factory()`` trained by torch alone,
never our builder. In one process (the in-process pipeline) for K 1 to 4, then over torchrun, where
the launcher writes ``factory()``'s values to safetensors and each worker reads its own layers. A
stack of Hugging Face ``GPT2Block``s (``Conv1D`` has no ``reset_parameters()``) trains too.
``--init meta`` keeps the per-layer seeded build and its refusal; checkpoints run no code.
Tolerances as the transparency tests: losses and norms rtol 1e-5, parameters rtol 1e-5, atol 1e-6.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from executor.config import RunConfig
from executor.models.build import build_meta_model
from executor.models.initial_weights import FromFile, indexed, write_layers
from executor.runtime.data import mix_seed
from executor.runtime.pipeline import LocalPipeline, prepare
from executor.state import checkpoint, state_file
from sim.errors import GpipeInputError
from tests.helpers import user_init_models
from tests.helpers.in_process import gpipe

CUSTOM = "tests.helpers.user_init_models:custom_init"
GPT2 = "tests.helpers.user_init_models:gpt2_blocks"
PARTITIONS = {1: (6,), 2: (3, 3), 3: (2, 2, 2), 4: (1, 2, 2, 1)}


def users_model(factory, seed=0, **options):
    """What the user trains without a pipeline."""
    torch.manual_seed(seed)
    return factory(**options)


def every_tensor(module):
    """Parameters and all buffers (non-persistent ones too), by name."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def assert_bitwise(actual, expected):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_every_stage_starts_from_factorys_values_bitwise(stages):
    pipe = LocalPipeline(RunConfig.of(model=CUSTOM, partition=PARTITIONS[stages], batch_size=8, microbatches=2,
                                   seed=3))
    assert_bitwise(every_tensor(pipe.model()), every_tensor(users_model(user_init_models.custom_init, seed=3)))


def test_the_factory_file_gives_workers_the_same_values(tmp_path):
    """The launcher's path: write factory()'s values per layer, read each stage's layers back."""
    meta = build_meta_model(CUSTOM)
    reference = users_model(user_init_models.custom_init)
    write_layers(indexed(reference), str(tmp_path / "weights"))
    source = FromFile(str(tmp_path / "weights"), meta, seed=0)
    layers = [layer for first, end in ((0, 1), (1, 3), (3, 6)) for layer in source.layers(meta, range(first, end))]
    assert_bitwise(every_tensor(torch.nn.Sequential(*layers)), every_tensor(reference))
    assert len(load_file(str(tmp_path / "weights" / "layer-00004.safetensors"))) == 1  # the gate's own tensor


def test_a_tied_weight_is_written_once_and_reaches_every_copy(tmp_path):
    meta = build_meta_model("tests.helpers.sample_models:tied_lm")
    from tests.helpers.sample_models import tied_lm
    reference = users_model(tied_lm, seed=1)
    write_layers(indexed(reference), str(tmp_path / "w"))
    index = json.loads((tmp_path / "w" / "model.safetensors.index.json").read_text())
    assert "3.weight" not in index["weight_map"] and "0.embedding.weight" in index["weight_map"]
    head = FromFile(str(tmp_path / "w"), meta, seed=1).layers(meta, [3])[0]
    assert torch.equal(head.weight, reference[0].embedding.weight)


def reference_training(factory, config, make_optimizer, steps):
    """``factory()`` trained by torch alone on the pipeline's data: losses, norms, the model."""
    model = users_model(factory, seed=config.seed)
    optimizer = make_optimizer(model.parameters())
    pipe_batches = LocalPipeline(config)
    losses, norms = [], []
    for step in range(steps):
        inputs, targets = pipe_batches.batch(step)
        optimizer.zero_grad()
        loss = pipe_batches.prepared.loss_fn(model(inputs), targets)
        loss.backward()
        if config.clip_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, model


OPTIMIZERS = {
    "sgd": (dict(optimizer="sgd", lr=0.02), lambda p: torch.optim.SGD(p, lr=0.02)),
    "adam": (dict(optimizer="adam", lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    "adamw": (dict(optimizer="adamw", lr=0.01, weight_decay=0.1, clip_grad_norm=0.05),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
}


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_training_equals_the_users_own_training(stages, optimizer):
    settings, make = OPTIMIZERS[optimizer]
    config = RunConfig.of(model=CUSTOM, partition=PARTITIONS[stages], batch_size=8, microbatches=4, steps=3,
                       schedule="1f1b" if stages % 2 else "gpipe", **settings)
    losses, norms, reference = reference_training(user_init_models.custom_init, config, make, config.steps)
    pipe = LocalPipeline(config)
    assert [pipe.run_step(step) for step in range(config.steps)] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    if norms:
        assert pipe.grad_norms == pytest.approx(norms, rel=1e-5)
        assert min(pipe.grad_norms) > config.clip_grad_norm  # every step clipped
    for (name, p), q in zip(pipe.model().named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- Hugging Face GPT2Block stack


def gpt2_config(stages, dropout=0.0, **extra):
    partition = {1: (4,), 2: (2, 2), 4: (1, 1, 1, 1)}[stages]
    return RunConfig.of(model=GPT2, options={"dropout": dropout}, data="tests.helpers.user_init_models:gpt2_data", loss="mse",
                     partition=partition, batch_size=6, microbatches=3, optimizer="sgd", lr=0.5, steps=2, **extra)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_a_stack_of_gpt2_blocks_trains_as_the_users_model(stages):
    config = gpt2_config(stages)
    losses, _, reference = reference_training(user_init_models.gpt2_blocks,
                                              config, lambda p: torch.optim.SGD(p, lr=0.5), config.steps)
    pipe = LocalPipeline(config)
    assert [pipe.run_step(step) for step in range(config.steps)] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for (name, p), q in zip(pipe.model().named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_gpt2_blocks_with_dropout_replay_their_masks_under_rematerialisation():
    def grads(stages, checkpoint):
        pipe = LocalPipeline(gpt2_config(stages, dropout=0.2, checkpoint=checkpoint))
        loss = pipe.run_step(0, update=False)
        return loss, {n: p.grad.clone() for n, p in pipe.model().named_parameters()}

    for stages in (2, 4):
        loss, expected = grads(stages, "never")
        for policy in ("always", "except_last", "full"):
            again, got = grads(stages, policy)
            assert again == loss
            for name, grad in expected.items():
                assert torch.equal(got[name], grad), (stages, policy, name)


def test_gpt2_blocks_with_dropout_at_one_stage_equal_the_users_model_on_the_same_masks():
    """K = 1, M = 1: the stage seeds its generator for (seed, step, stage 0, micro-batch 0) before
    the forward; the user's model seeded the same way draws the same dropout masks."""
    config = RunConfig.of(model=GPT2, options={"dropout": 0.2}, data="tests.helpers.user_init_models:gpt2_data", loss="mse",
                       partition=(4,), batch_size=6, microbatches=1, optimizer="sgd", lr=0.5)
    pipe = LocalPipeline(config)
    model = users_model(user_init_models.gpt2_blocks, dropout=0.2)
    inputs, targets = pipe.batch(0)
    torch.default_generator.manual_seed(mix_seed(config.seed, 0, 0, 0))
    outputs = model(inputs)
    assert pipe.run_step(0) == pytest.approx(pipe.prepared.loss_fn(outputs, targets).item(), rel=1e-6)
    without_dropout = users_model(user_init_models.gpt2_blocks)(inputs)
    assert (outputs - without_dropout).abs().max() > 0.01  # dropout was on (float noise is below 1e-5)


# ----------------------------------------------------------------------------- --init meta and refusals


def test_init_meta_starts_from_the_per_layer_seeded_values():
    from executor.models.materialize import materialise

    config = RunConfig.of(model="mlp", options={"width": 8, "layers": 4}, partition=(2, 2), batch_size=4,
                       microbatches=2, init="meta", seed=2)
    meta = build_meta_model("mlp", {"width": 8, "layers": 4})
    expected = every_tensor(torch.nn.Sequential(*materialise(meta, range(4), seed=2)))
    assert_bitwise(every_tensor(LocalPipeline(config).model()), expected)


def test_init_meta_refuses_a_module_without_reset_parameters_and_factory_does_not():
    config = gpt2_config(2, init="meta")
    with pytest.raises(GpipeInputError) as info:
        prepare(config)
    assert "'weight' of Conv1D in layer 0 (GPT2Block) has no reset_parameters()" in str(info.value)
    assert "--init meta" in str(info.value) and "\n" not in str(info.value)
    prepare(gpt2_config(2))  # the default builds factory() and needs no reset_parameters()


def test_an_unknown_init_is_one_line():
    with pytest.raises(GpipeInputError, match="unknown --init 'seeded'"):
        RunConfig.of(model="mlp", partition=(8,), init="seeded").validate()


def test_a_checkpoint_shard_holding_a_pickle_is_refused_in_one_line(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    directory = tmp_path / "step-000000"
    directory.mkdir()
    torch.save({"module": Payload()}, directory / "stage-0.safetensors")
    manifest = {"stages": 1, "dir": "step-000000"}
    with pytest.raises(GpipeInputError) as info:
        checkpoint.check_shards(str(tmp_path), manifest)
    assert "is not a gpipe state file" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(GpipeInputError):
        state_file.load(str(directory / "stage-0.safetensors"))
    assert not (tmp_path / "ran").exists()


def test_state_files_round_trip_what_a_shard_holds(tmp_path):
    optimizer = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), betas=(0.8, 0.9))
    optimizer.step()
    state = {"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(), "none": None,
             "nested": {"$odd": (1, 2.5, float("inf")), 3: [True, "x"]}}
    state_file.save(str(tmp_path / "s.safetensors"), state)
    back = state_file.load(str(tmp_path / "s.safetensors"))
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert back["optimizer"]["state"].keys() == state["optimizer"]["state"].keys()
    assert torch.equal(back["rng"], state["rng"]) and back["none"] is None
    assert back["nested"] == {"$odd": (1, 2.5, float("inf")), 3: [True, "x"]}


# ----------------------------------------------------------------------------- over torchrun


@pytest.mark.slow
def test_four_processes_train_from_factorys_values_as_the_users_model(tmp_path):
    """K = 4 over gloo with AdamW and clipping: the losses, norms and every checkpointed parameter
    after the steps equal the user's own training of ``factory()``."""
    config = RunConfig.of(model=CUSTOM, partition=PARTITIONS[4], batch_size=8, microbatches=4, steps=3,
                       **OPTIMIZERS["adamw"][0])
    losses, norms, reference = reference_training(user_init_models.custom_init, config, OPTIMIZERS["adamw"][1], 3)
    done = gpipe("train", "--model", CUSTOM, "--partition", "1,2,2,1", "--batch", "8", "--microbatches", "4",
                 "--steps", "3", "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1",
                 "--clip-grad-norm", "0.05", "--report", str(tmp_path / "r.json"), "--save-every", "3",
                 "--checkpoint-dir", str(tmp_path / "ck"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert report["grad_norms"] == pytest.approx(norms, rel=1e-5)
    manifest = checkpoint.read_manifest(str(tmp_path / "ck"))
    trained = {}
    for stage in range(4):
        trained.update(state_file.load(checkpoint.shard_path(str(tmp_path / "ck" / manifest["dir"]), stage))["module"])
    expected = reference.state_dict()
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_gpt2_blocks_train_over_two_processes_and_init_meta_is_refused_before_any_worker(tmp_path):
    config = gpt2_config(2)
    losses, _, _ = reference_training(user_init_models.gpt2_blocks, config, lambda p: torch.optim.SGD(p, lr=0.5), 2)
    common = ["train", "--model", GPT2, "--data", "tests.helpers.user_init_models:gpt2_data", "--loss", "mse", "--stages",
              "2", "--batch", "6", "--microbatches", "3", "--optimizer", "sgd", "--lr", "0.5", "--steps", "2"]
    done = gpipe(*common, "--report", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "r.json").read_text())["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    refused = gpipe(*common, "--init", "meta")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "gpipe: error: 'weight' of Conv1D in layer 0 (GPT2Block) has no reset_parameters() to initialise it under "
        "--init meta; give Conv1D a reset_parameters() method that sets it, or drop --init meta to start from "
        "factory()'s values"]


def test_a_model_larger_than_this_host_is_refused_before_anything_is_built():
    # 8 layers of 100000 x 100000: 320 GB of fp32 weights, far more than this machine holds
    done = gpipe("train", "--model", "mlp", "--layers", "8", "--width", "100000", "--stages", "2", "--batch", "2",
                 "--microbatches", "1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "needs 298.03 GiB but this host has" in lines[0]
    assert "--init meta" in lines[0] and "--init-from PATH" in lines[0]


def test_init_and_init_from_together_are_one_line(tmp_path):
    done = gpipe("train", "--model", "mlp", "--stages", "2", "--init", "meta", "--init-from", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpipe: error: --init meta and --init-from both say where the first weights come from; give one of them"]
