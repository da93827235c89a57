"""A plan's step at another fraction of peak FLOP/s: how far an assumed efficiency moves days and dollars.

Where a device's efficiency is the catalog's assumption (:mod:`sim.catalog.efficiency_note`), the plan (its
layout and partition) is simulated again on the device at each end of
:data:`sim.catalog.efficiency_note.ASSUMED_EFFICIENCY_RANGE`, as the search simulated it, and priced like
the point figure. Nothing is scaled: the step is not proportional to 1/efficiency, since transfers,
all-reduces, bubbles and memory-bound kernels do not follow it.

Limits: it is the same plan at each end, not the best plan there; another layout may win at another
efficiency, so each end's days are an upper bound on the best plan's. The memory-bandwidth fraction
stays at its assumption; memory, and so whether the plan fits, does not depend on either.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from sim.catalog.efficiency_note import ASSUMED_EFFICIENCY_RANGE
from sim.catalog.hardware import Link, System
from sim.planner.search import PlanOption, simulate_candidate
from sim.planner.whatif import with_efficiency
from sim.workloads.tensor_parallel import with_tensor_parallel
from sim.workloads.workload import Workload


def at_efficiency(option: PlanOption, workload: Workload, system: System, batch: int, efficiency: float,
                  dp_overlap: bool = False, tp_link: Link | None = None) -> PlanOption:
    """``option`` with its step simulated again on ``system``'s device at ``efficiency`` of peak
    FLOP/s (its cost left to the caller); ``workload`` and ``system`` are the unsplit ones it was
    searched on, ``tp_link`` the tensor-parallel link it was searched with."""
    c = option.candidate
    assert option.partition is not None
    split, groups = with_tensor_parallel(workload, with_efficiency(system, efficiency), c.tensor_parallel,
                                         c.sequence_parallel, c.context_parallel, tp_link)
    result = simulate_candidate(split, groups, option.partition, batch, c, dp_overlap=dp_overlap)
    return replace(option, result=result, cost=None)


# A plan re-priced at the low and the high end of the assumed range, each with its fraction
Ends = tuple[tuple[float, PlanOption], tuple[float, PlanOption]]


class RangeEnds:
    """Called with a plan priced in days: its days and dollars at both ends of
    :data:`ASSUMED_EFFICIENCY_RANGE` where its hardware's efficiency is assumed, else None; each plan
    simulated again once. ``planned`` are the searches (``system``, ``workload``, ``batch`` each),
    ``assumed(system)`` says whether a system's efficiency is assumed, ``cost_of(option, planned)``
    prices a plan as the point figure was priced."""

    def __init__(self, planned: list, assumed: Callable[[System], bool],
                 cost_of: Callable[[PlanOption, Any], Any], dp_overlap: bool = False) -> None:
        self.planned, self.assumed, self.cost_of, self.dp_overlap = planned, assumed, cost_of, dp_overlap
        self.known: dict[int, Ends | None] = {}

    def __call__(self, option: PlanOption | None) -> Ends | None:
        if option is None or option.cost is None or option.cost.days is None:
            return None
        if id(option) not in self.known:
            self.known[id(option)] = self._priced_again(option)
        return self.known[id(option)]

    def _priced_again(self, option: PlanOption) -> Ends | None:
        p = next(p for p in self.planned if p.system.name == option.hardware)
        if not self.assumed(p.system):
            return None
        ends = []
        for efficiency in ASSUMED_EFFICIENCY_RANGE:
            again = at_efficiency(option, p.workload, p.system, p.batch, efficiency, self.dp_overlap)
            again.cost = self.cost_of(again, p)
            ends.append((efficiency, again))
        return (ends[0], ends[1])
