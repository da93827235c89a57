"""Analytic workloads for the built-in models: per-layer FLOPs, bytes and memory against a roofline.

Each model's layer list mirrors the torch model the executor builds, layer for layer, so a partition
(``balance``) means the same thing to the simulator and to the executor. Torch-free: ``gpipe
simulate`` must not import torch.

Time of one layer pass on ``device`` (the roofline, Williams et al., CACM 2009)::

    forward_s  = max(F / achieved_flops(dtype), B / achieved_bandwidth) + LAYER_OVERHEAD_S
    backward_s = max(2F / achieved_flops(dtype), 2B / achieved_bandwidth) + 2 * LAYER_OVERHEAD_S
    recompute_s = forward_s

F counts matmul FLOPs as 2*m*n*k (convolutions as the matmul they are, attention scores q.k^T and
values p.v included); backward costs twice the forward (one matmul for the input gradient, one for
the weight gradient: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1).
Ignored in F: bias adds, activations, normalisation, softmax, pooling, residual adds and the
embedding gather; they are memory-bound and enter through B. B counts bytes each op reads and
writes (weights read once per pass, activations read and written per op, no fusion).

Memory per layer and micro-batch (``saved_bytes``) counts what PyTorch autograd keeps for these
modules: Linear and Conv2d save their input, ReLU its output, GELU its input, LayerNorm its input
plus fp32 mean and rstd per token, BatchNorm2d its input (plus per-channel statistics, ignored),
softmax its output, the attention matmuls q, k, v and the probabilities, dropout a one-byte mask
per element (only when dropout > 0; CUDA's fused kernel; on CPU PyTorch keeps a mask in the
input's dtype), Embedding its int64 indices. Tensors that do not grow with the micro-batch (position
ids, the causal mask, BatchNorm's per-channel statistics) are left out. Each tensor is
counted once: a ReLU's output is the next layer's input and is counted there (the next layer's
first op saves it), so summing a stage's layers counts every tensor once, except the last layer's
saved output in the mlp and cnn (ReLU), which equals that stage's ``output_bytes``. The transformer
block's count matches Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", eq. 1: s*b*h*(34 + 5*a*s/h) bytes at 16 bits with dropout, less their dropout
on the attention probabilities (3*a*s^2*b), which the executor's model does not have.

Limits: no kernel fusion, no flash attention (the (heads, seq, seq) scores are materialised, as
in the explicit attention the executor runs), the causal mask saves no FLOPs, the loss after the
last layer is not counted, one fixed launch overhead per layer, transient workspace not counted.
Optimizer state follows the parameters' dtype, as torch.optim does for a model cast to that dtype
(no fp32 master weights).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sim.errors import GpipeInputError
from sim.hardware import Device
from sim.model_defaults import DEFAULT_OPTIONS
from sim.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_SLOTS
from sim.workload import LayerCost, UniformWorkload, Workload

BUILTIN_MODELS = ("uniform", "mlp", "transformer", "cnn")

# Assumption: a layer's pass costs a few eager-mode kernel launches that do not overlap with the
# device's work, ~5 us of CPU dispatch each (PyTorch eager, CUDA launch latency); 10 us in all.
LAYER_OVERHEAD_S = 10e-6

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
STAT_BYTES = 4  # LayerNorm's saved mean and rstd are fp32 whatever the input dtype
INDEX_BYTES = 8  # token ids are int64
MASK_BYTES = 1  # dropout's saved mask is a bool per element

# Options every analytic model accepts besides its own (DEFAULT_OPTIONS); uniform takes only the
# optimizer's. optimizer_slots: state tensors per parameter (sim.optimizers; set by --optimizer).
COMMON_DEFAULTS: dict[str, Any] = {"dtype": "fp32", "optimizer_slots": OPTIMIZER_SLOTS[DEFAULT_OPTIMIZER]}

_HAS_OPTIMIZER_S = "optimizer_s" in {f.name for f in dataclasses.fields(LayerCost)}


@dataclass(frozen=True)
class LayerSpec:
    """One layer's costs per sample (row); fixed terms do not scale with the micro-batch."""

    name: str
    params: int
    flops_per_row: float  # forward matmul FLOPs
    traffic_bytes_per_row: float  # activation bytes read + written in forward
    fixed_traffic_bytes: float  # weights (or the rows of them) read once per forward
    saved_bytes_per_row: float
    input_bytes_per_row: float
    output_bytes_per_row: float


