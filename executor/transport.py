"""How boundary tensors move between neighbouring stages: one small interface, two implementations.

A message is the list of tensors one micro-batch sends across a boundary in one direction (the
leaves of a tuple or dict of tensors, see :mod:`executor.boundary`; usually one tensor). A stage
announces every message it will receive in a step with :meth:`Transport.expect` (in the order its
own schedule consumes them), then takes each with :meth:`Transport.recv`, and hands its outputs to
:meth:`Transport.send`. Channels are ``"act"`` (activations, from stage k-1) and ``"grad"``
(gradients, from stage k+1); the neighbour is implied by the channel.

* :class:`LocalTransport` passes tensors through in-process mailboxes, so the whole pipeline can run
  in one process (tests, debugging) with the same schedule walk.
Once per step, :meth:`Transport.all_reduce_sum` adds a scalar over every stage of the pipeline (the
squared gradient norms that global clipping needs).

* :class:`DistTransport` uses ``torch.distributed`` point-to-point ops. Each boundary gets two
  process groups, one per direction, so on every communicator messages flow one way and in the
  same order on both ends: deadlock-free on NCCL (where a pair's sends and receives share a stream)
  and on gloo. Receives are posted as early as announced, so data lands while the stage computes.
  Each tensor of a message has its own tag (micro-batch x tensors + index), so the tensors of one
  message never match another's receive.
  The sum over stages is one ``all_reduce`` over the pipeline's ranks (every rank of the run).
  Peers on the same host exchange CPU messages through shared memory instead
  (:mod:`executor.shm_transport`), behind the same methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch
import torch.distributed as dist

from executor.shm_transport import Layout, message_sizes

if TYPE_CHECKING:
    from executor.shm_transport import HostLinks

ACT = "act"
GRAD = "grad"


Shapes = Layout  # (shape, dtype) of each tensor of a message


class Transport(Protocol):
    def expect(self, channel: str, microbatch: int, shapes: Shapes) -> None:
        """Announce a message this stage will receive (posting the receives, if the backend can)."""

    def ready(self, channel: str, microbatch: int) -> bool:
        """Whether :meth:`recv` would return without waiting (only the local transport knows)."""

    def recv(self, channel: str, microbatch: int) -> list[torch.Tensor]:
        """The announced message, waiting for it if needed."""

    def send(self, channel: str, microbatch: int, tensors: Sequence[torch.Tensor]) -> None:
        """Send a message: activations to stage k+1 (``act``), gradients to stage k-1 (``grad``)."""

    def finish_step(self) -> None:
        """Wait for this step's sends to complete (their buffers may be freed after)."""

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a scalar on this stage's device) summed over every stage of the pipeline."""


class LocalMailboxes:
    """Shared by the stages of one in-process pipeline: ``(stage, channel, micro-batch) -> tensor``."""

    def __init__(self) -> None:
        self.boxes: dict[tuple[int, str, int], list[torch.Tensor]] = {}

    def endpoint(self, stage: int) -> "LocalTransport":
        return LocalTransport(self, stage)


class LocalTransport:
    """One stage's view of :class:`LocalMailboxes`; tensors are passed by reference, detached."""

    def __init__(self, mailboxes: LocalMailboxes, stage: int) -> None:
        self.mailboxes = mailboxes
        self.stage = stage

    def expect(self, channel: str, microbatch: int, shapes: Shapes) -> None:
        pass

    def ready(self, channel: str, microbatch: int) -> bool:
        return (self.stage, channel, microbatch) in self.mailboxes.boxes

    def recv(self, channel: str, microbatch: int) -> list[torch.Tensor]:
        key = (self.stage, channel, microbatch)
        if key not in self.mailboxes.boxes:
            raise RuntimeError(f"stage {self.stage} has no {channel} for micro-batch {microbatch}: "
                               "the schedule walk is out of order")
        return self.mailboxes.boxes.pop(key)

    def send(self, channel: str, microbatch: int, tensors: Sequence[torch.Tensor]) -> None:
        target = self.stage + 1 if channel == ACT else self.stage - 1
        self.mailboxes.boxes[(target, channel, microbatch)] = [t.detach() for t in tensors]

    def finish_step(self) -> None:
        pass

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("in-process stages do not reduce one by one: LocalPipeline adds the stages' "
                           "values itself between the end-of-step phases")


