"""Hugging Face mixture-of-experts decoders (``hf:mixtral``, ``hf:qwen3_moe``): their router loss across stages.

transformers' own decoder layers run the experts (under expert parallelism their blocks' forward is
replaced, :mod:`executor.parallel.hf_experts`); what a pipeline must add is the load-balancing loss,
which ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` compute from every layer's router logits at
once when ``output_router_logits`` is set (``load_balancing_loss_func``): ``experts x sum_e F_e x P_e``,
with F_e each expert's top-k assignments and P_e its summed softmax probability, both over every MoE
layer's tokens and divided by their count, added to the loss at ``router_aux_loss_coef``. Neither sum
splits by layer, so each layer adds its own to two fixed-shape tensors the pipeline carries from stage
to stage (``router_counts``, no gradient; ``router_probs``, with one), and the head computes the loss
from the totals and attaches it to the logits (:func:`executor.models.moe_aux_loss.attach_aux_loss`):
its gradient flows back along the carried sums to every layer's router, on whatever stage. The
micro-batch is the unit (as the model computes it on one batch); no attention mask (no padding).

Limits: tensor parallelism of these layers is refused in one line (transformers stores the experts as
3-D tensors, which the column/row styles do not split). ``--init-from`` a Mixtral ``save_pretrained``
folder is refused in one line: transformers writes the experts there in the legacy per-expert layout,
not the module's names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from executor.models.moe_aux_loss import attach_aux_loss

MOE_TYPES = ("mixtral", "qwen3_moe")
COUNTS, PROBS = "router_counts", "router_probs"


def experts_of(config: Any) -> int:
    return int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0)


def trains_router_loss(config: Any) -> bool:
    """The model adds its routers' loss: a MoE config with ``output_router_logits`` set, as transformers does."""
    return config.model_type in MOE_TYPES and bool(getattr(config, "output_router_logits", False))


def start_sums(value: dict[str, Any], config: Any, like: torch.Tensor) -> dict[str, Any]:
    """The embedding's output with the two sums at zero."""
    zeros = torch.zeros(experts_of(config), dtype=torch.float32, device=like.device)
    return {**value, COUNTS: zeros, PROBS: zeros.clone()}


def _router(layer: nn.Module) -> nn.Module | None:
    gate = getattr(getattr(layer, "mlp", None), "gate", None)
    return gate if gate is not None and type(gate).__name__.endswith("TopKRouter") else None


def run_layer(layer: nn.Module, call: Any, value: dict[str, Any], config: Any) -> tuple[Any, dict[str, Any]]:
    """``call()`` (the decoder layer) with its router's logits added to the carried sums."""
    router = _router(layer)
    hidden = value["hidden_states"]
    if hidden.is_meta or is_fake(hidden):  # the shape check: the experts' loop needs data; shapes are kept
        probs = value[PROBS] + (0.0 * router.weight.sum() if router is not None else 0.0)
        return hidden * 1.0, {COUNTS: value[COUNTS], PROBS: probs}
    if router is None:  # a dense layer (Qwen3's mlp_only_layers)
        return call(), {COUNTS: value[COUNTS], PROBS: value[PROBS]}
    captured: list[torch.Tensor] = []
    handle = router.register_forward_hook(lambda module, args, out: captured.append(out[0]))
    try:
        out = call()
    finally:
        handle.remove()
    probs = F.softmax(captured[0].float(), dim=-1)  # (tokens, experts)
    _, chosen = torch.topk(probs, config.num_experts_per_tok, dim=-1)
    counts = value[COUNTS].index_add(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
    return out, {COUNTS: counts, PROBS: value[PROBS] + probs.sum(dim=0)}


def attach_router_loss(logits: torch.Tensor, value: dict[str, Any], config: Any) -> torch.Tensor:
    """The head's logits carrying ``router_aux_loss_coef x`` the load-balancing loss of the totals."""
    counts, probs = value[COUNTS], value[PROBS]
    if logits.is_meta or is_fake(logits):
        return logits
    rows = counts.sum() / config.num_experts_per_tok  # tokens x MoE layers
    if float(rows) == 0:
        return logits
    aux = experts_of(config) * torch.sum((counts / rows) * (probs / rows))
    return attach_aux_loss(logits, aux, float(config.router_aux_loss_coef))
