"""Exact count of the activation memory a stage holds: saved-for-backward tensors plus its stash.

What is counted (the same quantity the simulator predicts as activation memory): the union, over the
micro-batches whose backward has not finished, of
  * every tensor autograd saves for backward during a forward run with gradients enabled (a
    ``never`` forward, or a recompute), seen through ``torch.autograd.graph.saved_tensors_hooks``;
  * the stage's stashed boundary input of that micro-batch.
Tensors are counted by storage: a storage saved several times (a ReLU output that the next Linear
also saves, or a stash that the first layer saves) counts once, with its full ``nbytes``. The
stage's parameters and buffers are excluded (they are weights, not activations). Not counted:
gradients, optimizer state, temporaries freed inside a layer, and the output being sent.

The peak is sampled after every forward and recompute (when a micro-batch's saved set is largest)
and after every backward; it is exact for what it counts, not an allocator figure.

Limits: under ZeRO-2/3 (FSDP2) a layer's saved weight is the unit's gathered parameter, not the
module's (sharded) one, so it is counted as an activation, at whatever size its storage has when the
peak is sampled (FSDP frees it after the forward under ZeRO-3): the count is not exact there, and
``gpipe validate`` compares those runs' sharded bytes, not their activations.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from executor.runtime.boundary import tensors


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``tensor``'s data in this process: a DTensor's shard, a pending
    collective's result, or ``tensor`` itself."""
    while type(tensor) is not torch.Tensor and is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, names[0])
    return tensor


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage that holds ``tensor``'s data in this process."""
    storage = local_tensor(tensor).untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class ActivationCounter:
    """Tracks saved and stashed storages per micro-batch; ``peak_bytes`` is the largest union seen.

    The union's total is kept as entries come and go, so a sample (after every action) costs the same
    however many micro-batches are held. A storage address two entries hold (freed by one micro-batch's
    input-gradient pass, then reused by another's forward) counts once, at the size the entry added
    to the count last holds: what a union of the entries' tables, taken in that order, gives."""

    def __init__(self, excluded: list[torch.Tensor]) -> None:
        self._excluded = {storage_key(t)[0] for t in excluded}
        # micro-batch (or (micro-batch, tag): a layer's input or recompute under --checkpoint full)
        # -> {storage ptr: nbytes}
        self._live: dict[Any, dict[int, int]] = {}
        self._order: dict[Any, int] = {}  # entry -> when it joined _live (a later one's size wins)
        self._joined = 0
        self._holders: dict[int, dict[Any, int]] = {}  # storage ptr -> {entry: nbytes}
        self.peak_bytes = 0
        self.current_bytes = 0  # bytes of the distinct storages held now

    def exclude(self, tensors: list[torch.Tensor]) -> None:
        """Count ``tensors`` as parameters from now on, never as activations (FSDP's gathered
        parameters, whose storages come and go: :mod:`executor.parallel.fully_sharded`)."""
        self._excluded.update(storage_key(t)[0] for t in tensors)

    def _size(self, ptr: int) -> int:
        """The bytes ``ptr`` counts for: its size in the latest entry that holds it (0: none)."""
        holders = self._holders.get(ptr)
        if not holders:
            return 0
        if len(holders) == 1:
            return next(iter(holders.values()))
        return holders[max(holders, key=self._order.__getitem__)]

    def _add(self, microbatch: Any, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        ptr, nbytes = storage_key(tensor)
        if not ptr or ptr in self._excluded:
            return
        held = self._live.get(microbatch)
        if held is None:
            held = self._live[microbatch] = {}
            self._order[microbatch] = self._joined
            self._joined += 1
        before = self._size(ptr)
        held[ptr] = nbytes
        self._holders.setdefault(ptr, {})[microbatch] = nbytes
        self.current_bytes += self._size(ptr) - before

    def stash(self, microbatch: int, value: Any) -> None:
        """The boundary input of ``microbatch`` (a tensor, or a tuple, list or dict of them) is held
        until its backward."""
        for tensor in tensors(value):
            self._add(microbatch, tensor)

    @contextlib.contextmanager
    def saving(self, microbatch: int) -> Iterator[None]:
        """Count what autograd saves for backward inside this block as held by ``microbatch``."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self._add(microbatch, tensor)
            # Detached (same storage and version counter): a saved output kept with its grad_fn would be
            # a reference cycle through its own node, which a graph kept for a later W never breaks.
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def release(self, microbatch: int) -> None:
        """``microbatch``'s backward is done: its saved tensors and stash are freed."""
        held = self._live.pop(microbatch, None)
        if held is None:
            return
        for ptr in held:
            before = self._size(ptr)
            holders = self._holders[ptr]
            del holders[microbatch]
            if not holders:
                del self._holders[ptr]
            self.current_bytes += self._size(ptr) - before
        del self._order[microbatch]

    def sample(self) -> int:
        """Bytes held now (distinct storages), updating the peak."""
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        return self.current_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
