"""The rows ``gpipe plan`` prints: plans that differ only in placement folded into one, partitions short.

Two plans whose layout, partition, predicted step and peak memory agree and whose placements differ
are one choice for the reader: they share a row, whose placement says ``any`` (or lists the
placements it stands for). A layout the placements cannot change (D = 1, K = 1, or every device of
the plan on one node, :func:`sim.planner.search.placements_differ`) says ``any`` too, though the planner
searched it once. A partition is written run-length encoded: ``8x2`` is eight stages of two layers,
``3x9,7`` three stages of nine then one of seven; a list still longer than
:data:`PARTITION_WIDTH` becomes ``64x1-3``, 64 stages of one to three layers (the exact list is in
``--json`` and the plan file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from sim.catalog.hardware import System
from sim.engine.placement import PLACEMENTS
from sim.planner.search import PlanOption, placements_differ
from sim.workloads.tensor_parallel import tensor_parallel_system

PARTITION_WIDTH = 24  # characters of the partition column before a list is summarised


@dataclass(frozen=True)
class PlanRow:
    """One printed row: ``options`` predict the same step and memory; the first is the ranked plan."""

    options: tuple[PlanOption, ...]
    placement: str  # what the placement column shows: stages, replicas, any, or a list

    @property
    def option(self) -> PlanOption:
        return self.options[0]


def short_placement(placement: str) -> str:
    """``stages`` for ``stages_adjacent``, ``replicas`` for ``replicas_adjacent``."""
    return placement.removesuffix("_adjacent")


def compact_partition(partition: Sequence[int] | None) -> str:
    """``8x2``, ``3x9,7`` or ``11,6x10,11``: runs of equal stages as count x layers; past
    :data:`PARTITION_WIDTH` characters, ``64x1-3`` (the stage count and the range of layers)."""
    if not partition:
        return ""
    runs: list[list[int]] = []  # [layers, count]
    for layers in partition:
        if runs and runs[-1][0] == layers:
            runs[-1][1] += 1
        else:
            runs.append([layers, 1])
    text = ",".join(f"{count}x{layers}" if count > 1 else f"{layers}" for layers, count in runs)
    if len(text) <= PARTITION_WIDTH:
        return text
    low, high = min(partition), max(partition)
    return f"{len(partition)}x{low}-{high}" if low != high else f"{len(partition)}x{low}"


def fold_placements(options: Sequence[PlanOption], systems: Mapping[str, System]) -> list[PlanRow]:
    """``options`` in their order, those equal but for placement (same hardware, layout, partition,
    step and peak memory) in one row at the first one's place; ``systems`` by name, as planned."""
    groups: list[list[PlanOption]] = []
    for option in options:
        for group in groups:
            if same_but_placement(group[0], option):
                group.append(option)
                break
        else:
            groups.append([option])
    return [PlanRow(tuple(group), _placement_text(group, systems.get(group[0].hardware))) for group in groups]


def same_but_placement(a: PlanOption, b: PlanOption) -> bool:
    """Whether two plans predict alike and differ at most in placement (one row for both)."""
    return (a.hardware == b.hardware and replace(a.candidate, placement=b.candidate.placement) == b.candidate
            and a.partition == b.partition and math.isclose(a.step_time_s, b.step_time_s, rel_tol=1e-9)
            and a.max_peak_memory_bytes == b.max_peak_memory_bytes)


def _placement_text(group: Sequence[PlanOption], system: System | None) -> str:
    c = group[0].candidate
    placements = list(dict.fromkeys(o.candidate.placement for o in group))
    if set(placements) >= set(PLACEMENTS):
        return "any"
    if system is not None:
        groups = tensor_parallel_system(system, c.tensor_parallel * c.context_parallel)
        if not placements_differ(groups, c.replicas, c.stages):
            return "any"
    return "/".join(short_placement(p) for p in placements)


def best_rows(planned: Sequence, rows: Sequence[PlanRow]) -> list[tuple[str, PlanRow]]:
    """Each search's best plan (``planned``: ``system`` and ``result`` each), best first, with its
    rank in ``rows`` (``>N`` below them); its placement twins folded as in the table."""
    systems = {p.system.name: p.system for p in planned}
    out = []
    for p in sorted((p for p in planned if p.result.best is not None), key=lambda p: p.result.best.score):
        best = fold_placements(p.result.ranked, systems)[0]
        rank = next((i for i, row in enumerate(rows, 1) if best.option in row.options), None)
        out.append((str(rank) if rank else f">{len(rows)}", rows[rank - 1] if rank else best))
    return out
