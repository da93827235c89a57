"""Which transport a stage uses for each of its neighbours: chosen once, when the stage is set up.

A neighbour on the same process (two chunks of one device: the turn of a V-shaped schedule) is
reached through the process's in-process mailboxes (:class:`executor.transport.p2p.LocalTransport`);
one on the same host that this process's shared-memory links cover (:func:`executor.transport.shm_transport.host_links`:
CPU tensors, a core for every rank, ``--transport auto``) through shared memory
(:class:`executor.transport.shm_p2p.SharedMemoryTransport`); any other over ``torch.distributed``,
gloo or NCCL (:class:`executor.transport.p2p.DistTransport`). Where every neighbour of a stage is
reached one way, that transport is the stage's; otherwise a :class:`RoutedTransport` hands each
direction of each channel to the one chosen for it. No call asks again which way a message goes.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from executor.transport.p2p import ACT, DIRECTIONS, GRAD, DistTransport, LocalTransport, Peers, Shapes, Transport, \
    pipeline_sum
from executor.transport.shm_p2p import SharedMemoryTransport
from executor.transport.shm_transport import HostLinks

IN_PROCESS, SHARED_MEMORY, DIST = "in process", "shared memory", "torch.distributed"


def routes(peers: Peers, links: HostLinks | None) -> dict[tuple[str, bool], str]:
    """For each (channel, incoming) the stage has a neighbour in, how that neighbour is reached."""
    here = peers.position(peers.stage)
    chosen = {}
    for channel, incoming in DIRECTIONS:
        if not peers.exists(channel, incoming):
            continue
        if peers.position(peers.stage_of(channel, incoming)) == here:
            chosen[(channel, incoming)] = IN_PROCESS
        elif links is not None and links.covers(peers.rank(channel, incoming)):
            chosen[(channel, incoming)] = SHARED_MEMORY
        else:
            chosen[(channel, incoming)] = DIST
    return chosen


def stage_transport(peers: Peers, device: torch.device, pipeline_group: dist.ProcessGroup | None = None,
                    links: HostLinks | None = None, local: LocalTransport | None = None) -> Transport:
    """The transport of the stage ``peers`` describe: to its neighbours as :func:`routes` chooses,
    its sum over the pipeline over ``pipeline_group``. ``local`` is the stage's end of its process's
    mailboxes, needed where a neighbour runs in the same process."""
    chosen = routes(peers, links)
    ways = set(chosen.values())
    over_dist = DistTransport(peers, device, pipeline_group, links)
    if ways <= {DIST}:
        return over_dist
    shared = SharedMemoryTransport(peers, links, pipeline_group) if SHARED_MEMORY in ways else None  # type: ignore[arg-type]
    if ways == {SHARED_MEMORY}:
        return shared  # type: ignore[return-value]
    if IN_PROCESS in ways and local is None:
        raise ValueError(f"stage {peers.stage} has a neighbour in its own process but no mailboxes to reach it")
    by_way: dict[str, Transport] = {DIST: over_dist, IN_PROCESS: local}  # type: ignore[dict-item]
    if shared is not None:
        by_way[SHARED_MEMORY] = shared
    return RoutedTransport(peers.stage, {direction: by_way[way] for direction, way in chosen.items()},
                           pipeline_group, links)


class RoutedTransport:
    """A stage whose neighbours are reached different ways: each direction of each channel goes to
    the transport chosen for it at set-up; the end of a step is each transport's end of step.

    ``links`` as :class:`executor.transport.p2p.DistTransport` keeps them, for the gradient sum."""

    def __init__(self, stage: int, routes: dict[tuple[str, bool], Transport],
                 pipeline_group: dist.ProcessGroup | None = None, links: HostLinks | None = None) -> None:
        self.stage = stage
        self.pipeline_group = pipeline_group
        self.links = links
        self._in = {channel: routes[(channel, True)] for channel in (ACT, GRAD) if (channel, True) in routes}
        self._out = {channel: routes[(channel, False)] for channel in (ACT, GRAD) if (channel, False) in routes}
        self._members: list[Transport] = []
        for transport in routes.values():
            if all(transport is not member for member in self._members):
                self._members.append(transport)

    def expect(self, channel: str, microbatch: int, shapes: Shapes) -> None:
        self._in[channel].expect(channel, microbatch, shapes)

    def ready(self, channel: str, microbatch: int) -> bool:
        return self._in[channel].ready(channel, microbatch)

    def recv(self, channel: str, microbatch: int) -> list[torch.Tensor]:
        return self._in[channel].recv(channel, microbatch)

    def send(self, channel: str, microbatch: int, tensors: Sequence[torch.Tensor]) -> None:
        self._out[channel].send(channel, microbatch, tensors)

    def finish_step(self) -> None:
        for member in self._members:
            member.finish_step()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return pipeline_sum(value, self.pipeline_group)
