"""Pure least-squares fits of the costs the simulator needs, with their residuals. No I/O, no torch.

Every fit minimises *relative* residuals ``(predicted - measured) / measured`` with
``scipy.optimize.least_squares``, so a 50 us action weighs as much as a 50 ms one: the validation
goal is a relative error. The models, each affine in what was measured:

* link (ping-pong): ``one_way_s = latency_s + bytes / bandwidth``                 (Hockney 1994)
* all-reduce among n parties (ring): ``seconds = 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency_s``
  (Patarasuk and Yuan 2009; the form :func:`sim.engine.engine.ring_allreduce_s` predicts with)
* actions in the pipeline, per (K, kind): ``measured_s = scale * (profiled_s - fixed_s) +
  fixed_scale * fixed_s + overhead_s + cold_start_s * cold`` (:func:`fit_action`), where
  ``profiled_s`` sums the stage's layers from the isolated layer profile and ``fixed_s`` is its
  part that does not grow with the rows (each layer's profile at zero rows). ``scale`` absorbs
  contention between the K processes sharing the machine and what a pipeline's caches cost the
  rows' work; ``fixed_scale`` how much of an isolated call's fixed cost a stage's one call over its
  layers pays; ``overhead_s`` the executor's per-action work (seeding, recording, memory
  accounting), bounded below by 0, since work cannot take negative time. With one scale for both
  parts, a fit missed its own design's runs at both ends of the rows, low at 16 rows and high at 2
  (docs/notes/2026-11-27-figures-behind-the-code.md).
  ``cold`` is 1 for the step's first action on its device (:func:`sim.schedules.schedule.cold_starts`),
  after the optimizer: within one run the step's first forward took longer than the forwards after
  it (docs/notes/2026-11-26-cold-starts.md, ``benchmarks/cold_starts.py``). A line without the
  term spreads that time over every action, so a run of few micro-batches is priced short.
  Beside the lines, per K, the warm-up after a long wait (:mod:`sim.engine.host`): the amount whose
  payments, taken out of the points, leave the lines fitting best
  (:func:`calibrate.noise.warm_up_fit.fit_warm_up`, with this host's other quirks). Without it
  the per-action overhead carried it, and K = 2's forward line missed its worst design point several
  times as far (docs/notes/2026-11-27-warm-up-after-waits.md).
* sends inside the pipeline, per K: ``send_s = a + bytes * b`` (the sender's own time in isend)
* optimizer, per K: ``optimizer_s = a + param_bytes * b``
* step overhead, per K: one constant added to every stage's end of step (data, zero_grad, posting
  receives), fitted on whole-step times after the rest is fixed.
* replica spread, per K: quantiles of a process's own step-to-step compute deviation, from two
  stages of one run in the same step (:func:`replica_spread`), how late the slowest of D replicas
  finishes (:mod:`sim.engine.stragglers`).
* roofline efficiency: ``time_s = max(flops / (e * peak_flops), bytes / (b * peak_bandwidth)) +
  overhead_s`` (Williams et al. 2009), the form :mod:`sim.workloads.models` uses, fitted on the layer profile.

Limits: affine forms cannot capture cache effects that change with size other than through
``profiled_s``; with one distinct x the slope and intercept are not identifiable and the fit keeps
the slope (intercept 0), reported through ``identifiable``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy.optimize import least_squares, lsq_linear


@dataclass(frozen=True)
class AffineFit:
    """``y = slope * x + intercept`` and the relative residuals of the points it was fitted on."""

    slope: float
    intercept: float
    residuals: tuple[float, ...] = ()
    identifiable: bool = True

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept

    @property
    def rms_relative(self) -> float:
        r = self.residuals
        return math.sqrt(sum(v * v for v in r) / len(r)) if r else 0.0

    @property
    def worst_relative(self) -> float:
        return max((abs(v) for v in self.residuals), default=0.0)

    def to_dict(self) -> dict:
        return {"slope": self.slope, "intercept": self.intercept, "points": len(self.residuals),
                "rms_relative": self.rms_relative, "worst_relative": self.worst_relative,
                "identifiable": self.identifiable}

    @classmethod
    def from_dict(cls, data: dict) -> "AffineFit":
        return cls(float(data["slope"]), float(data["intercept"]), (),
                   bool(data.get("identifiable", True)))


def fit_affine(x: Sequence[float], y: Sequence[float], slope_bounds: tuple[float, float] = (-np.inf, np.inf),
               intercept_bounds: tuple[float, float] = (-np.inf, np.inf)) -> AffineFit:
    """Least squares of ``y ~ slope * x + intercept`` on relative residuals; y must be positive."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xs) != len(ys) or len(xs) == 0:
        raise ValueError(f"need as many x as y and at least one point, got {len(xs)} and {len(ys)}")
    if np.any(ys <= 0):
        raise ValueError("relative residuals need positive measurements")
    identifiable = len(np.unique(xs)) >= 2
    if not identifiable:  # one distinct x: keep the line through the origin
        slope = float(np.mean(ys / xs)) if xs[0] != 0 else 0.0
        intercept = 0.0 if xs[0] != 0 else float(np.mean(ys))
        residuals = tuple(float(v) for v in (slope * xs + intercept - ys) / ys)
        return AffineFit(slope, intercept, residuals, identifiable=False)
    # a linear start: ordinary least squares on relative residuals, then bounded refinement
    design = np.stack([xs / ys, 1.0 / ys], axis=1)
    start, *_ = np.linalg.lstsq(design, np.ones_like(ys), rcond=None)
    lower = [slope_bounds[0], intercept_bounds[0]]
    upper = [slope_bounds[1], intercept_bounds[1]]
    start = np.clip(start, np.array(lower) + 1e-300, np.array(upper) - 1e-300)
    scale = np.array([max(abs(start[0]), 1e-12), max(abs(start[1]), float(np.min(ys)) * 1e-3)])

    def residuals(p: np.ndarray) -> np.ndarray:
        return (p[0] * xs + p[1] - ys) / ys

    result = least_squares(residuals, start, bounds=(lower, upper), x_scale=scale, xtol=1e-15,
                           ftol=1e-15, gtol=1e-15)
    slope, intercept = (float(v) for v in result.x)
    return AffineFit(slope, intercept, tuple(float(v) for v in residuals(result.x)))