class AnalyticWorkload:
    """A built-in model as a list of :class:`LayerSpec`, costed on any device by the roofline."""

    def __init__(self, name: str, options: dict[str, Any], layers: Sequence[LayerSpec]) -> None:
        self.name = name
        self.options = dict(options)
        self.layers = tuple(layers)
        self.num_layers = len(self.layers)
        self.dtype: str = options["dtype"]
        self.optimizer_slots: int = options["optimizer_slots"]

    @property
    def parameter_count(self) -> int:
        return sum(spec.params for spec in self.layers)

    def layer_costs(self, rows: int, device: Device) -> Sequence[LayerCost]:
        if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows <= 0:
            raise GpipeInputError(f"micro-batch rows must be a positive integer, got {rows!r}")
        flops_s = device.achieved_flops(self.dtype)
        bytes_s = device.achieved_bandwidth()
        return [self._cost(spec, rows, flops_s, bytes_s) for spec in self.layers]

    def _cost(self, spec: LayerSpec, rows: int, flops_s: float, bytes_s: float) -> LayerCost:
        flops = spec.flops_per_row * rows
        moved = spec.traffic_bytes_per_row * rows + spec.fixed_traffic_bytes
        forward_s = max(flops / flops_s, moved / bytes_s) + LAYER_OVERHEAD_S
        backward_s = max(2 * flops / flops_s, 2 * moved / bytes_s) + 2 * LAYER_OVERHEAD_S
        param_bytes = spec.params * DTYPE_BYTES[self.dtype]
        extra = {}
        if _HAS_OPTIMIZER_S:
            # Elementwise update: read weight, grad and slots, write weight and slots.
            extra["optimizer_s"] = (3 + 2 * self.optimizer_slots) * param_bytes / bytes_s
        return LayerCost(
            name=spec.name, forward_s=forward_s, backward_s=backward_s, recompute_s=forward_s,
            saved_bytes=round(spec.saved_bytes_per_row * rows),
            output_bytes=round(spec.output_bytes_per_row * rows),
            input_bytes=round(spec.input_bytes_per_row * rows),
            param_bytes=param_bytes, grad_bytes=param_bytes,
            optimizer_bytes=self.optimizer_slots * param_bytes, **extra,
        )

    def describe(self) -> dict:
        return {"name": self.name, "options": dict(self.options), "num_layers": self.num_layers,
                "parameter_count": self.parameter_count}


# --- mlp -----------------------------------------------------------------------------------------
def mlp_layers(o: dict[str, Any]) -> list[LayerSpec]:
    """``layers`` x [Linear(w, w) + ReLU] on rows of ``width`` features.

    Per row: F = 2w^2; B = 4w*e (Linear reads w, writes w; ReLU reads w, writes w) + weights once;
    saved = w*e (Linear's input; ReLU's output is counted as the next layer's input).
    """
    w, e = o["width"], DTYPE_BYTES[o["dtype"]]
    params = w * w + w
    spec = LayerSpec(
        "linear_relu", params, flops_per_row=2.0 * w * w, traffic_bytes_per_row=4.0 * w * e,
        fixed_traffic_bytes=params * e, saved_bytes_per_row=w * e, input_bytes_per_row=w * e,
        output_bytes_per_row=w * e,
    )
    return [spec] * o["layers"]


