"""A Hugging Face decoder's shape read from what its modules are, on the meta device (``hf:<type>``).

Any ``model_type`` ``transformers`` knows as a causal language model is built from its config
(``--option key=value`` for the config's fields; nothing downloaded) on PyTorch's meta device, and
its structure read into a :class:`sim.workloads.decoder_shape.DecoderShape`, which the simulator
prices as the analytic transformer of that shape. Nothing here is keyed by family name:

- the decoder layers: the ``ModuleList`` of ``num_hidden_layers`` blocks holding linear layers;
- the attention: a block's module whose class is an attention; its linear layers are the input
  projections (q, k and v, or one fused qkv) and the output projection (the last one back to the
  stream's width); heads from the module or the config, their width from the output projection, the
  key/value heads from what the input projections add beyond the queries; norms inside it are q/k norms;
- the MLP: the block's other linear layers, fc1 (one, or a gate and an up projection, or one fused
  to twice the width of fc2's input: gated) and fc2; its activation from its activation module;
- norms: modules whose class is a norm (RMS or layer norm), their parameters per element; outside
  the layers, the final norm and any norm after the embedding;
- positions: a learned table (another embedding as wide as the stream), a rotary module (its
  frequencies give the rotated fraction of each head), ALiBi (what the modeling code builds when
  neither is there), or none; the head's weight tied to the embedding's when it is the same tensor;
- a parallel block: layer 0's forward run on a meta batch with every parameter frozen and the
  attention's output made the only tensor needing a gradient: the MLP's input needs one only if the
  MLP runs after attention. Where the model cannot run on the meta device, a block attribute or
  config field naming a parallel residual or attention decides, else a single norm per block;
- sliding windows: the attention module's ``sliding_window``, else the config's per-layer types
  and ``sliding_window``.

Every parameter is counted; what no term of the shape covers is priced as memory and said. Refused
in one line, for what the structure is: mixtures of experts, blocks without attention
(state-space or recurrent layers), attention projections other than q, k, v and an output
(multi-head latent attention), MLPs of other widths, layers of different shapes.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from executor.models.hf import transformers_module, type_and_fields
from sim.errors import GpipeInputError
from sim.workloads.decoder_shape import ANALYSIS_KEYS, HF_OPTIONS, DecoderShape

_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_PARALLEL_FIELDS = ("use_parallel_residual", "parallel_attn", "parallel_residual", "parallel_block")


def decoder_shape(name: str, options: dict[str, Any]) -> DecoderShape:
    """The shape of ``name`` (``hf:<type>`` or ``hf-config:PATH``) with config fields ``options``;
    one line for a type that is not a causal language model or a structure the shape cannot take."""
    fields = {k: v for k, v in options.items() if k not in HF_OPTIONS and k not in ANALYSIS_KEYS}
    return _cached_shape(name, json.dumps(fields, sort_keys=True, default=str))


@lru_cache(maxsize=32)
def _cached_shape(name: str, fields_json: str) -> DecoderShape:
    transformers = transformers_module()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type, data = type_and_fields(name, json.loads(fields_json))
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GpipeInputError(f"Hugging Face model type {model_type!r} is not a causal language model transformers "
                              "knows; give a decoder-only type such as llama, nemotron, bloom or qwen2")
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1].strip()
        raise GpipeInputError(f"{name!r}: the config refuses the options {data} ({reason})") from None
    if getattr(config, "is_encoder_decoder", False):
        raise GpipeInputError(f"{name!r} is an encoder-decoder; planning by shape takes decoder-only models")
    experts = next((getattr(config, f) for f in _EXPERT_FIELDS if getattr(config, f, None)), None)
    if experts:
        raise GpipeInputError(f"{name!r} is a mixture of {experts} experts; expert parallelism is not modelled")
    if getattr(config, "num_key_value_heads", 0) is None:  # None: one key/value head per head, as configs mean it
        config.num_key_value_heads = config.num_attention_heads
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and isinstance(getattr(config, "pad_token_id", None), int) and config.pad_token_id >= vocab:
        config.pad_token_id = None  # a default padding id of the config's own vocabulary, beyond a smaller one
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1].strip()
        raise GpipeInputError(f"{name!r} cannot be built from its config ({type(exc).__name__}: {reason}); "
                              "check the --option sizes") from None
    return read_shape(model, config, model_type, name)


# ----------------------------------------------------------------------------- what a module is

def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not list(module.children())


def _is_attention(module: nn.Module) -> bool:
    kind = type(module).__name__.lower()
    return "attention" in kind and "cross" not in kind and not getattr(module, "is_cross_attention", False)


def _linear(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in, out, bias) of a linear layer (``nn.Linear`` and its kin, transformers' ``Conv1D``)."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Embedding) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if list(module.children()) or _is_norm(module):
        return None
    bias = isinstance(getattr(module, "bias", None), torch.Tensor)
    if hasattr(module, "nf") and hasattr(module, "nx"):  # Conv1D: weight (in, out)
        return int(module.nx), int(module.nf), bias
    return int(weight.shape[1]), int(weight.shape[0]), bias


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _activation(module: nn.Module, config: Any) -> str:
    for child in module.modules():
        kind = type(child).__name__.lower()
        if "squared" in kind or "relu2" in kind:
            return "squared_relu"
        for name in ("relu", "silu", "swish", "gelu"):
            if name in kind:
                return "silu" if name == "swish" else name
    act = str(getattr(config, "hidden_act", None) or getattr(config, "activation_function", None) or "gelu")
    return "squared_relu" if act == "relu2" else "relu" if act == "relu" else "silu" if act in ("silu", "swish") \
        else act


def _decoder_layers(model: nn.Module, config: Any) -> nn.ModuleList:
    """The stack of decoder layers: the module list of ``num_hidden_layers`` blocks holding linear layers."""
    want = getattr(config, "num_hidden_layers", None)
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)
              and any(_linear(x) for x in m[0].modules())]
    exact = [m for m in stacks if len(m) == want]
    if not (exact or stacks):
        raise GpipeInputError(f"no stack of decoder layers found in {type(model).__name__}; planning by shape takes "
                              "decoder-only transformers")
    return max(exact or stacks, key=_numel)


# ----------------------------------------------------------------------------- one block

def _block(layer: nn.Module, d: int, config: Any, where: str) -> dict[str, Any]:
    """What one decoder layer is: widths, biases, norms, its own parameters."""
    if any("expert" in n.split(".")[-1] for n, _ in [*layer.named_modules(), *layer.named_parameters()]):
        raise GpipeInputError(f"{where} is a mixture of experts; expert parallelism is not modelled")
    attention = next((m for m in layer.modules() if _is_attention(m) and any(_linear(x) for x in m.modules())), None)
    if attention is None:
        raise GpipeInputError(f"{where} has no attention ({type(layer).__name__}: a state-space or recurrent "
                              "layer?); planning by shape takes attention blocks")
    a = _attention(attention, d, config, where)
    m = _mlp(layer, a["inside"], d, where)
    stream_norms = [n for n in layer.modules() if _is_norm(n) and id(n) not in a["inside"]
                    and _numel(n) in (0, d, 2 * d)]
    kinds = {"rmsnorm" if "rms" in type(n).__name__.lower() else "layernorm" for n in stream_norms}
    norm_weights = max((_numel(n) // d for n in stream_norms), default=0)
    dq, kv_width, width, ffn = a["dq"], a["kv_width"], m["width"], m["ffn"]
    # what the transformer's block counts (sim.workloads.transformer.transformer_layers); the rest is extra
    priced = (d * (dq + kv_width) + dq * d + (width + ffn) * d + len(stream_norms) * norm_weights * d
              + a["proj"] * d + m["fc2"] * d + a["qkv"] * (dq + kv_width) + m["fc1"] * width)
    return {"heads": a["heads"], "kv_heads": kv_width // (2 * a["head_dim"]), "head_dim": a["head_dim"], "ffn": ffn,
            "gated": width == 2 * ffn, "activation": _activation(layer, config),
            "norm": kinds.pop() if len(kinds) == 1 else "layernorm",
            "norm_weights": norm_weights, "norms": len(stream_norms), "qk_norm": bool(a["qk_norms"]),
            "biases": tuple(b for b in ("qkv", "proj", "fc1", "fc2") if {**a, **m}[b]),
            "window": _window(attention, config), "extra": _numel(layer) - priced,
            "qk_norm_params": sum(_numel(n) for n in a["qk_norms"]),
            "softcap": getattr(attention, "attn_logit_softcapping", None),
            "parallel_attribute": any(bool(getattr(layer, f, False)) for f in _PARALLEL_FIELDS)}


def _attention(attention: nn.Module, d: int, config: Any, where: str) -> dict[str, Any]:
    """The attention's widths: its input projections (q, k and v, or fused) and the output one, the
    last projection back to the stream's width ``d``; heads from the module, else the config."""
    attn = [(n, _linear(m)) for n, m in attention.named_modules() if _linear(m)]
    outs = [i for i, (_, (_, b, _)) in enumerate(attn) if b == d]
    if not outs:
        raise GpipeInputError(f"{where}: no attention projection back to the stream's width {d}")
    dq, _, proj_bias = attn[outs[-1]][1]
    projections = [lin for i, (_, lin) in enumerate(attn) if i != outs[-1]]
    if any(a != d for a, _, _ in projections):
        names = ", ".join(n for n, (a, _, _) in attn if a != d)
        raise GpipeInputError(f"{where}: attention projections of other widths ({names}: low-rank or latent "
                              "attention?) are not modelled; planning by shape takes q, k, v (or fused) and an output")
    heads = next((getattr(attention, k) for k in ("num_heads", "num_attention_heads", "n_heads", "n_head")
                  if isinstance(getattr(attention, k, None), int)), None)
    if heads is None and isinstance(getattr(attention, "head_dim", None), int) and attention.head_dim:
        heads = dq // attention.head_dim
    if heads is None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(getattr(text, "num_attention_heads", 0) or 0)
    if not heads or dq % heads:
        raise GpipeInputError(f"{where}: {heads} heads do not divide the attention's width {dq}")
    head_dim = dq // heads
    kv_width = sum(b for _, b, _ in projections) - dq
    if kv_width <= 0 or kv_width % (2 * head_dim):
        raise GpipeInputError(f"{where}: attention projections of {sum(b for _, b, _ in projections)} outputs are "
                              f"not queries of {dq} and keys and values of whole {head_dim}-wide heads")
    # a norm beside an input projection normalises queries or keys; one beside only the output
    # projection (a post-norm layer's) normalises the stream, and counts with the block's norms
    owners = {n.rpartition(".")[0] for i, (n, _) in enumerate(attn) if i != outs[-1]}
    qk_norms = [m for n, m in attention.named_modules() if _is_norm(m) and n.rpartition(".")[0] in owners]
    inside = {id(m) for m in attention.modules()} - {id(m) for m in attention.modules()
                                                      if _is_norm(m) and m not in qk_norms}
    return {"dq": dq, "kv_width": kv_width, "heads": heads, "head_dim": head_dim, "qk_norms": qk_norms,
            "qkv": any(lin[2] for lin in projections), "proj": proj_bias, "inside": inside}


