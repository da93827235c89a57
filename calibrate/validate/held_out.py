"""Held-out validation: predict runs the fit never saw, measure them with the executor, compare.

The held-out design covers: K in {1, 2} (and up to the stage count the
machine has room for), M from 1 to 16 including values that do not divide the batch, balanced and
skewed partitions, every checkpoint policy and both schedules, and D = 2 data-parallel replicas
with K = 1 and K = 2 (their gradients averaged by the all-reduce calibration measured), and, where
the costs file profiled the layers split over T ranks, runs whose stages are split over T ranks
(tensor parallelism; a stage's measured figures are its rank 0's). Any
configuration that is also in the calibration design is dropped, so no prediction is of a run the
fit learned from.

A run with more processes (D x K x T) than the machine has cores (CPU) or GPUs is still measured and
its error shown, marked ``oversubscribed``: the simulator has its processes take turns on the cores
(:mod:`sim.engine.shared_cores`), but not what else crowding does (its gloo sends wait while the cores are
taken: 13-18 ms a send measured in the D = 2 x K = 2 run on two cores, against 0.1-0.4 ms with a core
per process), so its error stays out of the summary.

Errors are relative to the measurement: ``(predicted - measured) / measured``. Step times compare
the simulator's step with the executor's median step (warm-up excluded); memory compares each
stage's predicted peak activation bytes with the executor's exact count (:mod:`executor.runtime.memory`).

Each round of a run is also put at the calibration's reference speed: divided by the speed factor
of the probes its ranks took just before and after it (:mod:`calibrate.noise.speed`). The error against
that (``step_error_at_reference``) is the simulator's own error with the machine's drift since
calibration taken out; ``round_spread`` (interquartile range of those rounds over their median) is
how precisely this machine measured the run at all. Both are published beside the raw error.

Two measures of noise stand beside each error: ``interval``, where the error lies given this
validation's own rounds (:func:`median_interval`), and ``halves``, the error as the calibration's fits
on its odd and on its even design rounds predict the run (:func:`calibrate.fit.calibration.fit_halves`;
costs files from a quick calibration have none): what a calibration from the other half of the same
minutes would have predicted. An error inside both is one this machine cannot tell from noise. A
third, ``calibs``, where other costs files are given: the error as calibrations taken at other
moments predict the same measurement (:mod:`calibrate.validate.across_calibrations`), the noise neither of
the first two sees.

The warm-up after long waits (:mod:`sim.engine.warm_up`) moves more between moments than the speed does, so
each round is also bracketed by an after-wait probe (:mod:`calibrate.noise.after_wait_probe`): the busy
errors with each stage's predicted warm-up scaled to its run's probe stand beside the others
(``busy_errors_at_probed_warm_up``), and the table gives how far the probes ranged against the
calibration's.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from calibrate.fit.design import RunSpec, calibration_design, run_config, skewed
from calibrate.fit.step_fit import predict
from calibrate.goals import BUBBLE_GOAL_POINTS, BUSY_GOAL, STEP_GOAL, past
from calibrate.noise.after_wait_probe import WAIT_S, after_wait_reference_s, run_after_wait_probes, warm_up_factor
from calibrate.noise.speed import run_probes, speed_factor
from calibrate.fit.step_components import (measured_components, predicted_end_span_s, predicted_replica_waits_s,
                                           replica_waits)
from sim.planner.partition import even_partition
from sim.schedules.schedule import default_virtual_stages


# (stages, microbatches, partition kind, checkpoint, schedule)
HELD_OUT = [
    (1, 1, "balanced", "never", "gpipe"),
    (1, 3, "balanced", "except_last", "gpipe"),
    (1, 5, "balanced", "never", "gpipe"),
    (1, 16, "balanced", "always", "gpipe"),
    (2, 1, "balanced", "except_last", "gpipe"),
    (2, 3, "skewed", "never", "gpipe"),
    (2, 4, "balanced", "always", "1f1b"),
    (2, 5, "balanced", "never", "gpipe"),
    (2, 6, "skewed", "except_last", "1f1b"),
    (2, 7, "balanced", "always", "gpipe"),
    (2, 12, "balanced", "except_last", "gpipe"),
    (2, 16, "skewed", "never", "1f1b"),
    (1, 4, "balanced", "full", "gpipe"),  # per-layer recompute: no calibration run has it
    (2, 4, "skewed", "full", "1f1b"),
    (2, 8, "balanced", "never", "zb-h1"),  # the split backward: no calibration run has it
    (2, 8, "balanced", "never", "zbv"),  # two chunks per process in a V, the backward split
    (2, 6, "balanced", "selective", "gpipe"),  # the attention core rerun in the backward (models with one)
]
# (replicas, stages, microbatches, partition kind, checkpoint, schedule): data-parallel runs
HELD_OUT_REPLICAS = [
    (2, 1, 3, "balanced", "except_last", "gpipe"),
    (2, 2, 4, "balanced", "never", "1f1b"),
]
# (tensor-parallel ranks, stages, microbatches, partition kind, checkpoint, schedule): each stage
# split over T ranks, priced from the costs file's profile of the split layers (calibrate.measure.tp_profile)
HELD_OUT_TENSOR_PARALLEL = [
    (2, 1, 4, "balanced", "never", "gpipe"),
    (2, 1, 8, "balanced", "always", "gpipe"),
]


def validation_design(num_layers: int, batch_size: int, max_stages: int = 2,
                      limit: int | None = None, max_replicas: int = 2,
                      attention_core: bool = False, tensor_parallel: Sequence[int] = ()) -> list[RunSpec]:
    """The held-out runs for a model of ``num_layers`` layers, none of them in the calibration design;
    ``--checkpoint selective`` among them only for a model with an ``attention_core`` to drop, runs
    with T ranks per stage only for the T in ``tensor_parallel`` (those the costs file profiled).

    Data-parallel runs come next to last and need every replica to get at least one row per
    micro-batch (batch >= D x M); they are kept even where D x K oversubscribes the machine (see the
    module). Tensor-parallel runs come last.
    """
    seen = set(calibration_design(num_layers, batch_size, max_stages, tensor_parallel, split_backward=True))
    wanted = ([(1, 1, *run) for run in HELD_OUT] + [(1, *run) for run in HELD_OUT_REPLICAS if run[0] <= max_replicas]
              + [(t, 1, *run[1:]) for run in HELD_OUT_TENSOR_PARALLEL for t in [run[0]] if t in tensor_parallel])
    specs = []
    for parts, replicas, stages, m, kind, checkpoint, schedule in wanted:
        if stages > min(max_stages, num_layers) or batch_size < replicas * m:
            continue
        if checkpoint == "selective" and not attention_core:
            continue
        split = even_partition if kind == "balanced" else skewed
        virtual = default_virtual_stages(schedule)
        if stages * virtual > num_layers:
            continue
        spec = RunSpec(split(num_layers, stages * virtual), m, checkpoint, schedule, batch_size, replicas, parts,
                       virtual)
        if spec not in seen and spec not in specs:
            specs.append(spec)
    return specs[:limit] if limit else specs


def machine_processes(device: str) -> int:
    """Processes this machine runs side by side without oversubscribing: cores, or GPUs on CUDA."""
    from executor.device import device_api

    return device_api(device).ranks_per_host()


@dataclass
class Comparison:
    run: str
    predicted_step_s: float
    measured_step_s: float
    predicted_peak_bytes: list[int]
    measured_peak_bytes: list[int]
    measured_rounds_s: list[float]  # each round's median step; measured_step_s is their median
    round_speeds: list[float]  # each round's speed factor against the calibration's reference pace
    replicas: int = 1  # D data-parallel copies of the pipeline
    oversubscribed: bool = False  # D x K processes exceeded the machine's cores (GPUs)
    # components (replica 0): busy seconds per stage, the bubble, the end-of-step span
    predicted_busy_s: list[float] = field(default_factory=list)
    measured_busy_s: list[float] = field(default_factory=list)
    predicted_end_span_s: float = 0.0
    measured_end_span_s: float = 0.0
    # per stage, each round's busy seconds divided by the round's speed factor
    busy_rounds_at_reference_s: list[list[float]] = field(default_factory=list)
    # per action kind (F, R, B, I, W), per stage: the seconds a step's actions of that kind take,
    # predicted and measured (the median over rounds of each round's, at the reference speed)
    predicted_kind_s: dict[str, list[float]] = field(default_factory=dict)
    measured_kind_at_reference_s: dict[str, list[float]] = field(default_factory=dict)
    # the step as the fits on the calibration's odd and even design rounds predict it (calibrate.fit.calibration.fit_halves)
    predicted_step_halves_s: list[float] = field(default_factory=list)
    # D > 1: per stage, replica 0's wait a step for the stage's slowest replica, measured (median over
    # rounds, calibrate.fit.step_components.replica_waits) and simulated (the straggler allowance), and
    # the spread of a replica's compute per step (median over rounds)
    measured_replica_wait_s: list[float] = field(default_factory=list)
    predicted_replica_wait_s: list[float] = field(default_factory=list)
    replica_busy_spread: float = 0.0
    # per stage (replica 0), the part of the predicted busy time the device runs slow after long
    # waits (sim.engine.warm_up): the component whose size this machine moves most from moment to moment
    predicted_warm_up_s: list[float] = field(default_factory=list)
    # each round's after-wait probe against the calibration's (calibrate.noise.after_wait_probe.warm_up_factor)
    round_warm_up_factors: list[float] = field(default_factory=list)

    @property
    def replica_wait_points(self) -> tuple[float, float]:
        """Replica 0's wait for the other replicas in points of the step (mean over stages, as the
        bubble), predicted and measured; (0, 0) for one replica."""
        if not self.measured_replica_wait_s or self.measured_step_s <= 0 or self.predicted_step_s <= 0:
            return 0.0, 0.0
        return (statistics.fmean(self.predicted_replica_wait_s or [0.0]) / self.predicted_step_s * 100,
                statistics.fmean(self.measured_replica_wait_s) / self.measured_step_s * 100)

    @property
    def kind_errors_at_reference(self) -> dict[str, list[float | None]]:
        """Per kind and stage, the predicted time of a step's actions against the measured: which
        kind of work a busy-time error comes from (None for a stage that ran none of that kind)."""
        return {kind: [(p - m) / m if m else None for p, m in zip(self.predicted_kind_s[kind], measured)]
                for kind, measured in self.measured_kind_at_reference_s.items() if kind in self.predicted_kind_s}

    @property
    def busy_errors(self) -> list[float]:
        """Per stage, predicted busy time against measured (forward, recompute, backward, optimizer)."""
        return [(p - m) / m if m else 0.0 for p, m in zip(self.predicted_busy_s, self.measured_busy_s)]

    @property
    def measured_busy_at_reference_s(self) -> list[float]:
        """Per stage, the median over rounds of its busy seconds at the reference speed."""
        return [statistics.median(rounds) for rounds in self.busy_rounds_at_reference_s]

    @property
    def busy_round_spread(self) -> float:
        """The noise beside the busy errors: per stage, the interquartile range of its rounds' busy
        seconds at the reference speed over their median; the widest stage's."""
        return max((relative_spread(rounds) for rounds in self.busy_rounds_at_reference_s), default=0.0)

    @property
    def warm_up_shares(self) -> list[float]:
        """Per stage, the share of its predicted busy time that is the warm-up after long waits
        (empty where the prediction has none recorded)."""
        return [w / b if b else 0.0 for w, b in zip(self.predicted_warm_up_s, self.predicted_busy_s)]

    @property
    def predicted_busy_at_probed_warm_up_s(self) -> list[float]:
        """Per stage, the predicted busy time with its warm-up scaled to each round's after-wait probe
        and put at the reference speed as that round's measurement is (the warm-up's loss is measured in
        the round's own seconds), the median over rounds; the prediction unchanged without factors."""
        if not self.round_warm_up_factors or not self.predicted_warm_up_s:
            return list(self.predicted_busy_s)
        moments = list(zip(self.round_warm_up_factors, self.round_speeds))
        return [statistics.median(busy - warm + warm * factor / speed for factor, speed in moments)
                for busy, warm in zip(self.predicted_busy_s, self.predicted_warm_up_s)]

    @property
    def busy_errors_at_probed_warm_up(self) -> list[float]:
        """Per stage, :attr:`busy_errors_at_reference` with the warm-up at the run's probed moment:
        what the error is once the after-wait loss's own moves are taken out."""
        return [(p - m) / m if m else 0.0
                for p, m in zip(self.predicted_busy_at_probed_warm_up_s, self.measured_busy_at_reference_s)]

    @property
    def busy_error_intervals_at_probed_warm_up(self) -> list[tuple[float, float]]:
        """Per stage, :attr:`busy_errors_at_probed_warm_up` against the ends of its median's interval."""
        return [error_interval(p, rounds)
                for p, rounds in zip(self.predicted_busy_at_probed_warm_up_s, self.busy_rounds_at_reference_s)]

    @property
    def warm_up_factor(self) -> float:
        """The median over rounds of the after-wait probe against the calibration's (1.0 without)."""
        return statistics.median(self.round_warm_up_factors) if self.round_warm_up_factors else 1.0

    @property
    def busy_errors_at_reference(self) -> list[float]:
        """Per stage, predicted busy time against measured at the reference speed: the machine's
        drift since calibration taken out, as for the step (a round that ran 10% slow computed 10%
        slow, which no model of the work predicts)."""
        return [(p - m) / m if m else 0.0 for p, m in zip(self.predicted_busy_s, self.measured_busy_at_reference_s)]

    @property
    def predicted_bubble(self) -> float:
        return bubble(self.predicted_busy_s, self.predicted_step_s)

    @property
    def measured_bubble(self) -> float:
        """The median over rounds of each round's bubble (:attr:`bubble_rounds`), the value its interval
        is about; from the median busy times and the median step where rounds were not kept. Not the
        bubble of the medians: those come from different rounds, and where busy time and step do not
        move together (D > 1, whose step waits for the slower replica while replica 0's busy time does
        not grow) the bubble of the medians misses every round's (D=2 K=1: -7.9 points against -1.4
        for the median round in one validation)."""
        rounds = self.bubble_rounds
        return statistics.median(rounds) if rounds else bubble(self.measured_busy_s, self.measured_step_s)

    @property
    def bubble_error_points(self) -> float:
        """Predicted minus measured bubble, in percentage points."""
        return (self.predicted_bubble - self.measured_bubble) * 100

    @property
    def bubble_rounds(self) -> list[float]:
        """Each round's bubble, from its stages' busy seconds and its step (their speed factor cancels)."""
        return [bubble(busy, step) for busy, step in zip(zip(*self.busy_rounds_at_reference_s),
                                                         self.rounds_at_reference_s)]

    @property
    def bubble_error_interval_points(self) -> tuple[float, float]:
        """The predicted bubble against the ends of the rounds' bubbles' median interval
        (:func:`median_interval`), in points, lower first; (0, 0) without rounds."""
        rounds = self.bubble_rounds
        if not rounds:
            return 0.0, 0.0
        low, high = median_interval(rounds)
        return (self.predicted_bubble - high) * 100, (self.predicted_bubble - low) * 100

    @property
    def step_error(self) -> float:
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    @property
    def rounds_at_reference_s(self) -> list[float]:
        """Each round's step divided by its speed factor."""
        return [m / v for m, v in zip(self.measured_rounds_s, self.round_speeds)]

    @property
    def measured_at_reference_s(self) -> float:
        """The median over rounds of each round's step at the reference speed."""
        return statistics.median(self.rounds_at_reference_s)

    @property
    def round_spread(self) -> float:
        """Interquartile range of the rounds at the reference speed, over their median: how far
        this machine lets one measurement of the run be trusted."""
        return relative_spread(self.rounds_at_reference_s)

    @property
    def step_error_at_reference(self) -> float:
        """The step error with the machine's drift since calibration taken out (:mod:`calibrate.noise.speed`)."""
        return (self.predicted_step_s - self.measured_at_reference_s) / self.measured_at_reference_s

    @property
    def step_error_interval_at_reference(self) -> tuple[float, float]:
        """The step error at the reference speed against the ends of the measured median's interval
        (:func:`median_interval`): how far this validation's own rounds let the error move."""
        return error_interval(self.predicted_step_s, self.rounds_at_reference_s)

    @property
    def busy_error_intervals_at_reference(self) -> list[tuple[float, float]]:
        """Per stage, :attr:`busy_errors_at_reference` against the ends of its median's interval."""
        return [error_interval(p, rounds) for p, rounds in zip(self.predicted_busy_s, self.busy_rounds_at_reference_s)]

    @property
    def step_error_halves_at_reference(self) -> tuple[float, float] | None:
        """The step error at the reference speed as the two half calibrations predict the run, lower
        first: how far the calibration's own noise moves the prediction (None without halves)."""
        if len(self.predicted_step_halves_s) != 2:
            return None
        measured = self.measured_at_reference_s
        low, high = sorted((p - measured) / measured for p in self.predicted_step_halves_s)
        return low, high

    @property
    def memory_errors(self) -> list[float]:
        return [(p - m) / m if m else (0.0 if p == 0 else float("inf"))
                for p, m in zip(self.predicted_peak_bytes, self.measured_peak_bytes)]

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "predicted_step_s": self.predicted_step_s,
                "measured_step_s": self.measured_step_s, "measured_rounds_s": self.measured_rounds_s,
                "step_error": self.step_error, "round_speeds": self.round_speeds,
                "measured_at_reference_s": self.measured_at_reference_s,
                "step_error_at_reference": self.step_error_at_reference,
                "round_spread": self.round_spread, "replicas": self.replicas,
                "oversubscribed": self.oversubscribed,
                "predicted_peak_activation_bytes": self.predicted_peak_bytes,
                "measured_peak_activation_bytes": self.measured_peak_bytes,
                "memory_errors": self.memory_errors,
                "predicted_busy_s": self.predicted_busy_s, "measured_busy_s": self.measured_busy_s,
                "predicted_warm_up_s": self.predicted_warm_up_s, "warm_up_shares": self.warm_up_shares,
                "busy_errors": self.busy_errors,
                "measured_busy_at_reference_s": self.measured_busy_at_reference_s,
                "busy_rounds_at_reference_s": self.busy_rounds_at_reference_s,
                "busy_errors_at_reference": self.busy_errors_at_reference,
                "round_warm_up_factors": self.round_warm_up_factors, "warm_up_factor": self.warm_up_factor,
                "busy_errors_at_probed_warm_up": self.busy_errors_at_probed_warm_up,
                "busy_error_intervals_at_probed_warm_up": [
                    list(i) for i in self.busy_error_intervals_at_probed_warm_up],
                "predicted_bubble": self.predicted_bubble,
                "measured_bubble": self.measured_bubble, "bubble_error_points": self.bubble_error_points,
                "predicted_end_span_s": self.predicted_end_span_s, "measured_end_span_s": self.measured_end_span_s,
                "predicted_kind_s": self.predicted_kind_s,
                "measured_kind_at_reference_s": self.measured_kind_at_reference_s,
                "kind_errors_at_reference": self.kind_errors_at_reference, "busy_round_spread": self.busy_round_spread,
                "step_error_interval_at_reference": list(self.step_error_interval_at_reference),
                "busy_error_intervals_at_reference": [list(i) for i in self.busy_error_intervals_at_reference],
                "bubble_error_interval_points": list(self.bubble_error_interval_points),
                "predicted_step_halves_s": self.predicted_step_halves_s,
                "measured_replica_wait_s": self.measured_replica_wait_s,
                "predicted_replica_wait_s": self.predicted_replica_wait_s,
                "replica_wait_points": list(self.replica_wait_points), "replica_busy_spread": self.replica_busy_spread,
                "step_error_halves_at_reference": (list(self.step_error_halves_at_reference)
                                                   if self.step_error_halves_at_reference else None)}


