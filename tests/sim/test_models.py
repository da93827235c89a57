"""Analytic workloads: parameter counts and saved activations against torch references, roofline
behaviour, option validation, and the paper's Transformer on TPUv3.

The torch references below follow the layer lists in sim/workloads/transformer.py and
sim/workloads/mlp_and_cnn.py, built from plain torch.nn modules; torch is imported here only, never by
sim.workloads.models.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from sim.catalog.hardware import IDEAL_DEVICE, get_system
from sim.errors import GpipeInputError
from sim.workloads.model_defaults import DEFAULT_BATCH, DEFAULT_OPTIONS
from sim.workloads.models import BUILTIN_MODELS, LAYER_OVERHEAD_S, AnalyticWorkload, get_workload
from sim.workloads.precision import PRECISIONS

TPU_V3 = get_system("tpu-v3").device
H100_SXM = get_system("h100-nvlink", fitted=False).device  # the roofline these tests check (sim.catalog.kernel_model fits GPUs)
TRAINED = [name for name, p in PRECISIONS.items() if not p.planning_only]  # what the executor's torch models run
from sim.workloads.workload import UniformWorkload


# --- torch references ------------------------------------------------------------------------------
class Embedding(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))


class Block(nn.Module):
    """Pre-LayerNorm block with explicit causal attention (nanoGPT's non-flash path)."""

    def __init__(self, d: int, ff: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))  # (b, h, s, s)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        att = torch.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def torch_layers(name: str, o: dict) -> list[nn.Module]:
    if name == "mlp":
        return [nn.Sequential(nn.Linear(o["width"], o["width"]), nn.ReLU()) for _ in range(o["layers"])]
    if name == "transformer":
        d = o["d_model"]
        return ([Embedding(o["vocab"], o["seq"], d)]
                + [Block(d, o["ff"], o["heads"]) for _ in range(o["layers"])]
                + [nn.Sequential(nn.LayerNorm(d), nn.Linear(d, o["vocab"]))])
    c = o["channels"]

    def conv(cin: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())

    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, o["classes"]))
    return [conv(3)] + [conv(c) for _ in range(o["layers"])] + [head]


def torch_input(name: str, o: dict, rows: int) -> torch.Tensor:
    if name == "mlp":
        return torch.randn(rows, o["width"])
    if name == "transformer":
        return torch.randint(0, o["vocab"], (rows, o["seq"]))
    return torch.randn(rows, 3, o["image"], o["image"])


