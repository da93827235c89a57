"""Any decoder-only Hugging Face model (``hf:<type>``) priced as the transformer of its structure's shape:
every family with tensor, sequence and context parallelism, fp8 and selective recompute; ``hf:llama``
equal to the built-in transformer of its shape; what the shape cannot price said in ``assumed``."""

import json
import warnings

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from gpipe.main import main  # noqa: E402
from gpipe.workload_flags import resolve_workload  # noqa: E402
from sim.errors import GpipeInputError  # noqa: E402
from sim.evidence.replay import replay  # noqa: E402
from sim.workloads.named_models import named_models, named_options  # noqa: E402

SIZES = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
         "intermediate_size": 512, "vocab_size": 1000}
# per family, the fields that give it whole key/value heads for T = 2 and a window shorter than seq
FAMILIES = {
    "llama": {}, "mistral": {"sliding_window": 64}, "qwen2": {}, "qwen3": {}, "nemotron": {}, "bloom": {},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 4}, "gpt_neox": {}, "gemma": {},
    "gemma2": {"sliding_window": 64}, "phi3": {}, "starcoder2": {}, "olmo": {}, "olmo2": {}, "gpt2": {},
    "opt": {"word_embed_proj_dim": 256}, "mpt": {}, "gptj": {}, "phi": {}, "cohere": {}, "stablelm": {},
    "granite": {}, "persimmon": {}, "codegen": {}, "gpt_bigcode": {"multi_query": False},
}
SEQ = 128
SPLIT = ["--hardware", "h100-nvlink", "--stages", "2", "--batch", "8", "--microbatches", "4", "--tensor-parallel", "2",
         "--context-parallel", "2", "--precision", "fp8", "--checkpoint", "selective"]


def flags(options):
    return [item for key, value in options.items() for item in ("--option", f"{key}={json.dumps(value)}")]


def family_options(family):
    return {**SIZES, **FAMILIES[family], "seq": SEQ}


