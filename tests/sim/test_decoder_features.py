"""The transformer's decoder features (sim.workloads.decoder_features): the defaults are GPT's layout
exactly, each feature moves what it says by the literal amount, and bad values are one line."""

import dataclasses

import pytest

from sim.catalog.hardware import get_system
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.errors import GpipeInputError
from sim.workloads.decoder_features import FEATURE_DEFAULTS
from sim.workloads.layer_spec import STAT_BYTES
from sim.workloads.models import get_workload
from sim.workloads.precision import FP32_BYTES
from sim.workloads.tensor_parallel import with_tensor_parallel
from sim.workloads.transformer import transformer_layers

GPT = {"layers": 4, "d_model": 512, "ff": 2048, "heads": 8, "seq": 256, "vocab": 8000, "precision": "bf16-model",
       "attention": "flash"}
S, D, V = GPT["seq"], GPT["d_model"], GPT["vocab"]


def layers(**features):
    return get_workload("transformer", {**GPT, **features}).layers


def test_the_defaults_given_explicitly_are_gpts_layout_and_absent_from_the_options():
    given = {k: v for k, v in FEATURE_DEFAULTS.items() if v is not None}
    assert layers(**given) == layers()
    assert not set(FEATURE_DEFAULTS) & set(get_workload("transformer", GPT).describe()["options"])


def test_rmsnorm_keeps_one_statistic_and_one_weight_per_element():
    block, rms = layers()[1], layers(norm="rmsnorm")[1]
    assert block.params - rms.params == 2 * D  # two norms' biases
    assert block.saved_bytes_per_row - rms.saved_bytes_per_row == 2 * STAT_BYTES * S  # each norm's mean
    head, rms_head = layers()[-1], layers(norm="rmsnorm")[-1]
    assert head.params - rms_head.params == D


def test_biases_none_drops_every_bias():
    full, bare = get_workload("transformer", GPT), get_workload("transformer", {**GPT, "biases": "none"})
    per_block = 3 * D + D + GPT["ff"] + D  # QKV, proj, fc1, fc2
    assert full.parameter_count - bare.parameter_count == GPT["layers"] * per_block + V


def test_rotary_positions_have_no_table_and_rotate_q_and_k_in_every_block():
    learned, rotary = layers(), layers(positions="rotary")
    assert learned[0].params - rotary[0].params == S * D
    c = 2  # bf16-model's compute bytes
    assert rotary[1].traffic_bytes_per_row - learned[1].traffic_bytes_per_row == 2 * c * S * (D + D + D - D)
    half = layers(positions="rotary", rotary_fraction=0.5)[1]
    assert half.traffic_bytes_per_row - learned[1].traffic_bytes_per_row == pytest.approx(c * S * 2 * D)


def test_head_dim_widens_the_attention_not_the_stream():
    """Gemma's 16 heads of 256 on a 3,072-wide stream: QKV and proj are 4,096 wide."""
    o = {**GPT, "d_model": 3072, "heads": 16, "ff": 8192, "head_dim": 256}
    block = get_workload("transformer", o).layers[1]
    dq = 16 * 256
    assert block.flops_per_row == 2.0 * S * (3072 * 3 * dq + dq * 3072 + 2 * 3072 * 8192) + 4.0 * S * S * dq
    odd = {**o, "d_model": 3000}  # heads need not divide the stream when their width is given
    assert get_workload("transformer", odd).layers[1].attention_flops_per_row == 4.0 * S * S * dq
    with pytest.raises(GpipeInputError, match="does not divide d_model"):
        get_workload("transformer", {**odd, "head_dim": 0})


def test_a_parallel_block_never_saves_the_stream_between_attention_and_mlp():
    F = 2  # bf16-model's residual stream
    sequential, parallel = layers()[1], layers(parallel_block=True)[1]
    assert sequential.saved_bytes_per_row - parallel.saved_bytes_per_row == F * S * D
    shared = layers(parallel_block=True, norms=1)[1]  # one norm feeds both: its output saved once
    assert sequential.saved_bytes_per_row - shared.saved_bytes_per_row == (F + 2) * S * D + 2 * STAT_BYTES * S


