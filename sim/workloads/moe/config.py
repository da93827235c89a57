"""A mixture-of-experts decoder's config read into the options that price it (``hf:mixtral``, ``deepseek-v3``).

The shape path reads dense decoders from their modules on the meta device
(:mod:`sim.workloads.decoder_shape`); a mixture of experts is read from its config's fields instead,
torch-free, with the field names of ``transformers``' own configuration and modeling code
(5.x; the released ``config.json`` files use the same names):

- ``deepseek_v3`` (DeepSeek-V3): ``n_routed_experts`` routed experts of ``moe_intermediate_size``,
  ``num_experts_per_tok`` of them per token, ``n_shared_experts`` shared experts of that width (one
  MLP ``n_shared_experts x moe_intermediate_size`` wide), the first ``first_k_dense_replace`` layers
  dense MLPs of ``intermediate_size``, then MoE every ``moe_layer_freq``-th layer (``i %
  moe_layer_freq == 0``; absent: every layer); multi-head latent attention (``q_lora_rank``,
  ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``:
  :mod:`sim.workloads.moe.latent_attention`) and ``num_nextn_predict_layers`` multi-token prediction modules.
- ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): ``num_experts`` (``num_local_experts`` in
  transformers 5) of ``moe_intermediate_size``, layer ``i`` MoE when ``(i + 1) % decoder_sparse_step
  == 0`` and not in ``mlp_only_layers`` (those dense of ``intermediate_size``); norms over q and k.
- ``mixtral``: ``num_local_experts`` of ``intermediate_size`` on every layer.
- ``llama4_text`` (Llama 4): ``num_local_experts`` of ``intermediate_size`` plus one shared expert of
  the same width, on the layers ``moe_layers`` lists, else every ``interleave_moe_layer_step``-th
  (``range(step - 1, layers, step)``); the others dense MLPs of ``intermediate_size_mlp``.
- ``gpt_oss`` (gpt-oss): ``num_local_experts`` of ``intermediate_size`` on every layer, with biases on
  the experts, the router and the attention, one attention sink per head, and ``layer_types``
  alternating ``sliding_attention`` (``sliding_window`` tokens) and full attention.

Every layer's MLP is gated (SwiGLU), norms are RMSNorms with a weight, positions rotary, embedding
and head untied unless ``tie_word_embeddings``. What the options cannot say (Llama 4's chunked
attention and layers without rotary positions, gpt-oss's clamped SwiGLU, DeepSeek's group-limited
routing) is priced as the plain form and said in the workload's ``assumed`` lines.
"""

from __future__ import annotations

from typing import Any

from sim.errors import GpipeInputError

# Hugging Face model types read here; their config fields are this module's docstring's
MOE_TYPES = ("deepseek_v3", "qwen3_moe", "mixtral", "llama4_text", "gpt_oss")
_EXPERT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts")


def _get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    return next((config[key] for key in keys if config.get(key) is not None), default)


def moe_layer_indices(config: dict[str, Any], model_type: str, layers: int) -> tuple[int, ...]:
    """The layers whose MLP is a mixture of experts, as each family's modeling code decides it."""
    if model_type == "deepseek_v3":
        first = int(_get(config, "first_k_dense_replace", default=0))
        every = int(_get(config, "moe_layer_freq", default=1))
        return tuple(i for i in range(layers) if i >= first and i % every == 0)
    if model_type == "qwen3_moe":
        step = int(_get(config, "decoder_sparse_step", default=1))
        dense = set(config.get("mlp_only_layers") or ())
        return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if model_type == "llama4_text":
        given = config.get("moe_layers")
        if given is not None:
            return tuple(sorted(int(i) for i in given if 0 <= int(i) < layers))
        step = int(_get(config, "interleave_moe_layer_step", default=1))
        return tuple(range(step - 1, layers, step))
    return tuple(range(layers))  # mixtral, gpt_oss: every layer


def _windows(config: dict[str, Any], model_type: str, layers: int) -> str:
    """gpt-oss's per-layer windows as the transformer's ``window`` pattern (0: full attention)."""
    types = config.get("layer_types")
    window = int(_get(config, "sliding_window", default=0))
    if model_type != "gpt_oss" or not types or not window:
        return "0"
    per_layer = [window if kind == "sliding_attention" else 0 for kind in types[:layers]]
    for period in range(1, len(per_layer) + 1):
        if all(w == per_layer[i % period] for i, w in enumerate(per_layer)):
            return ",".join(str(w) for w in per_layer[:period])
    return "0"


