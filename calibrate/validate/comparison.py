"""One held-out run's prediction against its measured rounds: step, memory, busy time, bubble, waits.

Errors are relative to the measurement: ``(predicted - measured) / measured``. Step times compare
the simulator's step with the executor's median step (warm-up excluded); memory compares each
stage's predicted peak activation bytes with the executor's exact count (:mod:`executor.runtime.memory`).
Each round is also put at the calibration's reference speed (divided by its speed factor,
:mod:`calibrate.noise.speed`): the errors ``..._at_reference`` are the simulator's own, with the
machine's drift since calibration taken out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from calibrate.fit.design import RunSpec
from calibrate.fit.step_components import (measured_components, predicted_end_span_s, predicted_replica_waits_s,
                                           replica_waits)
from calibrate.fit.step_fit import predict
from calibrate.noise.after_wait_probe import after_wait_reference_s, run_after_wait_probes, warm_up_factor
from calibrate.noise.speed import run_probes, speed_factor
from calibrate.validate.intervals import error_interval, median_interval, relative_spread


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
    # the step as the fits on the calibration's odd and even design rounds predict it
    # (calibrate.fit.design_fit.fit_halves)
    predicted_step_halves_s: list[float] = field(default_factory=list)
    # D > 1: per stage, replica 0's wait a step for the stage's slowest replica, measured (median over
    # rounds, calibrate.fit.step_components.replica_waits) and simulated (the straggler allowance), and
    # the spread of a replica's compute per step (median over rounds)
    measured_replica_wait_s: list[float] = field(default_factory=list)
    predicted_replica_wait_s: list[float] = field(default_factory=list)
    replica_busy_spread: float = 0.0
    # per stage (replica 0), the part of the predicted busy time the device runs slow after long
    # waits (sim.engine.host): the component whose size this machine moves most from moment to moment
    predicted_warm_up_s: list[float] = field(default_factory=list)
    # each round's after-wait probe against the calibration's (calibrate.noise.after_wait_probe.warm_up_factor)
    round_warm_up_factors: list[float] = field(default_factory=list)
    # why the run is not judged (a round's speed correction out of bounds after it was measured again,
    # calibrate.validate.held_out.speeds_within_bounds); None for a run judged
    not_judged: str | None = None
    # ZeRO-2/3: each rank's sharded bytes field by field (SHARDED_FIELDS: its shards of the parameters,
    # gradients and optimizer state, the gathered units in flight, the unsharded gradients accumulated
    # until the reduce-scatter); under expert parallelism without ZeRO-2/3 each rank's parameter, gradient
    # and optimizer bytes (EXPERT_STATE_FIELDS: its n/E routed experts); simulated and counted by the
    # executor, in (replica, stage) order
    predicted_sharded_bytes: list[dict[str, int]] = field(default_factory=list)
    measured_sharded_bytes: list[dict[str, int]] = field(default_factory=list)

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
        bubble of the medians: those come from different rounds, and where busy time and step do not move
        together (D > 1, whose step waits for the slower replica while replica 0's busy time does not
        grow) the bubble of the medians misses every round's (a D=2 K=1 run:
        docs/notes/2026-11-27-figures-behind-the-code.md)."""
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
        (:func:`calibrate.validate.intervals.median_interval`), in points, lower first; (0, 0)
        without rounds."""
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
        (:func:`calibrate.validate.intervals.median_interval`): how far this validation's own rounds let
        the error move."""
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
        """Each stage's activation peak, then (ZeRO-2/3, expert parallelism) each rank's sharded or state
        bytes field by field (:data:`SHARDED_FIELDS`, :data:`EXPERT_STATE_FIELDS`): predicted / counted - 1."""
        pairs = [*zip(self.predicted_peak_bytes, self.measured_peak_bytes),
                 *((p.get(name, 0), m.get(name, 0)) for p, m in zip(self.predicted_sharded_bytes,
                                                                     self.measured_sharded_bytes)
                   for name in SHARDED_FIELDS)]
        return [(p - m) / m if m else (0.0 if p == 0 else float("inf")) for p, m in pairs]

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
                "predicted_sharded_bytes": self.predicted_sharded_bytes,
                "measured_sharded_bytes": self.measured_sharded_bytes,
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
                                                   if self.step_error_halves_at_reference else None),
                "not_judged": self.not_judged}



def bubble(busy_s: Sequence[float], step_s: float) -> float:
    """The idle share of the stages' step: 1 - mean busy / step, one definition for both sides."""
    return 1.0 - statistics.fmean(busy_s) / step_s if busy_s and step_s > 0 else 0.0


