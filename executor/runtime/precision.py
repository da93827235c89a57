"""What ``--precision`` means where a stage computes: autocast around the layers, fp32 around the loss.

``fp32`` changes nothing. ``bf16`` runs a stage's layers under ``torch.autocast(device_type,
dtype=torch.bfloat16)`` (CPU or CUDA), in the forward and again in the recompute, so a recomputed
graph is the one the forward would have kept and the gradients are identical. Parameters,
their gradients and the optimizer state stay fp32: autocast casts a weight to bf16 when a matmul
uses it (once per autocast region, a copy the matmul saves for backward) and the gradient flows back
through that cast into the fp32 weight. The loss is computed outside autocast on the output cast to
fp32. Boundary tensors cross stages in the dtype autocast produced (bf16 after a matmul or ReLU,
fp32 after a residual add onto an fp32 stream), and their gradients in the same dtype; the dry run
(:mod:`executor.runtime.shapes`) runs under the same autocast to learn them. See :mod:`sim.workloads.precision` for
the simulator's side of the same definition.

Limits: the dry run computes on the CPU, whose autocast runs a few ops in bf16 that CUDA's runs in
fp32 (layer_norm, softmax, sum, exp, ...); a layer ending in one of them sends fp32 on CUDA where
the dry run expected bf16, which :func:`check_boundary` reports instead of sending mislabelled bytes.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Sequence

import torch

from executor.runtime.boundary import Boundary
from sim.workloads.precision import check_precision

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def autocast(precision: str, device_type: str) -> ContextManager[object]:
    """The context a stage's layers run in at ``precision`` on a ``device_type`` ("cpu", "cuda")."""
    if check_precision(precision) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=TORCH_DTYPES[precision])


def check_boundary(tensors: Sequence[torch.Tensor], boundary: Boundary, stage: int) -> None:
    """Fail clearly when what a stage sends is not the dtype its neighbour allocated for it."""
    for tensor, leaf in zip(tensors, boundary.leaves):
        if tensor.dtype != leaf.dtype:
            where = f" at {leaf.path}" if leaf.path else ""
            raise RuntimeError(f"stage {stage} produced {tensor.dtype} at its boundary{where} where the dry run "
                               f"found {leaf.dtype}; this layer's autocast differs between the CPU and the "
                               "training device (see executor/runtime/precision.py)")
