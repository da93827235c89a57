"""How a decoder differs from the built-in transformer: norms, biases, positions, head width, block layout.

The built-in transformer (:func:`sim.workloads.transformer.transformer_layers`) is GPT-style: LayerNorms
with a weight and a bias, a bias on every linear layer and the head, a learned position table of
``seq`` rows, sequential attention then MLP, ``d_model / heads`` wide heads. Decoders people train
differ from it in ways that move memory and bytes far more than FLOPs. Each difference is an option
of the transformer, for planning only (the executor trains the defaults and refuses these in one
line), which :mod:`sim.workloads.decoder_shape` sets from a Hugging Face model's structure:

- ``head_dim``: the heads' width when ``heads x head_dim`` is not ``d_model`` (Gemma: 16 x 256 on a
  3,072-wide stream); the query, key, value and attention-output widths follow it. 0: d_model / heads.
- ``norm``: ``layernorm`` keeps a mean and a reciprocal deviation per token, ``rmsnorm`` only the
  latter (as the fused kernels of Megatron-LM and Transformer Engine run it); ``norm_weights`` are
  its parameters per element (2 weight and bias, 1 weight, 0 none; default 2 and 1 respectively).
- ``norms``: norms over the residual width per block, 2 by default. Each one more (Gemma 2's norms
  on the branches' outputs) reads and writes the stream and saves its input and statistics; one
  fewer (a norm shared by parallel attention and MLP) drops a norm and its saved output.
- ``parallel_block``: attention and MLP read the same input (GPT-J, GPT-NeoX, Falcon): the MLP's
  norm reads the block input, so the stream after attention is never saved. Collectives, residual
  adds and traffic are the sequential block's (Megatron-LM may fuse the two all-reduces into one).
- ``qk_norm``: norms over the queries and keys after their projection (Qwen3, OLMo 2): read and
  written once, their inputs saved; their weights go in ``extra_block_params``.
- ``embedding_norm``: a norm right after the token embedding (BLOOM).
- ``biases``: which linear layers have biases, a comma list of ``qkv``, ``proj``, ``fc1``, ``fc2``,
  ``head`` (all by default; ``none``): parameters, and weights read per pass.
- ``positions``: ``learned`` (a table of ``position_rows`` rows, ``seq`` by default, added to the
  token embedding), ``rotary`` (queries and keys rotated in each block: read and written once more,
  over ``rotary_fraction`` of each head; nothing saved, as fused rotary kernels run it), ``alibi``
  (a bias on the scores, added by the attention kernel or the scores' own matmul: free) or ``none``.
- ``tied``: the head's weight is the token embedding's: counted once in the parameters; a stage
  holding both keeps one copy, and stages holding one each sum its gradient after the step.
- ``window``: sliding-window attention, a comma list of windows repeated over the layers (``4096``
  every layer, ``4096,0`` every other one; 0: full attention). A flash kernel skips the blocks
  outside the window, so its queries attend to ``min(window, seq)`` keys; eager and fused
  attention compute every score and are priced as without it.
- ``extra_params`` and ``extra_block_params``: parameters the shape has no term for (the embedding
  layer's and each block's): memory, not work; negative where the shape counts one the model lacks.

Torch-free, like the rest of the simulator's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.errors import GpipeInputError

BIASES = ("qkv", "proj", "fc1", "fc2", "head")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary", "alibi", "none")
STATS_PER_NORM = {"layernorm": 2, "rmsnorm": 1}  # fp32 statistics a norm keeps per token
# The features' values where the built-in transformer has them; an option absent means this
FEATURE_DEFAULTS: dict[str, Any] = {
    "head_dim": 0, "norm": "layernorm", "norm_weights": None, "norms": 2, "parallel_block": False,
    "qk_norm": False, "embedding_norm": False, "biases": ",".join(BIASES), "positions": "learned",
    "position_rows": 0, "rotary_fraction": 1.0, "tied": False, "window": "0", "extra_params": 0,
    "extra_block_params": 0,
}
_FLAGS = ("parallel_block", "qk_norm", "embedding_norm", "tied")
_COUNTS = ("head_dim", "norms", "position_rows", "extra_params", "extra_block_params")


@dataclass(frozen=True)
class Features:
    """The features of a transformer's options, defaults filled in."""

    head_dim: int
    norm: str
    norm_weights: int
    norms: int
    parallel_block: bool
    qk_norm: bool
    embedding_norm: bool
    biases: frozenset[str]
    positions: str
    position_rows: int
    rotary_fraction: float
    tied: bool
    windows: tuple[int, ...]
    extra_params: int
    extra_block_params: int

    @classmethod
    def of(cls, options: dict[str, Any]) -> "Features":
        o = {**FEATURE_DEFAULTS, **{k: v for k, v in options.items() if k in FEATURE_DEFAULTS}}
        weights = o["norm_weights"]
        return cls(int(o["head_dim"]), o["norm"], 2 if weights is None and o["norm"] == "layernorm" else
                   1 if weights is None else int(weights), int(o["norms"]), bool(o["parallel_block"]),
                   bool(o["qk_norm"]), bool(o["embedding_norm"]), frozenset(_biases(o["biases"])), o["positions"],
                   int(o["position_rows"]), float(o["rotary_fraction"]), bool(o["tied"]), _windows(o["window"]),
                   int(o["extra_params"]), int(o["extra_block_params"]))

    @property
    def stats(self) -> int:
        return STATS_PER_NORM[self.norm]

    def window(self, layer: int) -> int:
        """Layer ``layer``'s window (0: full attention)."""
        return self.windows[layer % len(self.windows)]


