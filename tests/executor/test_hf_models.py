"""Hugging Face decoder-only models as pipeline layers: the same losses and gradients as the model's
own forward and backward, pipelined or not, starting from its ``save_pretrained`` folder.

fp32. Tolerances: losses rtol 1e-5, gradients rtol 1e-4 / atol 1e-6: the pipeline sums the loss
over micro-batches (and a tied embedding's gradient over stages) in another order than the model's
single pass; nothing else differs.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from executor.config import RunConfig  # noqa: E402
from executor.models.build import checkpoint_names, model_ref  # noqa: E402
from executor.runtime.pipeline import LocalPipeline, prepare  # noqa: E402
from sim.errors import GpipeInputError  # noqa: E402
from tests.helpers import in_process

CONFIGS = {
    "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
SEQ = 8
PARTITIONS = {1: (4,), 2: (2, 2), 3: (1, 2, 1), 4: (1, 1, 1, 1)}  # embedding, 2 layers, head (with the final norm)


def saved_model(tmp_path, family, tie=None):
    options = dict(CONFIGS[family])
    if tie is not None:
        options["tie_word_embeddings"] = tie
    config = transformers.AutoConfig.for_model(family, **options)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    return model, options


def run_config(tmp_path, stages, microbatches=2, checkpoint="except_last", schedule="gpipe"):
    return RunConfig.of(model=f"hf-config:{tmp_path}", options={"seq": SEQ}, partition=PARTITIONS[stages],
                     batch_size=6, microbatches=microbatches, checkpoint=checkpoint, schedule=schedule,
                     init_from=str(tmp_path))


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("gpt2", None)])
@pytest.mark.parametrize("stages,microbatches,checkpoint,schedule",
                         [(1, 1, "never", "gpipe"), (2, 3, "except_last", "1f1b"), (3, 2, "always", "gpipe"),
                          (4, 6, "never", "1f1b")])
def test_losses_and_gradients_equal_the_models_own(tmp_path, family, tie, stages, microbatches, checkpoint,
                                                  schedule):
    model, _ = saved_model(tmp_path, family, tie)
    pipe = LocalPipeline(run_config(tmp_path, stages, microbatches, checkpoint, schedule))
    ids, targets = pipe.batch(0)
    loss = pipe.run_step(0, update=False)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(torch.tensor(loss), out.loss.detach(), rtol=1e-5, atol=1e-6)
    rename = checkpoint_names(f"hf-config:{tmp_path}", {"seq": SEQ})
    theirs = dict(model.named_parameters())
    first_copy = {}
    for stage in pipe.stages:
        for name, p in stage.module.named_parameters():
            first_copy.setdefault(rename(name), p)  # a tied head's copy holds the same summed gradient
    for name, p in theirs.items():
        torch.testing.assert_close(first_copy[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert set(first_copy) >= set(theirs)


def test_a_tied_llama_shares_its_head_across_stages(tmp_path):
    saved_model(tmp_path, "llama", tie=True)
    groups = prepare(run_config(tmp_path, 2)).shared
    assert [(g.owners, g.names) for g in groups] == [((0, 1), {0: "0.embed_tokens.weight", 1: "3.lm_head.weight"})]


def test_a_llama_2_7b_config_counts_its_parameters():
    ref = model_ref("hf:llama", {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                                 "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000})
    assert ref.num_layers == 34
    assert round(ref.parameter_count / 1e9, 2) == 6.74


@pytest.mark.parametrize("name,options,message", [
    ("hf:bert", {}, "Hugging Face model type 'bert' is not supported; choose one of gpt2, llama, mistral, qwen2"),
    ("hf:llama", {"hidden_size": 30, "num_attention_heads": 4}, "the config refuses"),
])
def test_bad_hugging_face_models_are_one_line(name, options, message):
    with pytest.raises(GpipeInputError) as info:
        model_ref(name, options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_config_file_that_is_not_one_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(GpipeInputError, match="has no model_type"):
        model_ref(f"hf-config:{tmp_path}", {})
    (tmp_path / "config.json").write_text("not json")
    with pytest.raises(GpipeInputError, match="is not a readable config.json"):
        model_ref(f"hf-config:{tmp_path}", {})


def test_simulate_and_plan_take_a_hugging_face_model(capsys):
    from gpipe.main import main

    options = [item for key, value in CONFIGS["llama"].items() for item in ("--option", f"{key}={value}")]
    assert main(["simulate", "--model", "hf:llama", *options, "--option", "seq=8", "--stages", "2",
                 "--microbatches", "2", "--batch", "4", "--hardware", "a100-nvlink", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    expected = model_ref("hf:llama", {**CONFIGS["llama"], "seq": 8}).parameter_count
    assert simulated["parameter_count"] == expected and simulated["model"]["num_layers"] == 4
    assert main(["plan", "--model", "hf:llama", *options, "--option", "seq=8", "--batch", "4", "--hardware",
                 "a100-nvlink", "--microbatch-options", "1,2", "--json", "--quiet"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["parameter_count"] == expected and planned["ranked"]
    # measured op by op on the meta device when asked: the same layers and parameters
    assert main(["simulate", "--model", "hf:llama", *options, "--option", "seq=8", "--option", "analysis=meta",
                 "--stages", "2", "--microbatches", "2", "--batch", "4", "--hardware", "a100-nvlink", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["parameter_count"] == expected and measured["model"]["num_layers"] == 4
    assert measured["planned_from"] is None and simulated["planned_from"] == "hf:llama"


@pytest.mark.slow
def test_training_a_hugging_face_model_with_gpipe_train(tmp_path):
    """Two processes, the tied GPT-2 head on the second: the losses of the in-process K=1 pipeline."""
    import os
    import subprocess
    import sys

    saved_model(tmp_path / "gpt2", "gpt2")
    report = tmp_path / "report.json"
    result = in_process.gpipe("train", "--model", f"hf-config:{tmp_path / 'gpt2'}",
                              "--option", f"seq={SEQ}", "--init-from", str(tmp_path / "gpt2"), "--partition", "2,2",
                              "--batch", "6", "--microbatches", "3", "--steps", "3", "--optimizer", "adam", "--lr",
                              "0.01", "--report", str(report))
    assert result.returncode == 0, result.stderr
    local = LocalPipeline(RunConfig.of(model=f"hf-config:{tmp_path / 'gpt2'}", options={"seq": SEQ}, partition=(4,),
                                    batch_size=6, microbatches=3, optimizer="adam", lr=0.01,
                                    init_from=str(tmp_path / "gpt2")))
    expected = [local.run_step(s) for s in range(3)]
    assert json.loads(report.read_text())["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("command,model,message", [
    ("simulate", "hf:nosuchtype", "model type 'nosuchtype' is not a causal language model transformers knows"),
    ("plan", "hf:nosuchtype", "model type 'nosuchtype' is not a causal language model transformers knows"),
    ("train", "hf:bert", "model type 'bert' is not supported; choose one of gpt2, llama"),  # planned, not trained
    ("train", "hf:bloom", "model type 'bloom' is not supported; choose one of gpt2, llama"),
])
def test_an_unknown_hugging_face_type_ends_every_command_with_one_line_and_exit_2(command, model, message, capsys):
    from gpipe.main import main

    assert main([command, "--model", model, *(["--stages", "2"] if command == "train" else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_a_config_the_model_cannot_be_built_from_is_one_line():
    with pytest.raises(GpipeInputError) as info:
        model_ref("hf:llama", {**CONFIGS["llama"], "hidden_size": 0})
    assert "cannot be built from its config" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("gpt2", None)])
def test_without_a_file_training_starts_from_what_from_config_gives(family, tie):
    """``hf:<type>`` with no ``--init-from``: every tensor is what ``from_config`` gives under the
    run's seed, and the first step's loss is the model's own."""
    options = dict(CONFIGS[family], **({} if tie is None else {"tie_word_embeddings": tie}))
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(family, **options))
    pipe = LocalPipeline(RunConfig.of(model=f"hf:{family}", options={**options, "seq": SEQ}, partition=PARTITIONS[2],
                                   batch_size=6, microbatches=2, seed=4))
    rename = checkpoint_names(f"hf:{family}", options)
    ours = {rename(name): tensor for name, tensor in pipe.model().state_dict().items()}
    theirs = model.state_dict()
    assert set(theirs) <= set(ours)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    ids, _ = pipe.batch(0)
    expected = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(torch.tensor(pipe.run_step(0, update=False)), expected.detach(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("name,options,expected", [
    ("hf:llama", {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "vocab_size": 1000},
     {"layers": 4, "d_model": 256, "ff": 688, "heads": 8, "kv_heads": 2, "vocab": 1000, "activation": "swiglu"}),
    ("hf:nemotron", {"num_hidden_layers": 2, "hidden_size": 192, "intermediate_size": 768, "num_attention_heads": 6,
                     "num_key_value_heads": 2, "vocab_size": 500},
     {"layers": 2, "d_model": 192, "ff": 768, "heads": 6, "kv_heads": 2, "vocab": 500, "activation": "squared_relu"}),
    ("hf:bloom", {"n_layer": 3, "hidden_size": 128, "n_head": 4, "vocab_size": 700},
     {"layers": 3, "d_model": 128, "ff": 512, "heads": 4, "kv_heads": 0, "vocab": 700, "activation": "gelu"}),
])
def test_any_decoder_only_type_is_planned_by_its_shape(name, options, expected):
    """Types the executor does not train (nemotron, bloom) as well: the model's shape, read from its
    structure without a download, as the transformer's options."""
    from gpipe.workload_flags import resolve_workload

    shaped = resolve_workload(name, {**options, "seq": 128}).options
    assert {k: shaped[k] for k in expected} == expected and shaped["seq"] == 128 and shaped["attention"] == "flash"


def test_tensor_parallelism_plans_a_hugging_face_model_by_its_shape(capsys):
    from gpipe.main import main

    options = ["--option=num_hidden_layers=4", "--option=hidden_size=256", "--option=intermediate_size=688",
               "--option=num_attention_heads=8", "--option=num_key_value_heads=2", "--option=vocab_size=1000",
               "--option=seq=256"]
    assert main(["simulate", "--model", "hf:llama", *options, "--stages", "2", "--batch", "8", "--microbatches", "4",
                 "--hardware", "h100-nvlink", "--tensor-parallel", "2", "--precision", "bf16-model", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["planned_from"] == "hf:llama" and simulated["tensor_parallel"] == 2
    from gpipe.workload_flags import resolve_workload

    config = {o.split("=")[1]: int(o.split("=")[2]) for o in options}
    assert simulated["model"]["name"] == "hf:llama" and simulated["model"]["options"]["seq"] == 256
    assert resolve_workload("hf:llama", config).options["activation"] == "swiglu"  # the gated MLP it prices
    assert main(["plan", "--model", "hf:llama", *options, "--batch", "8", "--hardware", "h100-nvlink",
                 "--tensor-parallel-options", "1,2", "--quiet"]) == 0
    assert "hf:llama priced by its structure as a transformer" in capsys.readouterr().out


def test_a_mixture_of_experts_is_planned_by_its_config_with_tensor_parallelism():
    proc = in_process.gpipe("simulate", "--model", "hf:mixtral", "--option", "num_hidden_layers=4", "--tensor-parallel",
                            "2", "--hardware", "h100-nvlink", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensor_parallel"] == 2


@pytest.mark.parametrize("name,message", [("hf:mamba", "layer 0 has no attention"),
                                          ("hf:t5", "not a causal language model")])
def test_what_cannot_be_planned_by_shape_is_one_line(name, message):
    import subprocess
    import sys

    proc = in_process.gpipe("simulate", "--model", name, "--tensor-parallel", "2", "--hardware", "h100-nvlink")
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_the_fork_server_preloads_each_familys_modeling_code(tmp_path):
    """``rank_imports`` names modules that exist (the fork server skips one that does not, silently),
    read from a config file's model_type as well as from ``hf:TYPE``."""
    import importlib.util

    from executor.models.hf import FAMILIES, rank_imports

    for family in FAMILIES:
        modules = rank_imports(f"hf:{family}", {})
        assert modules[0] == "executor.models.hf" and modules[1].endswith(f".modeling_{family}")
        assert all(importlib.util.find_spec(module) is not None for module in modules)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 32}))
    assert rank_imports(f"hf-config:{tmp_path}", {})[1] == "transformers.models.mistral.modeling_mistral"
    assert rank_imports("hf:bert", {}) == []