@dataclass(frozen=True)
class ActionLine:
    """``measured = slope * (profiled - fixed) + fixed_slope * fixed + intercept + cold_start_s *
    cold``, with its relative residuals; ``fixed_slope`` None where the points could not tell the two
    parts apart; ``cold`` 1 for the step's first action on its device."""

    slope: float
    intercept: float
    fixed_slope: float | None
    residuals: tuple[float, ...] = ()
    cold_start_s: float = 0.0
    # the weighted sum of squared relative residuals the fit minimised (what fit_warm_up compares)
    cost: float = 0.0

    def to_dict(self) -> dict:
        line = AffineFit(self.slope, self.intercept, self.residuals).to_dict()
        return {**line, **({} if self.fixed_slope is None else {"fixed_slope": self.fixed_slope}),
                "cold_start_s": self.cold_start_s}


def fit_action(profiled: Sequence[float], fixed: Sequence[float], measured: Sequence[float],
               groups: Sequence[Any] = (), slope_bounds: tuple[float, float] = (0.2, 5.0),
               fixed_bounds: tuple[float, float] = (0.0, 5.0),
               intercept_bounds: tuple[float, float] = (0.0, 1.0), overhead_s: float | None = None,
               cold: Sequence[float] = (), extra: Sequence[float] = ()) -> ActionLine:
    """Least squares of the action model on relative residuals, each point weighted by
    1/sqrt(points of its group), so that every design run counts alike whatever its micro-batch
    count (a 16-micro-batch run has eight times the actions of a 2-micro-batch one, and its small
    actions would otherwise set the line for the large ones). When the fixed part's share of the
    profiled time varies by less than 5 points over the points (one row count, say), the two parts
    cannot be told apart and one slope is fitted (``fixed_slope`` None); with one profiled time, the
    overhead is left at 0 and the slope alone carries the points. A given ``overhead_s`` is kept as
    the overhead and only the scales are fitted. ``cold`` (1 or 0 per point) marks the actions that
    pay a cold start: its seconds are fitted (at least 0) where the points hold both, else 0 (the
    overhead cannot be told from it). Only forwards hold cold points: every schedule opens a
    device's step with one, so a line's cold start is fitted, never shared as its overhead is.
    ``extra`` (seconds per point, 0 where empty) is time the points are known to hold beyond the
    line (the warm-up after a long wait, :mod:`sim.engine.host`): the line is fitted to the rest, the
    residuals stay relative to the whole measured time."""
    p, f, m = (np.asarray(v, dtype=float) for v in (profiled, fixed, measured))
    if not len(p) == len(f) == len(m) or len(p) == 0:
        raise ValueError(f"need as many profiled, fixed and measured times, at least one, got {len(p)}, {len(f)}, {len(m)}")
    if np.any(m <= 0) or np.any(p <= 0):
        raise ValueError("relative residuals need positive times")
    labels = list(groups) if len(groups) else list(range(len(p)))
    counts = {g: labels.count(g) for g in set(labels)}
    weight = np.array([1.0 / math.sqrt(counts[g]) for g in labels])
    if overhead_s is not None:
        intercept_bounds = (overhead_s, float(np.nextafter(overhead_s, np.inf)))
    elif len(np.unique(p)) < 2:  # one profiled time: scale and overhead cannot be told apart; keep the scale
        intercept_bounds = (0.0, 1e-300)
    c = np.asarray(cold, dtype=float) if len(cold) else np.zeros_like(p)
    if len(c) != len(p):
        raise ValueError(f"need a cold mark per point, got {len(c)} for {len(p)}")
    share = f / p
    split = float(np.max(share) - np.min(share)) >= 0.05
    columns = [(p - f) / m, f / m, 1.0 / m] if split else [p / m, 1.0 / m]
    bounds = [slope_bounds, fixed_bounds, intercept_bounds] if split else [slope_bounds, intercept_bounds]
    if 0 < np.sum(c) < len(c):  # both cold and warm points: the cold start is identifiable
        columns.append(c / m)
        bounds.append((0.0, 1.0))
    design = np.stack(columns, axis=1)
    e = np.asarray(extra, dtype=float) if len(extra) else np.zeros_like(p)
    if len(e) != len(p):
        raise ValueError(f"need an extra time per point, got {len(e)} for {len(p)}")
    target = 1.0 - e / m
    # bvls: exact on a few columns; the default method stopped 1e-5 short near a bound (scipy 1.17)
    result = lsq_linear(design * weight[:, None], weight * target, bounds=([b[0] for b in bounds], [b[1] for b in bounds]),
                        method="bvls")
    coefficients = [float(v) for v in result.x]
    relative = design @ result.x - target
    residuals = tuple(float(v) for v in relative)
    cost = float(np.sum((weight * relative) ** 2))
    cold_start = coefficients[-1] if len(columns) > (3 if split else 2) else 0.0
    if split:
        return ActionLine(coefficients[0], coefficients[2], coefficients[1], residuals, cold_start, cost)
    return ActionLine(coefficients[0], coefficients[1], None, residuals, cold_start, cost)