def _mlp(layer: nn.Module, inside: set[int], d: int, where: str) -> dict[str, Any]:
    """The MLP's widths: the layer's linear layers outside the attention, fc2 the last one back to ``d``
    and fc1 the rest (one, or a gate and a value: gated when they add up to twice fc2's input)."""
    mlp = [(n, _linear(m)) for n, m in layer.named_modules() if id(m) not in inside and _linear(m)]
    down = [i for i, (_, (_, b, _)) in enumerate(mlp) if b == d]
    if not down:
        raise GpipeInputError(f"{where}: no MLP projection back to the stream's width {d}")
    ffn, _, fc2_bias = mlp[down[-1]][1]
    ups = [lin for i, (_, lin) in enumerate(mlp) if i != down[-1]]
    width = sum(b for _, b, _ in ups)
    if any(a != d for a, _, _ in ups) or width not in (ffn, 2 * ffn):
        raise GpipeInputError(f"{where}: an MLP of widths {[lin[:2] for _, lin in mlp]} is not modelled; planning by "
                              f"shape takes fc1 to ff (or a gate and a value, 2 ff) and fc2 back to {d}")
    return {"ffn": ffn, "width": width, "fc1": any(lin[2] for lin in ups), "fc2": fc2_bias}


def _window(attention: nn.Module, config: Any) -> int:
    """The layer's sliding window (0: full attention): its attention's own, else the config's."""
    if hasattr(attention, "sliding_window"):
        return int(attention.sliding_window or 0)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return 0
    types = getattr(config, "layer_types", None)
    index = getattr(attention, "layer_idx", None)
    if types and isinstance(index, int) and index < len(types):
        return int(window) if "sliding" in str(types[index]) else 0
    return int(window)