def moe_options(config: dict[str, Any], seq: int, name: str) -> dict[str, Any]:
    """The MoE transformer's options (:mod:`sim.workloads.moe.layers`) for a MoE ``config``; one line
    naming what is missing or not modelled."""
    model_type = str(config.get("model_type", ""))
    if model_type not in MOE_TYPES:
        raise GpipeInputError(f"{name!r} is a mixture of experts of type {model_type!r}, which is not read; "
                              f"mixtures of experts are planned for {', '.join(MOE_TYPES)}")
    try:
        d = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise GpipeInputError(f"{name!r}: its config lacks {exc}; give hidden_size, num_hidden_layers, "
                              "num_attention_heads and vocab_size") from None
    kv = int(_get(config, "num_key_value_heads", default=heads))
    experts = int(_get(config, *_EXPERT_FIELDS))
    top_k = int(_get(config, "num_experts_per_tok", default=1))
    act = str(_get(config, "hidden_act", default="silu"))
    if act not in ("silu", "swish"):
        raise GpipeInputError(f"{name!r}: the experts' activation {act!r} is not modelled; the MoE shape takes "
                              "gated silu (SwiGLU) experts")
    deepseek = model_type == "deepseek_v3"
    expert_ff = int(_get(config, "moe_intermediate_size", "intermediate_size")) if model_type in (
        "deepseek_v3", "qwen3_moe") else int(config["intermediate_size"])
    dense_ff = int(_get(config, "intermediate_size_mlp", default=0) if model_type == "llama4_text"
                   else config.get("intermediate_size") or expert_ff)
    shared_ff = (expert_ff * int(_get(config, "n_shared_experts", default=0)) if deepseek
                 else expert_ff if model_type == "llama4_text" else 0)
    head_dim = int(_get(config, "head_dim", default=0) or 0)
    moe = moe_layer_indices(config, model_type, layers)
    o: dict[str, Any] = {
        "layers": layers, "d_model": d, "ff": dense_ff, "heads": heads, "kv_heads": 0 if kv == heads else kv,
        "seq": int(seq), "vocab": vocab, "activation": "swiglu", "attention": "flash", "dropout": 0.0,
        "norm": "rmsnorm", "positions": "rotary", "biases": "qkv,proj" if config.get("attention_bias") else "none",
        "tied": bool(config.get("tie_word_embeddings", False)), "window": _windows(config, model_type, layers),
        "qk_norm": model_type == "qwen3_moe",
        "experts": experts, "top_k": top_k, "expert_ff": expert_ff, "shared_ff": shared_ff,
        "moe_layers": ",".join(str(i) for i in moe) or "none",
        "expert_biases": model_type == "gpt_oss", "router_bias": model_type == "gpt_oss",
    }
    # per block, weights no term prices: Qwen3's q and k norms (head_dim each), gpt-oss's sink per head
    sinks = heads if model_type == "gpt_oss" else 0
    qk_norms = 2 * (head_dim or d // heads) if model_type == "qwen3_moe" else 0
    if sinks or qk_norms:
        o["extra_block_params"] = sinks + qk_norms
    if head_dim and head_dim * heads != d and not deepseek:
        o["head_dim"] = head_dim
    if deepseek:
        o.update({"q_lora_rank": int(config.get("q_lora_rank") or 0), "kv_lora_rank": int(config["kv_lora_rank"]),
                  "qk_nope_head_dim": int(config["qk_nope_head_dim"]),
                  "qk_rope_head_dim": int(config["qk_rope_head_dim"]), "v_head_dim": int(config["v_head_dim"]),
                  "mtp_layers": int(_get(config, "num_nextn_predict_layers", default=0)),
                  "expert_groups": int(config.get("n_group") or 0),
                  "routed_groups": int(config.get("topk_group") or 0)})
    return o


def assumed_lines(config: dict[str, Any]) -> list[str]:
    """What the MoE shape prices as a plainer form than the family runs, one line each."""
    model_type = str(config.get("model_type", ""))
    lines = ["routed experts dropless (every token reaches its top-k experts) unless --option capacity_factor=C; "
             "each stage holds all its layers' experts unless --expert-parallel E splits them"]
    if model_type == "deepseek_v3":
        lines.append("DeepSeek's group-limited routing counted in the nodes a deduplicating dispatcher reaches, its "
                     "experts' load and its score-correction bias priced as plain top-k over sigmoid scores; "
                     "multi-token prediction modules share the embedding and the head")
    if model_type == "llama4_text":
        lines.append("Llama 4's chunked attention and layers without rotary positions priced as full causal "
                     "attention with rotary positions")
    if model_type == "gpt_oss":
        lines.append("gpt-oss's clamped SwiGLU priced as SwiGLU; attention sinks as parameters, not work")
    return lines


def names_experts(model: str, options: dict[str, Any] | None = None) -> bool:
    """Whether ``model`` (a runs file's or ``--model``'s name, with its ``options``) is a mixture of
    experts: an ``hf:`` type or an ``hf-config:`` file of :data:`MOE_TYPES`, a named MoE model, or the
    built-in transformer with ``experts``. Torch-free: read from names and files, nothing built."""
    import json

    from sim.workloads.named_models import is_named, named_models

    options = options or {}
    if model.startswith("hf:"):
        return model[3:] in MOE_TYPES
    if model.startswith("hf-config:"):
        try:
            with open(model[len("hf-config:"):]) as handle:
                return json.load(handle).get("model_type") in MOE_TYPES
        except (OSError, ValueError, AttributeError):
            return False
    if is_named(model):
        return named_models()[model].moe
    return bool(options.get("experts"))