def relative_spread(values: Sequence[float]) -> float:
    """Interquartile range over the median (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def median_interval(values: Sequence[float], confidence: float = 0.9) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics x(k) and
    x(n + 1 - k) with the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is at least
    ``confidence`` (with 15 rounds, the 4th and 12th of them: 96.5%); (min, max) where no k reaches it.

    Limits: it assumes the rounds independent draws of one pace. Rounds interleaved over a
    validation's minutes see its slow and fast stretches, so the interval covers how the machine moved
    while validating; not how it moved between calibration and validation (what the speed probe
    corrects, imperfectly), nor the calibration's own noise.
    """
    from scipy.stats import binom

    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("an interval needs at least one value")
    k = 1
    while k + 1 <= (n + 1) // 2 and 1.0 - 2.0 * binom.cdf(k, n, 0.5) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k]


def error_interval(predicted: float, rounds: Sequence[float]) -> tuple[float, float]:
    """(predicted - m) / m at both ends of the rounds' median interval, lower error first; (0, 0)
    without rounds."""
    if not rounds:
        return 0.0, 0.0
    low, high = median_interval(rounds)
    return ((predicted - high) / high if high else 0.0), ((predicted - low) / low if low else 0.0)


def bubble(busy_s: Sequence[float], step_s: float) -> float:
    """The idle share of the stages' step: 1 - mean busy / step, one definition for both sides."""
    return 1.0 - statistics.fmean(busy_s) / step_s if busy_s and step_s > 0 else 0.0


