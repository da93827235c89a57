"""Deferred batch norm: normalise per micro-batch, update running statistics once per mini-batch.

GPipe (Huang et al. 2019, section 2.2) computes batch statistics per micro-batch during training and
accumulates the moving averages over the whole mini-batch. :class:`DeferredBatchNorm` does this:
each tracked forward adds the micro-batch's per-channel sum and sum of squares, and :meth:`commit`
applies one running-stat update from the mini-batch totals, so running_mean/running_var equal those
of one unpipelined pass over the whole mini-batch (up to float rounding). Forwards run under
:func:`recomputing` (re-materialization) do not accumulate, so recompute never counts twice.

Limit: the per-micro-batch normalisation itself differs from whole-batch normalisation, as in the
paper; only the running statistics are deferred.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_TRACKING = [True]


def is_recomputing() -> bool:
    """Inside :func:`recomputing`: a forward that runs again for its backward."""
    return not _TRACKING[0]


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Within this block deferred batch norms do not accumulate statistics."""
    previous = _TRACKING[0]
    _TRACKING[0] = False
    try:
        yield
    finally:
        _TRACKING[0] = previous


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm{1,2,3}d with the same parameters and buffers whose running stats are deferred."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def reset_accumulators(self) -> None:
        self._sum: torch.Tensor | None = None
        self._sum_squares: torch.Tensor | None = None
        self._count = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or not self.track_running_stats:
            return super().forward(input)
        if not hasattr(self, "_count"):
            self.reset_accumulators()
        if _TRACKING[0]:
            with torch.no_grad():
                dims = [0] + list(range(2, input.dim()))
                x = input.detach().float()
                total = x.sum(dims)
                squares = (x * x).sum(dims)
                self._sum = total if self._sum is None else self._sum + total
                self._sum_squares = squares if self._sum_squares is None else self._sum_squares + squares
                self._count += input.numel() // input.shape[1]
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def commit(self) -> None:
        """Apply one running-stat update from everything accumulated since the last commit."""
        if not self.training or not self.track_running_stats or not getattr(self, "_count", 0):
            return
        with torch.no_grad():
            n = self._count
            mean = self._sum / n
            var = (self._sum_squares / n - mean * mean).clamp_min(0.0)
            unbiased = var * (n / (n - 1)) if n > 1 else var
            self.num_batches_tracked += 1
            momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                        else self.momentum)
            self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        self.reset_accumulators()

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replace every BatchNorm{1,2,3}d under ``module`` by a deferred one with the same state."""
        if isinstance(module, _BatchNorm) and not isinstance(module, cls) \
                and type(module).__name__ in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d"):
            deferred = cls(module.num_features, module.eps, module.momentum, module.affine,
                           module.track_running_stats, device=_device_of(module))
            deferred.load_state_dict(module.state_dict())
            deferred.train(module.training)
            return deferred
        for name, child in module.named_children():
            module.add_module(name, cls.convert(child))
        return module


def _device_of(module: nn.Module) -> torch.device | None:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return None


def commit_all(module: nn.Module) -> None:
    """Commit every deferred batch norm under ``module`` (once per mini-batch)."""
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.commit()
