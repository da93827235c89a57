"""The optimizers gpipe trains with, and the state each keeps per parameter: one table for every part.

The executor builds them from torch.optim (:mod:`executor.runtime.optim`); the simulator counts their state
in each stage's memory; calibration records the one it measured with. Torch-free.

State per parameter, in tensors the size of the parameter (``optimizer_slots``): ``sgd`` keeps none
(torch's SGD without momentum, as gpipe runs it), ``adam`` and ``adamw`` keep two (``exp_avg`` and
``exp_avg_sq``). torch.optim allocates them in the parameters' dtype, fp32 in the executor.
"""

from __future__ import annotations

from sim.errors import GpipeInputError

OPTIMIZER_SLOTS: dict[str, int] = {"sgd": 0, "adam": 2, "adamw": 2}
OPTIMIZERS = tuple(OPTIMIZER_SLOTS)
DEFAULT_OPTIMIZER = "adamw"  # what language models are trained with


def check_optimizer(name: object) -> str:
    """``name`` if it is a known optimizer, else a one-line error listing them."""
    if name not in OPTIMIZER_SLOTS:
        raise GpipeInputError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return str(name)


def optimizer_slots(name: str) -> int:
    """Tensors of optimizer state per parameter tensor that ``name`` keeps."""
    return OPTIMIZER_SLOTS[check_optimizer(name)]
