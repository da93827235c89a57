"""The weighted sum of one stage's gradients over its data-parallel group: asynchronous, in buckets.

Each replica scales its gradients by its share of the global batch (rows_d / B) and the group sums
them, so the sum is the gradient of one process's mean loss over the whole batch, uneven splits
included. Over the process group's backend in buckets of at most :data:`BUCKET_BYTES` (DDP's
``bucket_cap_mb`` default), or through shared memory where every rank of the group is on this host
(:mod:`executor.transport.shm_allreduce`). Where a model routes tokens to experts, a replica may lack
an expert's gradient that another has: the replicas first agree on which gradients exist.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from executor.models.loaded_types import is_dtensor
from executor.runtime.recording import Recorder
from executor.transport.shm_allreduce import SharedSum
from executor.transport.shm_transport import HostLinks
from sim.formats.timeline import DP_ALLREDUCE

BUCKET_BYTES = 25 * 2**20  # largest all-reduce message, as DDP's bucket_cap_mb default


class GradientAverage:
    """The weighted sum of one stage's gradients over its dp group: asynchronous, in buckets.

    :meth:`launch` after the stage's last backward of a step, :meth:`wait` before anything reads
    the gradients. Buckets hold consecutive gradients of one dtype, at most ``bucket_bytes`` each
    (a larger gradient is a bucket of its own); through shared memory (``links`` covering the
    group), a bucket per run of one dtype, whatever its size. The span
    :data:`~sim.formats.timeline.DP_ALLREDUCE` runs from the launch to the end of the wait: on the host's
    clock, the time the all-reduce was in flight, bounded above by when the stage came to wait for it.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup, weight: float,
                 recorder: Recorder, bucket_bytes: int = BUCKET_BYTES, links: HostLinks | None = None,
                 sparse: bool = False) -> None:
        self.params = list(params)
        # some gradients may be absent on some replicas (a routed expert no row of this replica reached)
        self.sparse = sparse
        self.group = group
        self.weight = weight
        self.recorder = recorder
        self.bucket_bytes = bucket_bytes
        self._pending: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
        self._close: Callable[[], None] | None = None
        # another sum launched and awaited with this one (expert parallelism: the experts' over their replicas)
        self.also: GradientAverage | None = None
        # ranks of one host, each with a core: the sum goes through shared memory, a bucket per dtype
        ranks = dist.get_process_group_ranks(group)
        self._shared: list[tuple[SharedSum, list[int]]] = []
        if links is not None and all(r == links.rank or links.covers(r) for r in ranks):
            locals_ = [local_tensor(p) for p in self.params]
            for number, bucket in enumerate(self.buckets(list(range(len(locals_))), locals_, math.inf)):
                shapes = [tuple(locals_[i].shape) for i in bucket]
                self._shared.append((SharedSum(links, ranks, shapes, locals_[bucket[0]].dtype, str(number)), bucket))

    @property
    def through_shared_memory(self) -> bool:
        """Whether the sum goes through shared memory (:mod:`executor.transport.shm_allreduce`) rather than the
        process group's backend."""
        return bool(self._shared)

    def buckets(self, items: list, tensors: Sequence[torch.Tensor], bucket_bytes: float | None = None) -> list[list]:
        """``items`` (one per tensor) in buckets of consecutive tensors of one dtype, at most
        ``bucket_bytes`` each (default :attr:`bucket_bytes`; a larger tensor is a bucket of its own)."""
        cap = self.bucket_bytes if bucket_bytes is None else bucket_bytes
        result: list[list] = []
        size, dtype = 0, None
        for item, tensor in zip(items, tensors):
            nbytes = tensor.numel() * tensor.element_size()
            if not result or tensor.dtype != dtype or size + nbytes > cap:
                result.append([])
                size, dtype = 0, tensor.dtype
            result[-1].append(item)
            size += nbytes
        return result

    def launch(self) -> None:
        self._close = self.recorder.open_span(DP_ALLREDUCE)  # one span, with the experts' sum (also)
        self._start()
        if self.also is not None:
            self.also._start()

    def _agree_on_absent(self) -> None:
        """Every replica sums the same gradients: one absent here but present on another replica is
        taken as zero; one absent on every replica stays absent, so the optimizer skips it as one
        process would (a routed expert no row of the batch reached)."""
        present = torch.tensor([float(p.grad is not None) for p in self.params])
        dist.all_reduce(present, op=dist.ReduceOp.SUM, group=self.group)
        for param, count in zip(self.params, present.tolist()):
            if count > 0 and param.grad is None:
                param.grad = torch.zeros_like(param)

    def _start(self) -> None:
        if self.sparse:
            self._agree_on_absent()
        if self._shared:
            for shared_sum, indices in self._shared:
                shared_sum.launch([_local_grad(self.params[i]) for i in indices], self.weight)
            return
        # a tensor-parallel gradient's shard: the same shard on every replica of this stage's rank t
        grads = [_local_grad(p) for p in self.params if p.grad is not None]
        for bucket in self.buckets(grads, grads):
            flat = torch.cat([g.reshape(-1) for g in bucket]).mul_(self.weight)
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._pending.append((work, flat, bucket))  # type: ignore[arg-type]

    def wait(self) -> None:
        self._finish()
        if self.also is not None:
            self.also._finish()
        if self._close is not None:
            self._close()
            self._close = None

    def _finish(self) -> None:
        for shared_sum, indices in self._shared:
            shared_sum.finish([_local_grad(self.params[i]) for i in indices])
        for work, flat, bucket in self._pending:
            work.wait()
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._pending.clear()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel tensor's shard on this rank (the same shard on every replica of its rank t),
    or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    return None if param.grad is None else local_tensor(param.grad)
