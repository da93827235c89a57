"""Mixtures of experts in the simulator's workloads: parameter counts against their makers' figures, the
router, grouped expert matmuls, shared experts, dense layers first or interleaved, capacity, latent
attention, multi-token prediction, active-parameter model FLOPs, and hf: MoE types through the shape path."""

import dataclasses
import json

import pytest

from gpipe.main import main
from sim.catalog.kernel_model import GROUPED_MATMUL_RELATIVE, KernelEfficiency, layer_times
from sim.errors import GpipeInputError
from sim.workloads.layer_spec import LayerSpec
from sim.workloads.moe.layers import expected_max_load, moe_layer_set
from sim.workloads.moe.workload import MoEWorkload, named_moe_workload
from sim.workloads.named_models import named_models
from sim.workloads.resolve import resolve_workload

MOE_MODELS = ["deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "mixtral-8x22b", "llama4-maverick",
              "gpt-oss-120b"]
# a tiny MoE transformer: 4 layers, the first dense, 4 experts of 96 top-2, a shared MLP of 32
TINY = {"layers": 4, "d_model": 64, "ff": 128, "heads": 4, "seq": 32, "vocab": 256, "experts": 4, "top_k": 2,
        "expert_ff": 96, "shared_ff": 32, "moe_layers": "1,2,3", "activation": "swiglu", "biases": "none",
        "precision": "bf16-model", "attention": "flash"}


def _within_published(ours: float, published: float) -> bool:
    """Within 1%, or equal to the published figure at the digits it is given to (37B, 3.3B, 12.9B are
    truncated or rounded counts, not measurements): ``published <= ours < published + one unit of its last digit``."""
    digits = f"{published / 1e9:g}"
    unit = 10 ** -(len(digits.split(".")[1]) if "." in digits else 0) * 1e9
    return abs(ours / published - 1) <= 0.01 or published <= ours < published + unit


@pytest.mark.parametrize("name", MOE_MODELS)
def test_parameter_counts_equal_the_published_totals(name):
    model = named_models()[name]
    published = model.published
    counts = named_moe_workload(name, {}).parameter_counts()
    assert model.moe and counts["main"] == pytest.approx(published["total"], rel=0.01), counts
    active = counts["active"] + published["active_counts_embedding"] * counts["embedding"]
    assert _within_published(active, published["active"]), (active, published["active"])


def test_gpt_oss_counts_match_its_model_card_to_the_digit():
    """gpt-oss's card gives 116.83B total and 5.13B active (embedding not counted): the counts of every
    bias, sink and router agree to the last digit."""
    counts = named_moe_workload("gpt-oss-120b", {}).parameter_counts()
    assert round(counts["main"] / 1e9, 2) == 116.83 and round(counts["active"] / 1e9, 2) == 5.13


def test_which_layers_are_mixtures_follows_each_family():
    def moe(name, **fields):
        return sorted(moe_layer_set(named_moe_workload(name, fields).options))

    assert moe("deepseek-v3", num_hidden_layers=6) == [3, 4, 5]  # first_k_dense_replace = 3
    assert moe("deepseek-v3", num_hidden_layers=6, moe_layer_freq=2) == [4]  # i >= 3 and i % 2 == 0
    assert moe("llama4-maverick", num_hidden_layers=6) == [1, 3, 5]  # interleave_moe_layer_step = 2
    assert moe("qwen3-30b-a3b", num_hidden_layers=4, decoder_sparse_step=2) == [1, 3]
    assert moe("qwen3-30b-a3b", num_hidden_layers=4, mlp_only_layers=[0]) == [1, 2, 3]
    assert moe("mixtral-8x7b", num_hidden_layers=3) == [0, 1, 2]


def test_a_moe_block_prices_its_router_experts_and_shared_mlp():
    w = MoEWorkload("tiny", {}, TINY)
    dense, sparse = w.layers[1], w.layers[2]
    d, s, E, k, f, fs, ff = 64, 32, 4, 2, 96, 32, 128
    # the MoE block is the dense block with the MLP replaced: router + top-k experts + shared MLP per token
    assert sparse.flops_per_row - dense.flops_per_row == 2 * s * (d * E + k * 3 * d * f + 3 * d * fs - 3 * d * ff)
    assert sparse.grouped_matmul_flops_per_row == 2 * s * k * 3 * d * f
    assert sparse.params - dense.params == d * E + E * 3 * d * f + 3 * d * fs - 3 * d * ff  # every expert held
    padded = MoEWorkload("tiny", {}, {**TINY, "capacity_factor": 1.5}).layers[2]
    assert padded.grouped_matmul_flops_per_row == 1.5 * sparse.grouped_matmul_flops_per_row  # padded to capacity
    assert padded.params == sparse.params


def test_grouped_expert_matmuls_run_further_from_peak_than_dense_ones():
    kernels = KernelEfficiency(matmul=0.7, attention=0.6, memory=0.8, collective=0.75, optimizer=0.5,
                               matmul_launch_s=0.0)
    dense = LayerSpec("x", 0, 1e12, 0.0, 0.0, 0.0, 0.0, 0.0)
    grouped = dataclasses.replace(dense, grouped_matmul_flops_per_row=1e12)
    args = (1, 1e15, 1e12, kernels, 0.0, 0.0)
    assert layer_times(grouped, *args).forward_s == pytest.approx(layer_times(dense, *args).forward_s
                                                                  / GROUPED_MATMUL_RELATIVE)