def check_feature(key: str, value: Any, model: str = "transformer") -> Any:
    """``value`` of feature ``key`` converted and checked; one line naming the fix otherwise."""
    if key in ("norm", "positions"):
        choices = NORMS if key == "norm" else POSITIONS
        if value not in choices:
            raise GpipeInputError(f"{key}={value!r} for model {model}; choose one of {', '.join(choices)}")
        return value
    if key in _FLAGS:
        return flag_value(key, value, model)
    if key == "biases":
        _biases(value, model)
        return value
    if key == "window":
        _windows(value, model)
        return ",".join(str(w) for w in value) if isinstance(value, (list, tuple)) else str(value)
    if key == "rotary_fraction":
        try:
            fraction = float(value)
        except (TypeError, ValueError):
            fraction = -1.0
        if isinstance(value, bool) or not 0.0 < fraction <= 1.0:
            raise GpipeInputError(f"rotary_fraction={value!r} for model {model}; use a number in (0, 1]")
        return fraction
    # extra parameters may be negative: terms the shape counts that a model does not have (a final norm)
    least, most = (0, 2) if key == "norm_weights" else (None, None) if key.startswith("extra") else (0, None)
    number = int(value) if isinstance(value, str) and value.strip().lstrip("+-").isdigit() else value
    if (isinstance(number, bool) or not isinstance(number, int) or (least is not None and number < least)
            or (most and number > most)):
        bounds = f" from {least}{f' to {most}' if most else ' up'}" if least is not None else ""
        raise GpipeInputError(f"{key}={value!r} for model {model}; use an integer{bounds}")
    return number


def flag_value(key: str, value: Any, model: str) -> bool:
    """An on/off option: 0, 1, true or false (any case) as given on the command line or in a file;
    one line naming ``key`` otherwise."""
    if isinstance(value, str) and value.lower() in ("0", "1", "true", "false"):
        return value.lower() in ("1", "true")
    if isinstance(value, (bool, int)) and value in (0, 1):
        return bool(value)
    raise GpipeInputError(f"{key}={value!r} for model {model}; use 0 or 1")


def _biases(value: Any, model: str = "transformer") -> tuple[str, ...]:
    names = tuple(b.strip() for b in str(value).split(",") if b.strip() and b.strip() != "none")
    unknown = [b for b in names if b not in BIASES]
    if unknown:
        raise GpipeInputError(f"biases={value!r} for model {model}: {', '.join(unknown)} is not a layer; give a "
                              f"comma list of {', '.join(BIASES)}, or none")
    return names


def _windows(value: Any, model: str = "transformer") -> tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        windows = tuple(int(w) for w in items)
    except (TypeError, ValueError):
        windows = ()
    if not windows or any(w < 0 for w in windows):
        raise GpipeInputError(f"window={value!r} for model {model}; give a comma list of windows repeated over "
                              "the layers (0: full attention), e.g. 4096 or 4096,0")
    return windows
