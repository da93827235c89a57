"""Meta-device analysis: FLOPs and bytes against the analytic formulas, the row line, user factories."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from sim.catalog.hardware import get_system
from sim.errors import GpipeInputError
from calibrate.measure.meta_profile import (_measure, fake_mode, parse_sample_shape, profile_layers, sample_of,
                                            torch_workload)
from gpipe.workload_flags import resolve_workload
from sim.workloads.models import get_workload

OPTS = {"layers": 2, "d_model": 64, "ff": 256, "heads": 4, "seq": 32, "vocab": 128}


def test_transformer_flops_match_the_formula_exactly():
    w = torch_workload("transformer", dict(OPTS))
    s, d, f, V = 32, 64, 256, 128
    for rows in (1, 3, 16):
        block = w.profiles[1].at(rows)
        assert block.forward_flops == pytest.approx(rows * (2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d))
        # backward: input and weight gradient of every matmul, both attention matmuls twice
        assert block.backward_flops == pytest.approx(2 * block.forward_flops)
        assert w.profiles[-1].at(rows).forward_flops == pytest.approx(rows * 2 * s * d * V)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_bytes_match_the_analytic_count_plus_the_fixed_tensors(precision):
    """Also in bf16, where the analytic model follows CUDA's autocast and the analysis runs CPU's:
    CPU autocast runs softmax in bf16 and saves its 2-byte output only, where CUDA saves the fp32
    output and p.v its bf16 cast (4 bytes per attention score more)."""
    meta = torch_workload("transformer", {**OPTS, "precision": precision})
    analytic = get_workload("transformer", {**OPTS, "precision": precision})
    device = get_system("ideal").device
    s, h = OPTS["seq"], OPTS["heads"]
    for rows in (1, 4):
        m, a = meta.layer_costs(rows, device), analytic.layer_costs(rows, device)
        cpu_less = 4 * h * s * s * rows if precision == "bf16" else 0
        # the analytic model leaves out what does not grow with rows: position ids, causal mask
        assert m[0].saved_bytes - a[0].saved_bytes == 8 * s
        assert m[1].saved_bytes - a[1].saved_bytes == s * s - cpu_less
        assert m[-1].saved_bytes == a[-1].saved_bytes
        for x, y in zip(m, a):
            assert (x.param_bytes, x.input_bytes, x.output_bytes, x.saves_input) == \
                (y.param_bytes, y.input_bytes, y.output_bytes, y.saves_input)
    assert meta.parameter_count == analytic.parameter_count


@pytest.mark.parametrize("name,options", [("mlp", {"layers": 3, "width": 16}),
                                          ("cnn", {"layers": 1, "channels": 4, "image": 6})])
def test_bf16_mlp_and_cnn_match_the_analytic_count(name, options):
    """bf16 casts the fp32 input of the first layer and saves the cast (``saves_input`` false),
    saves autocast's weight copies once per micro-batch, and sends bf16 between layers."""
    device = get_system("ideal").device
    meta = torch_workload(name, {**options, "precision": "bf16"}).layer_costs(5, device)
    analytic = get_workload(name, {**options, "precision": "bf16"}).layer_costs(5, device)
    # BatchNorm's saved mean and invstd per channel, left out of the analytic model (the meta
    # kernel keeps them in the input's dtype: 2 x 2 bytes per channel under bf16)
    bn_stats = 4 * options.get("channels", 0)
    for i, (m, a) in enumerate(zip(meta, analytic)):
        relu_out = a.output_bytes if name == "mlp" or i < len(meta) - 1 else 0  # counted by the next layer
        fixed = bn_stats if name == "cnn" and i < len(meta) - 1 else 0
        assert m.saved_bytes == a.saved_bytes + relu_out + fixed, a.name
        assert (m.param_bytes, m.input_bytes, m.output_bytes, m.saves_input) == \
            (a.param_bytes, a.input_bytes, a.output_bytes, a.saves_input), a.name
    assert not meta[0].saves_input and meta[1].saves_input


def test_bf16_counts_the_same_flops_at_fp32_weights():
    fp32 = torch_workload("transformer", dict(OPTS))
    bf16 = torch_workload("transformer", {**OPTS, "precision": "bf16"})
    for a, b in zip(fp32.profiles, bf16.profiles):
        assert a.at(3).forward_flops == b.at(3).forward_flops
        assert a.at(3).backward_flops == b.at(3).backward_flops
        assert a.parameters == b.parameters
    costs = bf16.layer_costs(2, get_system("a100-nvlink").device)
    assert costs[1].param_bytes == 4 * bf16.profiles[1].parameters


