"""Check a model against a partition before training, and find the boundary tensors' shapes.

Every rank runs this (it needs no communication, so a bad model fails the same way everywhere,
before any process group exists), and so does ``gpipe train`` before it starts torchrun. A dry
forward of at most two rows runs layer by layer in eval mode without gradients (eval so batch norm
touches no running statistics), under the run's autocast (:mod:`executor.precision`) so each
boundary has the dtype the stages will exchange; a layer that cannot take the previous layer's
output fails with one line naming both. The rows dimension must come first and pass through every
layer unchanged, since micro-batches are split along it; the shapes after it are what stages
exchange.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from executor.precision import autocast
from executor.stage import Boundary
from sim.errors import GpipeInputError
from sim.plan import validate_partition


def stage_bounds(partition: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """``[(first layer, end layer)]`` per stage."""
    bounds, start = [], 0
    for count in partition:
        bounds.append((start, start + count))
        start += count
    return bounds


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def dry_run(model: nn.Sequential, partition: tuple[int, ...], inputs: torch.Tensor, targets: torch.Tensor,
            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            precision: str = "fp32") -> list[Boundary]:
    """Validate ``model`` against ``partition``; return the K+1 boundaries (input, cuts, output)."""
    validate_partition(partition, len(model))
    rows = min(2, inputs.shape[0])
    x, t = inputs[:rows], targets[:rows]
    boundaries = [Boundary(tuple(x.shape[1:]), x.dtype)]
    ends = {end for _, end in stage_bounds(partition)}
    layer_stage = [k for k, count in enumerate(partition) for _ in range(count)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i, layer in enumerate(model):
                before = tuple(x.shape)
                try:
                    with autocast(precision, x.device.type):
                        x = layer(x)
                except Exception as exc:  # any failure here is the model's, reported in one line
                    source = "the input" if i == 0 else f"layer {i - 1}'s output"
                    raise GpipeInputError(
                        f"layer {i} ({type(layer).__name__}, stage {layer_stage[i]}) fails on {source} "
                        f"of shape {list(before)}: {_first_line(exc)}; fix the model's layer sizes"
                    ) from None
                if not isinstance(x, torch.Tensor):
                    raise GpipeInputError(f"layer {i} ({type(layer).__name__}) returns "
                                          f"{type(x).__name__}; pipeline layers must return one tensor")
                if x.dim() == 0 or x.shape[0] != rows:
                    raise GpipeInputError(f"layer {i} ({type(layer).__name__}) changes the rows dimension "
                                          f"({list(before)} -> {list(x.shape)}); the first dimension must "
                                          "stay the batch so micro-batches can be split")
                if i + 1 in ends:
                    boundaries.append(Boundary(tuple(x.shape[1:]), x.dtype))
            try:
                loss_fn(x.float(), t)
            except Exception as exc:
                raise GpipeInputError(f"the loss cannot compare the model's output of shape {list(x.shape)} "
                                      f"with targets of shape {list(t.shape)}: {_first_line(exc)}; "
                                      "choose the matching --loss or targets") from None
    finally:
        model.train(was_training)
    return boundaries


def stage_module(model: nn.Sequential, partition: tuple[int, ...], stage: int) -> nn.Sequential:
    """Stage ``stage``'s layers (shared with ``model``, not copied)."""
    start, end = stage_bounds(partition)[stage]
    return model[start:end]
