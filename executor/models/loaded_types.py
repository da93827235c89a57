"""``isinstance`` against a class of a module that may never have been imported, without importing it.

Why: ``torch.distributed.tensor`` (DTensor) and ``torch.distributed.optim`` (ZeroRedundancyOptimizer)
each take a large share of torch's own import time to import
(docs/notes/2026-11-27-figures-behind-the-code.md), in every rank of every run; only tensor-parallel and
ZeRO runs use them. An object of a class whose module was never imported cannot exist, so where that
module is not loaded the answer is no, and where it is, the ordinary ``isinstance``.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable


def is_loaded_instance(value: Any, module: str, name: str) -> bool:
    """Whether ``value`` is an instance of ``module.name``, importing nothing."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(value, getattr(loaded, name))


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (a tensor-parallel parameter, gradient or norm)."""
    return is_loaded_instance(value, "torch.distributed.tensor", "DTensor")


def is_sharded(tensors: Iterable[Any]) -> bool:
    """Whether any of ``tensors`` is a DTensor: a tensor-parallel stage's parameters."""
    return any(is_dtensor(t) for t in tensors)


def is_zero_optimizer(value: Any) -> bool:
    """Whether ``value`` is a ZeroRedundancyOptimizer (optimizer state sharded over the replicas)."""
    return is_loaded_instance(value, "torch.distributed.optim", "ZeroRedundancyOptimizer")