def test_a_sliding_window_shortens_a_flash_kernels_keys_on_its_layers_only():
    windowed = layers(window="64,0")
    assert windowed[1].attention_flops_per_row == 4.0 * S * 64 * D
    assert windowed[2].attention_flops_per_row == layers()[2].attention_flops_per_row == 4.0 * S * S * D
    assert layers(window="64", attention="eager")[1] == layers(attention="eager")[1]  # every score computed
    assert layers(window="1024")[1] == layers()[1]  # longer than the sequence


def test_a_tied_head_is_one_parameter_held_once_per_stage():
    tied = get_workload("transformer", {**GPT, "tied": True})
    untied = get_workload("transformer", GPT)
    assert untied.parameter_count - tied.parameter_count == V * D
    (shared,) = tied.shared_parameters
    assert shared.layers == (0, GPT["layers"] + 1) and shared.param_bytes == V * D * 2  # bf16 weights
    system = get_system("h100-nvlink", fitted=False)
    one_stage = [simulate(w, system, (GPT["layers"] + 2,), 8,
                          ParallelLayout.for_partition((GPT["layers"] + 2,), 2, checkpoint="never"), record=False).stages[0].peak_memory_bytes
                 for w in (tied, untied)]
    assert one_stage[1] - one_stage[0] == shared.static_bytes
    split, groups = with_tensor_parallel(tied, system, 2, True)
    assert split.shared_parameters[0].param_bytes == V // 2 * D * 2 and split.parameter_count == tied.parameter_count


def test_relu_saves_one_mlp_tensor_where_gelu_saves_two():
    assert layers()[1].saved_bytes_per_row - layers(activation="relu")[1].saved_bytes_per_row == GPT["ff"] * S * 2


def test_a_norm_after_the_embedding_and_qk_norms_are_counted():
    F = 2
    assert layers(embedding_norm=True)[0].params - layers()[0].params == 2 * D
    assert layers(embedding_norm=True)[0].saved_bytes_per_row - layers()[0].saved_bytes_per_row == \
        S * D * F + 2 * STAT_BYTES * S
    assert layers(qk_norm=True)[1].saved_bytes_per_row - layers()[1].saved_bytes_per_row == 2 * S * 2 * D


@pytest.mark.parametrize("key,value,message", [
    ("norm", "batchnorm", "choose one of layernorm, rmsnorm"), ("biases", "qkv,bias", "bias is not a layer"),
    ("window", "a,b", "comma list of windows"), ("rotary_fraction", 2, "a number in (0, 1]"),
    ("tied", "maybe", "use 0 or 1"), ("norm_weights", 3, "from 0 to 2"), ("positions", "sinusoid", "learned"),
])
def test_bad_features_are_one_line(key, value, message):
    with pytest.raises(GpipeInputError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        get_workload("transformer", {**GPT, key: value})
    assert "\n" not in str(info.value)


def test_the_executor_refuses_the_planning_features_in_one_line():
    from executor.models.build import resolve_options

    with pytest.raises(GpipeInputError, match="has no option 'norm'"):
        resolve_options("transformer", {"norm": "rmsnorm"})


def test_tensor_parallelism_splits_the_features_as_the_layout():
    """QKV and fc1 biases split over T, norms replicated: the block's parameters on one device."""
    o = {**GPT, "norm": "rmsnorm", "biases": "qkv", "head_dim": 128}
    whole = transformer_layers(get_workload("transformer", o).options)[1]
    split = transformer_layers(get_workload("transformer", o).options, tp=2)[1]
    dq = 8 * 128
    assert whole.params - split.params == (D * 3 * dq + dq * D + 2 * D * GPT["ff"] + 3 * dq) // 2
    assert dataclasses.replace(split, params=0).flops_per_row == whole.flops_per_row / 2
