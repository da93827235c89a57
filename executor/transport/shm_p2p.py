"""Boundary messages to neighbours on the same host through shared memory: a transport of its own.

The same interface as :class:`executor.transport.p2p.DistTransport` (:class:`executor.transport.p2p.Transport`),
over the host's shared-memory links (:mod:`executor.transport.shm_transport`: why, and how a message
lies in shared pages). A stage uses it for a neighbour whose rank gathered the same host and run
directory at set-up, where the host has a core for every rank
(:func:`executor.transport.stage_transport.stage_transport` chooses, once).

Each message key is found once and kept (:class:`executor.transport.shm_transport.Link`): a received
message's tensors are the shared pages themselves, the stage's until the end of its step
(:meth:`finish_step` releases them); a sent one is copied into the key's next slot. A message of
other shapes under the same key (a last micro-batch of fewer rows) is a key of its own.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from executor.transport.p2p import Peers, Shapes, pipeline_sum
from executor.transport.shm_transport import HostLinks, Link


class SharedMemoryTransport:
    """Point-to-point through this host's shared memory to the neighbours of ``peers``, all of which
    ``links`` covers; the sum over the pipeline's stages goes over ``torch.distributed``."""

    def __init__(self, peers: Peers, links: HostLinks, pipeline_group: dist.ProcessGroup | None = None) -> None:
        self.peers = peers
        self.stage = peers.stage
        self.links = links
        self.pipeline_group = pipeline_group  # every stage of this pipeline; None: the whole world
        # (channel, micro-batch) -> its link: the receives announced this step, and every key sent so far
        # (the same each step: found once)
        self._incoming: dict[tuple[str, int], Link] = {}
        self._outgoing: dict[tuple[str, int], Link] = {}

    def expect(self, channel: str, microbatch: int, shapes: Shapes) -> None:
        self._incoming[(channel, microbatch)] = self.links.link(
            self.peers.rank(channel, True), self.links.rank, self.peers.boundary(channel, True), channel,
            microbatch, shapes)

    def ready(self, channel: str, microbatch: int) -> bool:
        return self._incoming[(channel, microbatch)].arrived()

    def recv(self, channel: str, microbatch: int) -> list[torch.Tensor]:
        link = self._incoming.pop((channel, microbatch), None)
        if link is None:
            raise RuntimeError(f"stage {self.stage} did not expect {channel} of micro-batch {microbatch}")
        return link.take()  # the message's tensors in the shared pages, until the step ends

    def send(self, channel: str, microbatch: int, tensors: Sequence[torch.Tensor]) -> None:
        link = self._outgoing.get((channel, microbatch))
        if link is None or not link.fits(tensors):
            link = self._outgoing[(channel, microbatch)] = self.links.link(
                self.links.rank, self.peers.rank(channel, False), self.peers.boundary(channel, False), channel,
                microbatch, [(tuple(t.shape), t.dtype) for t in tensors])
        link.send(tensors)

    def finish_step(self) -> None:
        self.links.release()  # this step's received tensors are no longer used
        if self._incoming:
            raise RuntimeError(f"stage {self.stage} ended a step with unreceived tensors {sorted(self._incoming)}")

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return pipeline_sum(value, self.pipeline_group)
