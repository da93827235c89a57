"""What crosses a stage boundary: a tensor, or a tuple, list or dict of tensors, described by a dry run.

Layers take one value and return one value, as ``nn.Sequential`` chains them; the value may be a
tensor or a (nested) tuple, list or dict of tensors, so a block can hand the next one its hidden
states with an attention mask, position ids or rotary tables. At a boundary the value is flattened
to its tensor leaves (``torch.utils._pytree``), each leaf is sent as a tensor of its own, and the
receiver rebuilds the same structure.

Each leaf is either

* per row: its first dimension is the micro-batch's rows and the rest is fixed (hidden states, a
  (rows, seq) attention mask); or
* fixed: the same shape whatever the rows (rotary tables, a causal mask); it is sent with every
  micro-batch, since the receiver cannot know it is the same each time.

The dry run tells them apart by running the model at two row counts (:mod:`executor.runtime.shapes`). A
gradient flows back for every leaf that required grad on the sending side in the dry run (floating
point and computed from parameters or from an input that needs a gradient); integer leaves and leaves
computed from constants alone carry none. Non-tensor leaves (None, numbers, strings) cannot cross a
boundary: the receiver would have to trust that they are the same for every micro-batch, so they
are refused with one line. Inside a stage anything may pass between layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Sequence

import torch
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten


@dataclass(frozen=True)
class LeafSpec:
    """One tensor of a boundary: its shape (after the rows if ``per_row``), dtype and gradient."""

    path: str  # where it sits in the value, for error messages: "", "[0]", "['mask']"
    tail: tuple[int, ...]
    dtype: torch.dtype
    per_row: bool
    carries_grad: bool

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows, *self.tail) if self.per_row else self.tail


@dataclass(frozen=True)
class Boundary:
    """The value crossing one boundary: its leaves and how to rebuild the structure from them."""

    leaves: tuple[LeafSpec, ...]
    spec: TreeSpec

    # Asked of every message a stage sends or receives: found once (a frozen dataclass's cached_property
    # writes the instance's __dict__, not through __setattr__)
    @cached_property
    def has_grad(self) -> bool:
        return any(leaf.carries_grad for leaf in self.leaves)

    @cached_property
    def grad_indices(self) -> list[int]:
        """Positions of the leaves a gradient comes back for, in leaf order."""
        return [i for i, leaf in enumerate(self.leaves) if leaf.carries_grad]

    @cached_property
    def _one_tensor(self) -> bool:
        """The value is a tensor itself, not a container of them."""
        return self.spec.is_leaf()

    def shapes(self, rows: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(leaf.shape(rows), leaf.dtype) for leaf in self.leaves]

    def grad_shapes(self, rows: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(self.leaves[i].shape(rows), self.leaves[i].dtype) for i in self.grad_indices]

    def flatten(self, value: Any) -> list[torch.Tensor]:
        if self._one_tensor and isinstance(value, torch.Tensor):
            return [value]
        leaves, spec = tree_flatten(value)
        if spec != self.spec:
            raise RuntimeError(f"a stage produced a value of structure {spec}, not the {self.spec} the "
                               "dry run saw; layers must return the same structure for every micro-batch")
        return leaves

    def unflatten(self, leaves: Sequence[torch.Tensor]) -> Any:
        return tree_unflatten(list(leaves), self.spec)

    def bytes(self, rows: int) -> int:
        """Bytes sent forward for a micro-batch of ``rows``."""
        return sum(_numel(leaf.shape(rows)) * _itemsize(leaf.dtype) for leaf in self.leaves)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def leaf_paths(value: Any) -> list[str]:
    """A readable path for every leaf of ``value``, in flattening order ("" for a bare tensor)."""
    return [keystr(path) for path, _ in tree_flatten_with_path(value)[0]]


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``value``."""
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def map_tensors(fn, value: Any) -> Any:
    """``value`` with ``fn`` applied to each tensor leaf (other leaves kept)."""
    return tree_map(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, value)
