"""The bubble of every schedule against M, on the textbook model: the README's and the notebook's figure.

The model is 2K identical layers (forward 1 ms, backward 2 ms of which the weight gradients are
half, :class:`sim.workloads.workload.UniformWorkload`) on K devices with free links, so every curve shows the
schedule alone: two layers per stage for the one-chunk schedules, one per chunk for those with two
chunks per device (interleaved with V = 2, zbv, dualpipev). Limits: the split backward costs nothing
here (measured costs price it, :mod:`sim.formats.costs`), and on a stage whose input needs no gradient I is
free and W the whole backward, as the executor runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sim.catalog.hardware import get_system
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.schedules.schedule import SCHEDULES, check_v_schedule, default_virtual_stages
from sim.workloads.workload import UniformWorkload

DEFAULT_MICROBATCHES = (4, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class ScheduleBubble:
    schedule: str
    microbatches: int
    bubble_fraction: float
    step_time_s: float


def schedule_bubbles(stages: int = 4, microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
                     schedules: Sequence[str] = SCHEDULES) -> list[ScheduleBubble]:
    """Each schedule's simulated bubble at each M it can run (interleaved: M a multiple of K;
    dualpipev: M >= 2K)."""
    ideal = get_system("ideal")
    workload = UniformWorkload(2 * stages)
    points = []
    for schedule in schedules:
        chunks = default_virtual_stages(schedule)
        for m in microbatches:
            if (schedule == "interleaved" and m % stages) or (schedule == "dualpipev" and m < 2 * stages):
                continue
            check_v_schedule(schedule, stages, m)
            result = simulate(workload, ideal, [2 // chunks] * (stages * chunks), m,
                              ParallelLayout.for_partition([2 // chunks] * (stages * chunks), m, checkpoint="never",
                                                           schedule=schedule, virtual_stages=chunks), record=False)
            points.append(ScheduleBubble(schedule, m, result.bubble_fraction, result.step_time_s))
    return points