def measured_saved_bytes(layer: nn.Module, x: torch.Tensor, precision: str = "fp32") -> tuple[int, torch.Tensor]:
    """Bytes autograd saves running ``layer`` on ``x`` (under CPU autocast for bf16): distinct
    storages, parameters excluded (autocast's bf16 copies of them are counted)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = layer(x)
    return sum(seen.values()), out


def cpu_autocast_less(precision: str, name: str, o: dict, rows: int) -> int:
    """Bytes CPU autocast saves less than CUDA's, which the analytic model follows: CPU runs
    softmax in bf16 and saves its bf16 output only; CUDA runs it in fp32, saving the fp32 output
    and (for p.v) its bf16 cast, 4 bytes per attention score more."""
    if precision != "bf16" or name != "block":
        return 0
    return 4 * o["heads"] * o["seq"] ** 2 * rows


OPTION_SETS = [
    ("mlp", {"layers": 3, "width": 48}),
    ("mlp", {}),
    ("transformer", {"layers": 2, "d_model": 32, "ff": 80, "heads": 4, "seq": 8, "vocab": 50}),
    ("transformer", {}),
    ("cnn", {"layers": 2, "channels": 8, "image": 6, "classes": 7}),
    ("cnn", {}),
]


# --- parameter counts ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,options", OPTION_SETS)
def test_parameter_counts_equal_torch_reference(name: str, options: dict) -> None:
    workload = get_workload(name, options)
    layers = torch_layers(name, workload.describe()["options"])
    assert workload.num_layers == len(layers)
    per_layer = [sum(p.numel() for p in m.parameters()) for m in layers]
    costs = workload.layer_costs(1, IDEAL_DEVICE)
    assert [c.param_bytes // 4 for c in costs] == per_layer
    assert workload.describe()["parameter_count"] == sum(per_layer)


def test_paper_transformer_parameter_counts() -> None:
    """GPipe (Huang et al. 2019): ~50.3M per layer; 32k embedding + softmax ~131M (no biases/LN)."""
    workload = get_workload("transformer", {"layers": 1, "d_model": 2048, "ff": 8192, "heads": 32,
                                            "seq": 1024, "vocab": 32000})
    assert isinstance(workload, AnalyticWorkload)
    embed, block, head = workload.layers
    assert block.params == pytest.approx(50.3e6, rel=0.005)
    position_params = 1024 * 2048  # the paper's figure counts the token table and softmax only
    assert embed.params - position_params + head.params == pytest.approx(131e6, rel=0.005)


# --- saved activations -----------------------------------------------------------------------------
@pytest.mark.parametrize("precision", TRAINED)
@pytest.mark.parametrize("name,options", [OPTION_SETS[0], OPTION_SETS[2], OPTION_SETS[4]])
def test_saved_bytes_match_autograd(name: str, options: dict, precision: str) -> None:
    """Each layer's saved_bytes equals what autograd keeps, less a saved ReLU output (its output
    is the next layer's input and counted there). The model's input needs no gradient, as in the
    pipeline; every later layer's does. bf16 runs under CPU autocast, see cpu_autocast_less."""
    rows = 3
    workload = get_workload(name, {**options, "precision": precision})
    o = workload.describe()["options"]
    x = torch_input(name, o, rows)
    for i, (layer, cost) in enumerate(zip(torch_layers(name, o), workload.layer_costs(rows, IDEAL_DEVICE))):
        x = x.detach().requires_grad_(x.is_floating_point() and i > 0)
        measured, out = measured_saved_bytes(layer, x, precision)
        ends_in_relu = isinstance(layer, nn.Sequential) and isinstance(layer[-1], nn.ReLU)
        expected = cost.saved_bytes + (cost.output_bytes if ends_in_relu else 0)
        # Per-call tensors that do not grow with rows, left out of the model: position ids,
        # the (seq, seq) causal mask, BatchNorm's mean/invstd and running statistics (C fp32 each).
        if cost.name == "embedding":
            expected += options["seq"] * 8
        elif name == "transformer" and cost.name == "block":
            expected += options["seq"] ** 2
        elif name == "cnn" and cost.name != "head":
            expected += 4 * options["channels"] * 4
        assert measured == expected - cpu_autocast_less(precision, cost.name, o, rows), cost.name
        assert out.numel() * out.element_size() == cost.output_bytes
        assert x.numel() * x.element_size() == cost.input_bytes
        x = out


@pytest.mark.parametrize("precision", TRAINED)
@pytest.mark.parametrize("name,options", OPTION_SETS[::2] + [
    ("transformer", {"layers": 1, "d_model": 16, "ff": 24, "heads": 2, "seq": 6, "vocab": 30,
                     "dropout": 0.1}),
    ("transformer", {"layers": 1, "d_model": 32, "ff": 48, "heads": 8, "kv_heads": 2, "seq": 6, "vocab": 30}),
    ("transformer", {"layers": 1, "d_model": 32, "ff": 48, "heads": 4, "kv_heads": 4, "seq": 6, "vocab": 30}),
    ("transformer", {"layers": 1, "d_model": 32, "ff": 48, "heads": 4, "seq": 6, "vocab": 30,
                     "activation": "squared_relu"}),
    ("transformer", {"layers": 1, "d_model": 32, "ff": 48, "heads": 8, "kv_heads": 2, "seq": 6, "vocab": 30,
                     "activation": "swiglu", "dropout": 0.1}),
    ("transformer", {"layers": 1, "d_model": 32, "ff": 48, "heads": 4, "seq": 6, "vocab": 30, "attention": "flash"}),
    ("transformer", {"layers": 1, "d_model": 32, "ff": 48, "heads": 8, "kv_heads": 2, "seq": 6, "vocab": 30,
                     "attention": "flash", "dropout": 0.1})])