def meta_parameters(family, options):
    """The model's parameters, each tensor once, as transformers builds it."""
    config = transformers.AutoConfig.for_model(family, **{k: v for k, v in options.items() if k != "seq"})
    if getattr(config, "num_key_value_heads", 0) is None:
        config.num_key_value_heads = config.num_attention_heads
    if isinstance(getattr(config, "pad_token_id", None), int) and config.pad_token_id >= config.vocab_size:
        config.pad_token_id = None  # the default config's own, beyond the vocabulary given
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def simulated(capsys, argv):
    assert main(["simulate", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_simulates_split_over_tensor_and_context_parallel_devices_in_fp8(family, capsys):
    options = family_options(family)
    data = simulated(capsys, ["--model", f"hf:{family}", *flags(options), *SPLIT])
    assert (data["tensor_parallel"], data["sequence_parallel"], data["context_parallel"]) == (2, True, 2)
    assert data["precision"] == "fp8" and data["planned_from"] == f"hf:{family}" and data["step_time_s"] > 0
    assert data["model"]["name"] == f"hf:{family}" and data["model"]["num_layers"] == SIZES["num_hidden_layers"] + 2
    assert data["parameter_count"] == meta_parameters(family, options)  # every parameter, each once


def test_hf_llama_is_the_built_in_transformer_of_its_shape(capsys):
    """Llama is the built-in transformer with RMSNorm, no biases and rotary positions: the same
    step time, peak memory and parameters, split or not, at every recompute policy."""
    llama = {**SIZES, "seq": SEQ}
    builtin = {"layers": 2, "d_model": 256, "heads": 8, "kv_heads": 4, "ff": 512, "vocab": 1000, "seq": SEQ,
               "activation": "swiglu", "attention": "flash", "norm": "rmsnorm", "biases": "none",
               "positions": "rotary"}
    for layout in (SPLIT, ["--hardware", "a100-nvlink", "--stages", "2", "--batch", "8", "--microbatches", "4",
                           "--precision", "bf16", "--checkpoint", "full"]):
        for extra in ([], ["--option", "attention=eager", "--checkpoint", "selective"]):
            if extra and "--context-parallel" in layout:
                continue  # context parallelism runs on flash kernels
            ours = simulated(capsys, ["--model", "hf:llama", *flags(llama), *layout, *extra])
            theirs = simulated(capsys, ["--model", "transformer", *flags(builtin), *layout, *extra])
            assert ours["step_time_s"] == theirs["step_time_s"]
            assert [s["peak_memory_bytes"] for s in ours["stages"]] == [s["peak_memory_bytes"] for s in theirs["stages"]]
            assert ours["parameter_count"] == theirs["parameter_count"]


@pytest.mark.parametrize("family,fields,line", [
    ("bloom", {}, "ALiBi positions: the bias on the attention scores taken as free"),
    ("mpt", {}, "ALiBi positions"),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 4}, "attention and MLP in parallel"),
    ("gpt_neox", {}, "attention and MLP in parallel from one input (parallel block)"),
    ("mistral", {"sliding_window": 64}, "sliding window of 64 tokens on 2 of 2 layers: the flash kernel's queries"),
    ("gemma2", {"sliding_window": 64}, "sliding window of 64 tokens on 1 of 2 layers"),
    ("mistral", {"sliding_window": 4096}, "sliding window of 4096 tokens on 2 of 2 layers, not shorter than seq"),
    ("gemma2", {}, "soft-capped attention scores or logits"),
    ("gpt2", {}, "dropout (p=0.1) not priced"),
])
def test_what_the_shape_cannot_price_is_said_in_assumed(family, fields, line, capsys):
    workload = resolve_workload(f"hf:{family}", {**SIZES, **fields, "seq": SEQ})
    assert any(a.startswith(line) for a in workload.assumed), workload.assumed
    assert main(["simulate", "--model", f"hf:{family}", *flags({**SIZES, **fields, "seq": SEQ}), "--stages", "2",
                 "--hardware", "h100-nvlink", "--batch", "4", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert f"hf:{family} priced by its structure as a transformer" in out and f"assumed: {line}" in out
    assert not resolve_workload("hf:llama", {**SIZES, "seq": SEQ, "attention": "flash"}).assumed  # nothing of Llama
    assert resolve_workload("hf:llama", {**SIZES, "seq": SEQ}).assumed[0].startswith("attention not named: a flash")


def test_a_sliding_window_is_priced_on_a_flash_kernel():
    full = resolve_workload("hf:mistral", {**SIZES, "sliding_window": None, "seq": 1024})
    windowed = resolve_workload("hf:mistral", {**SIZES, "sliding_window": 256, "seq": 1024})
    assert windowed.layers[1].attention_flops_per_row == full.layers[1].attention_flops_per_row / 4
    assert windowed.parameter_count == full.parameter_count


@pytest.mark.parametrize("family,options", [
    ("llama", SIZES), ("gpt2", {"n_layer": 2, "n_embd": 256, "n_head": 8, "vocab_size": 1000})])
def test_the_shape_prices_what_the_meta_device_measures(family, options):
    """Layer for layer, the FLOPs and parameters read from the structure are those PyTorch's FLOP
    counter and the module tree measure (``--option analysis=meta``)."""
    shaped = resolve_workload(f"hf:{family}", {**options, "seq": 64})
    measured = resolve_workload(f"hf:{family}", {**options, "seq": 64, "analysis": "meta"})
    assert shaped.num_layers == measured.num_layers == 4
    for spec, profile in zip(shaped.layers, measured.profiles):
        assert spec.flops_per_row == profile.at(1).forward_flops and spec.params == profile.parameters
    assert shaped.parameter_count == measured.parameter_count


def test_named_models_read_the_same_shape_from_their_structure():
    keys = ("layers", "d_model", "ff", "heads", "kv_heads", "vocab", "activation")
    for name, model in named_models().items():
        if model.moe:  # mixtures of experts: tests/sim/test_moe_workloads.py
            continue
        shaped = resolve_workload(f"hf-config:{model.config_path}", {"seq": model.seq}).options
        named = named_options(name, {})
        assert {k: shaped[k] for k in keys} == {k: named[k] for k in keys}, name


def test_replayed_runs_of_hugging_face_families_are_modelled_with_their_assumptions():
    """Families, fp8 and tensor and context parallelism the replay refused before."""
    base = {"id": "", "source": "a test", "hardware": "h100-nvlink", "nodes": 1, "pipeline_stages": 2, "replicas": 1,
            "virtual_stages": 1, "microbatch_size": 1, "global_batch": 8, "checkpoint": "full",
            "sequence_parallel": True, "measured_step_s": 0.01}
    runs = [("hf:bloom", {"n_layer": 4, "hidden_size": 256, "n_head": 8, "vocab_size": 1000}, 2, 1, "bf16-model",
             "ALiBi positions"),
            ("hf:nemotron", {**SIZES, "num_hidden_layers": 4}, 2, 2, "fp8", None),
            ("hf:llama", {**SIZES, "num_hidden_layers": 4}, 1, 1, "fp8", None),
            ("hf:gpt_neox", {**SIZES, "num_hidden_layers": 4}, 2, 1, "bf16-model", "attention and MLP in parallel")]
    for model, options, tp, cp, precision, line in runs:
        run = {**base, "id": model, "model": model, "options": {**options, "seq": SEQ}, "tensor_parallel": tp,
               "context_parallel": cp, "precision": precision}
        done = replay(run, resolve_workload)
        assert done.modelled, done.reason
        assert done.layout["tensor_parallel"] == tp and done.layout["context_parallel"] == cp
        assert line is None or any(a.startswith(line) for a in done.assumed), done.assumed


def test_a_hugging_face_plan_is_priced_alike_and_names_the_model_to_train(tmp_path, capsys):
    options = {**SIZES, "num_hidden_layers": 4, "seq": SEQ}
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "hf:qwen2", *flags(options), "--hardware", "h100-nvlink", "--batch", "8",
                 "--tensor-parallel-options", "1,2", "--train-tokens", "1B", "--quiet", "--out", str(plan)]) == 0
    capsys.readouterr()
    saved = json.loads(plan.read_text())
    assert saved["model"]["name"] == "hf:qwen2" and saved["model"]["options"]["hidden_size"] == 256
    assert "d_model" not in saved["model"]["options"]  # the config's fields, which gpipe train builds from
    again = simulated(capsys, ["--plan", str(plan)])
    assert again["step_time_s"] == saved["predicted"]["step_time_s"] and again["plan_note"] is None


