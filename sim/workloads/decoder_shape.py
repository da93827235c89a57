"""A Hugging Face decoder priced as the analytic transformer of its shape (``--model hf:<type>``).

:mod:`executor.models.hf_shape` builds the model from its ``transformers`` config on PyTorch's meta
device (nothing downloaded, nothing allocated) and reads what its modules are into a
:class:`DecoderShape`: the widths of the attention's projections (separate q, k, v or fused) and the
MLP's (gated or plain), the norms and their kind, which linear layers have biases, the position
embedding (a learned table, a rotary module, ALiBi or none), whether the head's weight is the
embedding's, whether attention and MLP run in parallel, sliding windows, and every parameter. This
module, torch-free, turns that record into the built-in transformer's options with the features of
:mod:`sim.workloads.decoder_features`, so a Hugging Face model is priced by the same arithmetic as
the built-in transformer (tensor, sequence and context parallelism, fp8, every recompute policy):
``hf:llama`` and ``transformer`` with Llama's options give the same step time and memory.

What the shape cannot price is said in the workload's ``assumed`` lines (the replay prints them):
ALiBi's score bias (free), a parallel block's collectives (the sequential block's), a sliding window
under eager attention or context parallelism (full attention), soft-capped logits, dropout, and
parameters no term covers (counted as memory, not work). Attention is a flash kernel unless the
options say ``attention=eager`` or ``fused``: the executor runs Hugging Face attention as
``scaled_dot_product_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sim.errors import GpipeInputError
from sim.workloads.decoder_features import BIASES, FEATURE_DEFAULTS
from sim.workloads.model_options import resolve_options
from sim.workloads.models import AnalyticWorkload
from sim.workloads.transformer import transformer_layers

# The options of an hf: model that are ours, not its config's: tokens per sample, the attention
# kernel priced, and how it is priced (meta: measured op by op, sim.workloads.meta_workload)
HF_OPTIONS: dict[str, Any] = {"seq": 64, "attention": "flash", "analysis": "shape"}
ANALYSES = ("shape", "meta")
ANALYSIS_KEYS = ("precision", "optimizer_slots", "compile")  # options of the pricing, not of the model


@dataclass(frozen=True)
class DecoderShape:
    """What a decoder's modules are, as the meta device shows them (see the module docstring)."""

    model_type: str
    layers: int
    hidden: int  # the residual stream's width
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # the MLP's hidden width (each half's, when gated)
    gated: bool  # fc1 projects to 2 x ffn: the gate and the value
    activation: str  # the MLP's nonlinearity: gelu, relu, squared_relu, silu, ...
    vocab: int
    norm: str  # layernorm or rmsnorm
    norm_weights: int  # a norm's parameters per element: 2 (weight, bias), 1 or 0
    norms: int  # norms over the stream per block
    parallel_block: bool
    qk_norm: bool
    embedding_norm: bool
    biases: tuple[str, ...]  # of sim.workloads.decoder_features.BIASES
    positions: str  # learned, rotary, alibi or none
    position_rows: int  # a learned table's
    rotary_fraction: float
    tied: bool
    windows: tuple[int, ...]  # per layer; 0: full attention
    extra_params: int  # besides the embedding, norms and head: memory, not work
    extra_block_params: int  # per block, likewise
    parameters: int  # the model's, each tensor once
    notes: tuple[str, ...] = field(default=())  # what the structure has that the shape does not price
    unknown_params: int = 0  # of the extra parameters, those of no module the shape knows (not q/k norms)


def window_pattern(windows: tuple[int, ...]) -> str:
    """The shortest list of windows that, repeated, gives every layer's (``4096,0`` alternating)."""
    for period in range(1, len(windows) + 1):
        if all(w == windows[i % period] for i, w in enumerate(windows)):
            return ",".join(str(w) for w in windows[:period])
    return "0"


def priced_options(shape: DecoderShape, given: dict[str, Any]) -> dict[str, Any]:
    """The transformer's options for ``shape`` with ``given`` (``seq``, ``attention``, the
    analysis' ``precision`` and ``optimizer_slots``); features only where they differ from its."""
    activation = ("swiglu" if shape.gated else shape.activation if shape.activation in ("relu", "squared_relu")
                  else "gelu")
    o: dict[str, Any] = {
        "layers": shape.layers, "d_model": shape.hidden, "ff": shape.ffn, "heads": shape.heads,
        "kv_heads": 0 if shape.kv_heads == shape.heads else shape.kv_heads,
        "seq": given.get("seq", HF_OPTIONS["seq"]), "vocab": shape.vocab, "dropout": 0.0, "activation": activation,
        "attention": given.get("attention", HF_OPTIONS["attention"]),
        **{k: given[k] for k in ANALYSIS_KEYS if k in given},
    }
    features = {"head_dim": shape.head_dim if shape.heads * shape.head_dim != shape.hidden else 0,
                "norm": shape.norm, "norm_weights": shape.norm_weights, "norms": shape.norms,
                "parallel_block": shape.parallel_block, "qk_norm": shape.qk_norm,
                "embedding_norm": shape.embedding_norm,
                "biases": ",".join(b for b in BIASES if b in shape.biases) or "none", "positions": shape.positions,
                "position_rows": shape.position_rows if shape.positions == "learned" else 0,
                "rotary_fraction": shape.rotary_fraction if shape.positions == "rotary" else 1.0,
                "tied": shape.tied, "window": window_pattern(shape.windows), "extra_params": shape.extra_params,
                "extra_block_params": shape.extra_block_params}
    own = {"norm_weights": 2 if shape.norm == "layernorm" else 1}
    o.update({k: v for k, v in features.items() if v != own.get(k, FEATURE_DEFAULTS[k])})
    return resolve_options("transformer", o)