def test_executor_models_match(name: str, options: dict, precision: str) -> None:
    """The executor's own torch models, when present: same layers, parameters and saved bytes,
    input and output bytes (what crosses a stage boundary). On CPU, PyTorch's dropout keeps its
    mask in the input's dtype (4 bytes for the embedding's fp32 sum, 2 after a bf16 matmul), not
    1 byte; CPU autocast saves less around softmax (cpu_autocast_less)."""
    executor_models = pytest.importorskip("executor.models.build")
    rows = 2
    workload = get_workload(name, {**options, "precision": precision})
    model = executor_models.build_model(name, options)
    model.train()
    assert len(model) == workload.num_layers
    assert sum(p.numel() for p in model.parameters()) == workload.describe()["parameter_count"]
    o = workload.describe()["options"]
    x = torch_input(name, o, rows)
    drop = options.get("dropout", 0.0) > 0
    mask_bytes = {"embedding": 4, "block": 4 if precision == "fp32" else 2}
    for i, (layer, cost) in enumerate(zip(model, workload.layer_costs(rows, IDEAL_DEVICE))):
        x = x.detach().requires_grad_(x.is_floating_point() and i > 0)
        assert x.numel() * x.element_size() == cost.input_bytes, cost.name
        measured, x = measured_saved_bytes(layer, x, precision)
        assert x.numel() * x.element_size() == cost.output_bytes, cost.name
        if isinstance(layer, nn.Sequential) and isinstance(layer[-1], nn.ReLU):
            measured -= x.numel() * x.element_size()
        flash = options.get("attention") == "flash"  # no causal mask saved, no softmax for CPU autocast to keep less
        fixed = {"embedding": options.get("seq", 0) * 8, "block": 0 if flash else options.get("seq", 0) ** 2,
                 "stem": 16 * options.get("channels", 0),
                 "conv_bn_relu": 16 * options.get("channels", 0)}.get(cost.name, 0)
        masks = {"embedding": 1, "block": 2}.get(cost.name, 0) if drop else 0
        elements = rows * options.get("seq", 0) * options.get("d_model", 0)
        cpu_mask_extra = masks * elements * (mask_bytes.get(cost.name, 1) - 1)
        expected = cost.saved_bytes + fixed + cpu_mask_extra - (0 if flash else cpu_autocast_less(precision, cost.name, o, rows))
        assert measured == expected, cost.name


def test_transformer_block_saved_bytes_korthikanti() -> None:
    """Korthikanti et al. 2022, eq. 1: s*b*h*(34 + 5*a*s/h) bytes at 16 bits with dropout, of
    which 2 bytes per token and hidden unit and a*s^2*b are one-byte dropout masks. In fp32 every
    other tensor doubles: s*b*h*(2*34 - 2) + (2*5 - 1)*a*s^2*b. Ours adds the fp32 LayerNorm
    statistics (16 bytes per token) they ignore and has no dropout on the attention probabilities
    (their one-byte mask and the 4-byte dropped probabilities: 5*a*s^2*b in fp32)."""
    s, d, a, b = 128, 256, 8, 2
    workload = get_workload("transformer", {"layers": 1, "d_model": d, "ff": 4 * d, "heads": a,
                                            "seq": s, "dropout": 0.1, "precision": "fp32"})
    block = workload.layer_costs(b, IDEAL_DEVICE)[1]
    assert block.saved_bytes == s * b * d * (2 * 34 - 2) + (2 * 5 - 1) * a * s * s * b + 16 * s * b - 5 * a * s * s * b


