"""``--checkpoint selective``: the attention core recomputed inside the backward (Korthikanti et al. 2022).

The core (QK^T, the causal mask, softmax, attention over V) saves the (heads, seq, seq) probabilities,
the largest activations of a transformer at long sequences, yet costs little to run again. Under
:func:`recompute_attention_core` the built-in transformer's attention runs it as
:class:`AttentionCore`: the forward keeps only q, k and v (as QKV wrote them), and the backward reruns
the core with gradients on, at the forward's autocast state, before taking its gradients. The
values are those of the explicit core (the same ops in the same order), so a run's losses and
gradients are those of ``never``. The core draws no random numbers (the model has no dropout on the
probabilities), so nothing needs replaying.

Limits: for the built-in transformer only (``executor.models.build.CausalSelfAttention``); Hugging Face
layers run attention through ``scaled_dot_product_attention``, whose kernels choose what they save.
The recomputed probabilities exist during the backward of one core at a time and are not counted, as
no working memory of an op is.
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from typing import Iterator

import torch

_ACTIVE: ContextVar[bool] = ContextVar("recompute_attention_core", default=False)


@contextlib.contextmanager
def recompute_attention_core(active: bool = True) -> Iterator[None]:
    """Within this block, attention cores that support it keep no probabilities for backward."""
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def recomputing_attention_core() -> bool:
    return _ACTIVE.get()


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Causal attention of q (rows, heads, seq, dim) over k, v (rows, kv heads, seq, dim), each key
    and value head repeated to the ``groups`` query heads it serves: (rows, heads, seq, dim)."""
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    seq, dim = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(dim)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v


class AttentionCore(torch.autograd.Function):
    """:func:`attention_core` saving q, k and v only; the backward recomputes it."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.groups = groups
        ctx.device_type = q.device.type
        ctx.autocast = torch.is_autocast_enabled(ctx.device_type)
        ctx.autocast_dtype = torch.get_autocast_dtype(ctx.device_type)
        return attention_core(q, k, v, groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            out = attention_core(q, k, v, ctx.groups)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        return dq, dk, dv, None