# ----------------------------------------------------------------------------- the whole model

def read_shape(model: nn.Module, config: Any, model_type: str, name: str) -> DecoderShape:
    """The :class:`DecoderShape` of a meta-device ``model`` built from ``config``."""
    embedding = model.get_input_embeddings()
    vocab, d = (int(n) for n in embedding.weight.shape)
    layers = _decoder_layers(model, config)
    # the stream's width is the blocks' (what their linear layers read and write): the embedding's, or, for
    # an embedding projected in and out, one of their norms'
    widths = [d] + [int(m.weight.shape[0]) for m in layers[0].modules() if _is_norm(m)
                    and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1]
    linears = [lin for lin in map(_linear, layers[0].modules()) if lin]
    d = next((w for w in widths if any(a == w for a, _, _ in linears) and any(b == w for _, b, _ in linears)), d)
    head = model.get_output_embeddings()
    if head is None or _linear(head) is None:
        raise GpipeInputError(f"{name!r} has no linear head over the vocabulary; planning by shape takes causal "
                              "language models")
    tied = head.weight is embedding.weight
    blocks = [_block(layer, d, config, f"{name} layer {i}") for i, layer in enumerate(layers)]
    first = blocks[0]
    same = ("heads", "kv_heads", "head_dim", "ffn", "gated", "biases")
    differing = next((i for i, b in enumerate(blocks) if any(b[k] != first[k] for k in same)), None)
    if differing is not None:
        raise GpipeInputError(f"{name!r}: layer {differing} differs in shape from layer 0 "
                              f"({', '.join(k for k in same if blocks[differing][k] != first[k])}); planning by "
                              "shape takes layers of one shape")
    # norms as most layers have them; what a layer has beyond is memory (extra parameters, below)
    norms = max({b["norms"] for b in blocks}, key=[b["norms"] for b in blocks].count)
    norm_weights = first["norm_weights"]
    priced_block = [_numel(layer) - b["extra"] + (norms - b["norms"]) * norm_weights * d
                    for layer, b in zip(layers, blocks)]
    in_layers = {id(m) for m in layers.modules()}
    outer = [m for m in model.modules() if id(m) not in in_layers]
    tables = [m for m in outer if isinstance(m, nn.Embedding) and m is not embedding and m.embedding_dim == d]
    table = max(tables, key=lambda m: m.num_embeddings, default=None)
    rotary = next((m for m in model.modules() if "rotary" in type(m).__name__.lower()), None)
    positions, rows, fraction = _positions(model, table, rotary, first["head_dim"])
    outer_norms = [m for m in outer if _is_norm(m)]
    notes = []
    if not outer_norms:
        notes.append("no final norm before the head: priced with one")
    if first["softcap"] or getattr(config, "final_logit_softcapping", None):
        notes.append("soft-capped attention scores or logits: the capping not priced")
    dropout = max((m.p for m in model.modules() if isinstance(m, nn.Dropout)), default=0.0)
    if dropout:
        notes.append(f"dropout (p={dropout:g}) not priced")
    parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    extra_block = min(_numel(layer) - p for layer, p in zip(layers, priced_block))
    head_bias = _linear(head)[2]  # type: ignore[index]
    embedding_norm = len(outer_norms) > 1
    # what the transformer counts besides the blocks (the final norm always); the rest is extra
    priced = (vocab * d * (1 if tied else 2) + head_bias * vocab + rows * d + (1 + embedding_norm) * norm_weights * d
              + sum(priced_block))
    return DecoderShape(
        model_type=model_type, layers=len(blocks), hidden=d, heads=first["heads"], kv_heads=first["kv_heads"],
        head_dim=first["head_dim"], ffn=first["ffn"], gated=first["gated"], activation=first["activation"],
        vocab=vocab, norm=first["norm"], norm_weights=norm_weights, norms=norms,
        parallel_block=_parallel(model, layers, first, config), qk_norm=first["qk_norm"],
        embedding_norm=embedding_norm,
        biases=first["biases"] + (("head",) if head_bias else ()), positions=positions, position_rows=rows,
        rotary_fraction=fraction, tied=tied, windows=tuple(b["window"] for b in blocks),
        extra_params=parameters - priced - len(blocks) * extra_block,
        extra_block_params=extra_block, parameters=parameters, notes=tuple(notes),
        unknown_params=parameters - priced - len(blocks) * first["qk_norm_params"])


