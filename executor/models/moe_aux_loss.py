"""The routers' load-balancing loss reaching the gradients as one process's would, whatever the pipeline.

A router's auxiliary loss is computed inside a block, far from the last stage's loss, and a stage's
backward starts from the gradient it receives, not from a loss. So the loss is not added to the model's
output: :class:`AuxLossInjector` passes the block's output through unchanged and, in its backward,
seeds the auxiliary loss's own graph with ``coefficient x weight``, as Megatron-Core's
``MoEAuxLossAutoScaler`` does. ``weight`` is the micro-batch's share of the mini-batch (rows_m / batch
rows, the factor the last stage scales the main loss by, :mod:`executor.runtime.stage`), read when the
forward runs, so the sum over micro-batches (and the replicas' weighted gradient sum) is the gradient of
the mean of the micro-batches' losses: what one process accumulating over the same micro-batches
computes. The auxiliary loss is a function of each micro-batch's tokens (its expert fractions are not
additive), as Megatron-Core and transformers compute it, so one process training the whole batch at
once differs from M micro-batches by that much.

:func:`micro_batch_weight` sets the weight for the forwards that follow (the stage sets it before each
forward and recompute). Forwards outside a recompute add ``weight x coefficient x aux`` to a tally
(:func:`take_aux_loss`) that the step's report prints beside the loss.
"""

from __future__ import annotations

from typing import Any

import torch

_state: dict[str, Any] = {"weight": 1.0, "tally": 0.0}


def set_micro_batch_weight(weight: float) -> None:
    """The share of the mini-batch the next forwards belong to (1: a whole batch, as one process runs)."""
    _state["weight"] = float(weight)


def micro_batch_weight() -> float:
    return float(_state["weight"])


def add_to_tally(value: float) -> None:
    _state["tally"] += value


def take_aux_loss() -> float:
    """The weighted auxiliary losses added since the last call (coefficient included), and reset."""
    value, _state["tally"] = float(_state["tally"]), 0.0
    return value


class AuxLossInjector(torch.autograd.Function):
    """``output`` unchanged; backward: ``output``'s gradient, and ``scale`` as ``aux``'s gradient."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def attach_aux_loss(output: torch.Tensor, aux: torch.Tensor, coefficient: float) -> torch.Tensor:
    """``output`` carrying ``coefficient x aux`` into the backward at this micro-batch's weight."""
    from executor.runtime.batchnorm import is_recomputing

    scale = coefficient * micro_batch_weight()
    if not is_recomputing():
        add_to_tally(scale * float(aux.detach()))
    if not (torch.is_grad_enabled() and aux.requires_grad) or coefficient == 0:
        return output
    return AuxLossInjector.apply(output, aux, scale)

