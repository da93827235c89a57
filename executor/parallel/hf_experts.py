"""Hugging Face mixture-of-experts blocks (``hf:mixtral``, ``hf:qwen3_moe``) under expert parallelism:
each rank keeps n/E of a block's experts and its tokens reach them through the built-in's exchange.

transformers stores a block's routed experts as two 3-D tensors, ``mlp.experts.gate_up_proj``
(n, 2 x ff, d) and ``mlp.experts.down_proj`` (n, d, ff), run by a loop over the experts any token
chose. Under ``--expert-parallel E`` rank r of a group keeps rows ``r x n/E .. (r+1) x n/E - 1`` of
both as parameters of the same names (:class:`LocalFusedExperts`), so a stage's state dict keeps
transformers' names, only their first dimension cut by E. The block's forward is replaced by one that
routes with the block's own router as transformers runs it (its top-k, its normalisation: Mixtral's
softmax-then-top-k renormalised, Qwen3-MoE's ``norm_topk_prob``) and hands the tokens, weights and
choices to :func:`executor.parallel.expert_exchange.routed_output`: the same dispatch, the same
per-(source, expert) calls, the same combine in the one-process loop's expert order. Each expert
computes as the model's experts implementation does: ``grouped_mm`` (transformers' default) in the
weights' dtype even under bf16 autocast, its weighted outputs added in fp32; the eager loop under
autocast, added in the hidden states' dtype. Other implementations are refused in one line. The router's
logits still reach the carried load-balancing sums (:mod:`executor.models.hf_moe` hooks the router).

A local slice's gradient exists whenever the block ran, as the whole tensor's does in one process
(an expert no token chose has a zero gradient there, which AdamW still steps): the slice's output
carries a zero term of its parameters for that.

Checkpoints hold the whole tensors: the group's slices are concatenated in rank order, their
optimizer state likewise (:func:`gathered`); a rank resuming under expert parallelism takes its rows
of them (:func:`local_state`), so runs resume at any E, or without.

Limits: the router's jitter noise (Mixtral's ``router_jitter_noise``, 0 by default) is drawn on each
rank from its own generator, as in one process it is from one; a token's top-k outputs are added
in expert order (grouped_mm adds them in slot order: the same sum for top-2, fp32 rounding apart
above it); ZeRO-2/3 with these blocks is refused
(FSDP would shard the slices over all D replicas, not their expert-data-parallel ones); the experts
run in a Python loop, one call per (source rank, expert).
"""

from __future__ import annotations

import re
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from executor.parallel.expert_exchange import Exchange, routed_output, run_local_experts

FUSED_NAME = re.compile(r"^(.*\.experts\.)(gate_up_proj|down_proj)$")  # a block's 3-D experts' tensor


def is_fused_expert(name: str) -> bool:
    return FUSED_NAME.match(name) is not None


def is_hf_block(module: nn.Module) -> bool:
    """A transformers sparse MoE block: a top-k router beside experts stored as 3-D tensors."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (type(module).__name__.endswith("SparseMoeBlock") and type(gate).__name__.endswith("TopKRouter")
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


SUPPORTED = ("grouped_mm", "eager")  # the experts implementations computed here as transformers computes them


def implementation(experts: nn.Module) -> str:
    """The experts' implementation transformers dispatches to (``config._experts_implementation``)."""
    return str(getattr(getattr(experts, "config", None), "_experts_implementation", None) or "eager")


def hf_blocks(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if is_hf_block(m)]


def experts_in(block: nn.Module) -> int:
    return int(block.experts.gate_up_proj.shape[0])


