"""The warm-up after long waits, as calibration reads and fits it: a CPU host's effect, fenced off here.

A device of this kind of host runs slower right after it waited for an input (its caches and clock
went to other work meanwhile); the simulator charges it as :mod:`sim.engine.host` says, off unless a
CPU costs file carries ``pipeline[K].host``. Calibration learns it in two steps kept here:
:func:`busy_since_wait_s` reads from a measured timeline how much compute each action's device ran
since its last long wait (what the action paid of a warm-up, :func:`sim.engine.host.measured_paid_s`),
and :func:`fit_warm_up` picks the warm-up whose payments, taken out of the measured actions, leave
the action lines of :mod:`calibrate.fit.pipeline_fit` fitting best. Why and how large:
docs/notes/2026-11-27-warm-up-after-waits.md.

Limits: one warm-up per K, whatever the stage, the wait's length past :data:`sim.engine.host.IDLE_S`
or the kind of action; a grid search, so the fitted value is a multiple of its step.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Sequence

import numpy as np

from calibrate.fit.step_components import device_spans
from sim.formats.timeline import RECV_WAIT
from sim.schedules.schedule import COMPUTE_KINDS


def busy_since_wait_s(records: Sequence[Any], steps: Sequence[int], idle_s: float) -> dict[tuple, float]:
    """Per action (stage, virtual stage or None, kind, micro-batch), the median over ``steps`` of the
    compute seconds its device ran in the step since its last wait of at least ``idle_s`` for an
    input before it (0 for the action right after one; inf where no such wait came before it in the
    step): what calibration reads of the warm-up each action paid (:func:`sim.engine.host.measured_paid_s`).
    Replica 0's first tensor-parallel ranks; the waits are the timeline's ``recv_wait`` spans between
    two compute actions, summed."""
    seen: dict[tuple, list[float]] = {}
    for spans in device_spans(records, steps).values():
        since, waited = math.inf, 0.0
        for r in spans:
            if r.kind == RECV_WAIT:
                waited += r.end_s - r.start_s
            elif r.kind in COMPUTE_KINDS:
                if waited >= idle_s:
                    since = 0.0
                seen.setdefault((r.stage, r.virtual_stage, r.kind, r.microbatch), []).append(since)
                since += r.end_s - r.start_s
                waited = 0.0
    return {key: statistics.median(values) for key, values in seen.items()}


def fit_warm_up(cost_of: Callable[[float], float], most_s: float = 2e-3, step_s: float = 5e-6) -> float:
    """The warm-up after a long wait (:mod:`sim.engine.host`) whose action lines fit the measured
    actions best: ``cost_of(warm_up_s)`` fits every line with that warm-up taken out of the points
    and returns their summed weighted squares; the smallest over a grid from 0 to ``most_s`` by
    ``step_s`` wins (the cost is piecewise smooth in the warm-up, as each point's share of it is
    clipped, so a grid rather than a local search)."""
    candidates = np.arange(0.0, most_s + step_s / 2, step_s)
    costs = [cost_of(float(w)) for w in candidates]
    return float(candidates[int(np.argmin(costs))])