def replica_spread(runs: Sequence[Sequence[Sequence[float]]], quantiles: int = 20) -> list[float]:
    """Quantiles of the independent part of a process's compute deviation in one step, from runs of
    several stages (each run: per step, each stage's compute seconds): a stage's step over the
    run's median for that stage is ``1 + e``, and the difference of two stages' ``e`` in one step,
    over sqrt(2), has the variance of one process's own deviation, what a machine-wide slow moment
    (which moves both) leaves out; both signs are kept, as either process may be the slow one.
    ``quantiles`` equally weighted values at the midpoints of as many equal slices (:mod:`sim.engine.stragglers`);
    empty without a run of two stages or more."""
    samples: list[np.ndarray] = []
    for rows in runs:
        table = np.asarray(rows, dtype=float)
        if table.ndim != 2 or table.shape[1] < 2 or len(table) == 0:
            continue
        ratios = table / np.median(table, axis=0)
        for i in range(table.shape[1]):
            for j in range(i + 1, table.shape[1]):
                difference = (ratios[:, i] - ratios[:, j]) / math.sqrt(2.0)
                samples += [difference, -difference]
    if not samples:
        return []
    levels = (np.arange(quantiles) + 0.5) / quantiles
    # sample values, not interpolations between them, which would shrink the tails the slowest draw comes from
    return [float(v) for v in np.quantile(np.concatenate(samples), levels, method="inverted_cdf")]


@dataclass(frozen=True)
class LinkFit:
    latency_s: float
    bandwidth_bytes_per_s: float
    residuals: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        worst = max((abs(v) for v in self.residuals), default=0.0)
        return {"latency_s": self.latency_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "points": len(self.residuals), "worst_relative": worst}


def fit_link(nbytes: Sequence[float], one_way_s: Sequence[float]) -> LinkFit:
    """Latency and bandwidth from ping-pong points (one-way seconds per message size)."""
    line = fit_affine(nbytes, one_way_s, slope_bounds=(1e-15, np.inf), intercept_bounds=(0.0, np.inf))
    return LinkFit(line.intercept, 1.0 / line.slope, line.residuals)