def test_transformer_block_saved_bytes_bf16_autocast() -> None:
    """Under CUDA's bf16 autocast, per token: the fp32 residual stream saved twice (LN1 and LN2
    inputs, 2 x 4 bytes per unit), six bf16 tensors (QKV's and fc1's cast inputs, q/k/v, proj's
    input: 6 x 2), fc1's output and GELU's output (2 x 2 per ff unit), per score the fp32 softmax
    output and its bf16 cast (6 bytes), 16 bytes of LN statistics, and once per micro-batch the
    bf16 copies of the four weight matrices. The activations come to 3/4 of fp32's here (the
    scores, at 6 bytes instead of 4, weigh much at seq 128); at 2 rows per micro-batch the weight
    copies make the total exceed fp32's."""
    s, d, f, a, b = 128, 256, 1024, 8, 2
    options = {"layers": 1, "d_model": d, "ff": f, "heads": a, "seq": s}
    bf16 = get_workload("transformer", {**options, "precision": "bf16"}).layer_costs(b, IDEAL_DEVICE)[1]
    fp32 = get_workload("transformer", options).layer_costs(b, IDEAL_DEVICE)[1]
    copies = 2 * (4 * d * d + 2 * d * f)
    assert bf16.saved_bytes == s * b * (d * (2 * 4 + 6 * 2) + f * 2 * 2 + a * s * 6 + 16) + copies
    assert (bf16.saved_bytes - copies) / fp32.saved_bytes == pytest.approx(0.75, abs=0.01)
    assert bf16.saved_bytes > fp32.saved_bytes
    assert bf16.param_bytes == fp32.param_bytes == bf16.grad_bytes
    assert bf16.input_bytes == bf16.output_bytes == s * b * d * 4  # the residual stream stays fp32


# --- roofline --------------------------------------------------------------------------------------
def test_mlp_flops_linear_in_rows_and_times_grow() -> None:
    workload = get_workload("mlp", {"width": 1024, "layers": 2})
    assert isinstance(workload, AnalyticWorkload)
    assert workload.layers[0].flops_per_row == 2 * 1024 * 1024
    small, large = (workload.layer_costs(r, H100_SXM)[0] for r in (64, 4096))
    assert large.forward_s > small.forward_s and large.backward_s > small.backward_s
    assert large.saved_bytes == 64 * small.saved_bytes
    assert large.backward_s - 2 * LAYER_OVERHEAD_S == pytest.approx(2 * (large.forward_s - LAYER_OVERHEAD_S))
    for name in ("transformer", "cnn"):
        times = [get_workload(name, {}).layer_costs(r, H100_SXM) for r in (1, 8, 64)]
        for a, b in zip(times, times[1:]):
            assert all(y.forward_s > x.forward_s for x, y in zip(a, b))


def test_compute_bound_vs_memory_bound() -> None:
    """A wide Linear at 1 row reads 64 MiB of weights for 33.6 MFLOP: memory-bound. At 8192 rows
    it does 275 GFLOP on ~0.3 GB: compute-bound."""
    w = 4096
    workload = get_workload("mlp", {"width": w, "layers": 1})
    flops_s, bytes_s = H100_SXM.achieved_flops("fp32"), H100_SXM.achieved_bandwidth()
    weights = (w * w + w) * 4
    one = workload.layer_costs(1, H100_SXM)[0]
    assert one.forward_s == pytest.approx((weights + 16 * w) / bytes_s + LAYER_OVERHEAD_S)
    rows = 8192
    many = workload.layer_costs(rows, H100_SXM)[0]
    assert many.forward_s == pytest.approx(2 * w * w * rows / flops_s + LAYER_OVERHEAD_S)
    # bf16 has 15x the peak on an H100: the big case gets much faster; weights stay fp32, the
    # Linear saves the bf16 cast of its fp32 input instead of the input
    fast = get_workload("mlp", {"width": w, "layers": 1, "precision": "bf16"}).layer_costs(rows, H100_SXM)[0]
    assert fast.forward_s == pytest.approx(2 * w * w * rows / H100_SXM.achieved_flops("bf16") + LAYER_OVERHEAD_S)
    assert fast.forward_s < many.forward_s / 10
    assert fast.param_bytes == many.param_bytes
    assert fast.saved_bytes == many.saved_bytes // 2 and not fast.saves_input
    # memory-bound at one row, bf16 moves more: each weight is cast (read 4, write 2) and read (2)
    slow = get_workload("mlp", {"width": w, "layers": 1, "precision": "bf16"}).layer_costs(1, H100_SXM)[0]
    assert slow.forward_s == pytest.approx(((w * w + w) * 8 + 8 * w + 6 * w) / bytes_s + LAYER_OVERHEAD_S)


def test_embedding_is_memory_bound() -> None:
    workload = get_workload("transformer", {})
    embed = workload.layer_costs(16, H100_SXM)[0]
    assert embed.forward_s > LAYER_OVERHEAD_S  # no FLOPs counted, bytes only


