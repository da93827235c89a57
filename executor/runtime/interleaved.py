"""Multi-chunk schedules over ``torch.distributed``: one process per device, V chunks in each.

Rank d builds its chunks, virtual stages d, d+K, ..., d+(V-1)K under the interleaved schedule and
d, 2K-1-d under the V-shaped ones (:mod:`executor.runtime.chunks`, :func:`sim.schedules.schedule.device_of_virtual_stage`),
and joins them with the chunks of the other ranks:

* activations of virtual stage s go to the rank of s+1 and gradients to the rank of s-1 (in a loop,
  from rank K-1 the activations wrap to rank 0 between chunks; in a V they turn on rank K-1). Every
  virtual boundary b (s = b to b+1) between two ranks gets two process groups of its two ranks, one
  per direction, as the boundaries of one chunk per device do
  (:func:`executor.transport.p2p.boundary_groups`): on every communicator messages flow one way, in the
  order both ends' lists put them, and a message's tensors are tagged (micro-batch x tensors +
  index), so (group, tag) is unique per (virtual boundary, micro-batch, tensor).
* a boundary whose two virtual stages are on one rank (every boundary with K = 1; the turn of a V)
  hands over through in-process mailboxes, never through a process group.
* a parameter several chunks share (a tied embedding and head) is summed over the rank's own
  copies first, then over the ranks that hold a copy (one group per shared parameter, reduced in
  the order of its first layer on every rank, as :mod:`executor.parallel.sharing` does).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from executor.config import RunConfig
from executor.models.loaded_types import is_dtensor
from executor.parallel.sharing import SharedGroup
from executor.runtime.chunks import ChunkedDevice
from executor.runtime.pipeline import Prepared, make_stage
from executor.runtime.recording import Recorder
from executor.runtime.stage import PipelineStage
from executor.transport.p2p import ACT, GRAD, LocalMailboxes, Peers, Transport
from executor.transport.shm_transport import host_links
from executor.transport.stage_transport import stage_transport
from sim.schedules.schedule import device_of_virtual_stage, virtual_stages_of_device

if TYPE_CHECKING:
    from executor.parallel.replicas import Layout


def virtual_boundary_groups(devices: int, virtual_stages: int,
                            schedule: str = "interleaved") -> dict[tuple[int, str], dist.ProcessGroup]:
    """Two groups per virtual boundary b between two ranks (those of virtual stages b and b+1).

    Every rank must call this, in the same order, since ``new_group`` is collective. Needs K > 1.
    """
    groups = {}
    for b in range(devices * virtual_stages - 1):
        ranks = sorted({device_of_virtual_stage(b, devices, schedule), device_of_virtual_stage(b + 1, devices, schedule)})
        if len(ranks) == 1:
            continue  # the turn of a V: in process
        for channel in (ACT, GRAD):
            groups[(b, channel)] = dist.new_group(ranks)
    return groups


def chunk_peers(virtual_stage: int, devices: int, virtual_stages: int,
                groups: dict[tuple[int, str], dist.ProcessGroup], ranks: Sequence[int] | None = None,
                schedule: str = "interleaved") -> Peers:
    """The neighbours of one chunk: ``virtual_stage``'s, on the ranks of the neighbouring virtual
    stages' devices, over the groups of :func:`virtual_boundary_groups` (or of
    :func:`executor.parallel.replicas.build_layout` for one of several replicas, ``ranks`` then giving
    the global rank of each device of the replica). A neighbour on this rank (the turn of a V) is
    reached through the rank's in-process mailboxes (:func:`executor.transport.stage_transport.routes`)."""
    return Peers(virtual_stage, devices * virtual_stages, groups, ranks,
                 lambda s: device_of_virtual_stage(s, devices, schedule))


def shared_process_groups(groups: Sequence[SharedGroup], devices: int,
                          schedule: str = "interleaved") -> list[dist.ProcessGroup | None]:
    """One group of the ranks holding a copy, per shared parameter (None: one rank holds them all).

    Every rank must call this, in the same order, since ``new_group`` is collective.
    """
    result: list[dist.ProcessGroup | None] = []
    for group in groups:
        ranks = sorted({device_of_virtual_stage(owner, devices, schedule) for owner in group.owners})
        result.append(dist.new_group(ranks) if len(ranks) > 1 else None)
    return result


def _grad_or_zeros(parameter: nn.Parameter) -> torch.Tensor:
    if parameter.grad is None:
        parameter.grad = torch.zeros_like(parameter)
    return parameter.grad


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded gradient's part on this rank (the same part on every owner of the same replica)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def chunk_reducer(chunks: Sequence[PipelineStage], groups: Sequence[SharedGroup],
                  process_groups: Sequence[dist.ProcessGroup | None]) -> Callable[[], None] | None:
    """Sum each shared parameter's gradient over this rank's copies, then over the other ranks';
    None when this rank holds no shared parameter."""
    mine = []
    for group, process_group in zip(groups, process_groups):
        copies = [chunk.module.get_parameter(group.names[chunk.config.stage]) for chunk in chunks
                  if chunk.config.stage in group.owners]
        if copies:
            mine.append((copies, process_group))
    if not mine:
        return None

    def reduce() -> None:
        for copies, process_group in mine:
            grads = [_local(_grad_or_zeros(p)) for p in copies]  # a ZeRO-2/3 copy: this rank's shard
            total = torch.stack(grads).sum(dim=0) if len(grads) > 1 else grads[0]
            if process_group is not None:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group)
            for grad in grads:
                grad.copy_(total)

    return reduce


def make_dist_chunks(config: RunConfig, prepared: Prepared, rank: int, device: torch.device,
                     recorder: Recorder | None = None, layout: "Layout | None" = None) -> ChunkedDevice:
    """Rank ``rank``'s chunks over ``torch.distributed``. Collective: every rank calls it at the
    same point. With ``layout`` (:mod:`executor.parallel.replicas`) the rank is device ``layout.stage`` of one
    of D replicas, on that replica's rows, with the replica's groups and neighbours."""
    devices = config.stages
    ranks = pipeline_group = None
    if layout is not None:
        config = replace(config, batch_size=layout.rows)
        rank, groups, ranks, pipeline_group = layout.stage, layout.boundary_groups, layout.stage_ranks, layout.pp_group
        shared = layout.shared_groups
    else:
        groups = virtual_boundary_groups(devices, config.layout.virtual_stages, config.layout.schedule) if devices > 1 else {}
        shared = shared_process_groups(prepared.shared, devices, config.layout.schedule)
    mailboxes = LocalMailboxes()  # hand-offs between this rank's own chunks
    links = host_links(device, config.transport, config.timeout_s)

    def transport(virtual_stage: int) -> Transport:
        if devices == 1:
            return mailboxes.endpoint(virtual_stage)
        peers = chunk_peers(virtual_stage, devices, config.layout.virtual_stages, groups, ranks, config.layout.schedule)
        return stage_transport(peers, device, pipeline_group, links, mailboxes.endpoint(virtual_stage))

    tp_mesh = layout.tp_mesh if layout is not None else None
    sharding = layout.sharding if layout is not None else None
    experts = layout.experts if layout is not None else None
    chunks = [make_stage(config, prepared, s, transport(s), device, tp_mesh=tp_mesh, sharding=sharding,
                         experts=experts)
              for s in virtual_stages_of_device(rank, devices, config.layout.virtual_stages, config.layout.schedule)]
    chunked = ChunkedDevice(chunks, recorder)
    chunked.reduce_shared = chunk_reducer(chunks, prepared.shared, shared)
    return chunked
