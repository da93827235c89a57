"""One process training a mixture-of-experts model as the executor's tests compare with it: the whole
model, the mini-batch's micro-batches in turn (the routers' auxiliary loss is a function of each
micro-batch's tokens), each loss and auxiliary loss weighted by its share of the rows, gradients
accumulated; AdamW with clipping as torch runs it."""

from __future__ import annotations

import contextlib

import torch

from executor.config import RunConfig
from executor.models.build import build_model
from executor.models.moe_aux_loss import set_micro_batch_weight, take_aux_loss
from executor.runtime.data import split
from tests.helpers.parity import NEAR_ZERO_GRADIENT, assert_adam_close

# small Hugging Face MoE configs (transformers' Mixtral and Qwen3-MoE) the executor's tests train
HF_MOE_CONFIGS = {
    "mixtral": {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64, "num_local_experts": 4,
                "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.05},
    "qwen3_moe": {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
                  "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 1,
                  "output_router_logits": True, "router_aux_loss_coef": 0.05, "mlp_only_layers": [1]},
}

MOE = {"layers": 2, "d_model": 32, "ff": 64, "heads": 4, "seq": 8, "vocab": 64, "experts": 4, "top_k": 2,
       "expert_ff": 32, "aux_loss_coef": 0.05}


def chunks(inputs, targets, microbatches: int, replicas: int = 1):
    """The micro-batches D replicas train: each replica's ``torch.chunk`` share split into ``microbatches``."""
    for share_x, share_t in zip(split(inputs, replicas), split(targets, replicas)):
        yield from zip(split(share_x, microbatches), split(share_t, microbatches))


def accumulate(model, inputs, targets, loss_fn, microbatches: int, bf16: bool = False,
               replicas: int = 1) -> tuple[float, float]:
    """Gradients of the mean loss over ``microbatches`` chunks (of each of ``replicas`` shares) added to
    ``.grad``; (loss, auxiliary loss)."""
    take_aux_loss()
    total, rows = 0.0, inputs.shape[0]
    for x, t in chunks(inputs, targets, microbatches, replicas):
        set_micro_batch_weight(x.shape[0] / rows)
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with cast:
            y = model(x)
        loss = loss_fn(y.float(), t) * (x.shape[0] / rows)
        loss.backward()
        total += float(loss.detach())
    set_micro_batch_weight(1.0)
    return total, take_aux_loss()


def one_process(config: RunConfig, batches, loss_fn, microbatches: int, steps: int, replicas: int = 1,
                absent: set[str] | None = None, absent_by_step: list[set[str]] | None = None):
    """``steps`` of ``config``'s optimizer (sgd or adamw, clipping by the global norm, constant lr) on
    ``batches(step)``, each of ``replicas`` shares in ``microbatches`` chunks; (losses, aux losses, norms,
    model, near-zero masks): the masks mark elements
    whose gradient was below :data:`tests.helpers.parity.NEAR_ZERO_GRADIENT` at some step
    (:func:`tests.helpers.parity.assert_adam_close` says why they are held to a bound only). A parameter
    without a gradient in a step (an expert no row reached) is skipped by the optimizer, as torch's
    are; ``absent`` collects the names of those, ``absent_by_step`` gets one set of them per step."""
    model = build_model(config.model, config.options, config.seed)
    if config.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    losses, auxes, norms = [], [], []
    near_zero = [torch.zeros_like(p, dtype=torch.bool) for p in model.parameters()]
    for step in range(steps):
        optimizer.zero_grad()
        absent_by_step is None or absent_by_step.append(set())
        inputs, targets = batches(step)
        loss, aux = accumulate(model, inputs, targets, loss_fn, microbatches, config.precision == "bf16", replicas)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm or float("inf"))
        for mask, (name, p) in zip(near_zero, model.named_parameters()):
            if p.grad is None:
                absent is None or absent.add(name)
                absent_by_step is None or absent_by_step[-1].add(name)
                continue
            mask |= p.grad.abs() < NEAR_ZERO_GRADIENT
        optimizer.step()
        losses.append(loss)
        auxes.append(aux)
        norms.append(float(norm))
    return losses, auxes, norms, model, near_zero


def assert_parameters_equal(actual: dict[str, torch.Tensor], model, near_zero, lr_sum: float, atol: float) -> None:
    """Every parameter of ``model`` (named as ``actual``'s) as :func:`tests.helpers.parity.assert_adam_close`
    holds them."""
    assert set(actual) >= {name for name, _ in model.named_parameters()}
    for (name, expected), mask in zip(model.named_parameters(), near_zero):
        assert_adam_close(name, actual[name].detach(), expected.detach(), mask, lr_sum, atol)
