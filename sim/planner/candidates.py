"""The candidates the planner's search prices: every layout worth simulating, and the defaults of its degrees.

:func:`candidates` enumerates D, K, V, M, checkpoint policy, schedule, ZeRO stage, shard group,
gradient sync and placement, leaving out what is the same plan as one already listed (M values that
torch.chunk splits alike, placements on the same devices, ZeRO-3 beside ZeRO-2 under a pipeline) or
cannot run (D x K beyond the system, interleaving that does not divide). The enumeration of one D is
cached: the planner asks again for every E it searches. Torch-free.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Sequence

from sim.catalog.hardware import System
from sim.engine.placement import PLACEMENTS
from sim.formats.layout import ParallelLayout
from sim.schedules.microbatch import split_rows
from sim.schedules.schedule import (CHECKPOINT_POLICIES, PLANNED_SCHEDULES, SPLIT_BACKWARD_SCHEDULES,
                                    V_SHAPED_SCHEDULES, recomputes_per_layer)

# a layout the search prices (its partition is the partitioner's, beside it in sim.planner.search.PlanOption)
Candidate = ParallelLayout
# schedules, in the order they are searched; the non-interleaved ones run V = 1
NON_INTERLEAVED = ("gpipe", "1f1b")


def default_stage_options(system: System, num_layers: int) -> list[int]:
    """Powers of two up to the number of devices and layers."""
    return _powers_of_two(min(system.total_devices, num_layers))


def default_replica_options(system: System) -> list[int]:
    """Powers of two up to the number of devices."""
    return _powers_of_two(system.total_devices)


def _powers_of_two(limit: int, start: int = 1) -> list[int]:
    options, k = [], start
    while k <= limit:
        options.append(k)
        k *= 2
    return options


def placements_differ(system: System | None, replicas: int, stages: int) -> bool:
    """Whether the placements put some stage on other devices' links: only when D > 1, K > 1 and
    the D x K devices span more than one node (on one node every link is the intra-node link)."""
    if system is None:
        return replicas > 1 and stages > 1
    return replicas > 1 and stages > 1 and replicas * stages > system.devices_per_node


def candidates(stage_options: Iterable[int], microbatch_options: Iterable[int], batch_size: int,
               checkpoints: Sequence[str] = CHECKPOINT_POLICIES, schedules: Sequence[str] = PLANNED_SCHEDULES,
               replica_options: Iterable[int] = (1,), virtual_options: Iterable[int] = (2,),
               zero_options: Iterable[int] = (0,), placements: Sequence[str] = PLACEMENTS,
               system: System | None = None, num_layers: int | None = None,
               shard_group: int | None = None, shard_group_options: Sequence[int] = (),
               gradient_sync_options: Sequence[str | None] = (None,)) -> list[Candidate]:
    """Every combination worth simulating: M values that torch.chunk would turn into the same
    splits appear once, D x K beyond the system's devices, placements that are the same devices,
    ZeRO with one replica, ZeRO-3 with K > 1 beside ZeRO-2 (the same plan under torchtitan's policy: no
    reshard after forward when pipelined), and interleaving that cannot run (V x K over the layers, M
    not a multiple of K, K = 1) are left out. ``virtual_options`` are the V tried with the interleaved schedule;
    ``shard_group`` (HSDP) is given to the ZeRO-2/3 candidates whose D it divides; without it, those
    candidates shard over all D replicas and over each of ``shard_group_options`` that divides D; each
    ZeRO-2/3 candidate is tried with each of ``gradient_sync_options`` (None: the trainers' default),
    once where every replica runs one micro-batch (the two syncs are then the same plan)."""
    options = (tuple(stage_options), tuple(microbatch_options), batch_size, tuple(checkpoints), tuple(schedules),
               tuple(v for v in virtual_options if v >= 2), tuple(zero_options), tuple(placements),
               None if system is None else (system.total_devices, system.devices_per_node), num_layers,
               shard_group, tuple(shard_group_options), tuple(gradient_sync_options))
    return [c for d in replica_options for c in _replica_candidates(d, *options)]


@lru_cache(maxsize=256)
def _replica_candidates(d: int, stage_options: tuple[int, ...], microbatch_options: tuple[int, ...], batch_size: int,
                        checkpoints: tuple[str, ...], schedules: tuple[str, ...], virtual_options: tuple[int, ...],
                        zero_options: tuple[int, ...], placements: tuple[str, ...], devices: tuple[int, int] | None,
                        num_layers: int | None, shard_group: int | None,
                        shard_group_options: tuple[int, ...],
                        gradient_sync_options: tuple[str | None, ...]) -> tuple[Candidate, ...]:
    """:func:`candidates` of D = ``d`` on a system of ``devices`` (all, per node; None: unbounded), kept:
    the planner asks again for each E it searches."""
    out: list[Candidate] = []
    parts = split_rows(batch_size, d)
    if len(parts) < d:
        return ()  # torch.chunk gives fewer parts than replicas
    distinct = sorted(set(parts), reverse=True)
    for k in stage_options:
        if devices is not None and d * k > devices[0]:
            continue
        differ = d > 1 and k > 1 and (devices is None or d * k > devices[1])  # placements_differ
        where = list(placements) if differ else [placements[0]]
        zeros = [z for z in zero_options if z == 0 or d > 1]
        seen_splits = set()
        for m in microbatch_options:
            splits = tuple(tuple(split_rows(r, m)) for r in distinct)
            if splits in seen_splits:
                continue
            seen_splits.add(splits)
            counts = {len(split) for split in splits}
            for checkpoint in checkpoints:
                if checkpoint == "except_last" and counts == {1}:
                    continue  # identical to never with one micro-batch
                for schedule, v in _schedule_options(schedules, virtual_options, k, counts, num_layers):
                    if schedule in SPLIT_BACKWARD_SCHEDULES and recomputes_per_layer(checkpoint):
                        continue  # refused: a per-layer recompute's backward is not split
                    for zero in zeros:
                        if zero == 3 and k > 1 and 2 in zeros:
                            continue  # pipelined, ZeRO-3 gathers once per step: the ZeRO-2 plan (sim.engine.fsdp)
                        for placement in where:
                            for group in _shard_groups(zero, d, shard_group, shard_group_options):
                                for sync in gradient_syncs(zero, counts, gradient_sync_options):
                                    out.append(Candidate(k, m, checkpoint, schedule, d, v, zero, placement,
                                                         shard_group=group, gradient_sync=sync))
    return tuple(out)


def gradient_syncs(zero: int, counts: set[int], options: Sequence[str | None]) -> list[str | None]:
    """The gradient syncs a candidate of ``zero`` whose replicas run ``counts`` micro-batches is tried
    with: None below ZeRO-2; the first of ``options`` alone where every replica runs one micro-batch."""
    if zero < 2:
        return [None]
    return list(options)[:1] if counts == {1} else list(options)


def _shard_groups(zero: int, replicas: int, given: int | None, options: Sequence[int]) -> list[int | None]:
    """The shard groups a candidate of ``zero`` over ``replicas`` is tried with: none below ZeRO-2;
    ``given`` where it divides D; else all D replicas and each of ``options`` dividing D (HSDP)."""
    if zero < 2:
        return [None]
    if given:
        return [given if replicas % given == 0 else None]
    return [None, *sorted({g for g in options if 1 <= g < replicas and replicas % g == 0})]


def _schedule_options(schedules: Sequence[str], virtual_options: Sequence[int], stages: int, counts: set[int],
                      num_layers: int | None) -> list[tuple[str, int]]:
    out = []
    for schedule in schedules:
        if schedule == "gpipe":
            out.append((schedule, 1))
        elif schedule == "1f1b" and (stages > 1 or max(counts) > 1):
            # on one stage as fast as gpipe, but holding one micro-batch at a time, not all of them
            out.append((schedule, 1))
        elif schedule == "interleaved" and stages > 1 and all(c % stages == 0 for c in counts):
            out.extend((schedule, v) for v in virtual_options if num_layers is None or v * stages <= num_layers)
        elif schedule in V_SHAPED_SCHEDULES:
            # two chunks per device, in a V; on one device no better than 1f1b, with the split's cost
            if stages > 1 and (num_layers is None or 2 * stages <= num_layers) and (
                    schedule != "dualpipev" or min(counts) >= 2 * stages):
                out.append((schedule, 2))
        elif schedule in SPLIT_BACKWARD_SCHEDULES and stages > 1:
            out.append((schedule, 1))  # on one stage the same work as 1f1b's, in the same order
    return out
