"""One stage's optimizer and learning-rate schedule (torch.optim), and clipping by the global norm.

Every stage builds its own optimizer over its own parameters. sgd, adam and adamw update each
element from its own gradient and state only, so K optimizers over the K parts of the model take
exactly the step one optimizer over the whole model takes. ``weight_decay`` is torch.optim's: an L2
term added to the gradient for sgd and adam, decoupled decay for adamw; it applies to every
parameter (biases and norms included), as one torch.optim parameter group does.

The learning rate of step s (0-based) is ``lr * lr_factor(s)``, with N warm-up steps and T steps in
the run::

    s < N:               (s + 1) / (N + 1)                   linear warm-up, reaching 1 at s = N
    constant, s >= N:    1
    cosine,   s >= N:    (1 + cos(pi * (s - N) / (T - N))) / 2   from 1 down to 0 after the last step

the same sequence as torch's ``SequentialLR`` of ``LinearLR(start_factor=1/(N+1), total_iters=N)``
and ``CosineAnnealingLR(T_max=T-N)``, but computed in closed form by a ``LambdaLR``, so a resumed
run's rates equal an uninterrupted run's exactly.

Clipping follows ``torch.nn.utils.clip_grad_norm_`` on the whole model: the norm is taken over every
stage's gradients (each stage contributes the sum of squares of its own; the pipeline adds them up:
:class:`executor.runtime.pipeline.LocalPipeline` in process, an all-reduce across ranks otherwise) and every
gradient is scaled by ``max_norm / (norm + 1e-6)`` when that is below 1. Clipping a stage by its own
norm would give a different (and stage-count dependent) update. Limits: the L2 norm only; sums of
squares add in float64, per-tensor norms are fp32 as in torch, so the norm agrees with torch's to
float rounding, not bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from executor.models.loaded_types import is_dtensor
from sim.errors import GpipeInputError
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, check_optimizer

LR_SCHEDULES = ("constant", "cosine")
CLIP_EPS = 1e-6  # added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does


@dataclass(frozen=True)
class OptimSettings:
    """How a stage updates its parameters; see the module docstring for the formulas."""

    optimizer: str = DEFAULT_OPTIMIZER  # sgd | adam | adamw
    lr: float = 0.01  # peak learning rate
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None  # max global L2 norm; None: no clipping
    lr_schedule: str = "constant"  # constant | cosine
    lr_warmup_steps: int = 0
    total_steps: int = 1  # T: the run's steps, over which cosine decays

    def validate(self) -> "OptimSettings":
        """Raise GpipeInputError, one line naming the value and the fix, for anything invalid."""
        check_optimizer(self.optimizer)
        if not (_finite(self.lr) and self.lr > 0):
            raise GpipeInputError(f"learning rate must be positive, got {self.lr}; use e.g. --lr 0.001")
        if not (_finite(self.weight_decay) and self.weight_decay >= 0):
            raise GpipeInputError(f"--weight-decay must be 0 or more, got {self.weight_decay}; "
                                  "use --weight-decay 0 for none")
        if self.clip_grad_norm is not None and not (_finite(self.clip_grad_norm) and self.clip_grad_norm > 0):
            raise GpipeInputError(f"--clip-grad-norm must be positive, got {self.clip_grad_norm}; "
                                  "leave it out for no clipping")
        if self.lr_schedule not in LR_SCHEDULES:
            raise GpipeInputError(f"unknown --lr-schedule {self.lr_schedule!r}; choose one of "
                                  f"{', '.join(LR_SCHEDULES)}")
        warmup = self.lr_warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise GpipeInputError(f"--lr-warmup must be 0 or more steps, got {warmup!r}")
        if self.lr_schedule == "cosine" and warmup >= self.total_steps:
            raise GpipeInputError(f"--lr-warmup {warmup} leaves no step of the {self.total_steps} to decay "
                                  f"over with --lr-schedule cosine; use --lr-warmup {self.total_steps - 1} "
                                  "or fewer, or more --steps")
        return self

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based), as the scheduler sets it."""
        return self.lr * lr_factor(step, self.lr_schedule, self.lr_warmup_steps, self.total_steps)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The multiple of the peak learning rate that step ``step`` (0-based) uses."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps
    done = min(step - warmup_steps, decay_steps)  # stays at 0 past the end
    return 0.5 * (1.0 + math.cos(math.pi * done / decay_steps))


OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def optimizer_class_and_kwargs(settings: OptimSettings) -> tuple[type[torch.optim.Optimizer], dict[str, float]]:
    """The torch.optim class and its settings: what a plain optimizer and a ZeRO-sharded one
    (:mod:`executor.parallel.replicas`) are both built from."""
    return OPTIMIZER_CLASSES[settings.optimizer], {"lr": settings.lr, "weight_decay": settings.weight_decay}


def make_optimizer(settings: OptimSettings, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    optimizer_class, kwargs = optimizer_class_and_kwargs(settings)
    return optimizer_class(list(params), **kwargs)


def make_scheduler(settings: OptimSettings, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler to step once after every optimizer step; its state goes into checkpoints."""
    schedule, warmup, total = settings.lr_schedule, settings.lr_warmup_steps, settings.total_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, schedule, warmup, total))


def gradients(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def squared_norm(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared L2 norms of ``grads`` as a float64 scalar on ``device`` (0 when none). A
    sharded gradient (:mod:`executor.parallel.tensor_parallel`) counts with its whole norm, on every rank."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([_whole(torch.linalg.vector_norm(g)) for g in grads]).to(torch.float64)
    return (norms * norms).sum()


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm as a plain tensor: a tensor-parallel gradient's (a DTensor) over all its shards, once."""
    return norm.full_tensor() if is_dtensor(norm) else norm


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """The factor every gradient is scaled by: ``max_norm / (norm + 1e-6)``, at most 1."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + CLIP_EPS))


def scale_(grads: Sequence[torch.Tensor], coefficient: float) -> None:
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
