"""Which transport a stage uses for each neighbour, chosen once at set-up: in process, shared memory
or torch.distributed (executor.transport.stage_transport); no process group is needed to choose."""

from __future__ import annotations

import pytest
import torch

from executor.runtime.interleaved import chunk_peers
from executor.transport.p2p import ACT, GRAD, DistTransport, LocalMailboxes, Peers
from executor.transport.shm_p2p import SharedMemoryTransport
from executor.transport.stage_transport import DIST, IN_PROCESS, SHARED_MEMORY, RoutedTransport, routes, \
    stage_transport

CPU = torch.device("cpu")


class FakeLinks:
    """Shared-memory links of rank ``rank`` that reach ``local`` ranks (nothing is mapped)."""

    def __init__(self, rank: int, local: set[int]) -> None:
        self.rank, self.local = rank, local

    def covers(self, peer: int) -> bool:
        return peer in self.local


def test_each_neighbour_is_reached_the_way_chosen_for_it_and_only_neighbours_that_exist():
    middle = Peers(1, 3, {})
    assert routes(middle, None) == {(ACT, True): DIST, (ACT, False): DIST, (GRAD, True): DIST, (GRAD, False): DIST}
    # stage 0 on this host, stage 2 on another: activations in and gradients out through shared memory
    assert routes(middle, FakeLinks(1, {0})) == {(ACT, True): SHARED_MEMORY, (GRAD, False): SHARED_MEMORY,
                                                 (ACT, False): DIST, (GRAD, True): DIST}
    assert routes(Peers(0, 3, {}), FakeLinks(0, {1, 2})) == {(ACT, False): SHARED_MEMORY, (GRAD, True): SHARED_MEMORY}
    # one of two replicas: global ranks of the replica's stages
    assert Peers(1, 2, {}, ranks=[4, 5]).rank(ACT, True) == 4


def test_a_chunk_whose_neighbour_shares_its_device_reaches_it_in_process():
    """zbv over K = 2: virtual stages 0, 1 on devices 0, 1 and 2, 3 back on 1, 0; 1 hands 2 over in memory."""
    turn = chunk_peers(1, 2, 2, {}, schedule="zbv")
    assert routes(turn, FakeLinks(1, {0})) == {(ACT, True): SHARED_MEMORY, (GRAD, False): SHARED_MEMORY,
                                               (ACT, False): IN_PROCESS, (GRAD, True): IN_PROCESS}
    loop = chunk_peers(1, 2, 2, {}, schedule="interleaved")  # on device 1, neighbours on device 0
    assert set(routes(loop, None).values()) == {DIST}


def test_one_way_for_every_neighbour_is_that_transport_and_mixed_ways_are_routed():
    assert type(stage_transport(Peers(1, 3, {}), CPU)) is DistTransport
    links = FakeLinks(1, {0, 2})
    only_shared = stage_transport(Peers(1, 3, {}), CPU, links=links)
    assert type(only_shared) is SharedMemoryTransport and only_shared.links is links
    mixed = stage_transport(Peers(1, 3, {}), CPU, links=FakeLinks(1, {0}))
    assert type(mixed) is RoutedTransport
    assert type(mixed._in[ACT]) is SharedMemoryTransport and type(mixed._in[GRAD]) is DistTransport
    assert mixed._out[GRAD] is mixed._in[ACT] and len(mixed._members) == 2
    turn = chunk_peers(1, 2, 2, {}, schedule="zbv")
    with pytest.raises(ValueError, match="no mailboxes"):
        stage_transport(turn, CPU)
    local = LocalMailboxes().endpoint(1)
    assert stage_transport(turn, CPU, local=local)._out[ACT] is local


def test_in_process_hand_offs_go_through_the_routed_transport_unchanged():
    mailboxes = LocalMailboxes()
    sender = stage_transport(chunk_peers(1, 2, 2, {}, schedule="zbv"), CPU, local=mailboxes.endpoint(1))
    receiver = stage_transport(chunk_peers(2, 2, 2, {}, schedule="zbv"), CPU, local=mailboxes.endpoint(2))
    sender.send(ACT, 0, [torch.ones(2)])
    assert receiver.ready(ACT, 0) and torch.equal(receiver.recv(ACT, 0)[0], torch.ones(2))