class LocalFusedExperts(nn.Module):
    """This rank's rows of a block's two expert tensors, named as transformers names them; callable
    as :class:`~executor.parallel.expert_exchange.LocalExperts` is: over the rows each rank sent."""

    def __init__(self, experts: nn.Module, first: int, count: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[first:first + count].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[first:first + count].clone())
        self.act_fn = experts.act_fn
        self.first = first
        self.grouped = implementation(experts) == "grouped_mm"

    def expert(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        """Local expert ``index`` on ``rows``, as the model's experts implementation computes one:
        ``grouped_mm`` (transformers' default) multiplies in the weights' dtype whatever autocast says
        (its kernel is not autocast-enabled), the eager loop under autocast."""
        if not self.grouped:
            gate, up = F.linear(rows, self.gate_up_proj[index]).chunk(2, dim=-1)
            return F.linear(self.act_fn(gate) * up, self.down_proj[index])
        with torch.autocast(rows.device.type, enabled=False):
            gate_up, down = self.gate_up_proj[index], self.down_proj[index]
            gate, up = F.linear(rows.to(gate_up.dtype), gate_up).chunk(2, dim=-1)
            return F.linear((self.act_fn(gate) * up).to(down.dtype), down)

    def forward(self, received: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        local = [lambda rows, e=e: self.expert(e, rows) for e in range(self.gate_up_proj.shape[0])]
        out = run_local_experts(local, received, counts)
        return out + 0.0 * (self.gate_up_proj.sum() + self.down_proj.sum())  # a gradient, zero where unused


def routed_forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The sparse block's forward with its experts on the ranks holding them."""
    batch, sequence, width = hidden_states.shape
    jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    if block.training and jitter > 0:
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
    tokens = hidden_states.reshape(-1, width)
    _, weights, chosen = block.gate(tokens)
    # grouped_mm adds a token's weighted outputs in fp32, the eager loop in the hidden states' dtype
    added = torch.float32 if block.experts.grouped else hidden_states.dtype
    out = routed_output(block.exchange, tokens, weights, chosen, block, dtype=added)
    return out.to(hidden_states.dtype).reshape(batch, sequence, width)


def keep_local(module: nn.Module, exchange_of: Any) -> None:
    """Cut every Hugging Face block of ``module`` to this rank's experts, in place, routed through the
    :class:`Exchange` ``exchange_of(block)`` gives (one per block)."""
    for block in hf_blocks(module):
        exchange: Exchange = exchange_of(block)
        experts = experts_in(block)
        per_rank = experts // exchange.size
        block.experts = LocalFusedExperts(block.experts, exchange.rank * per_rank, per_rank)
        block.num_experts = experts
        block.exchange = exchange
        block.forward = types.MethodType(routed_forward, block)


def sharded_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks :func:`keep_local` cut."""
    return [m for m in module.modules() if isinstance(getattr(m, "experts", None), LocalFusedExperts)]


def _joined(values: list[Any]) -> Any:
    """Slices' optimizer state (or tensors) concatenated along the experts; None if any is missing."""
    if any(v is None for v in values):
        return None
    if torch.is_tensor(values[0]):
        return torch.cat(values) if values[0].dim() else values[0]
    return {key: _joined([v[key] for v in values]) for key in values[0]}


def gathered(parts: list[tuple[dict[str, torch.Tensor], Any, list[list[str]]]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """From the group's (module state, optimizer state, names) in rank order: each 3-D experts'
    tensor whole, and its optimizer state (by its first name) whole."""
    module = {key: torch.cat([state[key] for state, _, _ in parts]) for key in parts[0][0] if is_fused_expert(key)}
    optimizer: dict[str, Any] = {}
    if parts[0][1] is not None:
        for index, names in enumerate(parts[0][2]):
            if is_fused_expert(names[0]):
                optimizer[names[0]] = _joined([state.get(index) for _, state, _ in parts])
    return module, optimizer


def local_state(module: nn.Module, state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """``state`` (a checkpoint's whole stage) with each 3-D experts' tensor, and its optimizer state,
    cut to the rows ``module``'s rank holds; unchanged where ``module`` holds whole ones."""
    rows: dict[str, tuple[int, int]] = {}
    for prefix, block in module.named_modules():
        if isinstance(getattr(block, "experts", None), LocalFusedExperts):
            local = block.experts
            for name in ("gate_up_proj", "down_proj"):
                rows[f"{prefix}.experts.{name}"] = (local.first, local.first + local.gate_up_proj.shape[0])
    if not rows:
        return state

    def cut(value: Any, span: tuple[int, int]) -> Any:
        if torch.is_tensor(value):
            return value[span[0]:span[1]].clone() if value.dim() else value
        return {key: cut(v, span) for key, v in value.items()}

    out = dict(state, module={key: cut(v, rows[key]) if key in rows else v for key, v in state["module"].items()})
    if state.get("optimizer") is not None:
        entries = dict(state["optimizer"]["state"])
        for index, param_names in enumerate(names):
            span = next((rows[n] for n in param_names if n in rows), None)
            if span is not None and index in entries:
                entries[index] = cut(entries[index], span)
        out["optimizer"] = dict(state["optimizer"], state=entries)
    return out
