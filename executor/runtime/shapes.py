"""Check a model against a partition before training, and describe what crosses each boundary.

Every rank runs this (it needs no communication, so a bad model fails the same way everywhere,
before any process group exists), and so does ``gpipe train`` before it starts the ranks, on the
meta device: shapes and dtypes without storage, so no process allocates the model. A dry
forward runs layer by layer in eval mode (so batch norm touches no running statistics) at two row
counts, ``DRY_ROWS``, under the run's autocast (:mod:`executor.runtime.precision`; on fake CPU tensors,
:mod:`executor.models.fake`, since autocast ignores meta ones) so each boundary has the dtype the stages
will exchange; a layer that cannot take the previous layer's output fails with one line naming
both. Comparing the two runs tells, for every tensor at a stage boundary, whether its first
dimension is the rows (split and sent per micro-batch) or its shape is fixed (see
:mod:`executor.runtime.boundary`); autograd, left on, tells which tensors a gradient comes back for.

Limits: a layer must run on meta tensors (no ``.item()``, no shapes that depend on values); a layer
whose output structure depends on the data would break the boundary descriptions (the executor
then stops with the structure it saw).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from executor.models.fake import fake_mode
from executor.runtime.boundary import Boundary, LeafSpec, leaf_paths, map_tensors
from executor.runtime.precision import autocast
from sim.engine.stage_costs import stage_bounds, stage_of_layers
from sim.errors import GpipeInputError
from sim.formats.plan import validate_partition

DRY_ROWS = (2, 3)  # two row counts tell a leaf whose first dimension is the rows from a fixed one


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def take_rows(value: Any, rows: int) -> Any:
    """``rows`` rows of every tensor in ``value``, repeating rows when it has fewer."""
    def take(leaf: torch.Tensor) -> torch.Tensor:
        return leaf.index_select(0, torch.arange(rows, device=leaf.device) % leaf.shape[0])

    return map_tensors(take, value)


def _shape_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(list(value.shape))
    leaves, _ = tree_flatten(value)
    return "(" + ", ".join(str(list(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__
                           for v in leaves) + ")"


def _forward_all(model: nn.Sequential, x: Any, layer_stage: list[int], cuts: set[int],
                 precision: str = "fp32") -> list[Any]:
    """The values at the model input and after every stage (K+1 in all, the model output last)."""
    values = [x]
    for i, layer in enumerate(model):
        try:
            with autocast(precision, "cpu"):
                x = layer(x)
        except Exception as exc:  # any failure here is the model's, reported in one line
            source = "the input" if i == 0 else f"layer {i - 1}'s output"
            if isinstance(exc, NotImplementedError) or "meta" in str(exc):
                raise GpipeInputError(
                    f"layer {i} ({type(layer).__name__}, stage {layer_stage[i]}) cannot run on the meta device, "
                    f"where shapes are checked without allocating the model: {_first_line(exc)}; give it "
                    "shape-only code paths (no .item(), no data-dependent shapes)") from None
            raise GpipeInputError(
                f"layer {i} ({type(layer).__name__}, stage {layer_stage[i]}) fails on {source} "
                f"of shape {_shape_text(x)}: {_first_line(exc)}; fix the model's layer sizes"
            ) from None
        if i + 1 in cuts:
            values.append(x)
    return values


def describe_boundary(small: Any, large: Any, where: str) -> Boundary:
    """The boundary carrying ``small`` (at ``DRY_ROWS[0]`` rows) and ``large`` (at ``DRY_ROWS[1]``)."""
    low, high = DRY_ROWS
    leaves_small, spec = tree_flatten(small)
    leaves_large, spec_large = tree_flatten(large)
    if spec != spec_large:
        raise GpipeInputError(f"{where} changes structure with the rows ({spec} vs {spec_large}); "
                              "return the same tuple or dict whatever the batch")
    specs = []
    for path, a, b in zip(leaf_paths(small), leaves_small, leaves_large):
        name = f"{where}{' at ' + path if path else ''}"
        if not isinstance(a, torch.Tensor):
            raise GpipeInputError(f"{name} is a {type(a).__name__}; only tensors can cross a stage boundary, "
                                  "so make it a tensor or keep the layers that use it on one stage")
        if a.shape == b.shape:
            per_row, tail = False, tuple(a.shape)
        elif a.dim() and a.shape[0] == low and b.shape[0] == high and a.shape[1:] == b.shape[1:]:
            per_row, tail = True, tuple(a.shape[1:])
        else:
            raise GpipeInputError(f"{name} has shape {list(a.shape)} for {low} rows and {list(b.shape)} for "
                                  f"{high}; a tensor crossing a stage must keep the rows first (or a fixed "
                                  "shape) so micro-batches can be split")
        specs.append(LeafSpec(path, tail, a.dtype, per_row,
                              carries_grad=bool(a.requires_grad and (a.is_floating_point() or a.is_complex()))))
    return Boundary(tuple(specs), spec)


def _dry_forwards(model: nn.Sequential, inputs: Any, layer_stage: list[int], cuts: set[int],
                  precision: str) -> list[list[Any]]:
    """One forward per row count of ``DRY_ROWS``, with grad; under autocast on fake CPU tensors
    (a copy of the meta model) when the precision is not fp32."""
    def run(net: nn.Sequential, x: Any) -> list[list[Any]]:
        with torch.enable_grad():
            return [_forward_all(net, take_rows(x, rows), layer_stage, cuts, precision) for rows in DRY_ROWS]

    if precision == "fp32":
        return run(model, inputs)
    with fake_mode(copy.deepcopy(model)) as fake:
        return run(fake, map_tensors(lambda t: torch.empty(t.shape, dtype=t.dtype), inputs))


def dry_run(model: nn.Sequential, partition: tuple[int, ...], inputs: Any, targets: Any,
            loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], precision: str = "fp32") -> list[Boundary]:
    """Validate ``model`` against ``partition``; return the K+1 boundaries (input, cuts, output)."""
    validate_partition(partition, len(model))
    cuts = {end for _, end in stage_bounds(partition)}
    layer_stage = stage_of_layers(partition)
    was_training = model.training
    model.eval()
    try:
        runs = _dry_forwards(model, inputs, layer_stage, cuts, precision)
        names = ["the model's input"] + [f"the output of stage {k} (layer {end - 1})"
                                         for k, (_, end) in enumerate(stage_bounds(partition))]
        boundaries = [describe_boundary(a, b, name) for a, b, name in zip(*runs, names)]
        output, target = runs[0][-1], take_rows(targets, DRY_ROWS[0])
        if not isinstance(output, torch.Tensor):
            raise GpipeInputError(f"the last layer returns {_shape_text(output)}, but the loss takes one tensor; "
                                  "make the last layer return the model's output alone")
        try:
            with torch.no_grad():  # shapes only: a meta stand-in for the (perhaps fake) output
                loss_fn(torch.empty(output.shape, device="meta"), target)
        except Exception as exc:
            raise GpipeInputError(f"the loss cannot compare the model's output of shape {list(output.shape)} "
                                  f"with targets of shape {_shape_text(target)}: {_first_line(exc)}; "
                                  "choose the matching --loss or targets") from None
    finally:
        model.train(was_training)
    return boundaries


def stage_module(model: nn.Sequential, partition: tuple[int, ...], stage: int) -> nn.Sequential:
    """Stage ``stage``'s layers (shared with ``model``, not copied)."""
    start, end = stage_bounds(partition)[stage]
    return model[start:end]
