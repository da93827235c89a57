"""A traced run's tensor-parallel collectives as spans of their own, inside the action that issued them.

DTensor issues a stage's collectives (the all-reduce after a row-parallel projection, the input
gradient's all-reduce in the backward, sequence parallelism's reduce-scatters and all-gathers) from
inside the layers, as torch's functional collectives, which the executor's action loop never sees.
:class:`CollectiveSpans`, a ``TorchDispatchMode`` entered around each compute action of a traced
run (``--trace`` with T > 1), sees every one of them, waits for it where it was issued and records
the span from issue to completion as ``tp_all_reduce``, ``tp_reduce_scatter`` or ``tp_all_gather``
(:mod:`sim.formats.timeline`), nested in the F, R, B, I or W span.

Limits: only traced runs pay for it, and they pay twice: every operation of the action passes
through Python (a few microseconds each), and each collective is waited for at once instead of
when its result is first used, so on a GPU a backward all-reduce no longer overlaps the
weight-gradient matrix multiply issued after it. An untraced run's timeline (``--report`` alone,
calibration, validation) has no such spans and none of that cost.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sim.formats.timeline import TP_ALL_GATHER, TP_ALL_REDUCE, TP_REDUCE_SCATTER

_FUNCTIONAL = torch.ops._c10d_functional
KINDS = {_FUNCTIONAL.all_reduce: TP_ALL_REDUCE, _FUNCTIONAL.reduce_scatter_tensor: TP_REDUCE_SCATTER,
         _FUNCTIONAL.all_gather_into_tensor: TP_ALL_GATHER}


class CollectiveSpans(TorchDispatchMode):
    """Records each functional collective issued inside it as a span of ``recorder``'s, for
    ``microbatch``; everything else passes through unchanged."""

    def __init__(self, recorder: Any, microbatch: int) -> None:
        super().__init__()
        self.recorder = recorder
        self.microbatch = microbatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kind = KINDS.get(func.overloadpacket)
        if kind is None:
            return func(*args, **(kwargs or {}))
        close = self.recorder.open_span(kind, self.microbatch)
        out = func(*args, **(kwargs or {}))
        _FUNCTIONAL.wait_tensor(out)  # a later wait on it finds nothing left to wait for
        close()
        return out
