"""The cost of an all-reduce among devices of a system: flat ring inside a node, hierarchical across.

Two reductions use it. A parameter shared by several stages of one pipeline has its gradient summed
among them (:mod:`sim.engine.engine`), and with D data-parallel replicas each stage's gradients are averaged
over its data-parallel group: the D devices holding that stage in the D replicas
(:func:`data_parallel_group`, laid out by :mod:`sim.engine.placement`).

A ring all-reduce of ``n`` bytes among ``p`` parties (reduce-scatter, then all-gather) puts
2(p-1)/p x n bytes on each party's link and takes 2(p-1) latencies (Patarasuk and Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009). When the group spans nodes
it runs hierarchically, as NCCL does across nodes: a reduce-scatter among the g members inside each
node, a ring all-reduce of each 1/g shard among the nodes over the inter-node link, and an
all-gather inside each node:

    2(g-1)/g x n / B_intra + 2(g-1) x L_intra  +  2(N-1)/N x (n/g) / B_inter + 2(N-1) x L_inter

With one member per node (g = 1) it is a flat ring over the inter-node link.

Limits: a link is latency plus bytes over bandwidth; the all-reduce is not contended by pipeline
transfers or by other stages' all-reduces running at the same time, and PCIe through the host is
taken at its per-direction bandwidth as if unshared. Where the group's members are spread unevenly
over nodes, g is the most members on one node (the slowest node sets the pace). A calibrated link
(``gpipe calibrate`` measures the collective) replaces all of this by a flat ring on that link.
"""

from __future__ import annotations

import math
from typing import Sequence

from sim.catalog.hardware import Link, System
from sim.engine.placement import DEFAULT_PLACEMENT, device_of


def ring_allreduce_s(nbytes: float, parties: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` among ``parties`` over ``link``: 2(p-1)/p of the bytes on the
    wire per party at the link's collective bandwidth among p (:meth:`Link.collective_bytes_per_s`)
    and 2(p-1) latencies (reduce-scatter then all-gather)."""
    if parties < 2:
        return 0.0
    bandwidth = link.collective_bytes_per_s(parties)
    wire = 0.0 if math.isinf(bandwidth) else nbytes / bandwidth
    return 2 * (parties - 1) / parties * wire + 2 * (parties - 1) * link.latency_s


def group_allreduce_s(nbytes: float, devices: Sequence[int], system: System, link: Link | None = None) -> float:
    """All-reduce of ``nbytes`` among ``devices`` (global device numbers) of ``system``.

    Flat ring on the intra-node link inside one node, hierarchical across nodes (module docstring);
    a given ``link`` (a calibrated collective) is used instead as a flat ring among all parties.
    """
    parties = len(devices)
    if parties < 2:
        return 0.0
    if link is not None:
        return ring_allreduce_s(nbytes, parties, link)
    per_node: dict[int, int] = {}
    for device in devices:
        node = system.node_of(device)
        per_node[node] = per_node.get(node, 0) + 1
    if len(per_node) == 1:
        return ring_allreduce_s(nbytes, parties, system.intra_link)
    return hierarchical_allreduce_s(nbytes, max(per_node.values()), len(per_node), system.intra_link,
                                    system.inter_link)


def hierarchical_allreduce_s(nbytes: float, inside: int, nodes: int, intra: Link, inter: Link) -> float:
    """All-reduce of ``nbytes`` among ``inside`` members on each of ``nodes`` nodes (module docstring):
    a ring among the members of a node on ``intra``, then each 1/inside shard among the nodes on
    ``inter``; a flat ring on ``intra`` on one node."""
    intra_s = ring_allreduce_s(nbytes, inside, intra)  # reduce-scatter + all-gather
    if nodes <= 1:
        return intra_s
    return intra_s + ring_allreduce_s(nbytes / inside, nodes, inter)


def data_parallel_group(stage: int, replicas: int, stages: int, placement: str = DEFAULT_PLACEMENT) -> list[int]:
    """The devices holding ``stage`` in each of the ``replicas`` pipelines of ``stages`` devices."""
    return [device_of(d, stage, replicas, stages, placement) for d in range(replicas)]


def exposed_allreduce_s(allreduce_s: float, last_backward_s: float, layers: int) -> float:
    """What a data-parallel all-reduce run bucket by bucket inside the last backward leaves after it.

    Each layer's gradients are final once the last micro-batch's backward has passed it, so the
    reduction can run beside that backward (Megatron-LM's bucketed, overlapped reduction); what
    outlasts the backward is exposed, and at least the last layer's share, which becomes ready only
    as the backward ends. Limits: buckets are per layer, and the reduction does not slow the backward.
    """
    if allreduce_s <= 0:
        return 0.0
    return max(allreduce_s - last_backward_s, allreduce_s / max(1, layers))