def compare(data: dict[str, Any], spec: RunSpec, reports: Sequence[dict[str, Any]],
            processes_available: int | None = None) -> Comparison:
    """Prediction against the median step time over ``reports`` (one per round) of one run.

    ``processes_available`` (None: no limit) marks the run oversubscribed when D x K exceeds it.
    """
    result = predict(data, spec, data.get("system", "cpu"))
    halves = [predict({**data, **half}, spec, data.get("system", "cpu")).step_time_s
              for half in data.get("fit_halves", [])]
    measured = statistics.median(r["step_time_s"] for r in reports)
    # the pace probed with as many processes sharing the machine as this run has (D x K)
    reference = data.get("speed", {}).get("reference_s", {}).get(str(spec.processes))
    busy, span = measured_components(reports)
    replica_zero = sorted((s for s in result.stages if s.replica == 0), key=lambda s: s.stage)
    predicted_busy = [s.busy_s for s in replica_zero]
    speeds = [speed_factor(run_probes(r), reference) for r in reports]
    loss_reference = after_wait_reference_s(data, spec.processes)
    rounds_busy = [[r["stages"][k]["busy_s"] / speed for r, speed in zip(reports, speeds)] for k in range(len(busy))]
    waits = [replica_waits(r, spec.replicas) for r in reports]
    return Comparison(spec.label(), result.step_time_s, measured,
                      replica_zero_peak_bytes(result),
                      [s["peak_activation_bytes"] for s in reports[0]["stages"]],
                      [r["step_time_s"] for r in reports], speeds, spec.replicas,
                      processes_available is not None and spec.processes > processes_available,
                      predicted_busy, busy, predicted_end_span_s(result), span, rounds_busy,
                      predicted_kind_s(result, len(busy)), measured_kind_s(reports, speeds, len(busy)), halves,
                      [statistics.median(w[0][k] for w in waits) for k in range(len(busy))] if spec.replicas > 1
                      else [], predicted_replica_waits_s(result, len(busy)) if spec.replicas > 1 else [],
                      statistics.median(w[1] for w in waits) if spec.replicas > 1 else 0.0,
                      [s.warm_up_s for s in replica_zero],
                      [warm_up_factor(run_after_wait_probes(r), loss_reference) for r in reports]
                      if loss_reference is not None else [])