# --- transformer ---------------------------------------------------------------------------------
def transformer_layers(o: dict[str, Any]) -> list[LayerSpec]:
    """[Embedding, ``layers`` x pre-LayerNorm Block, Head], GPT-style with learned positions.

    With s = seq, d = d_model, f = ff, h = heads, V = vocab, e = dtype bytes, per row (sequence):

    - Embedding (token + position): params V*d + s*d; F = 0; saved = 8s (int64 ids) [+ sd mask].
    - Block: params 4d^2 + 2df + 9d + f (LN 2d, QKV 3d^2+3d, proj d^2+d, LN 2d, fc1 df+f,
      fc2 fd+d). F = 2s(3d^2 + d^2 + 2df) + 4s^2*d (q.k^T and p.v, each 2*s*s*d over all heads).
      saved = e(8sd + 2sf + h*s^2) + 16s: LN1 in, LN1 out (QKV's input), q/k/v (3sd), softmax
      probs (h*s^2), attention out (proj's input), LN2 in, LN2 out (fc1's input), fc1 out (GELU's
      input), GELU out (fc2's input), 4 fp32 LN statistics per token. Dropout p > 0 sits where
      the executor puts it: after the embedding sum, the attention projection and the MLP (not on
      the attention probabilities); each adds a mask of sd bytes.
    - Head: LayerNorm + Linear(d, V): params 2d + dV + V; F = 2s*d*V; saved = 2sd*e + 8s.
    """
    L, s, d, f, h, V = (o[k] for k in ("layers", "seq", "d_model", "ff", "heads", "vocab"))
    e, p = DTYPE_BYTES[o["dtype"]], o["dropout"]
    drop = p > 0
    embed = LayerSpec(
        "embedding", params=V * d + s * d, flops_per_row=0.0,
        # read ids; gather reads/writes sd; add reads sd (+ position table once), writes sd
        traffic_bytes_per_row=INDEX_BYTES * s + 4 * s * d * e + drop * (2 * s * d * e + s * d),
        fixed_traffic_bytes=s * d * e,
        saved_bytes_per_row=INDEX_BYTES * s + drop * MASK_BYTES * s * d,
        input_bytes_per_row=INDEX_BYTES * s, output_bytes_per_row=s * d * e,
    )
    block_params = 4 * d * d + 2 * d * f + 9 * d + f
    # Forward element traffic: 24sd (LN 2+2, QKV 1+3, q.k^T 2, p.v 1+1, transpose 2, proj 1+1,
    # residual adds 3+3, fc1 1, fc2 1) + 4sf (fc1 out, GELU 2, fc2 in) + 8hs^2 (scores written,
    # scale 2, mask 2, softmax 2, read by p.v); each dropout reads and writes sd plus its mask.
    block_traffic = e * (24 * s * d + 4 * s * f + 8 * h * s * s) + 4 * STAT_BYTES * s
    block_traffic += drop * (2 * e + MASK_BYTES) * 2 * s * d
    block_saved = e * (8 * s * d + 2 * s * f + h * s * s) + 4 * STAT_BYTES * s
    block_saved += drop * MASK_BYTES * 2 * s * d
    block = LayerSpec(
        "block", params=block_params,
        flops_per_row=2.0 * s * (4 * d * d + 2 * d * f) + 4.0 * s * s * d,
        traffic_bytes_per_row=block_traffic, fixed_traffic_bytes=block_params * e,
        saved_bytes_per_row=block_saved,
        input_bytes_per_row=s * d * e, output_bytes_per_row=s * d * e,
    )
    head_params = 2 * d + d * V + V
    head = LayerSpec(
        "head", params=head_params, flops_per_row=2.0 * s * d * V,
        traffic_bytes_per_row=e * (3 * s * d + s * V) + 2 * STAT_BYTES * s,
        fixed_traffic_bytes=head_params * e,
        saved_bytes_per_row=2 * s * d * e + 2 * STAT_BYTES * s,
        input_bytes_per_row=s * d * e, output_bytes_per_row=s * V * e,
    )
    return [embed] + [block] * L + [head]


