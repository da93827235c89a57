"""Mini-batches as a pure function of (seed, step), and their split into micro-batches.

Because step ``s`` always yields the same batch, a resumed run sees exactly the data an
uninterrupted run sees, and every rank can draw the batch itself (stage 0 keeps the inputs, the
last stage the targets) without sending data around. Built-in models draw synthetic data; a user's
``--data package.module:function`` is called as ``function(batch_size, step=step, seed=seed)`` and
must return ``(inputs, targets)`` that depend only on its arguments.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from executor.models import example_batch, load_object
from sim.errors import GpipeInputError, require_positive


def mix_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers, e.g. (seed, step, stage, micro-batch)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def batch_for_step(model: str, options: dict[str, Any], batch_size: int, seed: int, step: int,
                   data: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of mini-batch ``step``; rows must equal ``batch_size``."""
    if data:
        fn = load_object(data, "data function")
        inputs, targets = fn(batch_size, step=step, seed=seed)
    else:
        inputs, targets = example_batch(model, options, batch_size, mix_seed(seed, step))
    if inputs.shape[0] != batch_size or targets.shape[0] != batch_size:
        raise GpipeInputError(f"data for step {step} has {inputs.shape[0]} input and {targets.shape[0]} "
                              f"target rows, expected the batch size {batch_size}")
    return inputs, targets


def split_rows(batch_size: int, microbatches: int) -> list[int]:
    """Rows per micro-batch, exactly as ``torch.chunk`` splits ``batch_size`` rows into M chunks.

    Chunks hold ceil(N/M) rows, so N=10, M=4 gives 3,3,3,1 and N=2, M=4 gives only 1,1.
    """
    require_positive("batch size", batch_size, "use --batch 1 or more")
    require_positive("micro-batches (M)", microbatches, "use --microbatches 1 or more")
    chunk = -(-batch_size // microbatches)
    sizes = [chunk] * (batch_size // chunk)
    if batch_size % chunk:
        sizes.append(batch_size % chunk)
    return sizes


def split(tensor: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """``torch.chunk`` along rows; contiguous so each chunk can be sent as is."""
    return [c.contiguous() for c in torch.chunk(tensor, microbatches, dim=0)]