def boundary_groups(stages: int) -> dict[tuple[int, str], dist.ProcessGroup]:
    """Two groups per boundary b (stages b and b+1): ``(b, "act")`` and ``(b, "grad")``.

    Every rank must call this, in the same order, since ``new_group`` is collective.
    """
    groups = {}
    for b in range(stages - 1):
        for channel in (ACT, GRAD):
            groups[(b, channel)] = dist.new_group([b, b + 1])
    return groups


class DistTransport:
    """Point-to-point over ``torch.distributed``; rank == stage, or ``ranks[stage]`` for one of several
    replicas of the pipeline. Works with gloo and NCCL."""

    def __init__(self, stage: int, groups: dict[tuple[int, str], dist.ProcessGroup],
                 device: torch.device, pipeline_group: dist.ProcessGroup | None = None,
                 ranks: Sequence[int] | None = None, links: "HostLinks | None" = None) -> None:
        self.stage = stage
        self.links = links  # shared-memory links to the ranks of this host (executor.shm_transport)
        # announced, by shared memory: (channel, micro-batch) -> (peer, boundary, shapes, each tensor's bytes)
        self._local: dict[tuple[str, int], tuple[int, int, Shapes, tuple[int, ...]]] = {}
        # global rank of each stage of this pipeline (one of several replicas, executor.replicas); None: rank == stage
        self.ranks = tuple(ranks) if ranks is not None else None
        self.groups = groups
        self.device = device
        self.pipeline_group = pipeline_group  # every stage of this pipeline; None: the whole world
        self._pending: dict[tuple[str, int], list[tuple[dist.Work, torch.Tensor]]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def _peer_and_group(self, channel: str, incoming: bool) -> tuple[int, dist.ProcessGroup, int]:
        """The peer's global rank, the boundary's process group and the boundary's index."""
        # act flows k -> k+1 over boundary k; grad flows k+1 -> k over boundary k.
        if channel == ACT:
            peer = self.stage - 1 if incoming else self.stage + 1
        else:
            peer = self.stage + 1 if incoming else self.stage - 1
        boundary = min(peer, self.stage)
        return (self.ranks[peer] if self.ranks is not None else peer), self.groups[(boundary, channel)], boundary

    def _shared(self, peer: int) -> bool:
        return self.links is not None and self.links.covers(peer)

    def expect(self, channel: str, microbatch: int, shapes: Shapes) -> None:
        peer, group, boundary = self._peer_and_group(channel, incoming=True)
        if self._shared(peer):
            self._local[(channel, microbatch)] = (peer, boundary, shapes, message_sizes(shapes))
            return
        posted = []
        for index, (shape, dtype) in enumerate(shapes):
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            tag = microbatch * len(shapes) + index
            posted.append((dist.irecv(buffer, src=peer, group=group, tag=tag), buffer))
        self._pending[(channel, microbatch)] = posted

    def ready(self, channel: str, microbatch: int) -> bool:
        local = self._local.get((channel, microbatch))
        if local is not None:
            peer, boundary, _, sizes = local
            return self.links.ready(peer, boundary, channel, microbatch, sizes)  # type: ignore[union-attr]
        return all(work.is_completed() for work, _ in self._pending[(channel, microbatch)])

    def recv(self, channel: str, microbatch: int) -> list[torch.Tensor]:
        key = (channel, microbatch)
        if key in self._local:  # the message's tensors in the shared pages, until the step ends
            peer, boundary, shapes, sizes = self._local.pop(key)
            return self.links.take(peer, boundary, channel, microbatch, shapes, sizes)  # type: ignore[union-attr]
        if key not in self._pending:
            raise RuntimeError(f"stage {self.stage} did not expect {channel} of micro-batch {microbatch}")
        buffers = []
        for work, buffer in self._pending.pop(key):
            work.wait()  # on CUDA this makes the current stream wait, not the host
            buffers.append(buffer)
        return buffers

    def send(self, channel: str, microbatch: int, tensors: Sequence[torch.Tensor]) -> None:
        peer, group, boundary = self._peer_and_group(channel, incoming=False)
        if self._shared(peer):
            self.links.send(peer, boundary, channel, microbatch, tensors)  # type: ignore[union-attr]
            return
        for index, tensor in enumerate(tensors):
            tensor = tensor.detach().contiguous()
            tag = microbatch * len(tensors) + index
            self._sends.append((dist.isend(tensor, dst=peer, group=group, tag=tag), tensor))

    def finish_step(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self.links is not None:
            self.links.release()  # this step's received tensors are no longer used
        if self._pending or self._local:
            raise RuntimeError(f"stage {self.stage} ended a step with unreceived tensors "
                               f"{sorted([*self._pending, *self._local])}")

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        total = value.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pipeline_group)
        return total