def test_a_config_file_of_any_family_is_priced(tmp_path):
    config = transformers.AutoConfig.for_model("falcon", **{**SIZES, "new_decoder_architecture": True,
                                                            "num_kv_heads": 4})
    config.save_pretrained(tmp_path)
    workload = resolve_workload(f"hf-config:{tmp_path}", {"seq": SEQ})
    assert workload.shape.parallel_block and workload.shape.kv_heads == 4


@pytest.mark.parametrize("options,message", [
    ({"analysis": "guess"}, "--option analysis=guess: choose shape"),
    ({"attention": "fast"}, "attention='fast'"),
    ({"num_key_value_heads": 3}, "hf:llama: kv_heads=3 does not divide heads=8"),
    ({"hidden_size": 30}, "the config refuses"),
])
def test_bad_hugging_face_options_are_one_line(options, message):
    with pytest.raises(GpipeInputError, match=message) as info:
        resolve_workload("hf:llama", {**SIZES, **options})
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_every_causal_language_model_transformers_knows_is_priced_or_refused_in_one_line():
    """Each type of transformers' causal-LM mapping, at its default config with two layers: priced with
    every parameter counted, or refused in one line for what its structure is (experts, no attention,
    latent attention, an encoder-decoder), never a traceback."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    priced, moe = [], []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            workload = resolve_workload(f"hf:{model_type}", {"num_hidden_layers": 2, "seq": SEQ})
        except GpipeInputError as exc:
            assert "\n" not in str(exc)
            continue
        if hasattr(workload, "shape"):
            assert workload.parameter_count == workload.shape.parameters, model_type
        else:  # a mixture of experts, priced by its config's fields: transformers' own model, built on meta
            assert workload.parameter_counts()["main"] == _meta_parameters(model_type), model_type
            moe.append(model_type)
        priced.append(model_type)
    assert set(FAMILIES) - {"falcon", "gpt_bigcode"} <= set(priced) and len(priced) >= 60
    assert {"deepseek_v3", "qwen3_moe", "mixtral", "llama4_text", "gpt_oss"} <= set(moe)


def _meta_parameters(model_type):
    """Parameters of transformers' causal LM of ``model_type`` at its default config with two layers
    (DeepSeek-V3's multi-token prediction module is not part of it, as it is not of the published count)."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