def predicted_kind_s(result: Any, stages: int) -> dict[str, list[float]]:
    """Per compute kind the simulated step has, each stage's seconds of it (replica 0)."""
    from sim.schedules.schedule import COMPUTE_KINDS

    table: dict[str, list[float]] = {}
    for r in result.timeline.records:
        if r.kind in COMPUTE_KINDS and not r.replica:
            table.setdefault(r.kind, [0.0] * stages)[r.stage] += r.duration_s
    return table


def measured_kind_s(reports: Sequence[dict[str, Any]], speeds: Sequence[float], stages: int) -> dict[str, list[float]]:
    """Per compute kind, each stage's seconds of it in a step: the sum of the report's per-action
    medians, at the reference speed, the median over rounds."""
    rounds: dict[str, list[list[float]]] = {}
    for report, speed in zip(reports, speeds):
        table: dict[str, list[float]] = {}
        for action in report["actions"]:
            table.setdefault(action["kind"], [0.0] * stages)[action["stage"]] += action["duration_s"] / speed
        for kind, values in table.items():
            rounds.setdefault(kind, []).append(values)
    return {kind: [statistics.median(v[k] for v in values) for k in range(stages)] for kind, values in rounds.items()}


def replica_zero_peak_bytes(result: Any) -> list[int]:
    """Predicted peak activation bytes of replica 0's stages, in stage order, as the executor's
    report gives its measured ones (the simulator lists every device of every replica)."""
    stages = sorted((s for s in result.stages if getattr(s, "replica", 0) == 0), key=lambda s: s.stage)
    return [s.peak_activation_bytes for s in stages]


