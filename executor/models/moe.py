"""The built-in transformer's mixture-of-experts MLP: a router, routed experts, shared experts, dropless.

Per block (Shazeer et al. 2017; as Mixtral and Qwen3-MoE route): ``logits = router(x)`` (a d_model x
experts linear, no bias), probabilities by a softmax in fp32, each token's ``top_k`` experts and their
probabilities renormalised to sum to one (so top-1 gives its expert weight 1 and the router learns
from the load-balancing loss alone, as Mixtral's renormalisation does). Every token reaches each of its
experts (dropless: no capacity, nothing dropped); the loop over experts gathers an expert's tokens,
runs its MLP and adds the weighted output back with ``index_add_`` (correct and plain, not fast).
Shared experts are one MLP of ``shared_experts x expert_ff`` every token goes through (DeepSeek's
layout), added to the routed output. Each expert is the block's MLP (its activation, gated or not,
with biases), so tensor parallelism splits every expert as it splits the dense MLP
(:mod:`executor.parallel.tensor_parallel`): the router is replicated, its input and the experts'
outputs are whole on every rank, so every rank routes the same tokens.

Expert parallelism (:mod:`executor.parallel.expert_parallel`) keeps only this rank's experts, in a
``ModuleDict`` keyed by their index in the block (so their state-dict names stay those of the whole
list), and sets :attr:`MixtureOfExperts.exchange`: the routed part of the forward then sends each
assignment to the rank holding its expert and takes the outputs back, instead of the loop here.

Load balancing (Fedus et al. 2022, "Switch Transformers", eq. 4, over top-k assignments as
transformers' ``load_balancing_loss_func`` counts them): ``aux = experts x sum_e f_e x P_e``, f_e the
fraction of the micro-batch's tokens with e among their top-k, P_e the mean router probability of e.
It reaches the router's gradient through :mod:`executor.models.moe_aux_loss`, scaled by
``aux_loss_coef``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from executor.models.moe_aux_loss import attach_aux_loss


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """Switch Transformer's loss from fp32 ``probs`` (tokens, experts) and ``chosen`` (tokens, top_k)."""
    counts = torch.zeros(experts, dtype=probs.dtype, device=probs.device)
    counts.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=probs.dtype, device=probs.device))
    fraction = counts / probs.shape[0]  # sums to top_k over the experts
    return experts * torch.sum(fraction * probs.mean(dim=0))


class MixtureOfExperts(nn.Module):
    """(rows, seq, d_model) -> (rows, seq, d_model): ``experts`` MLPs made by ``make_mlp(width)``, each
    token through its ``top_k`` and, with ``shared_experts``, through one shared MLP."""

    def __init__(self, d_model: int, experts: int, top_k: int, expert_ff: int, shared_experts: int,
                 make_mlp: Callable[[int], nn.Module], aux_loss_coef: float) -> None:
        super().__init__()
        self.top_k, self.aux_loss_coef, self.num_experts = top_k, aux_loss_coef, experts
        self.router = nn.Linear(d_model, experts, bias=False)
        # all of them; under expert parallelism a ModuleDict of this rank's, keyed by their index
        self.experts: nn.ModuleList | nn.ModuleDict = nn.ModuleList(make_mlp(expert_ff) for _ in range(experts))
        self.shared = make_mlp(shared_experts * expert_ff) if shared_experts else None
        # expert parallelism: (tokens, weights, chosen, block) -> the routed output (fp32), None: the loop here
        self.exchange: Callable[..., torch.Tensor] | None = None

    def named_experts(self) -> list[tuple[int, nn.Module]]:
        """(index in the block, expert) of the experts this rank holds."""
        if isinstance(self.experts, nn.ModuleDict):
            return [(int(name), expert) for name, expert in self.experts.items()]
        return list(enumerate(self.experts))

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights (tokens, top_k), chosen experts (tokens, top_k), the load-balancing loss)."""
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen, load_balancing_loss(probs, chosen, self.num_experts)

    def routed(self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum (fp32) added to ``out`` (zeros when None), expert by expert on
        this rank: the part of the block expert parallelism moves to other ranks, which calibration times
        apart (:mod:`calibrate.measure.expert_profile`)."""
        if out is None:
            out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        for e, expert in self.named_experts():
            rows, slot = torch.where(chosen == e)
            if rows.numel():  # the same on every tensor-parallel rank: they route the same tokens
                y = expert(tokens[rows])
                out = out.index_add(0, rows, y.float() * weights[rows, slot].unsqueeze(1))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen, aux = self.route(tokens)
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device)
        if x.is_meta or is_fake(x):  # the shape check (executor.runtime.shapes): every expert on every token, no data
            for _, expert in self.named_experts():
                out = out + expert(tokens).float()
            return (out if self.shared is None else out + self.shared(tokens).float()).to(x.dtype).view_as(x)
        if self.exchange is not None:  # expert parallelism: each assignment to the rank holding its expert
            out = self.exchange(tokens, weights, chosen, self)
        else:
            out = self.routed(tokens, weights, chosen, out)
        if self.shared is not None:
            out = out + self.shared(tokens).float()
        out = attach_aux_loss(out, aux, self.aux_loss_coef)
        return out.to(x.dtype).view_as(x)