def _direct(model: nn.Sequential, sample: tuple[int, ...], dtype: torch.dtype, rows: int, device="meta",
            precision="fp32"):
    x = torch.empty((rows, *sample), dtype=dtype, device=device)
    out = []
    for i, layer in enumerate(model):
        measure, x = _measure(layer, x, i, precision)
        out.append(measure)
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name,options", [("cnn", {"layers": 2}), ("mlp", {"layers": 3}),
                                          ("transformer", {**OPTS, "dropout": 0.1})])
def test_the_row_line_equals_a_direct_measurement(name, options, precision):
    from executor.models.build import build_meta_model, example_batch

    model = build_meta_model(name, options)
    inputs, _ = example_batch(name, options, 1, 0)
    with fake_mode(model) as fake:
        profiles = profile_layers(fake, sample_of(tuple(inputs.shape[1:]), inputs.dtype), precision)
        for rows in (1, 5, 12):
            direct = _direct(fake, tuple(inputs.shape[1:]), inputs.dtype, rows, "cpu", precision)
            for profile, measured in zip(profiles, direct):
                assert vars(profile.at(rows)) == pytest.approx(vars(measured), rel=1e-12)


def test_parameters_are_not_counted_as_saved_activations():
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 30))
    profiles = profile_layers(model.to("meta"), sample_of((10,), torch.float32))
    # layer 1 saves only its input (4 rows x 20 floats): its weight is static memory
    assert profiles[1].at(4).saved_bytes == 4 * 20 * 4
    assert profiles[1].parameters == 20 * 30 + 30
    assert profiles[1].at(4).output_bytes == 4 * 30 * 4


def test_a_one_billion_parameter_transformer_is_analysed_without_allocating():
    options = {"layers": 24, "d_model": 1792, "ff": 7168, "heads": 14, "seq": 2048, "vocab": 50304}
    w = torch_workload("transformer", options)
    assert w.parameter_count > 1e9
    assert w.num_layers == 26
    costs = w.layer_costs(8, get_system("h100-nvlink").device)
    assert costs[1].saved_bytes > 8 * 2048 * 1792 * 4  # several activations of 8 sequences
    assert all(c.forward_s > 0 for c in costs)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_net.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def net(width=16, depth=3):
            return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])

        def example_batch(batch_size):
            return torch.randn(batch_size, 16), torch.randn(batch_size, 16)

        def pair():
            class Split(nn.Module):
                def forward(self, x):
                    return x, x
            return nn.Sequential(Split())
    """))
    (tmp_path / "user_bare.py").write_text(textwrap.dedent("""
        from torch import nn

        def bare():
            return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_net"
    for name in ("user_net", "user_bare"):
        sys.modules.pop(name, None)


def test_a_user_factory_with_example_batch(user_module):
    w = resolve_workload(f"{user_module}:net", {"depth": 5, "optimizer_slots": 0})
    assert w.num_layers == 5
    assert w.parameter_count == 5 * (16 * 16 + 16)
    cost = w.layer_costs(4, get_system("a100-nvlink").device)[2]
    assert cost.optimizer_bytes == 0
    assert cost.saved_bytes == 2 * 4 * 16 * 4  # Linear's input and Tanh's output


def test_a_user_factory_without_example_batch_needs_an_input_shape(user_module):
    with pytest.raises(GpipeInputError, match="--input-shape"):
        torch_workload("user_bare:bare", {})
    w = torch_workload("user_bare:bare", {"input_shape": "3,10,10"})
    assert w.profiles[1].at(2).input_bytes == 2 * 8 * 8 * 8 * 4


def test_a_layer_that_returns_a_tuple_counts_every_tensor_it_would_send(user_module):
    w = torch_workload("user_net:pair", {"input_shape": "4"})
    assert w.profiles[0].at(2).output_bytes == 2 * (2 * 4 * 4)  # (x, x): two tensors cross, one storage


@pytest.mark.parametrize("text", ["", "3,x", "0,4", "4:notatype"])
def test_bad_sample_shapes_are_rejected(text):
    with pytest.raises(GpipeInputError, match="--input-shape"):
        parse_sample_shape(text)


def test_sample_shape_with_dtype():
    assert parse_sample_shape("1024:int64") == ((1024,), torch.int64)
