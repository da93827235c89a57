"""Mini-batches as a pure function of (seed, step), and their split into micro-batches.

Because step ``s`` always yields the same batch, a resumed run sees exactly the data an
uninterrupted run sees, and every rank can draw the batch itself (stage 0 keeps the inputs, the
last stage the targets) without sending data around. Built-in models draw synthetic data (random
values: the timing is real, the loss cannot fall); ``--data text`` feeds a language model the
shipped Shakespeare byte by byte (:mod:`executor.runtime.text_data`); a user's ``--data
package.module:function`` is called as ``function(batch_size, step=step, seed=seed)`` and must
return ``(inputs, targets)`` that depend only on its arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from executor.models.build import example_batch, load_object
from executor.runtime.boundary import map_tensors, tensors
from executor.runtime.seeds import mix_seed
from executor.runtime.text_data import is_text_data, text_batch
from sim.errors import GpipeInputError
from sim.schedules.microbatch import split_rows  # noqa: F401  (re-exported: one split rule for both halves)


def batch_for_step(model: str, options: dict[str, Any], batch_size: int, seed: int, step: int,
                   data: str | None = None) -> tuple[Any, Any]:
    """The (inputs, targets) of mini-batch ``step``; rows must equal ``batch_size``.

    Inputs and targets are tensors, or tuples, lists or dicts of tensors whose first dimension is
    the rows (token ids with their attention mask, say).
    """
    if is_text_data(data):
        inputs, targets = text_batch(data, model, options, batch_size, seed, step)  # type: ignore[arg-type]
    elif data:
        fn = load_object(data, "data function")
        inputs, targets = fn(batch_size, step=step, seed=seed)
    else:
        inputs, targets = example_batch(model, options, batch_size, mix_seed(seed, step))
    for what, value in (("input", inputs), ("target", targets)):
        rows = {leaf.shape[0] if leaf.dim() else 0 for leaf in tensors(value)}
        if rows != {batch_size}:
            raise GpipeInputError(f"data for step {step} has {what} rows {sorted(rows)}, expected the batch size "
                                  f"{batch_size} first in every tensor; make the data function return "
                                  "batch_size rows")
    return inputs, targets


class MicroBatches(list):
    """A mini-batch value already split into its micro-batches (by :func:`split`) and on the stage's
    device: what :class:`executor.runtime.prefetch.StepBatches` hands a stage, split while the stage waited."""


def micro_batches(value: Any, microbatches: int, device: torch.device) -> MicroBatches:
    """``value`` split into ``microbatches`` (:func:`split`), each moved to ``device``."""
    return MicroBatches(map_tensors(lambda t: t.to(device, non_blocking=True), part)
                        for part in split(value, microbatches))


def split(value: Any, microbatches: int) -> list[Any]:
    """``torch.chunk`` of every tensor of ``value`` along rows, each chunk a copy with storage of its own.

    Views would keep the whole batch's storage alive and make the activation counter see the whole
    batch in every micro-batch; with copies a stage holds, and is charged for, exactly the rows of
    the micro-batches in flight, as the simulator assumes. The copy costs one pass over the batch.
    """
    leaves, spec = tree_flatten(value)
    chunks = [[c.clone(memory_format=torch.contiguous_format) for c in torch.chunk(leaf, microbatches, dim=0)]
              if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    count = min((len(c) for c in chunks if c is not None), default=0)
    return [tree_unflatten([c[m] if c is not None else leaf for c, leaf in zip(chunks, leaves)], spec)
            for m in range(count)]
