"""The MoE transformer's options: the transformer's (:mod:`sim.workloads.model_options`) plus its experts',
latent attention's and multi-token prediction's, each converted and checked, one line naming the fix.

- ``experts``, ``top_k``, ``expert_ff``: routed experts, the experts each token is routed to, each
  expert's (gated) width; ``shared_ff``: the shared experts' MLP width (0: none).
- ``moe_layers``: the comma list of layers whose MLP is the mixture (``none``: all dense); the
  others are dense MLPs of ``ff``.
- ``capacity_factor``: 0 dropless (every assignment computed, as Megatron-Core and DeepSeek-V3 train);
  C > 0 pads each expert to C x its mean load and drops what is above it.
- ``expert_imbalance``: the most loaded expert's tokens over the mean (0: the balls-into-bins figure
  of a router balanced in expectation, :func:`sim.workloads.moe.layers.expected_max_load`).
- ``dispatcher``: how tokens reach their experts' ranks: ``alltoall`` (Megatron-Core's default, one
  copy per assignment), ``deepep`` or ``hybridep`` (Megatron-Core's ``flex`` dispatcher with DeepEP or
  HybridEP: one copy per destination scale-up domain across the network, fanned out inside it;
  :func:`sim.workloads.moe.expert_parallel.remote_domains_per_token`).
- ``expert_groups``, ``routed_groups``: DeepSeek's group-limited routing (its config's ``n_group`` and
  ``topk_group``): the routed experts in that many groups, each token's top-k drawn from its best
  ``routed_groups`` of them (0: no limit); what a deduplicating dispatcher sends across nodes counts it.
- ``cuda_graphs``: the trainer captures the layers in CUDA graphs, which removes each MoE layer's fixed
  per-pass time (:data:`sim.workloads.moe.workload.MOE_LAYER_FIXED_S`).
- ``expert_biases``, ``router_bias``: gpt-oss's biases on the experts' matmuls and the router.
- ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``:
  multi-head latent attention when ``kv_lora_rank`` > 0 (:mod:`sim.workloads.moe.latent_attention`).
- ``mtp_layers``: DeepSeek-V3's multi-token prediction modules after the last block.
"""

from __future__ import annotations

from typing import Any

from sim.errors import GpipeInputError
from sim.workloads.decoder_features import flag_value
from sim.workloads.model_options import resolve_options

MOE_DEFAULTS: dict[str, Any] = {
    "experts": 8, "top_k": 2, "expert_ff": 0, "shared_ff": 0, "moe_layers": "none", "capacity_factor": 0.0,
    "expert_imbalance": 0.0, "dispatcher": "alltoall", "cuda_graphs": False, "expert_groups": 0, "routed_groups": 0,
    "expert_biases": False, "router_bias": False, "q_lora_rank": 0, "kv_lora_rank": 0,
    "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0, "mtp_layers": 0,
}
# the knobs of the pricing a user may set on any MoE model (--option capacity_factor=1.25)
MOE_KNOBS = ("capacity_factor", "expert_imbalance", "dispatcher", "cuda_graphs")
DISPATCHERS = ("alltoall", "deepep", "hybridep")
_FLAGS = ("expert_biases", "router_bias", "cuda_graphs")
_FRACTIONS = ("capacity_factor", "expert_imbalance")


def _number(key: str, value: Any, model: str, least: int) -> int:
    number = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(number, bool) or not isinstance(number, int) or number < least:
        raise GpipeInputError(f"{key}={value!r} for model {model}; use an integer from {least} up")
    return number


def _check(key: str, value: Any, model: str) -> Any:
    if key == "dispatcher":
        if value not in DISPATCHERS:
            raise GpipeInputError(f"dispatcher={value!r} for model {model}; use one of {', '.join(DISPATCHERS)}")
        return value
    if key in _FLAGS:
        return flag_value(key, value, model)
    if key in _FRACTIONS:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = -1.0
        if isinstance(value, bool) or number < 0 or (key == "expert_imbalance" and 0 < number < 1):
            floor = "0 (the balls-into-bins estimate) or 1 and up" if key == "expert_imbalance" else \
                "0 (dropless) or a positive number"
            raise GpipeInputError(f"{key}={value!r} for model {model}; use {floor}")
        return number
    if key == "moe_layers":
        text = ",".join(str(i) for i in value) if isinstance(value, (list, tuple)) else str(value)
        if text != "none" and not all(part.strip().isdigit() for part in text.split(",")):
            raise GpipeInputError(f"moe_layers={value!r} for model {model}; give a comma list of layer indices or none")
        return text
    return _number(key, value, model, 1 if key in ("experts", "top_k") else 0)


def resolve_moe_options(options: dict[str, Any], model: str = "moe transformer") -> dict[str, Any]:
    """The transformer's options checked (:func:`sim.workloads.model_options.resolve_options`) and the
    MoE ones filled in and checked: the full option dict that prices the model."""
    moe = {**MOE_DEFAULTS, **{k: v for k, v in options.items() if k in MOE_DEFAULTS}}
    merged = resolve_options("transformer", {k: v for k, v in options.items() if k not in MOE_DEFAULTS})
    moe = {key: _check(key, value, model) for key, value in moe.items()}
    groups, routed = moe["expert_groups"], moe["routed_groups"]
    if groups and (moe["experts"] % groups or not 0 < routed <= groups):
        raise GpipeInputError(f"expert_groups={groups}, routed_groups={routed} for model {model}: the groups must "
                              f"divide experts={moe['experts']} and each token use 1 to {groups} of them (n_group, "
                              "topk_group of a DeepSeek config); or no group limit: n_group=0 (expert_groups=0)")
    if moe["top_k"] > moe["experts"]:
        raise GpipeInputError(f"top_k={moe['top_k']} (a config's num_experts_per_tok) is above experts="
                              f"{moe['experts']} for model {model}; each token is routed to at most every expert: "
                              "choose from 1 to the experts")
    moe["expert_ff"] = moe["expert_ff"] or merged["ff"]
    layers = [int(i) for i in moe["moe_layers"].split(",")] if moe["moe_layers"] != "none" else []
    if any(i >= merged["layers"] for i in layers):
        raise GpipeInputError(f"moe_layers={moe['moe_layers']} names a layer beyond layers={merged['layers']} for "
                              f"model {model}; give indices from 0 to {merged['layers'] - 1}")
    if moe["kv_lora_rank"] and not (moe["qk_nope_head_dim"] and moe["qk_rope_head_dim"] and moe["v_head_dim"]):
        raise GpipeInputError(f"kv_lora_rank={moe['kv_lora_rank']} for model {model} needs qk_nope_head_dim, "
                              "qk_rope_head_dim and v_head_dim above 0 (multi-head latent attention)")
    return {**merged, **moe}