def round_speed_factor(data: dict[str, Any], spec: RunSpec, report: dict[str, Any]) -> float:
    """One round's speed factor: the probes its ranks took around it against the calibration's
    reference pace with as many processes sharing the machine as the run has (D x K x T)."""
    reference = data.get("speed", {}).get("reference_s", {}).get(str(spec.processes))
    return speed_factor(run_probes(report), reference)


def compare(data: dict[str, Any], spec: RunSpec, reports: Sequence[dict[str, Any]],
            processes_available: int | None = None, not_judged: str | None = None) -> Comparison:
    """Prediction against the median step time over ``reports`` (one per round) of one run.

    ``processes_available`` (None: no limit) marks the run oversubscribed when D x K exceeds it;
    ``not_judged`` says why the run is left out of the summary (None: it is judged).
    """
    result = predict(data, spec, data.get("system", "cpu"))
    halves = [predict({**data, **half}, spec, data.get("system", "cpu")).step_time_s
              for half in data.get("fit_halves", [])]
    measured = statistics.median(r["step_time_s"] for r in reports)
    busy, span = measured_components(reports)
    replica_zero = sorted((s for s in result.stages if s.replica == 0), key=lambda s: s.stage)
    predicted_busy = [s.busy_s for s in replica_zero]
    speeds = [round_speed_factor(data, spec, r) for r in reports]
    loss_reference = after_wait_reference_s(data, spec.processes)
    rounds_busy = [[r["stages"][k]["busy_s"] / speed for r, speed in zip(reports, speeds)] for k in range(len(busy))]
    waits = [replica_waits(r, spec.layout.replicas) for r in reports]
    return Comparison(spec.label(), result.step_time_s, measured,
                      replica_zero_peak_bytes(result),
                      [s["peak_activation_bytes"] for s in reports[0]["stages"]],
                      [r["step_time_s"] for r in reports], speeds, spec.layout.replicas,
                      processes_available is not None and spec.processes > processes_available,
                      predicted_busy, busy, predicted_end_span_s(result), span, rounds_busy,
                      predicted_kind_s(result, len(busy)), measured_kind_s(reports, speeds, len(busy)), halves,
                      [statistics.median(w[0][k] for w in waits) for k in range(len(busy))] if spec.layout.replicas > 1
                      else [], predicted_replica_waits_s(result, len(busy)) if spec.layout.replicas > 1 else [],
                      statistics.median(w[1] for w in waits) if spec.layout.replicas > 1 else 0.0,
                      [s.host.warm_up_s if s.host else 0.0 for s in replica_zero],
                      [warm_up_factor(run_after_wait_probes(r), loss_reference) for r in reports]
                      if loss_reference is not None else [], not_judged,
                      *sharded_bytes(result, reports[0], spec))


# What a ZeRO-2/3 rank holds, each compared on its own (sim.engine.fsdp.ShardedMemory, the executor's
# report's "ranks" entries): a field missing from a report counts as 0 bytes.
SHARDED_FIELDS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "gathered_parameter_bytes_peak",
                  "accumulated_gradient_bytes")
# expert parallelism: a rank's own parameters (its n/E routed experts), their gradients and optimizer state
EXPERT_STATE_FIELDS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")


def sharded_bytes(result: Any, report: dict[str, Any],
                  spec: RunSpec) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
    """ZeRO-2/3 runs: each rank's sharded bytes as the simulator predicts them and as the executor
    counted them, field by field (:data:`SHARDED_FIELDS`); expert-parallel runs without ZeRO-2/3: each
    rank's state bytes (:data:`EXPERT_STATE_FIELDS`, the simulator's ``state_bytes``); in (replica, stage)
    order, empty otherwise."""
    ranks = sorted(report.get("ranks", []), key=lambda r: (r.get("replica", 0), r.get("stage", 0)))
    if spec.layout.expert_parallel > 1 and spec.layout.zero < 2:
        devices = sorted((s for s in result.stages if s.state_bytes is not None), key=lambda s: (s.replica, s.stage))
        return ([dict(zip(EXPERT_STATE_FIELDS, s.state_bytes)) for s in devices],
                [{name: rank.get(name, 0) for name in EXPERT_STATE_FIELDS} for rank in ranks])
    if spec.layout.zero < 2 or spec.layout.replicas < 2:
        return [], []
    devices = sorted((s for s in result.stages if s.sharded is not None), key=lambda s: (s.replica, s.stage))
    predicted = [{name: getattr(s.sharded, name) for name in SHARDED_FIELDS} for s in devices]
    measured = [{name: rank.get(name, 0) for name in SHARDED_FIELDS} for rank in report.get("ranks", [])]
    return predicted, measured


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