def test_latent_attention_is_priced_as_what_it_computes():
    """DeepSeek-V3's MLA: q 7168x1536 and 1536x(128x192), kv 7168x576 and 512x(128x256), output 16384x7168,
    two latent norms, two block norms; the dense block's MLP 3 x 7168 x 18432."""
    w = named_moe_workload("deepseek-v3", {"num_hidden_layers": 4, "seq": 1024})
    attention = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168 + 1536 + 512
    assert w.layers[1].params == attention + 2 * 7168 + 3 * 7168 * 18432
    s, keys, h = 1024, 1024, 128
    projections = 2 * s * (attention - 1536 - 512 + 3 * 7168 * 18432)
    assert w.layers[1].flops_per_row == projections + 2 * s * keys * h * (192 + 128)
    assert w.layers[1].attention_flops_per_row == 2 * s * keys * h * (192 + 128)


def test_multi_token_prediction_modules_are_priced_but_not_published():
    w = named_moe_workload("deepseek-v3", {"num_hidden_layers": 4})
    assert [spec.name for spec in w.layers][-2:] == ["mtp", "head"] and w.num_layers == 4 + 3
    counts = w.parameter_counts()
    block = w.layers[-3]  # the last MoE block: the MTP module's is the same plus its projection and norms
    assert counts["mtp"] == w.layers[-2].params == block.params + 2 * 7168 * 7168 + 3 * 7168
    assert counts["total"] == counts["main"] + counts["mtp"]
    assert w.layers[-2].flops_per_row > block.flops_per_row + 2 * 4096 * 7168 * 129280  # its own head's matmul


def test_model_flops_per_token_count_active_parameters_only():
    w = named_moe_workload("mixtral-8x7b", {"seq": 4096})
    counts = w.parameter_counts()
    attention = 6 * 4096 * 2 * 32 * 128 * 32  # scores and values, 32 layers, forward and backward
    assert w.model_flops_per_token() == 6 * counts["active"] + attention
    assert w.describe()["model_flops_per_token"] == w.model_flops_per_token() < 6 * counts["total"] / 3


def test_expected_maximum_expert_load():
    assert expected_max_load(4096, 8, 2, imbalance=1.3) == 1.3
    # balls into bins: 1024 per expert on average, the fullest about 3 standard deviations above
    assert expected_max_load(4096, 8, 2) == pytest.approx(1 + (2 * 1024 * 2.0794) ** 0.5 / 1024, rel=1e-3)
    assert named_moe_workload("deepseek-v3", {}).expected_max_load(4096) > 1.1


def test_bad_moe_options_are_one_line(capsys):
    assert main(["simulate", "--model", "mixtral-8x7b", "--option", "num_experts_per_tok=9", "--stages", "2"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("gpipe: error: top_k=9") and error.count("\n") == 1
    with pytest.raises(GpipeInputError, match=r"top_k=9 \(a config's num_experts_per_tok\) is above experts=8"):
        named_moe_workload("mixtral-8x7b", {"num_experts_per_tok": 9})
    with pytest.raises(GpipeInputError, match="capacity_factor='-1'"):
        named_moe_workload("mixtral-8x7b", {"capacity_factor": "-1"})
    with pytest.raises(GpipeInputError, match="experts is not a field of its config"):
        named_moe_workload("mixtral-8x7b", {"experts": 4})


def test_simulate_holds_every_expert_on_its_stage(capsys):
    """A plain pipeline: each stage keeps all its layers' experts (18 bytes a parameter in bf16 with Adam)."""
    args = ["simulate", "--model", "qwen3-30b-a3b", "--option", "num_hidden_layers=6", "--option", "seq=1024",
            "--hardware", "h100-nvlink", "--stages", "2", "--microbatches", "4", "--batch", "4", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["planned_from"] == "qwen3-30b-a3b" and data["model"]["num_layers"] == 8
    workload = resolve_workload("qwen3-30b-a3b", {"num_hidden_layers": 6, "seq": 1024, "precision": "bf16-model"})
    first = sum(cost.param_bytes + cost.grad_bytes + cost.optimizer_bytes
                for cost in workload.layer_costs(1, _h100())[:4])
    assert first == 18 * sum(spec.params for spec in workload.layers[:4])
    assert 0 < data["step_time_s"] < 10


def test_hf_moe_types_go_through_the_shape_path(capsys):
    pytest.importorskip("transformers")
    small = ["--option", "num_hidden_layers=2", "--option", "seq=256", "--hardware", "h100-nvlink", "--stages", "2",
             "--microbatches", "2", "--batch", "2", "--json"]
    fewer = {"hf:deepseek_v3": ["--option", "n_routed_experts=16"]}  # its defaults: 256 experts of DeepSeek-V3's
    for model in ("hf:mixtral", "hf:qwen3_moe", "hf:deepseek_v3", "hf:llama4_text", "hf:gpt_oss"):
        assert main(["simulate", "--model", model, *small, *fewer.get(model, [])]) == 0, model
        data = json.loads(capsys.readouterr().out)
        assert data["planned_from"] == model and data["model"]["num_layers"] >= 4
    # the packaged config read by transformers prices as the named model
    from gpipe.workload_flags import resolve_workload as resolve_hf

    for name in ("mixtral-8x7b", "deepseek-v3", "gpt-oss-120b"):
        model = named_models()[name]
        hf = resolve_hf(f"hf-config:{model.config_path}", {"seq": model.seq})
        assert hf.parameter_counts() == named_moe_workload(name, {}).parameter_counts(), name


def _h100():
    from sim.catalog.hardware import get_system

    return get_system("h100-nvlink").device
