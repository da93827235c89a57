"""Named models (--model llama3-70b): packaged Hugging Face configs planned by their shape."""

import json

import pytest

from gpipe.main import main
from sim.errors import GpipeInputError
from sim.workloads.models import get_workload
from sim.workloads.named_models import named_models, named_options
from tests.helpers import in_process


def test_every_named_model_is_the_shape_transformers_reads_from_its_config():
    """The torch-free reader and transformers' own config classes agree on every packaged config."""
    transformers = pytest.importorskip("transformers")
    from sim.workloads.named_models import transformer_shape

    for name, model in named_models().items():
        assert model.source and model.seq > 0
        if model.moe:  # mixtures of experts: tests/sim/test_moe_workloads.py
            continue
        fields = json.loads(open(model.config_path).read())
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        shaped = transformer_shape(config.to_dict(), model.seq, name)
        assert {k: v for k, v in named_options(name, {}).items() if k not in model.features} == shaped, name


def test_every_dense_named_model_carries_the_features_its_structure_has():
    """index.json's features are what transformers' model of each packaged config is on the meta
    device: the planner prices Llama with RMSNorms, rotary positions and no biases, GPT-3 with a
    learned table and a tied head, Mistral with its window."""
    pytest.importorskip("transformers")
    from executor.models.hf_shape import decoder_shape
    from sim.workloads.decoder_features import FEATURE_DEFAULTS
    from sim.workloads.decoder_shape import priced_options

    for name, model in named_models().items():
        if model.moe:
            continue
        read = priced_options(decoder_shape("hf-config:" + model.config_path, {}), {"seq": model.seq})
        assert model.features == {k: v for k, v in read.items() if k in FEATURE_DEFAULTS}, name
    assert named_options("llama3-70b", {})["positions"] == "rotary"
    assert named_options("mistral-7b", {})["window"] == "4096"


@pytest.mark.parametrize("name,layers,d_model,kv_heads,activation,billions", [
    ("llama3-8b", 32, 4096, 8, "swiglu", 8.0), ("llama3-70b", 80, 8192, 8, "swiglu", 70.6),
    ("llama3-405b", 126, 16384, 8, "swiglu", 405.85), ("gpt3-175b", 96, 12288, 0, "gelu", 174.6),
    ("nemotron4-15b", 32, 6144, 8, "squared_relu", 15.7), ("nemotron4-340b", 96, 18432, 8, "squared_relu", 341.1),
])
def test_named_shapes_and_sizes(name, layers, d_model, kv_heads, activation, billions):
    """Sizes as their makers count them: Llama 3.1 405B's model card 405,853,388,800; GPT-3's 175B with
    its head tied to the embedding (174.6B counted exactly, as Megatron-LM counts it)."""
    o = named_options(name, {})
    assert (o["layers"], o["d_model"], o["kv_heads"], o["activation"], o["attention"]) == \
        (layers, d_model, kv_heads, activation, "flash")
    assert get_workload("transformer", o).parameter_count / 1e9 == pytest.approx(billions, abs=0.1)


def test_options_override_a_config_field_or_the_sequence_and_nothing_else():
    o = named_options("llama3-70b", {"num_hidden_layers": 40, "seq": 4096, "precision": "bf16-model"})
    assert (o["layers"], o["seq"], o["precision"]) == (40, 4096, "bf16-model")
    with pytest.raises(GpipeInputError, match="layers is not a field of its config"):
        named_options("llama3-70b", {"layers": 40})


def test_simulate_and_plan_take_a_named_model(capsys):
    assert main(["plan", "--list-models"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in named_models())
    assert main(["simulate", "--model", "llama3-8b", "--option", "num_hidden_layers=4", "--hardware", "h100-nvlink",
                 "--stages", "2", "--microbatches", "2", "--batch", "2", "--tensor-parallel", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["planned_from"] == "llama3-8b" and data["model"]["options"]["seq"] == 8192
    assert data["model"]["num_layers"] == 6  # 4 blocks, the embedding and the head


def test_a_named_model_the_executor_cannot_build_is_one_line():
    proc = in_process.gpipe("train", "--model", "nemotron4-15b", "--stages", "2")
    assert proc.returncode == 2 and "'nemotron' is not supported" in proc.stderr and proc.stderr.count("\n") == 1
