"""Sharding pieces that know no model: fused projections put in rank order, and the styles that split
a transformers ``Conv1D`` (GPT-2's projections) by columns or rows.

A fused projection ([q | k | v] rows, [gate | value] rows, GPT-2's [q | k | v] columns) split
contiguously would give rank 0 all of q; :func:`features_in_rank_order` permutes its output features
so that each rank's contiguous share holds its own part of every segment, and marks the module with
the permutation (:data:`ROW_ORDER`, :data:`ORDER_DIMS`) so that checkpoints can undo it
(:mod:`executor.parallel.tensor_parallel`). ``Conv1D`` stores its weight (in, out) and computes x @ W + b,
which torch's ``ColwiseParallel``/``RowwiseParallel`` do not know: :class:`Conv1DColwise` and
:class:`Conv1DRowwise` shard it along the other dimension and keep torch's input and output handling.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

ROW_ORDER = "_gpipe_tp_row_order"  # on a column-parallel linear whose fused rows were put in rank order
ORDER_DIMS = "_gpipe_tp_order_dims"  # tensor name -> the dimension ROW_ORDER indexes (default 0: rows)


def rank_order(sizes: list[int], parts: int) -> torch.Tensor:
    """The row order that makes a contiguous split in ``parts`` give each part its share of every
    segment of a fused projection whose segments have ``sizes`` rows."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.tensor([start + part * (size // parts) + row
                         for part in range(parts) for start, size in zip(starts, sizes)
                         for row in range(size // parts)], dtype=torch.long)


def features_in_rank_order(linear: nn.Module, sizes: list[int], parts: int, weight_dim: int = 0) -> None:
    """Put the output features of a fused projection in rank order: a linear's weight rows, or with
    ``weight_dim`` 1 a Conv1D's weight columns (and the bias's entries either way)."""
    order = rank_order(sizes, parts)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.index_select(weight_dim, order))
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])
    setattr(linear, ROW_ORDER, order)
    setattr(linear, ORDER_DIMS, {"weight": weight_dim, "bias": 0})


def _distribute_parameters(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Any], src_data_rank: Any) -> None:
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if param is not None:
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
                requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """``ColwiseParallel`` for a transformers ``Conv1D`` (x @ W + b, W stored (in, out)): its output
    features are W's columns, so W is split along dim 1 and the bias along dim 0; inputs and outputs
    as torch's style handles them for a linear."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
            if sub is module:
                _distribute_parameters(sub, mesh, {"weight": Shard(1), "bias": Shard(0)},
                                       getattr(self, "src_data_rank", 0))
        return distribute_module(module, device_mesh, partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """``RowwiseParallel`` for a transformers ``Conv1D``: W split along its rows (dim 0, the input
    features), the bias replicated and added once to the all-reduced sum."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
            if sub is module:
                _distribute_parameters(sub, mesh, {"weight": Shard(0), "bias": Replicate()},
                                       getattr(self, "src_data_rank", 0))
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