def summarize(all_comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """Median and worst errors over the runs that fit the machine; oversubscribed ones are counted."""
    comparisons = [c for c in all_comparisons if not c.oversubscribed]
    steps = [abs(c.step_error) for c in comparisons]
    at_reference = [abs(c.step_error_at_reference) for c in comparisons]
    memory = [abs(e) for c in comparisons for e in c.memory_errors]
    busy = [abs(e) for c in comparisons for e in c.busy_errors]
    busy_at_reference = [abs(e) for c in comparisons for e in c.busy_errors_at_reference]
    bubbles = [abs(c.bubble_error_points) for c in comparisons]
    kinds: dict[str, list[float]] = {}  # signed: a kind predicted low everywhere shows as such
    worst_step = max(comparisons, key=lambda c: abs(c.step_error_at_reference), default=None)
    stage_busy = [(abs(e), interval, c, k) for c in comparisons
                  for k, (e, interval) in enumerate(zip(c.busy_errors_at_reference, c.busy_error_intervals_at_reference))]
    worst_stage = max(stage_busy, key=lambda item: item[0], default=None)
    half_widths = [(high - low) / 2 for c in comparisons for low, high in [c.step_error_interval_at_reference]]
    busy_half_widths = [(high - low) / 2 for _, (low, high), _, _ in stage_busy]
    for c in comparisons:
        for kind, errors in c.kind_errors_at_reference.items():
            kinds.setdefault(kind, []).extend(e for e in errors if e is not None)
    return {"runs": len(comparisons), "oversubscribed_runs": len(all_comparisons) - len(comparisons),
            "median_busy_error": statistics.median(busy) if busy else 0.0, "worst_busy_error": max(busy, default=0.0),
            "median_busy_error_at_reference": statistics.median(busy_at_reference) if busy_at_reference else 0.0,
            "worst_busy_error_at_reference": max(busy_at_reference, default=0.0),
            "median_bubble_error_points": statistics.median(bubbles) if bubbles else 0.0,
            "worst_bubble_error_points": max(bubbles, default=0.0),
            "median_step_error": statistics.median(steps) if steps else 0.0,
            "worst_step_error": max(steps, default=0.0),
            "median_step_error_at_reference": statistics.median(at_reference) if at_reference else 0.0,
            "worst_step_error_at_reference": max(at_reference, default=0.0),
            "median_round_spread": statistics.median(c.round_spread for c in comparisons) if comparisons else 0.0,
            "median_busy_round_spread": (statistics.median(c.busy_round_spread for c in comparisons)
                                         if comparisons else 0.0),
            "median_memory_error": statistics.median(memory) if memory else 0.0,
            "worst_memory_error": max(memory, default=0.0),
            "median_kind_error_at_reference": {kind: statistics.median(errors) for kind, errors in kinds.items()},
            # the noise beside the errors: how far each run's own rounds let its error move (median_interval)
            "median_step_error_half_width_at_reference": statistics.median(half_widths) if half_widths else 0.0,
            "worst_step_error_interval_at_reference": (list(worst_step.step_error_interval_at_reference)
                                                       if worst_step else [0.0, 0.0]),
            "runs_with_step_error_beyond_noise": sum(1 for c in comparisons for low, high in
                                                     [c.step_error_interval_at_reference] if not low <= 0.0 <= high),
            "median_busy_error_half_width_at_reference": (statistics.median(busy_half_widths)
                                                          if busy_half_widths else 0.0),
            "worst_busy_error_interval_at_reference": list(worst_stage[1]) if worst_stage else [0.0, 0.0],
            "worst_busy_stage_at_reference": _stage_entry(worst_stage[2], worst_stage[3]) if worst_stage else None,
            "runs_with_bubble_error_beyond_noise": sum(1 for c in comparisons for low, high in
                                                       [c.bubble_error_interval_points] if not low <= 0.0 <= high),
            **halves_summary(comparisons, worst_step), **probed_warm_up_summary(comparisons),
            "beyond_goals_beyond_noise": beyond_goals(comparisons)}


def beyond_goals(comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """The errors that miss their goal by more than their own rounds allow: the stages whose busy error
    at the reference speed has its whole interval (:func:`median_interval`) beyond :data:`BUSY_GOAL`,
    also with the warm-up at each run's after-wait probe where runs were probed, and the runs whose
    step or bubble interval lies beyond :data:`STEP_GOAL` or :data:`BUBBLE_GOAL_POINTS`. An error past
    its goal whose interval still reaches inside it is one this machine's noise can explain; these
    cannot be. Each stage as [run, stage, error, low, high]; each run as [run, error, low, high]."""
    def stages(errors: Callable[[Comparison], list[float]],
               intervals: Callable[[Comparison], list[tuple[float, float]]]) -> list[list[Any]]:
        return [[c.run, k, e, low, high] for c in comparisons
                for k, (e, (low, high)) in enumerate(zip(errors(c), intervals(c))) if past((low, high), BUSY_GOAL)]

    result: dict[str, Any] = {
        "stages": sum(len(c.busy_errors_at_reference) for c in comparisons),
        "busy": stages(lambda c: c.busy_errors_at_reference, lambda c: c.busy_error_intervals_at_reference),
        "step": [[c.run, c.step_error_at_reference, *c.step_error_interval_at_reference] for c in comparisons
                 if past(c.step_error_interval_at_reference, STEP_GOAL)],
        "bubble": [[c.run, c.bubble_error_points, *c.bubble_error_interval_points] for c in comparisons
                   if past(c.bubble_error_interval_points, BUBBLE_GOAL_POINTS)]}
    if any(c.round_warm_up_factors for c in comparisons):
        result["busy_at_probed_warm_up"] = stages(lambda c: c.busy_errors_at_probed_warm_up,
                                                  lambda c: c.busy_error_intervals_at_probed_warm_up)
    return result


def _stage_entry(comparison: Comparison, stage: int) -> dict[str, Any]:
    """A stage named in the summary: its run, its index, how much of its predicted busy time is the
    warm-up after long waits (0 where none was recorded) and its run's after-wait probe against the
    calibration's."""
    shares = comparison.warm_up_shares
    return {"run": comparison.run, "stage": stage, "warm_up_share": shares[stage] if stage < len(shares) else 0.0,
            "warm_up_factor": comparison.warm_up_factor}


def probed_warm_up_summary(comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """The busy errors with each stage's warm-up at its run's probed after-wait loss
    (:attr:`Comparison.busy_errors_at_probed_warm_up`): median, worst and where, and how far the runs'
    probes ranged against the calibration's; {} where no run has probes against a reference."""
    probed = [c for c in comparisons if c.round_warm_up_factors]
    stages = [(abs(e), c, k) for c in probed for k, e in enumerate(c.busy_errors_at_probed_warm_up)]
    if not stages:
        return {}
    worst = max(stages, key=lambda item: item[0])
    rounds = [f for c in probed for f in c.round_warm_up_factors]
    return {"median_busy_error_at_probed_warm_up": statistics.median(e for e, _, _ in stages),
            "worst_busy_error_at_probed_warm_up": worst[0],
            "worst_busy_stage_at_probed_warm_up": _stage_entry(worst[1], worst[2]),
            "warm_up_factor_range": [min(c.warm_up_factor for c in probed), max(c.warm_up_factor for c in probed)],
            "round_warm_up_factor_range": [min(rounds), max(rounds)]}


def halves_summary(comparisons: Sequence[Comparison], worst_step: Comparison | None) -> dict[str, Any]:
    """How far the two half calibrations put each run's step apart (in points of its error): median
    and worst, and ``worst_step``'s errors by each half; {} without halves."""
    apart = [high - low for c in comparisons if c.step_error_halves_at_reference
             for low, high in [c.step_error_halves_at_reference]]
    if not apart or worst_step is None:
        return {}
    return {"median_halves_apart": statistics.median(apart), "worst_halves_apart": max(apart),
            "worst_step_error_halves_at_reference": list(worst_step.step_error_halves_at_reference or (0.0, 0.0))}


def check_fit_halves(data: dict[str, Any]) -> None:
    """Refuse, in one line, a costs file whose ``fit_halves`` is not two fits with a ``pipeline`` each."""
    from sim.errors import GpipeInputError

    halves = data.get("fit_halves", [])
    if not (isinstance(halves, list) and len(halves) in (0, 2)
            and all(isinstance(half, dict) and isinstance(half.get("pipeline"), dict) for half in halves)):
        raise GpipeInputError("the costs file's fit_halves is not two fits with a pipeline each; run gpipe "
                              "calibrate --force to measure it again")


def validate(data: dict[str, Any], steps: int = 5, limit: int | None = None,
             progress: Callable[[str], None] = print, rounds: int = 3,
             others: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Run the held-out design for the model in the costs ``data``; the comparisons and summary.

    Each configuration is measured in ``rounds`` rounds, the rounds interleaved (all configurations
    once, then all again), and compared by its median: on a shared machine whose speed drifts by
    tens of percent over seconds, one measurement of a run says more about the moment than the run.
    The costs files in ``others`` (other calibrations of the same model, checked by
    :func:`calibrate.validate.across_calibrations.check_same_calibration`) judge the same measurements: each
    run's ``calibrations`` entry and the summary's ``across_calibrations``.
    """
    from calibrate.measure.runs import run_configs
    from sim.formats.costs import MeasuredWorkload, allreduce_link, measured_precision

    for each in (data, *others):
        allreduce_link(each)  # a malformed entry is refused before any run starts
        check_fit_halves(each)
    model = data["model"]
    max_stages = max((int(k) for k in data.get("pipeline", {})), default=1)
    workload = MeasuredWorkload(data)
    specs = validation_design(int(model["num_layers"]), int(data["batch_size"]), max_stages, limit,
                              attention_core=workload.has_attention_core,
                              tensor_parallel=workload.tensor_parallel_options[1:])
    device = data.get("machine", {}).get("device", "cpu")
    configs = [run_config(model["name"], model["options"], s, steps, device, data.get("optimizer", "sgd"),
                          measured_precision(data))
               for s in specs]
    progress(f"validating on {len(specs)} held-out configurations ({steps} steps each, {rounds} rounds)")
    reports = run_configs(configs * rounds, progress=progress)
    available = machine_processes(device)
    comparisons = [compare(data, s, reports[i::len(specs)], available) for i, s in enumerate(specs)]
    summary, runs = summarize(comparisons), [c.to_dict() for c in comparisons]
    if others:
        from calibrate.validate import across_calibrations

        judged = [[compare(other, s, reports[i::len(specs)], available).to_dict() for i, s in enumerate(specs)]
                  for other in others]
        for k, run in enumerate(runs):
            run["calibrations"] = across_calibrations.run_entry([run] + [each[k] for each in judged])
        summary["across_calibrations"] = across_calibrations.summary(
            [run["calibrations"] for run in runs if not run["oversubscribed"]])
    return {"model": model, "precision": measured_precision(data), "machine": data.get("machine", {}),
            "steps": steps, "rounds": rounds, "summary": summary, "runs": runs}


def _after_waits(share: float) -> str:
    """``n% after waits``: a stage's share of predicted busy time that is the warm-up after long waits
    (:mod:`sim.engine.warm_up`)."""
    return f"{share * 100:.0f}% after waits"


def _stage_after_waits(result: dict[str, Any], label: str, stage: int) -> str:
    """`` (n% after waits; e% at the run's after-wait probe)`` of ``label``'s stage: its run's
    ``warm_up_shares``, and the median over the calibrations of its busy error with the warm-up at the
    run's probe where the run was probed (nothing for a stage without a warm-up)."""
    run = next((run for run in result["runs"] if run["run"] == label), {})
    shares = run.get("warm_up_shares") or []
    if stage >= len(shares) or shares[stage] <= 0:
        return ""
    probed = run.get("calibrations", {}).get("median", {}).get("busy_errors_at_probed_warm_up") or []
    at_probe = (f"; {probed[stage] * 100:+.1f}% at the run's after-wait probe"
                if run.get("round_warm_up_factors") and stage < len(probed) else "")
    return f" ({_after_waits(shares[stage])}{at_probe})"


def _worst_stage(summary: dict[str, Any], key: str = "worst_busy_stage_at_reference") -> str:
    """`` by <run> stage k (n% after waits)``: where the summary's worst busy error at the reference
    speed (or the one ``key`` names) is, with its run's after-wait probe against the calibration's
    where one was taken (nothing in results from before it was recorded)."""
    worst = summary.get(key)
    if not worst:
        return ""
    notes = [_after_waits(worst["warm_up_share"])] if worst["warm_up_share"] > 0 else []
    if "median_busy_error_at_probed_warm_up" in summary and "warm_up_factor" in worst:
        notes.append(f"after-wait probe x{worst['warm_up_factor']:.2f}")
    return f", by {worst['run']} stage {worst['stage']}" + (f" ({'; '.join(notes)})" if notes else "")


def _beyond_goals_line(goals: dict[str, Any], runs: int) -> str:
    """The summary's :func:`beyond_goals` as one line of the table."""
    return (f"past the goals by more than their own rounds allow (the error's whole interval beyond: busy "
            f"+-{BUSY_GOAL * 100:.0f}%, step +-{STEP_GOAL * 100:.0f}%, bubble +-{BUBBLE_GOAL_POINTS:.0f} "
            f"points): " + _goals_tally(goals, runs, "busy_at_probed_warm_up" in goals))


def _past_goals_by_every_calibration_line(goals: dict[str, Any], runs: int, probed: bool) -> str:
    """The summary's :func:`calibrate.validate.across_calibrations.past_goals` as one line of the table."""
    return ("past the goals by more than their own rounds allow by every calibration (neither the machine's "
            "round-to-round noise nor the moment of calibration explains these; the median over the "
            "calibrations shown): " + _goals_tally(goals, runs, probed))


def _goals_tally(goals: dict[str, Any], runs: int, probed: bool) -> str:
    """How many stages and runs miss each goal, each named with its error and, where the entry carries
    them, its interval's ends: stages as [run, stage, error, *bounds], runs as [run, error, *bounds]."""
    def percent(error: float, bounds: Sequence[float]) -> str:
        return f"{error * 100:+.1f}%" + (f" ({_interval(bounds)})" if bounds else "")

    def stages(entries: Sequence[Sequence[Any]]) -> str:
        return "".join(f"; {run} stage {stage} {percent(error, bounds)}" for run, stage, error, *bounds in entries)

    text = f"busy {len(goals['busy'])} of {goals['stages']} stages{stages(goals['busy'])}"
    if probed:
        text += (f"; with the warm-up at each run's after-wait probe {len(goals['busy_at_probed_warm_up'])} of "
                 f"{goals['stages']}{stages(goals['busy_at_probed_warm_up'])}")
    text += f"; step {len(goals['step'])} of {runs} runs" + "".join(
        f"; {run} {percent(error, bounds)}" for run, error, *bounds in goals["step"])
    return text + f"; bubble {len(goals['bubble'])} of {runs} runs" + "".join(
        f"; {run} {points:+.1f} points" + (f" ({bounds[0]:+.1f}..{bounds[1]:+.1f})" if bounds else "")
        for run, points, *bounds in goals["bubble"])


def _worst_signed(errors: Sequence[float]) -> float:
    return max(errors, key=abs, default=0.0)


def _interval(bounds: Sequence[float]) -> str:
    return f"{bounds[0] * 100:+.0f}..{bounds[1] * 100:+.0f}%"


def _mib(values: Sequence[int]) -> str:
    return "/".join(f"{v / 2**20:.2f}" for v in values)


OVERSUBSCRIBED_MARK = "*"


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table: one line per run (D, then the run), then the median and worst errors.

    Runs with more processes than the machine has cores (GPUs) carry :data:`OVERSUBSCRIBED_MARK`
    after D and stay out of the summary lines.
    """
    header = (f"{'D':>2}  {'run':<40} {'pred ms':>9} {'meas ms':>9} {'err':>7} {'@ref ms':>9} {'err@ref':>8} "
              f"{'spread':>7} {'interval':>11} {'halves':>11} {'calibs':>11}  "
              f"{'pred MiB':>13} {'meas MiB':>13} {'mem err':>8}  "
              f"{'busy err':>8} {'busy@ref':>8} {'spread':>7} {'interval':>11} {'bubble p/m':>11} {'end p/m ms':>13}")
    lines = [header, "-" * len(header)]
    for run in result["runs"]:
        worst_mem = max((abs(e) for e in run["memory_errors"]), default=0.0)
        mark = OVERSUBSCRIBED_MARK if run.get("oversubscribed") else " "
        busy_at_reference = run.get("busy_errors_at_reference", run.get("busy_errors", []))
        busy_intervals = run.get("busy_error_intervals_at_reference") or [[0.0, 0.0]] * len(busy_at_reference)
        worst_stage = max(range(len(busy_at_reference)), key=lambda k: abs(busy_at_reference[k]), default=None)
        busy_interval = busy_intervals[worst_stage] if worst_stage is not None else [0.0, 0.0]
        halves = run.get("step_error_halves_at_reference")
        calibrations = run.get("calibrations", {}).get("step_error_range_at_reference")
        lines.append(f"{run.get('replicas', 1):>2}{mark} {run['run']:<40} {run['predicted_step_s'] * 1e3:>9.2f} "
                     f"{run['measured_step_s'] * 1e3:>9.2f} {run['step_error'] * 100:>+6.1f}% "
                     f"{run.get('measured_at_reference_s', run['measured_step_s']) * 1e3:>9.2f} "
                     f"{run.get('step_error_at_reference', run['step_error']) * 100:>+7.1f}% "
                     f"{run.get('round_spread', 0.0) * 100:>6.1f}% "
                     f"{_interval(run.get('step_error_interval_at_reference', [0.0, 0.0])):>11} "
                     f"{_interval(halves) if halves else '-':>11} "
                     f"{_interval(calibrations) if calibrations else '-':>11}  "
                     f"{_mib(run['predicted_peak_activation_bytes']):>13} "
                     f"{_mib(run['measured_peak_activation_bytes']):>13} {worst_mem * 100:>7.2f}%  "
                     f"{_worst_signed(run.get('busy_errors', [])) * 100:>+7.1f}% "
                     f"{_worst_signed(busy_at_reference) * 100:>+7.1f}% "
                     f"{run.get('busy_round_spread', 0.0) * 100:>6.1f}% {_interval(busy_interval):>11} "
                     f"{run.get('predicted_bubble', 0.0) * 100:>5.1f}/{run.get('measured_bubble', 0.0) * 100:<5.1f} "
                     f"{run.get('predicted_end_span_s', 0.0) * 1e3:>6.2f}/{run.get('measured_end_span_s', 0.0) * 1e3:<6.2f}")
    s = result["summary"]
    lines.append("-" * len(header))
    lines.append(f"step time error: median {s['median_step_error'] * 100:.1f}%, worst "
                 f"{s['worst_step_error'] * 100:.1f}% over {s['runs']} runs; at the reference speed "
                 f"(machine drift since calibration taken out): median "
                 f"{s.get('median_step_error_at_reference', 0.0) * 100:.1f}%, worst "
                 f"{s.get('worst_step_error_at_reference', 0.0) * 100:.1f}%; rounds of one run spread by "
                 f"{s.get('median_round_spread', 0.0) * 100:.1f}% (median interquartile range)")
    if "median_step_error_half_width_at_reference" in s:
        lines.append("noise beside the errors (interval: where a run's error at the reference speed lies, from "
                     "its median's interval over its rounds, at least 90% confidence): a run's step error known "
                     f"to +-{s['median_step_error_half_width_at_reference'] * 100:.1f}% (median half-width), "
                     f"the worst run's in {_interval(s['worst_step_error_interval_at_reference'])}; "
                     f"{s['runs_with_step_error_beyond_noise']} of {s['runs']} runs' step errors beyond their "
                     f"interval's reach of zero; a stage's busy error known to "
                     f"+-{s['median_busy_error_half_width_at_reference'] * 100:.1f}%, the worst in "
                     f"{_interval(s['worst_busy_error_interval_at_reference'])}; "
                     f"{s['runs_with_bubble_error_beyond_noise']} of {s['runs']} runs' bubble errors beyond their "
                     "interval's reach of zero")
    if "median_halves_apart" in s:
        lines.append("the calibration's own noise (halves: the step error as fits on the odd and on the even "
                     "design rounds predict it): the halves put a run "
                     f"{s['median_halves_apart'] * 100:.1f} points apart (median), "
                     f"{s['worst_halves_apart'] * 100:.1f} at worst; the worst run's error by the halves "
                     f"{_interval(s['worst_step_error_halves_at_reference'])}")
    across = s.get("across_calibrations")
    if across:
        over = across["median_over_calibrations"]
        lines.append(f"the moment of calibration (calibs: the step error as each of {across['calibrations']} "
                     "costs files predicts the run, each at its own reference speed): they put a run "
                     f"{across['median_calibrations_apart'] * 100:.1f} points apart (median), "
                     f"{across['worst_calibrations_apart'] * 100:.1f} at worst; the median over them: step "
                     f"error median {over['median_step_error_at_reference'] * 100:.1f}%, worst "
                     f"{over['worst_step_error_at_reference'] * 100:.1f}%; busy median "
                     f"{over['median_busy_error_at_reference'] * 100:.1f}%, worst "
                     f"{over['worst_busy_error_at_reference'] * 100:.1f}%"
                     + (f" (with the warm-up at each run's probed after-wait loss: median "
                        f"{over['median_busy_error_at_probed_warm_up'] * 100:.1f}%, worst "
                        f"{over['worst_busy_error_at_probed_warm_up'] * 100:.1f}%)"
                        if "median_busy_error_at_probed_warm_up" in s else "")
                     + "; bubble median "
                     f"{over['median_bubble_error_points']:.1f} points, worst {over['worst_bubble_error_points']:.1f}")
        beyond = across["runs_beyond_noise_by_every_calibration"]
        lines.append(f"{len(beyond)} of {s['runs']} runs' step errors beyond their interval's reach of zero, on the "
                     "same side, by every calibration (errors no noise measured here explains)"
                     + (": " + "; ".join(beyond) if beyond else ""))
        stages = across["stages_beyond_noise_by_every_calibration"]
        lines.append(f"{len(stages)} stages' busy errors beyond their interval's reach of zero by every calibration"
                     + (": " + "; ".join(f"{run} stage {stage} {error * 100:+.1f}%{_stage_after_waits(result, run, stage)}"
                                         for run, stage, error in stages) if stages else ""))
        bubbles = across["bubbles_beyond_noise_by_every_calibration"]
        lines.append(f"{len(bubbles)} runs' bubble errors beyond their interval's reach of zero by every calibration"
                     + (": " + "; ".join(f"{run} {points:+.1f} points" for run, points in bubbles) if bubbles else ""))
        if "past_goals_by_every_calibration" in across:
            lines.append(_past_goals_by_every_calibration_line(across["past_goals_by_every_calibration"], s["runs"],
                                                               "median_busy_error_at_probed_warm_up" in s))
    lines.append("peak activation memory "
                 f"error: median {s['median_memory_error'] * 100:.2f}%, worst {s['worst_memory_error'] * 100:.2f}%")
    lines.append(f"components: busy time per stage error median {s.get('median_busy_error', 0.0) * 100:.1f}%, worst "
                 f"{s.get('worst_busy_error', 0.0) * 100:.1f}% (at the reference speed: median "
                 f"{s.get('median_busy_error_at_reference', s.get('median_busy_error', 0.0)) * 100:.1f}%, worst "
                 f"{s.get('worst_busy_error_at_reference', s.get('worst_busy_error', 0.0)) * 100:.1f}%"
                 f"{_worst_stage(s)}; rounds spread "
                 f"a stage's busy time by {s.get('median_busy_round_spread', 0.0) * 100:.1f}%); bubble error median "
                 f"{s.get('median_bubble_error_points', 0.0):.1f} points, worst "
                 f"{s.get('worst_bubble_error_points', 0.0):.1f} (bubble: 1 - mean busy / step; end: from the last "
                 "backward to the step's end, and in a measured step from the previous step's end to its first compute "
                 "action, predicted/measured)")
    if "median_busy_error_at_probed_warm_up" in s:
        lines.append("the after-wait loss at each run's moment (the first layer's forward after a "
                     f"{WAIT_S * 1e3:.0f} ms wait, probed around each round, against the calibration's): "
                     f"x{s['warm_up_factor_range'][0]:.2f}-x{s['warm_up_factor_range'][1]:.2f} over the runs "
                     f"(x{s['round_warm_up_factor_range'][0]:.2f}-x{s['round_warm_up_factor_range'][1]:.2f} over "
                     "rounds); busy time per stage with each stage's predicted warm-up scaled to it: error median "
                     f"{s['median_busy_error_at_probed_warm_up'] * 100:.1f}%, worst "
                     f"{s['worst_busy_error_at_probed_warm_up'] * 100:.1f}%"
                     f"{_worst_stage(s, 'worst_busy_stage_at_probed_warm_up')}")
    goals = s.get("beyond_goals_beyond_noise")
    if goals:
        lines.append(_beyond_goals_line(goals, s["runs"]))
    waits = [run for run in result["runs"] if run.get("replicas", 1) > 1 and run.get("measured_replica_wait_s")]
    if waits:
        lines.append("replicas (D > 1): replica 0's wait for the slowest replica of its stage before the gradient "
                     "all-reduce, a step, predicted (the straggler allowance calibration's deviations give) / "
                     "measured, in ms and in points of the step (part of the bubble), and the measured spread of "
                     "a replica's compute per step: "
                     + "; ".join(f"{run['run']}: "
                                 f"{statistics.fmean(run.get('predicted_replica_wait_s') or [0.0]) * 1e3:.1f}/"
                                 f"{statistics.fmean(run['measured_replica_wait_s']) * 1e3:.1f} ms "
                                 f"({run['replica_wait_points'][0]:.1f}/{run['replica_wait_points'][1]:.1f} points; "
                                 f"spread {run['replica_busy_spread'] * 100:.1f}%)"
                                 for run in waits))
    if s.get("median_kind_error_at_reference"):
        lines.append("by kind of action, at the reference speed, median signed error of a stage's step of them: "
                     + ", ".join(f"{kind} {error * 100:+.1f}%"
                                 for kind, error in sorted(s["median_kind_error_at_reference"].items())))
    if s.get("oversubscribed_runs"):
        lines.append(f"{OVERSUBSCRIBED_MARK} oversubscribed: more processes (D x K) than this machine has "
                     f"cores (GPUs); measured for correctness, {s['oversubscribed_runs']} run(s) left out of "
                     "the errors above")
    return "\n".join(lines)