def _positions(model: nn.Module, table: nn.Embedding | None, rotary: nn.Module | None,
               head_dim: int) -> tuple[str, int, float]:
    """(kind, a learned table's rows, the rotated fraction of each head)."""
    if table is not None:
        return "learned", int(table.num_embeddings), 1.0
    if rotary is not None:
        buffers = dict(rotary.named_buffers())
        frequencies = buffers.get("inv_freq")
        if frequencies is not None:
            dims = 2 * frequencies.numel()
        else:
            dims = next((int(b.shape[-1]) for b in buffers.values() if b.dim() == 2), head_dim)
        return "rotary", 0, min(1.0, dims / head_dim)
    code = vars(sys.modules[type(model).__module__])
    if any("alibi" in key.lower() for key in code) or any(getattr(m, "use_alibi", False) for m in model.modules()):
        return "alibi", 0, 1.0
    return "none", 0, 1.0


class _Probed(Exception):
    """Raised from the MLP's first projection once its input has been seen."""


def _parallel(model: nn.Module, layers: nn.ModuleList, block: dict[str, Any], config: Any) -> bool:
    """Whether layer 0's MLP reads its input without the attention's output (see the module docstring)."""
    probed = _probe_parallel(model, layers[0])
    if probed is not None:
        return probed
    if block["parallel_attribute"] or any(bool(getattr(config, f, False)) for f in _PARALLEL_FIELDS):
        return True
    return block["norms"] == 1