def assumed_lines(shape: DecoderShape, o: dict[str, Any], given: dict[str, Any] | None = None) -> list[str]:
    """What pricing ``shape`` with options ``o`` (from the ``given`` ones) takes that the model may do
    differently, one line each."""
    seq, flash = o["seq"], o["attention"] == "flash"
    lines = []
    if given is not None and "attention" not in given:
        lines.append("attention not named: a flash kernel, as Hugging Face models run scaled_dot_product_attention "
                     "on GPUs (--option attention=eager or fused for a kernel that keeps the scores)")
    if shape.positions == "alibi":
        lines.append("ALiBi positions: the bias on the attention scores taken as free (added inside the attention "
                     "kernel or the scores' matmul)")
    if shape.positions == "none":
        lines.append("no position embedding found (no table, rotary module or ALiBi): positions taken as free")
    if shape.positions == "learned" and shape.position_rows < seq:
        lines.append(f"the learned position table has {shape.position_rows} rows, fewer than seq={seq}: priced as "
                     "it is")
    if shape.parallel_block:
        lines.append("attention and MLP in parallel from one input (parallel block): priced without the stream "
                     "between them; collectives and residual traffic as a sequential block's")
    windowed = sorted({w for w in shape.windows if w})
    if windowed:
        layers = sum(1 for w in shape.windows if w)
        sizes = ", ".join(str(w) for w in windowed)
        if all(w >= seq for w in windowed):
            lines.append(f"sliding window of {sizes} tokens on {layers} of {shape.layers} layers, not shorter than "
                         f"seq={seq}: full attention")
        elif flash:
            lines.append(f"sliding window of {sizes} tokens on {layers} of {shape.layers} layers: the flash kernel's "
                         "queries attend to that many keys there (to all with context parallelism)")
        else:
            lines.append(f"sliding window of {sizes} tokens on {layers} of {shape.layers} layers not priced: "
                         f"{o['attention']} attention computes every score")
    if shape.unknown_params > 0:
        lines.append(f"{shape.unknown_params:,} parameters of modules the shape has no term for: counted as memory, "
                     "not as work")
    return lines + list(shape.notes)


def shape_line(name: str, shape: DecoderShape, o: dict[str, Any]) -> str:
    """One line saying how ``name`` is priced: its shape as the transformer's."""
    mlp = f"{'gated ' if shape.gated else ''}{shape.activation}"
    kv = f", {shape.kv_heads} key/value heads" if shape.kv_heads != shape.heads else ""
    positions = (f"rotary positions over {shape.rotary_fraction:.0%} of each head" if shape.positions == "rotary"
                 and shape.rotary_fraction < 1 else f"{shape.positions} positions")
    biases = ("no biases" if not shape.biases else "biases on " + ", ".join(shape.biases)
              if set(shape.biases) != set(BIASES) else "biases")
    layout = ", parallel attention and MLP" if shape.parallel_block else ""
    return (f"{name} priced by its structure as a transformer: {shape.layers} layers, d_model {shape.hidden}, ff "
            f"{shape.ffn} {mlp}, {shape.heads} heads of {shape.head_dim}{kv}, vocab {shape.vocab}, {shape.norm}, "
            f"{positions}, {biases}{', tied embedding and head' if shape.tied else ''}{layout}; "
            f"{o['attention']} attention")


class ShapedWorkload(AnalyticWorkload):
    """A Hugging Face decoder (``hf:<type>``) priced as the transformer of its shape.

    ``describe()`` names the model and the options it was given (config fields, ``seq``), which a
    plan file records and ``gpipe train`` builds from; ``options`` and ``describe()["shape"]`` are
    the transformer's options that price it."""

    def __init__(self, name: str, given: dict[str, Any], shape: DecoderShape) -> None:
        try:
            priced = priced_options(shape, given)
        except GpipeInputError as exc:
            raise GpipeInputError(f"{name}: {exc}") from None
        super().__init__(name, priced, transformer_layers(priced))
        self.given = dict(given)
        self.shape = shape
        self.is_transformer = True
        self.has_attention_core = True
        self.planned_from = name
        self.assumed = assumed_lines(shape, priced, given)
        self.shape_line = shape_line(name, shape, priced)

    def describe(self) -> dict:
        return {"name": self.name, "options": dict(self.given), "num_layers": self.num_layers,
                "parameter_count": self.parameter_count, "shape": dict(self.options)}
