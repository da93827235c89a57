"""The data-parallel gradient sum among ranks of one host through shared memory instead of gloo's TCP.

Why: two replicas of an 8 x 1024 MLP on this project's 2-core VM spent 56 ms of a 183-ms step
averaging 32 MiB of gradients over gloo (``benchmarks/README.md``): gathering them into buckets,
gloo's ring over loopback TCP (each byte copied through both kernels' socket buffers, by gloo's
threads on the cores the ranks compute on), and copying the result back. Ranks of one host can
instead each write their gradients once into shared pages and read the others' where they lie.

How: one file per bucket (consecutive gradients of one dtype) in the run's shared directory (the
pipeline messages' :data:`~executor.transport.shm_transport.SHM_DIR_ENV`), made by the group's first rank at
the first step and reserved whole (``posix_fallocate``): a header with each rank's arrival count
(one cache line each), then D input regions, one per rank, and one output region. Once every rank
has mapped it (after the first sum) its name is removed, so nothing is left behind however the run
ends; the pages go with the last mapping. Files are named by the order a process makes its sums in,
which its peers share (they build the same stages in the same order).

1. :meth:`SharedSum.launch`, after the rank's last backward: it writes ``weight x`` its gradients
   into its own input region (the one pass the bucket's ``torch.cat`` and scaling made before) and
   marks its arrival.
2. :meth:`SharedSum.finish`, when the step needs the gradients: once every rank has arrived, each
   sums its 1/D of the elements over the D input regions, in rank order, into the output region,
   marks a second arrival, and once every rank has done so copies the whole output into its
   gradients. Each element is summed once, by one rank, in one order, so every replica gets the
   same bits; with D = 2 they are the bits gloo gives (one addition, which is commutative).

Why two arrivals a step suffice: a rank writes its input region again only after the next step's
launch, which follows this step's second arrival of every rank (so nobody still reads it); it writes
its part of the output only after every rank's first arrival of the next step (so nobody still
copies this step's out). A waiting rank polls, then sleeps on its socket and is rung by the ranks
that arrive (:meth:`executor.transport.shm_transport.HostLinks.wait_until`), at most the run's timeout.

Limits: ranks of one host only, each with a core of its own (where
:func:`~executor.transport.shm_transport.host_links` makes links; elsewhere gloo or NCCL sums, as before);
the file holds D + 1 copies of the stage's
gradients in shared memory for the run; the sum is in the gradients' dtype, as gloo's; a gradient
that is None on a step leaves its slots untouched (every replica leaves out the same ones); x86's
store order is what makes a rank's arrival visible only after its writes (as for the messages).
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
from typing import Sequence

import torch

from executor.transport.shm_transport import ALIGN_BYTES, HostLinks, map_file

ARRIVAL_STRIDE = ALIGN_BYTES // 8  # int64s between two ranks' arrival counts: one cache line each


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def share_bounds(numel: int, parties: int, index: int) -> tuple[int, int]:
    """Elements ``[start, end)`` that rank ``index`` of ``parties`` sums: contiguous, in cache-line
    multiples (16 fp32) so two ranks never write one line, the last taking the remainder."""
    per_line = 16
    lines = -(-numel // per_line)
    start = min(numel, (lines * index // parties) * per_line)
    end = numel if index == parties - 1 else min(numel, (lines * (index + 1) // parties) * per_line)
    return start, end


class SharedSum:
    """One bucket's weighted sum over ``ranks`` (global ranks, all covered by ``links``), this rank's end.

    ``shapes`` are the bucket's gradients' shapes, in order: the layout is fixed for the run; a
    gradient that is None on a step is neither written nor read back."""

    def __init__(self, links: HostLinks, ranks: Sequence[int], shapes: Sequence[tuple[int, ...]],
                 dtype: torch.dtype, name: str) -> None:
        self.links = links
        self.ranks = list(ranks)
        self.index = self.ranks.index(links.rank)
        self.dtype = dtype
        self.numels = [math.prod(shape) for shape in shapes]
        self.offsets = [0, *itertools.accumulate(self.numels)][:-1]
        self.numel = sum(self.numels)
        # the n-th sum this rank made: a process may run several (calibration runs one configuration
        # after another in one launch), and its peers make theirs in the same order
        ranks_text = "-".join(map(str, self.ranks))
        dtype_text = str(dtype).replace("torch.", "")
        self.path = os.path.join(links.directory, f"allreduce-{next(links.sums_made)}-{ranks_text}-{name}-"
                                                  f"{dtype_text}-{self.numel}")
        self.generation = 0  # steps summed so far
        self.inputs: list[torch.Tensor] = []
        self.output: torch.Tensor | None = None
        self.arrivals: memoryview | None = None
        self._map: mmap.mmap | None = None

    @property
    def region_bytes(self) -> int:
        return _padded(self.numel * self.dtype.itemsize)

    def _mapped(self) -> None:
        if self._map is not None:
            return
        parties = len(self.ranks)
        header = _padded(parties * ALIGN_BYTES)
        size = header + (parties + 1) * self.region_bytes
        if self.index != 0:  # the group's first rank makes it
            self.links.wait_until(lambda: os.path.exists(self.path),
                                  lambda: f"rank {self.ranks[0]} made no gradient-sum file")
        self._map = map_file(self.path, size, self.index == 0, f"the {size}-byte gradient sum")
        self.arrivals = memoryview(self._map)[:header].cast("q")
        regions = [torch.frombuffer(self._map, dtype=self.dtype, count=self.numel,
                                    offset=header + i * self.region_bytes)
                   if self.numel else torch.empty(0, dtype=self.dtype) for i in range(parties + 1)]
        self.inputs, self.output = regions[:parties], regions[parties]

    def _arrive(self, count: int) -> None:
        assert self.arrivals is not None
        self.arrivals[self.index * ARRIVAL_STRIDE] = count  # after this rank's writes (x86 keeps stores in order)
        for rank in self.ranks:
            if rank != self.links.rank:
                self.links.ring(rank)

    def _wait_all(self, count: int) -> None:
        arrivals = self.arrivals
        assert arrivals is not None
        stride, parties = ARRIVAL_STRIDE, len(self.ranks)

        def everyone() -> bool:
            return all(arrivals[i * stride] >= count for i in range(parties))

        def missing() -> str:
            late = [self.ranks[i] for i in range(parties) if arrivals[i * stride] < count]
            return f"ranks {late} did not reach the data-parallel gradient sum of their step"

        if not everyone():
            self.links.wait_until(everyone, missing)

    def launch(self, grads: Sequence[torch.Tensor | None], weight: float) -> None:
        """Write ``weight x grads`` (in the layout's order; None where a gradient is absent this step)
        into this rank's input region and arrive; returns without waiting for anyone."""
        self._mapped()
        region = self.inputs[self.index]
        with torch.no_grad():
            for grad, offset, numel in zip(grads, self.offsets, self.numels):
                if grad is not None:
                    torch.mul(grad.reshape(-1), weight, out=region[offset:offset + numel])
        self.generation += 1
        self._arrive(2 * self.generation - 1)

    def finish(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Sum this rank's share once every rank has launched, then copy the whole sum into ``grads``
        once every rank has summed its share."""
        assert self.output is not None
        self._wait_all(2 * self.generation - 1)
        start, end = share_bounds(self.numel, len(self.ranks), self.index)
        with torch.no_grad():
            if end > start:
                out = self.output[start:end]
                if len(self.inputs) == 1:
                    out.copy_(self.inputs[0][start:end])
                else:
                    torch.add(self.inputs[0][start:end], self.inputs[1][start:end], out=out)
                for region in self.inputs[2:]:
                    out.add_(region[start:end])
            self._arrive(2 * self.generation)
            self._wait_all(2 * self.generation)
            if self.generation == 1 and self.index == 0:
                os.unlink(self.path)  # every rank has it mapped: its pages go when the last one unmaps
            for grad, offset, numel in zip(grads, self.offsets, self.numels):
                if grad is not None:
                    grad.copy_(self.output[offset:offset + numel].view_as(grad))
