"""How boundary tensors move between neighbouring stages: one small interface, its implementations.

A message is the list of tensors one micro-batch sends across a boundary in one direction (the
leaves of a tuple or dict of tensors, see :mod:`executor.runtime.boundary`; usually one tensor). A stage
announces every message it will receive in a step with :meth:`Transport.expect` (in the order its
own schedule consumes them), then takes each with :meth:`Transport.recv`, and hands its outputs to
:meth:`Transport.send`. Channels are ``"act"`` (activations, from stage k-1) and ``"grad"``
(gradients, from stage k+1); the neighbour is implied by the channel (:class:`Peers`). Once per
step, :meth:`Transport.all_reduce_sum` adds a scalar over every stage of the pipeline (the squared
gradient norms that global clipping needs).

* :class:`LocalTransport` passes tensors through in-process mailboxes, so the whole pipeline can run
  in one process (tests, debugging) with the same schedule walk.
* :class:`DistTransport` uses ``torch.distributed`` point-to-point ops (gloo or NCCL). Each boundary
  gets two process groups, one per direction, so on every communicator messages flow one way and in
  the same order on both ends: deadlock-free on NCCL (where a pair's sends and receives share a
  stream) and on gloo. Receives are posted as early as announced, so data lands while the stage
  computes. Each tensor of a message has its own tag (micro-batch x tensors + index), so the
  tensors of one message never match another's receive. The sum over stages is one ``all_reduce``
  over the pipeline's ranks (every rank of the run).
* :class:`executor.transport.shm_p2p.SharedMemoryTransport` hands CPU messages to peers on the same
  host through shared memory (:mod:`executor.transport.shm_transport`).

Which one a stage uses, for each neighbour, is chosen once when the stage is set up
(:func:`executor.transport.stage_transport.stage_transport`); no call asks again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from executor.transport.shm_transport import Layout

if TYPE_CHECKING:
    from executor.transport.shm_transport import HostLinks

ACT = "act"
GRAD = "grad"
DIRECTIONS = ((ACT, True), (ACT, False), (GRAD, True), (GRAD, False))  # (channel, incoming)


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


class Peers:
    """Where one stage's messages go: for each channel and direction, the neighbouring (virtual)
    stage, its process's global rank and the boundary between them.

    ``stage`` is the stage's index among ``stages``; ``position(s)`` the pipeline position (device) of
    stage s (itself, unless several chunks share a device); ``ranks[position]`` its global rank (one of
    several replicas, :mod:`executor.parallel.replicas`; None: rank == position). ``groups`` holds
    two process groups per boundary between two processes, one per direction (:func:`boundary_groups`)."""

    def __init__(self, stage: int, stages: int, groups: dict[tuple[int, str], dist.ProcessGroup],
                 ranks: Sequence[int] | None = None, position: Callable[[int], int] | None = None) -> None:
        self.stage, self.stages, self.groups = stage, stages, groups
        self.ranks = tuple(ranks) if ranks is not None else None
        self.position = position if position is not None else (lambda s: s)

    def stage_of(self, channel: str, incoming: bool) -> int:
        """The neighbouring stage: act flows s -> s+1 over boundary s, grad s+1 -> s over boundary s."""
        if channel == ACT:
            return self.stage - 1 if incoming else self.stage + 1
        return self.stage + 1 if incoming else self.stage - 1

    def exists(self, channel: str, incoming: bool) -> bool:
        return 0 <= self.stage_of(channel, incoming) < self.stages

    def rank(self, channel: str, incoming: bool) -> int:
        """The neighbour's global rank."""
        position = self.position(self.stage_of(channel, incoming))
        return self.ranks[position] if self.ranks is not None else position

    def boundary(self, channel: str, incoming: bool) -> int:
        return min(self.stage_of(channel, incoming), self.stage)

    def group(self, channel: str, incoming: bool) -> dist.ProcessGroup:
        """The process group of the boundary's direction ``channel`` flows in."""
        return self.groups[(self.boundary(channel, incoming), channel)]


def pipeline_sum(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``value`` summed over the pipeline's ranks (``group``; None: the whole world)."""
    total = value.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


class DistTransport:
    """Point-to-point over ``torch.distributed`` (gloo or NCCL) to the neighbours of ``peers``.

    ``links``, this process's shared-memory links to its host's ranks where it has them, are not
    used here: the stage's data-parallel gradient sum takes them (:mod:`executor.parallel.replicas`)."""

    def __init__(self, peers: Peers, device: torch.device, pipeline_group: dist.ProcessGroup | None = None,
                 links: "HostLinks | None" = None) -> None:
        self.peers = peers
        self.stage = peers.stage
        self.device = device
        self.pipeline_group = pipeline_group  # every stage of this pipeline; None: the whole world
        self.links = links
        self._pending: dict[tuple[str, int], list[tuple[dist.Work, torch.Tensor]]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def expect(self, channel: str, microbatch: int, shapes: Shapes) -> None:
        peer, group = self.peers.rank(channel, True), self.peers.group(channel, True)
        posted = []
        for index, (shape, dtype) in enumerate(shapes):
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            tag = microbatch * len(shapes) + index
            posted.append((dist.irecv(buffer, src=peer, group=group, tag=tag), buffer))
        self._pending[(channel, microbatch)] = posted

    def ready(self, channel: str, microbatch: int) -> bool:
        return all(work.is_completed() for work, _ in self._pending[(channel, microbatch)])

    def recv(self, channel: str, microbatch: int) -> list[torch.Tensor]:
        key = (channel, microbatch)
        if key not in self._pending:
            raise RuntimeError(f"stage {self.stage} did not expect {channel} of micro-batch {microbatch}")
        buffers = []
        for work, buffer in self._pending.pop(key):
            work.wait()  # on CUDA this makes the current stream wait, not the host
            buffers.append(buffer)
        return buffers

    def send(self, channel: str, microbatch: int, tensors: Sequence[torch.Tensor]) -> None:
        peer, group = self.peers.rank(channel, False), self.peers.group(channel, False)
        for index, tensor in enumerate(tensors):
            tensor = tensor.detach().contiguous()
            tag = microbatch * len(tensors) + index
            self._sends.append((dist.isend(tensor, dst=peer, group=group, tag=tag), tensor))

    def finish_step(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self._pending:
            raise RuntimeError(f"stage {self.stage} ended a step with unreceived tensors {sorted(self._pending)}")

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return pipeline_sum(value, self.pipeline_group)
