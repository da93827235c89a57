"""Well-known models by name (``--model llama3-70b``), planned torch-free by their configs' shape.

Each named model ships inside the package as a Hugging Face ``config.json`` (``sim/workloads/named_model_configs/``,
no weights, nothing downloaded) with the sequence length it was pre-trained at and the source of
its figures (``index.json``). The simulator and the planner take it as the built-in transformer of
the config's shape (:func:`transformer_shape`), torch-free: layers, width, heads, key/value heads,
FFN width, vocabulary and MLP (gated silu as ``swiglu``, squared ReLU as ``squared_relu``, GELUs as
``gelu``), flash attention, no dropout. ``--option`` overrides a config field (``num_hidden_layers=40``)
or the sequence (``seq=4096``). ``gpipe train --model NAME`` trains the config's own architecture
where the executor has it (``hf-config:`` of the packaged file).

Mixtures of experts (``deepseek-v3``, ``qwen3-30b-a3b``, ``mixtral-8x7b``, ...) are planned by their
config's fields as the MoE transformer (:mod:`sim.workloads.moe.workload`, with RMSNorms, rotary
positions and the config's biases); ``published`` keeps the total and active parameters their
makers state, which the tests hold the counts to.

Each dense model's features (:mod:`sim.workloads.decoder_features`: RMSNorm or LayerNorm, which
linear layers have biases, learned or rotary positions and the rotary fraction, a sliding window,
a tied head) are kept beside its config in ``index.json``, as transformers' own model of the config
has them on the meta device (:mod:`sim.workloads.decoder_shape`); a test reads them again, so the
torch-free planner prices what the model is. Limits: a config field given with ``--option`` changes
the shape, not the features (a window or a bias the override would add is not priced).
Encoder-decoders are refused. ``--model hf-config:PATH`` of the same file reads everything from the
model's structure (it takes torch and transformers).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sim.errors import GpipeInputError

NAMED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "named_model_configs")
# The config's activation -> the built-in transformer's MLP of the same shape
SHAPE_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "relu2": "squared_relu", "gelu": "gelu",
                     "gelu_new": "gelu", "gelu_fast": "gelu", "gelu_pytorch_tanh": "gelu"}
# options of the analysis (how the model is run), not of the config
ANALYSIS_KEYS = ("precision", "optimizer_slots", "attention", "compile")


@dataclass(frozen=True)
class NamedModel:
    name: str
    config_path: str  # the packaged Hugging Face config.json
    seq: int  # the sequence length it was pre-trained at: the default tokens per sample
    source: str
    moe: bool = False  # a mixture of experts: planned by sim.workloads.moe.workload
    # what its makers state: total and active parameters, and whether their active count has the input embedding
    published: dict[str, Any] | None = None
    # how a dense model's blocks differ from the built-in transformer's (sim.workloads.decoder_features):
    # its norms, biases, positions, window and tied head, as transformers' own model of the config has them
    features: dict[str, Any] | None = None


@lru_cache(maxsize=1)
def named_models() -> dict[str, NamedModel]:
    with open(os.path.join(NAMED_DIR, "index.json")) as handle:
        index = json.load(handle)["models"]
    models = {}
    for name, entry in index.items():
        path = os.path.join(NAMED_DIR, entry["config"])
        with open(path) as handle:
            experts = _field(json.load(handle), "num_local_experts", "num_experts", "n_routed_experts")
        models[name] = NamedModel(name, path, int(entry["seq"]), entry["source"], bool(experts),
                                  entry.get("published"), entry.get("features"))
    return models


def is_named(model: str | None) -> bool:
    return model in named_models()


def config_of(name: str) -> dict[str, Any]:
    with open(named_models()[name].config_path) as handle:
        return json.load(handle)


def named_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The built-in transformer's options for named model ``name`` with ``options`` (config fields,
    ``seq``, and the analysis' ``precision`` and ``optimizer_slots``) laid over it."""
    model = named_models()[name]
    config = config_of(name)
    given = {k: v for k, v in options.items() if k not in ("seq", *ANALYSIS_KEYS)}
    unknown = sorted(set(given) - set(config))
    if unknown:
        raise GpipeInputError(f"--model {name}: {', '.join(unknown)} is not a field of its config; give one of "
                              f"{', '.join(sorted(k for k in config if isinstance(config[k], int)))} or seq")
    config.update(given)
    shaped = transformer_shape(config, int(options.get("seq", model.seq)), name)
    return {**shaped, **(model.features or {}), **{k: options[k] for k in ANALYSIS_KEYS if k in options}}


def _field(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    return next((config[key] for key in keys if config.get(key) is not None), default)


def transformer_shape(config: dict[str, Any], seq: int, name: str) -> dict[str, Any]:
    """The built-in transformer's options for a decoder-only config's fields (a config.json, or a
    ``transformers`` config's ``to_dict()``); one line naming what is not modelled."""
    if config.get("is_encoder_decoder"):
        raise GpipeInputError(f"{name!r} is an encoder-decoder; planning by shape takes decoder-only models")
    experts = _field(config, "num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        raise GpipeInputError(f"{name!r} is a mixture of {experts} experts; expert parallelism is not modelled")
    d = int(_field(config, "hidden_size", "n_embd", "d_model"))
    heads = int(_field(config, "num_attention_heads", "n_head"))
    kv = _field(config, "num_key_value_heads", "num_kv_heads", default=heads)
    if config.get("multi_query") and not config.get("new_decoder_architecture"):
        kv = 1
    ff = int(_field(config, "intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", default=4 * d))
    act = _field(config, "hidden_act", "activation_function", "hidden_activation", default="gelu")
    if act not in SHAPE_ACTIVATIONS:
        raise GpipeInputError(f"{name!r}: the MLP's activation {act!r} is not modelled; planning by shape takes "
                              f"{', '.join(sorted(SHAPE_ACTIVATIONS))}")
    mlp = SHAPE_ACTIVATIONS[act]
    if str(config.get("model_type", "")).startswith("gemma"):  # gated like Llama's, GELU for silu: same shape
        mlp = "swiglu"
    return {"layers": int(_field(config, "num_hidden_layers", "n_layer")), "d_model": d, "ff": ff, "heads": heads,
            "kv_heads": 0 if int(kv) == heads else int(kv), "seq": int(seq), "vocab": int(config["vocab_size"]),
            "activation": mlp, "attention": "flash", "dropout": 0.0}