def test_optimizer_bytes_follow_slots() -> None:
    """RMSProp in the paper: 12 bytes per parameter with fp32 weights (weight + two slots)."""
    workload = get_workload("mlp", {"width": 64, "layers": 1})
    cost = workload.layer_costs(1, IDEAL_DEVICE)[0]
    params = 64 * 64 + 64
    assert cost.param_bytes + cost.optimizer_bytes == 12 * params
    assert cost.grad_bytes == cost.param_bytes
    sgd = get_workload("mlp", {"width": 64, "layers": 1, "optimizer_slots": 0})
    assert sgd.layer_costs(1, IDEAL_DEVICE)[0].optimizer_bytes == 0


def test_paper_transformer_forward_time_on_tpu_v3() -> None:
    """Transformer-L of the paper (d 2048, ff 8192, 32 heads, seq 1024) at batch 32, M = 8: 4 rows.

    Block forward FLOPs = 2*s*(4d^2 + 2*d*ff)*rows + 4*s^2*d*rows = 4 x 111.7 GFLOP = 447 GFLOP.
    At TPUv3's bf16 peak of 61.5 TFLOP/s per core that is 7.3 ms; the model's 50% efficiency gives
    ~15 ms. Expect the order of 10 ms: between the peak bound and 3x it.
    """
    workload = get_workload("transformer", {"layers": 4, "d_model": 2048, "ff": 8192, "heads": 32,
                                            "seq": 1024, "vocab": 32000, "precision": "bf16"})
    costs = workload.layer_costs(32 // 8, TPU_V3)
    at_peak_s = 4 * (2 * 1024 * (4 * 2048**2 + 2 * 2048 * 8192) + 4 * 1024**2 * 2048) / 61.5e12
    assert at_peak_s == pytest.approx(7.3e-3, rel=0.01)
    for block in costs[1:-1]:
        assert at_peak_s < block.forward_s < 3 * at_peak_s
    assert costs[-1].forward_s > costs[0].forward_s  # softmax over 32k is heavy, the lookup is not
    head_at_peak_s = 2 * 4 * 1024 * 2048 * 32000 / 61.5e12  # 537 GFLOP: 8.7 ms
    assert head_at_peak_s < costs[-1].forward_s < 3 * head_at_peak_s


# --- registry and validation -----------------------------------------------------------------------
def test_registry_and_describe() -> None:
    assert set(BUILTIN_MODELS) == set(DEFAULT_OPTIONS) == set(DEFAULT_BATCH)
    assert isinstance(get_workload("uniform", {}), UniformWorkload)
    assert get_workload("uniform", {"layers": 6}).num_layers == 6
    info = get_workload("transformer", {"layers": 3}).describe()
    assert info["name"] == "transformer" and info["num_layers"] == 5
    assert info["options"] == {**DEFAULT_OPTIONS["transformer"], "layers": 3, "precision": "fp32",
                               "optimizer_slots": 2}
    assert get_workload("cnn", {"channels": "8"}).describe()["options"]["channels"] == 8
    assert set(PRECISIONS) == {"fp32", "bf16", "bf16-model", "fp8"}


@pytest.mark.parametrize("name,options,shown", [
    ("mlp", {"width": 0}, "width=0"),
    ("mlp", {"layers": -2}, "layers=-2"),
    ("mlp", {"layers": 2.5}, "layers=2.5"),
    ("cnn", {"channels": "many"}, "channels='many'"),
    ("transformer", {"heads": 5}, "heads=5"),
    ("transformer", {"dropout": 1.0}, "dropout=1.0"),
    ("transformer", {"precision": "fp16"}, "unknown precision 'fp16'; choose one of fp32, bf16"),
    ("transformer", {"widht": 3}, "widht"),
    ("mlp", {"optimizer_slots": -1}, "optimizer_slots=-1"),
    ("uniform", {"precision": "bf16"}, "precision"),
    ("resnet", {}, "resnet"),
])
def test_bad_options_name_the_value(name: str, options: dict, shown: str) -> None:
    with pytest.raises(GpipeInputError) as info:
        get_workload(name, options)
    message = str(info.value)
    assert shown in message and "\n" not in message


def test_bad_rows_and_a_device_without_the_precision() -> None:
    workload = get_workload("mlp", {})
    with pytest.raises(GpipeInputError, match="rows"):
        workload.layer_costs(0, IDEAL_DEVICE)
    cpu_like = IDEAL_DEVICE.__class__("cpu", {"fp32": 1e11}, 1e10, 2e10)
    with pytest.raises(GpipeInputError, match="bf16"):
        get_workload("mlp", {"precision": "bf16"}).layer_costs(1, cpu_like)


def test_models_module_does_not_import_torch() -> None:
    code = "import sys, sim.workloads.models; sim.workloads.models.get_workload('transformer', {}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("precision", TRAINED)
@pytest.mark.parametrize("kv_heads", [0, 2])
def test_selective_recompute_saves_what_the_model_predicts(precision: str, kv_heads: int) -> None:
    """Under ``--checkpoint selective`` a block of the executor's transformer saves what the analytic
    model says less its attention core: no probabilities (nor, on CPU, the bf16 ones CUDA would keep
    besides), no causal mask, and with grouped keys and values no repeats."""
    executor_models = pytest.importorskip("executor.models.build")
    from executor.runtime.selective import recompute_attention_core

    options = {"layers": 1, "d_model": 32, "ff": 48, "heads": 8, "kv_heads": kv_heads, "seq": 6, "vocab": 30}
    rows = 2
    workload = get_workload("transformer", {**options, "precision": precision})
    embedding, block = executor_models.build_model("transformer", options)[:2]
    x = embedding(torch_input("transformer", workload.describe()["options"], rows)).detach().requires_grad_(True)
    cost = workload.layer_costs(rows, IDEAL_DEVICE)[1]
    with recompute_attention_core():
        measured, _ = measured_saved_bytes(block, x, precision)
    assert cost.core_saved_bytes > 0
    assert measured == cost.saved_bytes - cost.core_saved_bytes


# --- compile: torch.compile's fused elementwise regions ----------------------------------------------
@pytest.mark.parametrize("activation,mlp_bytes", [("gelu", 0), ("swiglu", 2 * 2)])
def test_compile_counts_each_elementwise_region_once(activation, mlp_bytes):
    """Autocast, eager attention: per sd, 8 fp32 elements, 2 casts and 2 bf16 ones (48 bytes) become
    5 fp32 and 4 bf16 (28); per h*s^2, 6 bf16, 2 fp32 and 2 casts (32) become 4 bf16 and the fp32
    probabilities (12); swiglu's silu and product move 2 bf16 elements per sf fewer. The embedding
    moves 2 fp32 elements per sd fewer; the head's norm 8 bytes per sd and its loss 14 per logit (an fp32
    copy and the log-probabilities written, read twice in fp32 and the logits once, against the logits read twice).
    FLOPs, what the matmuls move and what is saved do not change."""
    s, d, f, h, vocab = 32, 64, 256, 4, 100
    o = {"layers": 1, "d_model": d, "ff": f, "heads": h, "seq": s, "vocab": vocab, "precision": "bf16",
         "attention": "eager", "activation": activation}
    eager, compiled = (get_workload("transformer", {**o, "compile": on}).layers for on in (False, True))
    saved = [eager[i].traffic_bytes_per_row - compiled[i].traffic_bytes_per_row for i in range(3)]
    assert saved == pytest.approx([2 * s * d * 4, 20 * s * d + 20 * h * s * s + mlp_bytes * s * f,
                                   8 * s * d + 14 * s * vocab])
    for before, after in zip(eager, compiled):
        assert (after.flops_per_row, after.saved_bytes_per_row, after.matmul_traffic_bytes_per_row) == \
            (before.flops_per_row, before.saved_bytes_per_row, before.matmul_traffic_bytes_per_row)
    # the trainers' bf16 casts nothing: per sd LN2's read of the stream (2 bytes) is all compiling saves there
    model = {**o, "precision": "bf16-model", "attention": "flash", "activation": "gelu"}
    plain, fused = (get_workload("transformer", {**model, "compile": on}).layers[1] for on in (False, True))
    assert plain.traffic_bytes_per_row - fused.traffic_bytes_per_row == pytest.approx(2 * s * d)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_compile_is_true_or_false(value):
    with pytest.raises(GpipeInputError, match="compile=.* for model transformer; use true"):
        get_workload("transformer", {"compile": value})
