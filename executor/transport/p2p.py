"""How boundary tensors move between neighbouring stages: one small interface, two implementations.

A message is the list of tensors one micro-batch sends across a boundary in one direction (the
leaves of a tuple or dict of tensors, see :mod:`executor.runtime.boundary`; usually one tensor). A stage
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
  (:mod:`executor.transport.shm_transport`), behind the same methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch
import torch.distributed as dist

from executor.transport.shm_transport import Layout

if TYPE_CHECKING:
    from executor.transport.shm_transport import HostLinks, Link

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
        self.links = links  # shared-memory links to the ranks of this host (executor.transport.shm_transport)
        # by shared memory (executor.transport.shm_transport), (channel, micro-batch) -> its link: the receives
        # announced this step, and every key sent so far (the same each step: found once)
        self._incoming: dict[tuple[str, int], "Link"] = {}
        self._outgoing: dict[tuple[str, int], "Link"] = {}
        # global rank of each stage of this pipeline (one of several replicas, executor.parallel.replicas); None: rank == stage
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
            self._incoming[(channel, microbatch)] = self.links.link(  # type: ignore[union-attr]
                peer, self.links.rank, boundary, channel, microbatch, shapes)  # type: ignore[union-attr]
            return
        posted = []
        for index, (shape, dtype) in enumerate(shapes):
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            tag = microbatch * len(shapes) + index
            posted.append((dist.irecv(buffer, src=peer, group=group, tag=tag), buffer))
        self._pending[(channel, microbatch)] = posted

    def ready(self, channel: str, microbatch: int) -> bool:
        link = self._incoming.get((channel, microbatch))
        if link is not None:
            return link.arrived()
        return all(work.is_completed() for work, _ in self._pending[(channel, microbatch)])

    def recv(self, channel: str, microbatch: int) -> list[torch.Tensor]:
        key = (channel, microbatch)
        link = self._incoming.pop(key, None)
        if link is not None:  # the message's tensors in the shared pages, until the step ends
            return link.take()
        if key not in self._pending:
            raise RuntimeError(f"stage {self.stage} did not expect {channel} of micro-batch {microbatch}")
        buffers = []
        for work, buffer in self._pending.pop(key):
            work.wait()  # on CUDA this makes the current stream wait, not the host
            buffers.append(buffer)
        return buffers

    def send(self, channel: str, microbatch: int, tensors: Sequence[torch.Tensor]) -> None:
        link = self._outgoing.get((channel, microbatch))
        if link is not None and link.fits(tensors):
            link.send(tensors)
            return
        peer, group, boundary = self._peer_and_group(channel, incoming=False)
        if self._shared(peer):
            link = self._outgoing[(channel, microbatch)] = self.links.link(  # type: ignore[union-attr]
                self.links.rank, peer, boundary, channel, microbatch,  # type: ignore[union-attr]
                [(tuple(t.shape), t.dtype) for t in tensors])
            link.send(tensors)
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
        if self._pending or self._incoming:
            raise RuntimeError(f"stage {self.stage} ended a step with unreceived tensors "
                               f"{sorted([*self._pending, *self._incoming])}")

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        total = value.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pipeline_group)
        return total