def fit_ring_allreduce(parties: Sequence[int], nbytes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Latency and bandwidth of the ring all-reduce model from measured all-reduces.

    Point i all-reduced ``nbytes[i]`` among ``parties[i]`` processes in ``seconds[i]``. The model is
    linear in (1 / bandwidth, latency) with regressors ``2(n-1)/n * bytes`` (bytes each party sends)
    and ``2(n-1)`` (steps of the ring), so one party count and two sizes identify both; several
    party counts pool into one link. Limits: a backend that switches algorithm with size (NCCL's
    tree for small messages, gloo's halving-doubling) is fitted as if it were a ring throughout.
    """
    n, b, t = (np.asarray(v, dtype=float) for v in (parties, nbytes, seconds))
    if not len(n) == len(b) == len(t):
        raise ValueError(f"need as many parties, sizes and times, got {len(n)}, {len(b)} and {len(t)}")
    if len(np.unique(b)) < 2:
        raise ValueError("need at least two distinct sizes to separate latency from bandwidth")
    if np.any(n < 2) or np.any(t <= 0):
        raise ValueError("every all-reduce needs 2 or more parties and a positive time")
    wire_bytes, steps = 2 * (n - 1) / n * b, 2 * (n - 1)
    start, *_ = np.linalg.lstsq(np.stack([wire_bytes / t, steps / t], axis=1), np.ones_like(t), rcond=None)
    lower, upper = np.array([1e-15, 0.0]), np.array([np.inf, np.inf])
    start = np.clip(start, lower + 1e-300, upper)
    scale = np.array([max(abs(start[0]), 1e-12), max(abs(start[1]), float(np.min(t)) * 1e-3)])

    def residuals(p: np.ndarray) -> np.ndarray:
        return (p[0] * wire_bytes + p[1] * steps - t) / t

    result = least_squares(residuals, start, bounds=(lower, upper), x_scale=scale, xtol=1e-15, ftol=1e-15,
                           gtol=1e-15)
    seconds_per_byte, latency_s = (float(v) for v in result.x)
    return LinkFit(latency_s, 1.0 / seconds_per_byte, tuple(float(v) for v in residuals(result.x)))


def fit_constant(measured: Sequence[float], predicted: Sequence[float]) -> tuple[float, tuple[float, ...]]:
    """The constant ``c`` minimising the relative residuals of ``predicted + c`` against ``measured``."""
    m, p = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    if len(m) == 0:
        return 0.0, ()

    def residuals(c: np.ndarray) -> np.ndarray:
        return (p + c[0] - m) / m

    weights = 1.0 / m
    start = float(np.sum((m - p) * weights ** 2) / np.sum(weights ** 2))
    result = least_squares(residuals, [start], xtol=1e-15, ftol=1e-15, gtol=1e-15)
    return float(result.x[0]), tuple(float(v) for v in residuals(result.x))


@dataclass(frozen=True)
class RooflineFit:
    efficiency: float  # achieved fraction of peak FLOP/s
    bandwidth_efficiency: float  # achieved fraction of peak memory bandwidth
    residuals: tuple[float, ...] = field(default=())

    def to_dict(self) -> dict:
        rms = math.sqrt(sum(v * v for v in self.residuals) / len(self.residuals)) if self.residuals else 0.0
        return {"efficiency": self.efficiency, "bandwidth_efficiency": self.bandwidth_efficiency,
                "points": len(self.residuals), "rms_relative": rms}


def fit_roofline(flops: Sequence[float], traffic_bytes: Sequence[float], times_s: Sequence[float],
                 peak_flops: float, peak_bandwidth: float, overhead_s: float = 0.0) -> RooflineFit:
    """Efficiencies e, b in (0, 1.5] so the roofline predicts the measured times (log residuals)."""
    f, q, t = (np.asarray(v, dtype=float) for v in (flops, traffic_bytes, times_s))

    def predict(p: np.ndarray) -> np.ndarray:
        return np.maximum(f / (p[0] * peak_flops), q / (p[1] * peak_bandwidth)) + overhead_s

    def residuals(p: np.ndarray) -> np.ndarray:
        return np.log(predict(p) / t)

    result = least_squares(residuals, [0.3, 0.5], bounds=([1e-4, 1e-4], [1.5, 1.5]))
    e, b = (float(v) for v in result.x)
    return RooflineFit(e, b, tuple(float(v) for v in predict(result.x) / t - 1.0))


def fit_ring_gather(parties: Sequence[int], nbytes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Latency and bandwidth of the ring all-gather (or reduce-scatter) model from measured calls of
    ``nbytes`` unsharded: (n-1)/n of the bytes on each party's link and n-1 steps, half an all-reduce's
    of the same bytes, so :func:`fit_ring_allreduce` on half the bytes gives its bandwidth and half its
    latency. Limits: as :func:`fit_ring_allreduce`'s."""
    fit = fit_ring_allreduce(parties, [b / 2 for b in nbytes], seconds)
    return LinkFit(2 * fit.latency_s, fit.bandwidth_bytes_per_s, fit.residuals)
