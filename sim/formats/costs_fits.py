"""The fitted lines a costs file holds, typed: what executor runs add to the layer profile, per K.

Each record reads its part of a costs record (the dict :func:`sim.formats.costs.read_costs` returns,
in the current layout, :mod:`sim.formats.costs_v2`) without defaults: a file from before a field
existed was given it by :mod:`sim.formats.costs_v1`.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from sim.engine.host import NO_HOST_EFFECTS, HostEffects


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), xs ascending; linear extrapolation at both ends."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Affine:
    slope: float
    intercept: float

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Affine":
        return cls(float(data["slope"]), float(data["intercept"]))


@dataclass(frozen=True)
class ActionFit:
    """An action's in-pipeline time from its stage's profiled time: ``slope`` on the part that grows
    with the rows, ``fixed_slope`` on the part that does not (the profile's time at zero rows: each
    isolated layer call's dispatch, which a stage's one call over its layers pays in its own measure),
    plus a per-action ``intercept``. Without ``fixed_slope`` (None: a fit whose design could not tell
    the parts apart) both parts take ``slope``."""

    slope: float
    intercept: float
    fixed_slope: float | None = None
    # what the action adds when it starts cold (sim.schedules.schedule.cold_starts)
    cold_start_s: float = 0.0

    def scale(self, profiled_s: float, fixed_s: float = 0.0) -> float:
        """The profiled time in the pipeline, without the per-action intercept."""
        if self.fixed_slope is None:
            return self.slope * profiled_s
        return self.slope * (profiled_s - fixed_s) + self.fixed_slope * fixed_s

    def __call__(self, profiled_s: float, fixed_s: float = 0.0) -> float:
        return self.scale(profiled_s, fixed_s) + self.intercept

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ActionFit":
        """From a costs record's ``actions[kind]`` (:mod:`sim.formats.costs_v2`)."""
        fixed = data.get("fixed_slope")  # absent where the design could not tell the parts apart
        return cls(float(data["slope"]), float(data["intercept"]), None if fixed is None else float(fixed),
                   float(data["cold_start_s"]))


@dataclass(frozen=True)
class PipelineFit:
    """What executor runs with K processes add to the layer profile (see :mod:`calibrate.fit.least_squares`)."""

    threads: int
    actions: dict[str, ActionFit]  # kind -> measured_s from the stage's profiled_s
    send: Affine  # seconds the sender spends in isend, from bytes
    optimizer: Affine  # seconds of the optimizer step, from a stage's parameter bytes
    step_overhead_s: float
    # per kind of action, the executor's own time after it before the device's next action
    # (:attr:`sim.engine.stage_costs.StageCost.gap_after_s`); none where no design run had a gap
    gap_after_s: dict[str, float] = dataclasses.field(default_factory=dict)
    # quantiles of a process's compute deviation in one step (:attr:`sim.engine.stage_costs.StageCost.replica_spread`);
    # none for a K whose design runs had one stage
    replica_spread: tuple[float, ...] = ()
    # a split backward's I on the first stage, which computes no gradient: the executor's own work around
    # it, measured (0 without a split design run)
    first_input_s: float = 0.0
    # seconds each layer after a stage's first adds to a backward under --checkpoint full beyond the
    # backward's and the recompute's lines summed, measured (0 without a full design run: the sum as it is)
    full_backward_per_layer_s: float = 0.0
    # what a CPU host adds to the actions (:mod:`sim.engine.host`: the warm-up after a long wait); off
    # unless the costs were measured on a CPU host that showed it
    host: HostEffects = NO_HOST_EFFECTS

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PipelineFit":
        """From a costs record's ``pipeline[K]`` (:mod:`sim.formats.costs_v2` says which keys it may lack
        and why); its host effects from its ``host`` entry, off without one."""
        host = data.get("host")  # present only where calibration measured on a CPU host (sim.engine.host)
        return cls(int(data["threads"]), {k: ActionFit.from_dict(v) for k, v in data["actions"].items()},
                   Affine.from_dict(data["send"]), Affine.from_dict(data["optimizer"]),
                   float(data["step_overhead_s"]),
                   {kind: float(v) for kind, v in data["gap_after_s"].items()},
                   # optional, each absent where calibration had no design run to measure it by
                   tuple(float(v) for v in data.get("replica_spread", ())),
                   float(data.get("first_input_s", 0.0)),
                   float(data.get("full_backward_per_layer_s", 0.0)),
                   HostEffects.from_dict(host) if host is not None else NO_HOST_EFFECTS)


# the fitted line of a forward that keeps its graph for the backward (the pipeline fits' other lines are
# the schedule's kinds of action, F, R, B, I and W)
FORWARD_WITH_GRAPH = "F_graph"
# the fitted line of a split backward's W on the first stage: the whole backward, as its I computes no
# input gradient, but run as a W (weight gradients of a graph kept for the split), which the backward's
# line predicted 12-16% low in the held-out zb-h1 and zbv runs of two calibrations (6% in a third)
FIRST_STAGE_WEIGHT = "W_first"
# the points of a backward under --checkpoint full, which reruns each layer's forward just before that
# layer's backward: the backward's and the recompute's lines summed predicted it 6-13% low at K = 1 in
# four calibrations (one backward call over layers each rebuilding its graph in turn is not a stage's
# recompute followed by its backward); calibration fits the time each layer after the stage's first
# takes beyond that sum (PipelineFit.full_backward_per_layer_s)
BACKWARD_WITH_RECOMPUTE = "B_full"
IDENTITY = PipelineFit(1, {k: ActionFit(1.0, 0.0) for k in "FRB"}, Affine(0.0, 0.0), Affine(0.0, 0.0), 0.0)