# --- cnn -----------------------------------------------------------------------------------------
def cnn_layers(o: dict[str, Any]) -> list[LayerSpec]:
    """[Stem, ``layers`` x Conv-BN-ReLU, Head] on 3 x n x n images, C channels, k classes.

    Per row (image), with e = dtype bytes:

    - Stem Conv2d(3, C, 3, pad 1) + BN + ReLU: params 27C + C + 2C; F = 2*n^2*C*27;
      saved = e(3n^2 + Cn^2) (conv input, BN input; ReLU output counted by the next layer).
    - Block Conv2d(C, C, 3, pad 1) + BN + ReLU: params 9C^2 + C + 2C; F = 2*n^2*C*9C;
      saved = 2Cn^2*e.
    - Head AdaptiveAvgPool2d(1) + Flatten + Linear(C, k): params Ck + k; F = 2Ck;
      saved = C*e (Linear's input; pooling to 1x1 runs as a mean, which saves only shapes).
    Traffic per row: conv reads its input, writes Cn^2; BN reads twice (statistics, normalise)
    and writes once; ReLU reads and writes once. BN statistics per channel are not counted.
    """
    L, C, n, k = (o[key] for key in ("layers", "channels", "image", "classes"))
    e, area = DTYPE_BYTES[o["dtype"]], o["image"] ** 2
    stem_params = 27 * C + C + 2 * C
    stem = LayerSpec(
        "stem", params=stem_params, flops_per_row=2.0 * area * C * 27,
        traffic_bytes_per_row=e * (3 * area + 6 * C * area), fixed_traffic_bytes=stem_params * e,
        saved_bytes_per_row=e * (3 * area + C * area),
        input_bytes_per_row=3 * area * e, output_bytes_per_row=C * area * e,
    )
    block_params = 9 * C * C + C + 2 * C
    block = LayerSpec(
        "conv_bn_relu", params=block_params, flops_per_row=2.0 * area * C * 9 * C,
        traffic_bytes_per_row=7 * C * area * e, fixed_traffic_bytes=block_params * e,
        saved_bytes_per_row=2 * C * area * e,
        input_bytes_per_row=C * area * e, output_bytes_per_row=C * area * e,
    )
    head_params = C * k + k
    head = LayerSpec(
        "head", params=head_params, flops_per_row=2.0 * C * k,
        traffic_bytes_per_row=e * (C * area + 2 * C + k), fixed_traffic_bytes=head_params * e,
        saved_bytes_per_row=C * e,
        input_bytes_per_row=C * area * e, output_bytes_per_row=k * e,
    )
    return [stem] + [block] * L + [head]


# --- registry ------------------------------------------------------------------------------------
_BUILDERS: dict[str, Callable[[dict[str, Any]], list[LayerSpec]]] = {
    "mlp": mlp_layers, "transformer": transformer_layers, "cnn": cnn_layers,
}


def get_workload(name: str, options: dict[str, Any] | None = None) -> Workload:
    """The built-in model ``name`` with ``options`` over its defaults (``DEFAULT_OPTIONS``).

    Values may be strings (as typed on the command line); they are converted and checked.
    Raises GpipeInputError, one line naming the value and the fix, for anything invalid.
    """
    if name not in BUILTIN_MODELS:
        raise GpipeInputError(f"unknown model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}")
    merged = resolve_options(name, options or {})
    if name == "uniform":
        return UniformWorkload(num_layers=merged["layers"], optimizer_slots=merged["optimizer_slots"])
    return AnalyticWorkload(name, merged, _BUILDERS[name](merged))


def resolve_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Defaults filled in and every value checked; the full option dict ``describe()`` reports."""
    defaults = dict(DEFAULT_OPTIONS[name])
    if name != "uniform":
        defaults.update(COMMON_DEFAULTS)
    else:
        defaults["optimizer_slots"] = COMMON_DEFAULTS["optimizer_slots"]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise GpipeInputError(
            f"unknown option(s) {', '.join(unknown)} for model {name}; "
            f"choose from {', '.join(defaults)}")
    merged = {**defaults, **options}
    for key, value in merged.items():
        merged[key] = _check_option(name, key, value)
    if name == "transformer" and merged["d_model"] % merged["heads"]:
        raise GpipeInputError(
            f"heads={merged['heads']} does not divide d_model={merged['d_model']}; "
            "choose heads that divide d_model")
    return merged


def _check_option(model: str, key: str, value: Any) -> Any:
    if key == "dtype":
        if value not in DTYPE_BYTES:
            raise GpipeInputError(f"dtype={value!r} for model {model}; choose one of "
                                  f"{', '.join(DTYPE_BYTES)}")
        return value
    if key == "dropout":
        try:
            p = float(value)
        except (TypeError, ValueError):
            p = -1.0
        if isinstance(value, bool) or not 0.0 <= p < 1.0:
            raise GpipeInputError(f"dropout={value!r} for model {model}; use a number in [0, 1)")
        return p
    least = 0 if key == "optimizer_slots" else 1
    number = value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        number = int(value)
    if isinstance(number, bool) or not isinstance(number, int) or number < least:
        kind = "a non-negative" if least == 0 else "a positive"
        raise GpipeInputError(f"{key}={value!r} for model {model}; use {kind} integer")
    return number