def _probe_parallel(model: nn.Module, layer: nn.Module) -> bool | None:
    attention = next(m for m in layer.modules() if _is_attention(m) and any(_linear(x) for x in m.modules()))
    inside = {id(m) for m in attention.modules()}
    mlp_in = [m for m in layer.modules() if id(m) not in inside and _linear(m)]
    seen: list[bool] = []

    def mark(module, args, output):
        if isinstance(output, torch.Tensor):
            return output.detach().requires_grad_(True)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (output[0].detach().requires_grad_(True), *output[1:])
        return output

    def look(module, args):
        seen.append(bool(args and isinstance(args[0], torch.Tensor) and args[0].requires_grad))
        raise _Probed

    frozen = [(p, p.requires_grad) for p in model.parameters()]
    hooks = [attention.register_forward_hook(mark)] + [m.register_forward_pre_hook(look) for m in mlp_in]
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        ids = torch.zeros((1, 8), dtype=torch.long, device="meta")
        with torch.enable_grad():
            model(input_ids=ids)
    except _Probed:
        pass
    except Exception:  # a model that cannot run on the meta device: decided from its attributes
        return None
    finally:
        for hook in hooks:
            hook.remove()
        for p, wanted in frozen:
            p.requires_grad_(wanted)
    return (not seen[0]) if seen else None
