"""The costs file and the measured :class:`Workload` the simulator runs from it (``--costs FILE``).

The costs file is the contract between calibration, which writes it (through :func:`write_costs`),
and the simulator, which reads it: its format, reading, validation and the workload built from it
live here, so reading a costs file needs neither torch nor calibration's code.

The file (JSON, ``version`` 1) holds what ``gpipe calibrate`` measured and fitted: the
machine stamp, the model and its options, the precision it ran at (``precision``, fp32 when absent),
the per-layer profile (times per row count and thread
count, exact saved bytes), the fitted link, the per-K pipeline fits (per kind of action, the scales of
the profile's part that grows with rows and of its fixed part, and a per-action overhead
(:class:`ActionFit`); the sender's time per send, the optimizer, the gap after each kind of action
and the step overhead), the fitted roofline efficiency and, where the machine ran
two processes or more, the measured all-reduce (``allreduce``: backend, group sizes ``parties``,
``sizes_bytes``, ``measured_s[i][j]`` for ``parties[i]`` and ``sizes_bytes[j]``, and the ring model's
``latency_s`` and ``bandwidth_bytes_per_s``, which :func:`allreduce_link` turns into the link the
simulator prices data-parallel gradient averaging on). Torch-free to load.

:class:`MeasuredWorkload` answers ``layer_costs(rows, device)`` from the profile, interpolating
piecewise-linearly between measured row counts (linear extrapolation beyond them), and gives the
simulator exact per-stage sums through ``stage_cost`` (see :class:`sim.engine.stage_costs.CostTable`):
the union of saved storages of consecutive layers, and the per-action and per-step constants the
pipeline fits found, which a sum over layers cannot express. ``bind`` picks the fits for a stage
count K (CPU runs give each of K processes cores/K threads, so K changes every time) and puts the
fitted link into the ``cpu`` system. On any other catalog device, ``layer_costs`` falls back to the
analytic model with the fitted efficiency (built-in models only) at the file's precision: a what-if,
not a measurement.

Limits: a stage's forwards use one time whatever the micro-batch; under ``except_last`` it is the
average of M-1 no-grad forwards and one forward with grad. Row counts far outside the profiled range
are extrapolated. Stage 0 of the executor stashes views of the whole input batch, which it counts
once; here each micro-batch stashes its own rows (identical when the input is small, as token ids).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Sequence

from sim.catalog.hardware import LOCAL_CPU, Device, Link, System
from sim.engine.host import NO_HOST_EFFECTS, HostEffects
from sim.engine.stage_costs import StageCost, layer_weight_grad_s, per_layer_bytes
from sim.errors import GpipeInputError
from sim.formats.timeline import read_json
from sim.schedules.schedule import COMPUTE_KINDS
from sim.workloads.precision import DEFAULT_PRECISION, FP32_BYTES
from sim.workloads.workload import LayerCost, SharedParameter

COSTS_VERSION = 1
COSTS_KIND = "gpipe-costs"
# options that describe the simulator's analysis, not the model torch builds
ANALYSIS_OPTIONS = ("precision", "optimizer_slots")


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), xs ascending; linear extrapolation at both ends."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _positive(value: float, floor: float) -> float:
    return value if value > floor else floor


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
    plus a per-action ``intercept``. Without ``fixed_slope`` (costs files from before it, or a fit whose
    design could not tell the parts apart) both parts take ``slope``."""

    slope: float
    intercept: float
    fixed_slope: float | None = None
    # what the action adds when it starts cold (sim.schedules.schedule.cold_starts); 0 in files from before it
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
        fixed = data.get("fixed_slope")
        return cls(float(data["slope"]), float(data["intercept"]), None if fixed is None else float(fixed),
                   float(data.get("cold_start_s", 0.0)))


@dataclass(frozen=True)
class PipelineFit:
    """What executor runs with K processes add to the layer profile (see :mod:`calibrate.fit.least_squares`)."""

    threads: int
    actions: dict[str, ActionFit]  # kind -> measured_s from the stage's profiled_s
    send: Affine  # seconds the sender spends in isend, from bytes
    optimizer: Affine  # seconds of the optimizer step, from a stage's parameter bytes
    step_overhead_s: float
    # per kind of action, the executor's own time after it before the device's next action
    # (:attr:`sim.engine.stage_costs.StageCost.gap_after_s`); costs files written before it was measured have none
    gap_after_s: dict[str, float] = dataclasses.field(default_factory=dict)
    # quantiles of a process's compute deviation in one step (:attr:`sim.engine.stage_costs.StageCost.replica_spread`);
    # none in costs files written before it was measured, or for a K whose design runs had one stage
    replica_spread: tuple[float, ...] = ()
    # a split backward's I on the first stage, which computes no gradient: the executor's own work around
    # it, measured (0 in costs files written before it was, or without a split design run)
    first_input_s: float = 0.0
    # seconds each layer after a stage's first adds to a backward under --checkpoint full beyond the
    # backward's and the recompute's lines summed, measured (0 in costs files written before it was, or
    # without a full design run: the sum as it is; files that kept a factor over the sum instead are read
    # as the sum)
    full_backward_per_layer_s: float = 0.0
    # what a CPU host adds to the actions (:mod:`sim.engine.host`: the warm-up after a long wait); off
    # where the file measured none
    host: HostEffects = NO_HOST_EFFECTS

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PipelineFit":
        return cls(int(data["threads"]), {k: ActionFit.from_dict(v) for k, v in data["actions"].items()},
                   Affine.from_dict(data["send"]), Affine.from_dict(data["optimizer"]),
                   float(data["step_overhead_s"]),
                   {kind: float(v) for kind, v in data.get("gap_after_s", {}).items()},
                   tuple(float(v) for v in data.get("replica_spread", ())),
                   float(data.get("first_input_s", 0.0)),
                   float(data.get("full_backward_per_layer_s", 0.0)),
                   HostEffects.from_dict({"warm_up_s": data.get("warm_up_s", 0.0)}))


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


class MeasuredWorkload:
    """A model's measured costs on this machine, bound to a stage count K (default: the largest)."""

    def __init__(self, data: dict[str, Any], stages: int | None = None, checkpoint: str = "except_last",
                 microbatches: int | None = None, tensor_parallel: int = 1, replicas: int = 1) -> None:
        self.data = data
        model = data["model"]
        self.tensor_parallel = tensor_parallel
        self.replicas = replicas  # D copies of the pipeline sharing the machine: D x K x T processes
        self.sequence_parallel = False  # the split layers were profiled without it
        self.name = f"{model['name']} (measured{f', T={tensor_parallel}' if tensor_parallel > 1 else ''})"
        self.model_name = model["name"]
        self.options = dict(model["options"])
        self.num_layers = int(model["num_layers"])
        # T > 1: one rank of a stage split over T ranks, as calibrate.measure.tp_profile measured it
        profile = data["profile"] if tensor_parallel == 1 else data["tensor_parallel_profile"][str(tensor_parallel)]
        # the split stage's in-pipeline factor per kind, fitted on calibration's split runs (1: none)
        self.split_factor = {kind: float(v) for kind, v in
                             data.get("tensor_parallel_fit", {}).get(str(tensor_parallel), {}).items()}
        self.rows = [int(r) for r in profile["rows"]]
        self.times = {int(t): kinds for t, kinds in profile["times_s"].items()}
        self.memory = profile["memory"]
        self.fits = {int(k): PipelineFit.from_dict(v) for k, v in data.get("pipeline", {}).items()}
        self.stages = stages if stages is not None else max(self.fits, default=1)
        self.checkpoint = checkpoint
        self.microbatches = microbatches
        self.device_name = data.get("catalog_device", LOCAL_CPU.name)
        self.optimizer = str(data.get("optimizer", "sgd"))  # the one calibration trained with
        self.optimizer_slots = int(data.get("optimizer_slots", 0))
        # fp32 weights, their gradient and optimizer state (the executor trains fp32 master weights)
        self.shared_parameters = tuple(
            SharedParameter(str(p["name"]), tuple(int(i) for i in p["layers"]), int(p["param_bytes"]),
                            int(p["param_bytes"]) * (2 + self.optimizer_slots))
            for p in data.get("shared_parameters", []))
        self.precision = measured_precision(data)
        self.batch_size = int(data["batch_size"]) if data.get("batch_size") else None  # the calibrated batch
        # --checkpoint selective: the profile measured what each layer's attention core saves and what
        # rerunning it inside the backward takes (calibrate.measure.profile's core_bytes and C)
        self.has_attention_core = (all("C" in kinds for kinds in self.times.values())
                                   and any(any(m.get("core_bytes", ())) for m in self.memory))

    # ------------------------------------------------------------------ binding to a plan

    def bind(self, system: System, stages: int, checkpoint: str = "except_last",
             microbatches: int | None = None, replicas: int = 1) -> tuple["MeasuredWorkload", System]:
        """This workload for K=``stages`` in D=``replicas`` pipelines, and ``system`` with the
        fitted link if it is the one measured."""
        bound = MeasuredWorkload(self.data, stages, checkpoint, microbatches, self.tensor_parallel, replicas)
        link = self.data.get("link")
        if link and system.name == self.data.get("system", "cpu"):
            fitted = Link(f"fitted {link.get('name', 'link')}", float(link["bandwidth_bytes_per_s"]),
                          float(link["latency_s"]))
            system = replace(system, intra_link=fitted)
        return bound, system

    def allreduce_link(self, system: System) -> Link | None:
        """The calibrated all-reduce link for ``system`` if it is the one measured, else None: the
        shared-memory route's where the file has one and this run's D x K x T processes fit the
        measured machine's cores (where the executor sums through shared memory), else the backend's."""
        if system.name != self.data.get("system", "cpu"):
            return None
        cores = self.data.get("machine", {}).get("cpu_cores")
        return allreduce_link(self.data, shared_memory=cores is not None and self._processes <= int(cores))

    @property
    def tensor_parallel_options(self) -> list[int]:
        """The T the costs file has a profile for (1 always)."""
        return [1, *sorted(int(t) for t in self.data.get("tensor_parallel_profile", {}))]

    def split(self, tensor_parallel: int) -> "MeasuredWorkload":
        """This workload with each stage split over ``tensor_parallel`` ranks (its measured profile)."""
        if tensor_parallel not in self.tensor_parallel_options:
            raise GpipeInputError(f"--tensor-parallel {tensor_parallel}: the costs file has no profile of the layers "
                                  f"split over {tensor_parallel} ranks (it has T in {self.tensor_parallel_options}); "
                                  f"run gpipe calibrate --tensor-parallel {tensor_parallel} --force")
        return MeasuredWorkload(self.data, self.stages, self.checkpoint, self.microbatches, tensor_parallel,
                                self.replicas)

    @property
    def fit(self) -> PipelineFit:
        """The pipeline fits of as many processes of one thread count as this run's D x K (the
        nearest fitted K): the fits carry what processes sharing the machine cost each other, and D
        replicas of a K-stage pipeline run D x K processes of cores / (D x K) threads each. A stage
        split over T ranks keeps those per-action overheads, sends and step overhead, and scales
        its split profile (measured with its T ranks sharing the machine already) by the factors
        fitted on calibration's split runs (``tensor_parallel_fit``) where the file has them, in
        place of the slopes, and its optimizer line by the optimizer's factor there."""
        if not self.fits:
            return IDENTITY
        processes = self.stages * self.replicas
        nearest = self.fits[min(self.fits, key=lambda k: (abs(k - processes), -k))]
        if not self.split_factor:
            return nearest
        # a split stage: the profile's times scale by the factor fitted on split runs, not K's slope
        # (lines of their own for the forward keeping its graph, I and W are left out: fitted on whole
        # stages, they would not scale a split one; those take F's and B's split factors)
        # and the optimizer's line by the split stage's factor where calibration fitted one
        optimizer = self.split_factor.get("optimizer", 1.0)
        return replace(nearest, actions={kind: ActionFit(self.split_factor.get(kind, line.slope), line.intercept)
                                         for kind, line in nearest.actions.items() if kind in ("F", "R", "B")},
                       optimizer=Affine(optimizer * nearest.optimizer.slope, optimizer * nearest.optimizer.intercept))

    def _threads(self) -> int:
        """The profiled thread count of a D x K x T-process run: cores / processes on CPU, as the
        executor gives each (one table on CUDA)."""
        cores = int(self.data.get("machine", {}).get("cpu_cores", max(self.times)))
        return min(self.times, key=lambda t: (abs(t - max(1, cores // self._processes)), t))

    @property
    def _processes(self) -> int:
        """The run's D x K x T processes."""
        return max(1, self.stages) * self.tensor_parallel * self.replicas

    # ------------------------------------------------------------------ per layer

    def profiled_s(self, kind: str, layer: int, rows: int) -> float:
        """The isolated layer's median time for ``kind`` (calibrate.measure.profile.KINDS), interpolated in rows."""
        values = self.times[self._threads()][kind][layer]
        return _positive(interpolate(self.rows, values, rows), 1e-9)

    def profiled_parts_s(self, kind: str, layer: int, rows: int) -> tuple[float, float]:
        """(time, its fixed part) of the isolated layer: the fixed part is the profile's line through
        its two smallest row counts, taken at zero rows (between 0 and the time itself), what a
        call costs whatever its rows (:class:`ActionFit` scales it apart)."""
        total = self.profiled_s(kind, layer, rows)
        values = self.times[self._threads()][kind][layer]
        if len(self.rows) < 2:
            return total, 0.0
        (r0, r1), (t0, t1) = self.rows[:2], values[:2]
        fixed = t0 - (t1 - t0) * r0 / (r1 - r0)
        return total, min(max(fixed, 0.0), t0, total)

    def _split_backward_s(self, layers: range, rows: int, backwards: list[float],
                          layer_params: list[int]) -> tuple[float, float]:
        """(W, what I + W take beyond B) of the layers' profiled backwards, before the in-pipeline
        factor: from the profiled I and W where the profile has them (as the executor splits each
        layer's backward), else the analytic half of a layer with weights and no overhead."""
        if "W" not in self.times[self._threads()]:  # a profile from before I and W were timed apart
            return sum(layer_weight_grad_s(b, p) for b, p in zip(backwards, layer_params)), 0.0
        weight = sum(self.profiled_s("W", i, rows) for i in layers)
        split = sum(self.profiled_s("I", i, rows) for i in layers) + weight
        return weight, max(0.0, split - sum(backwards))

    def _mem(self, key: str, layer: int, rows: int) -> int:
        return max(0, round(interpolate(self.rows, self.memory[layer][key], rows)))

    def _core(self, layer: int, rows: int) -> tuple[int, float]:
        """The attention core's saved bytes and its recompute inside the backward (profile time, not
        yet scaled by the in-pipeline backward factor); (0, 0) for a layer without one."""
        if not self.has_attention_core or not any(self.memory[layer]["core_bytes"]):
            return 0, 0.0
        seconds = max(0.0, interpolate(self.rows, self.times[self._threads()]["C"][layer], rows))
        return self._mem("core_bytes", layer, rows), seconds

    def _forward_s(self, fit: PipelineFit, layers: range, rows: int, with_intercept: bool = True) -> float:
        """The in-pipeline time of a forward over ``layers`` as the policy runs it: without a graph
        (``always``, ``full``), keeping it (``never``, ``selective``, whose forward keeps all but the
        core), or one micro-batch in M keeping it (``except_last``: the mean over the step's
        forwards). A forward that keeps its graph is the profile's forward with grad, on its own
        line where calibration fitted one (it saves every activation, which a forward without grad
        does not), else on the forward's."""
        plain = fit.actions["F"]
        graph = fit.actions.get(FORWARD_WITH_GRAPH, plain)

        def price(line: ActionFit, kind: str) -> float:
            parts = self._parts(kind, layers, rows)
            return line(*parts) if with_intercept else line.scale(*parts)

        if self.checkpoint in ("never", "selective"):
            return price(graph, "R")
        if self.checkpoint == "except_last":
            m = self.microbatches or 1
            return ((m - 1) * price(plain, "F") + price(graph, "R")) / m
        return price(plain, "F")

    def _cold_start_s(self, fit: PipelineFit) -> tuple[float, ...]:
        """Per kind in COMPUTE_KINDS order, what an action adds when it starts cold (the step's first
        on its device): the forward's line's as the policy runs the first forward (keeping its graph
        under never and selective, and under except_last when it is the only one), the recompute's
        and backward's lines' own (calibration fits none for them: no device opens a step with
        one); I and W the backward's. Empty where no line has one (older costs files)."""
        lines = fit.actions
        plain = lines["F"].cold_start_s
        graph = lines.get(FORWARD_WITH_GRAPH, lines["F"]).cold_start_s
        keeps_graph = self.checkpoint in ("never", "selective") or (
            self.checkpoint == "except_last" and (self.microbatches or 1) == 1)
        forward = graph if keeps_graph else plain
        backward = lines["B"].cold_start_s
        values = (forward, lines["R"].cold_start_s, backward, backward, backward)
        return tuple(max(0.0, v) for v in values) if any(values) else ()

    def _parts(self, kind: str, layers: range, rows: int) -> tuple[float, float]:
        """(time, fixed part) of the profile's ``kind`` summed over ``layers``."""
        parts = [self.profiled_parts_s(kind, i, rows) for i in layers]
        return sum(t for t, _ in parts), sum(f for _, f in parts)

    def layer_costs(self, rows: int, device: Device) -> Sequence[LayerCost]:
        if device.name != self.device_name:
            return self._what_if(rows, device)
        fit = self.fit
        costs = []
        for i in range(self.num_layers):
            backward = self.profiled_parts_s("B", i, rows)
            in_pipeline = fit.actions["B"].scale(*backward) / backward[0]  # the backward's factor at these rows
            params = int(self.memory[i]["param_bytes"])
            own = self._mem("own_bytes", i, rows)
            inp, out = self._mem("input_bytes", i, rows), self._mem("output_bytes", i, rows)
            saved = own + inp + (out if self.memory[i]["saves_output"] else 0)
            core_bytes, core_s = self._core(i, rows)
            costs.append(LayerCost(
                name=self.memory[i]["name"],
                forward_s=self._forward_s(fit, range(i, i + 1), rows, with_intercept=False),
                backward_s=fit.actions["B"].scale(*backward),
                recompute_s=fit.actions["R"].scale(*self.profiled_parts_s("R", i, rows)),
                saved_bytes=saved, output_bytes=out, input_bytes=inp, param_bytes=params,
                grad_bytes=params, optimizer_bytes=self.optimizer_slots * params,
                optimizer_s=fit.optimizer.slope * params, saves_input=bool(self.memory[i]["saves_input"]),
                core_saved_bytes=core_bytes, core_recompute_s=in_pipeline * core_s))
        return costs

    # ------------------------------------------------------------------ exact stage sums

    def stage_saved_bytes(self, rows: int, first: int, end: int) -> int:
        """Distinct bytes a stage of layers [first, end) holds for one micro-batch, input included."""
        mem = self.memory
        total = self._mem("input_bytes", first, rows)
        for i in range(first, end):
            total += self._mem("own_bytes", i, rows)
            out = self._mem("output_bytes", i, rows)
            if i < end - 1:
                if mem[i]["saves_output"] or mem[i + 1]["saves_input"]:
                    total += out
            elif mem[i]["saves_output"]:
                total += out
        return total

    def stage_cost(self, rows: int, first: int, end: int, device: Device) -> StageCost:
        """Exact costs of the stage of layers [first, end) for a micro-batch of ``rows``."""
        if device.name != self.device_name:
            from sim.engine.stage_costs import sum_stage

            return sum_stage(self._what_if(rows, device)[first:end])
        fit = self.fit
        layers = range(first, end)
        recompute = self._parts("R", layers, rows)
        backwards = [self.profiled_s("B", i, rows) for i in layers]
        layer_params = [int(self.memory[i]["param_bytes"]) for i in layers]
        backward = self._parts("B", layers, rows)
        backward_s, recompute_s = fit.actions["B"](*backward), fit.actions["R"](*recompute)
        # W, the split's cost and the attention core's rerun: the backward's in-pipeline factor at these
        # rows, unless calibration fitted I and W on a run that split its backward
        in_pipeline = fit.actions["B"].scale(*backward) / backward[0]
        inp = self._mem("input_bytes", first, rows)
        out = self._mem("output_bytes", end - 1, rows)
        params = sum(layer_params)
        weight_grad, split_overhead = self._split_backward_s(layers, rows, backwards, layer_params)
        weight_grad, split_overhead = in_pipeline * weight_grad, in_pipeline * split_overhead
        if "W" in fit.actions and "W" in self.times[self._threads()]:
            # a design run split its backward: W's own in-pipeline line, and I's through the split's cost
            weight_grad = fit.actions["W"](*self._parts("W", layers, rows))
            if "I" in fit.actions:
                split_overhead = fit.actions["I"](*self._parts("I", layers, rows)) - (backward_s - weight_grad)
        # the first stage's split backward: W on a line of its own where calibration fitted one, I its measured time
        first_weight = (fit.actions[FIRST_STAGE_WEIGHT](*backward)
                        if first == 0 and FIRST_STAGE_WEIGHT in fit.actions else None)
        first_input = fit.first_input_s if first == 0 else 0.0
        full_backward = backward_s + recompute_s + (len(layers) - 1) * fit.full_backward_per_layer_s
        held, transient = per_layer_bytes([self._mem("input_bytes", i, rows) for i in layers],
                                          [self.stage_saved_bytes(rows, i, i + 1) for i in layers])
        cores = [self._core(i, rows) for i in layers]
        return StageCost(
            forward_s=self._forward_s(fit, layers, rows), backward_s=backward_s,
            activation_send_s=fit.send(out) if end < self.num_layers else 0.0,
            gradient_send_s=fit.send(inp) if first > 0 else 0.0,
            recompute_s=recompute_s,
            saved_bytes=self.stage_saved_bytes(rows, first, end),
            stash_bytes=inp, output_bytes=out,
            static_bytes=params * (2 + self.optimizer_slots),
            optimizer_s=_positive(fit.optimizer(params), 0.0), step_overhead_s=_positive(fit.step_overhead_s, 0.0),
            gap_after_s=tuple(_positive(fit.gap_after_s.get(kind, 0.0), 0.0) for kind in COMPUTE_KINDS)
            if fit.gap_after_s else (), cold_start_s=self._cold_start_s(fit), host=fit.host,
            layer_inputs_bytes=held, layer_transient_bytes=transient,
            weight_grad_s=weight_grad, split_overhead_s=split_overhead,
            first_weight_grad_s=first_weight, first_input_s=first_input, full_backward_s=full_backward,
            core_saved_bytes=sum(b for b, _ in cores), core_recompute_s=in_pipeline * sum(s for _, s in cores),
            replica_spread=fit.replica_spread)

    # ------------------------------------------------------------------ what-if on catalog devices

    def efficient_device(self, device: Device) -> Device:
        """``device`` with the efficiency fitted on the calibrated device (see module limits)."""
        eff = self.data.get("efficiency")
        if not eff:
            why = (f"model {self.model_name!r} has no analytic form" if self.precision == DEFAULT_PRECISION
                   else f"the measured device has no {self.precision} peak to fit it against")
            raise GpipeInputError(
                f"the costs file has no fitted efficiency ({why}); simulate it on the machine it was "
                f"measured on (--hardware {self.data.get('system', 'cpu')})")
        return replace(device, efficiency=float(eff["efficiency"]),
                       bandwidth_efficiency=float(eff["bandwidth_efficiency"]))

    def _what_if(self, rows: int, device: Device) -> Sequence[LayerCost]:
        from sim.workloads.models import get_workload

        analytic = get_workload(self.model_name, {**self.options, "precision": self.precision})
        return analytic.layer_costs(rows, self.efficient_device(device))

    def describe(self) -> dict:
        return {"name": self.model_name, "options": dict(self.options), "num_layers": self.num_layers,
                "parameter_count": (sum(int(m["param_bytes"]) for m in self.data["profile"]["memory"])
                                    - sum((len(p.layers) - 1) * p.param_bytes for p in self.shared_parameters))
                                   // FP32_BYTES,
                "costs": {"machine": self.data.get("machine", {}), "stages": self.stages}}


# ----------------------------------------------------------------------------- the file


def read_costs(path: str | os.PathLike[str], warn: bool = True) -> dict[str, Any]:
    """The costs file as a dict, checked for kind and version, with one-line errors; with ``warn``, a
    fit past its goal (:func:`fit_quality_warning`) is said once per file on stderr."""
    data = read_json(path, "costs file", "create it with gpipe calibrate --out FILE")
    if not isinstance(data, dict) or data.get("kind") != COSTS_KIND:
        raise GpipeInputError(f"{os.fspath(path)!r} is not a gpipe costs file; "
                              "create one with gpipe calibrate --out FILE")
    if data.get("version") != COSTS_VERSION:
        raise GpipeInputError(f"costs file version {data.get('version')!r} is not supported; this gpipe "
                              f"reads version {COSTS_VERSION} (re-run gpipe calibrate --force)")
    warning = fit_quality_warning(data, os.fspath(path)) if warn else None
    if warning and os.path.abspath(path) not in _WARNED:
        _WARNED.add(os.path.abspath(path))
        print(warning, file=sys.stderr, flush=True)
    return data


# ----------------------------------------------------------------------------- how well the fit holds

# A design run the fitted costs miss by more than this points at a noisy calibration, not the model:
# calibration measures such a run again and refuses if the miss remains; a file past it is warned about.
DESIGN_FIT_GOAL = 0.12
_WARNED: set[str] = set()  # costs files already warned about in this process


def design_step_errors(data: dict[str, Any]) -> list[tuple[str, float]]:
    """(run, relative step error) of each design run the file records: the fitted prediction against
    the measurement at the reference speed; [] for files without design runs."""
    return [(run["run"], (run["predicted_step_s"] - run["measured_step_s"]) / run["measured_step_s"])
            for run in data.get("design", []) if run.get("measured_step_s")]


def fit_quality(data: dict[str, Any], corrections: Sequence[dict[str, float]] = ()) -> dict[str, Any]:
    """How well the fit reproduces its own design runs: the goal, the worst and median step error,
    the run missed most, and the largest corrections applied to any run (``speed``, ``warm_up``)."""
    errors = design_step_errors(data)
    worst = max(errors, key=lambda e: abs(e[1]), default=("", 0.0))
    magnitudes = sorted(abs(e) for _, e in errors)
    quality: dict[str, Any] = {
        "goal": DESIGN_FIT_GOAL, "design_runs": len(errors),
        "worst_step_error": worst[1], "worst_run": worst[0],
        "median_abs_step_error": magnitudes[len(magnitudes) // 2] if magnitudes else 0.0,
        "within_goal": abs(worst[1]) <= DESIGN_FIT_GOAL}
    if corrections:
        quality["speed_factor_range"] = [min(c["speed"] for c in corrections), max(c["speed"] for c in corrections)]
        quality["warm_up_factor_range"] = [min(c["warm_up"] for c in corrections),
                                           max(c["warm_up"] for c in corrections)]
    return quality


def fit_quality_warning(data: dict[str, Any], path: str = "the costs file") -> str | None:
    """One line when the file's fit misses one of its own design runs past the goal (recomputed from
    its design runs, so a hand-edited ``fit_quality`` cannot hide it); None when it holds."""
    goal = float(data.get("fit_quality", {}).get("goal", DESIGN_FIT_GOAL))
    errors = design_step_errors(data)
    if not errors:
        return None
    run, error = max(errors, key=lambda e: abs(e[1]))
    if abs(error) <= goal:
        return None
    return (f"warning: {path} misses its own design run {run} by {error * 100:+.0f}% (goal {goal * 100:.0f}%): "
            "predictions from it can be off by as much; calibrate again with gpipe calibrate --force")


def write_costs(data: dict[str, Any], path: str | os.PathLike[str]) -> None:
    from sim.formats.timeline import write_json_atomic

    write_json_atomic(path, {"kind": COSTS_KIND, "version": COSTS_VERSION, **data})


def tensor_parallel_link(data: dict[str, Any], sequence_parallel: bool) -> Link | None:
    """The tensor-parallel collectives the costs file measured (``calibrate.measure.tp_collectives``) as a
    ring :class:`Link`: the all-reduce's, or with ``sequence_parallel`` the reduce-scatter plus
    all-gather pair's; None when it has none. Limits: measured idle among T ranks on one host."""
    entry = data.get("tensor_parallel")
    if not entry:
        return None
    kind = "sequence_parallel" if sequence_parallel else "all_reduce"
    try:
        fit = entry[kind]
        latency_s, bandwidth = float(fit["latency_s"]), float(fit["bandwidth_bytes_per_s"])
    except (KeyError, TypeError, ValueError):
        raise GpipeInputError(f"the costs file's tensor_parallel entry has no usable {kind} fit; re-run gpipe "
                              "calibrate --force to measure it again") from None
    if not (math.isfinite(latency_s) and latency_s >= 0 and bandwidth > 0):
        raise GpipeInputError(f"the costs file's tensor_parallel {kind} fit (latency {latency_s!r} s, bandwidth "
                              f"{bandwidth!r} B/s) is not a link; re-run gpipe calibrate --force")
    what = "reduce-scatter + all-gather" if sequence_parallel else "all-reduce"
    return Link(f"calibrated {what} ({entry.get('backend', '?')})", bandwidth, latency_s)


def allreduce_link(data: dict[str, Any], shared_memory: bool = False) -> Link | None:
    """The all-reduce the costs file measured as a :class:`Link` for the ring model, or None when
    it has none (a one-core machine, or a file from before it was measured). ``shared_memory``: the
    shared-memory route's fit (:mod:`calibrate.measure.collective`) where the file has one, else the backend's.

    The simulator prices a data-parallel group of D ranks as ``2(D-1)/D * bytes / bandwidth +
    2(D-1) * latency`` on this link instead of the slowest link the group crosses. Limits: it was
    measured idle on one host (:mod:`calibrate.measure.collective`); across nodes the catalog's links apply.
    """
    entry = data.get("allreduce")
    if entry is None:
        return None
    latency_s, bandwidth = _fitted_ring(entry, "allreduce")
    shared = entry.get("shared_memory")  # checked whichever is asked for: a bad file fails before any work
    if shared is not None:
        shared_latency_s, shared_bandwidth = _fitted_ring(shared, "allreduce shared_memory")
        if shared_memory:
            return Link("fitted shared-memory all-reduce", shared_bandwidth, shared_latency_s)
    return Link(f"fitted {entry.get('backend', 'all-reduce')} all-reduce", bandwidth, latency_s)


def _fitted_ring(entry: Any, what: str) -> tuple[float, float]:
    """(latency_s, bandwidth_bytes_per_s) of a costs file's fitted ring link; ``what`` names the
    entry in the one-line error a malformed one gets."""
    fix = "re-run gpipe calibrate --force to measure it again"
    if not isinstance(entry, dict):
        raise GpipeInputError(f"the costs file's {what} entry is {type(entry).__name__}, not an object; {fix}")
    try:
        latency_s = float(entry["latency_s"])
        bandwidth = float(entry["bandwidth_bytes_per_s"])
    except KeyError as exc:
        raise GpipeInputError(f"the costs file's {what} entry has no {exc.args[0]}; {fix}") from None
    except (TypeError, ValueError):
        raise GpipeInputError(f"the costs file's {what} latency_s {entry['latency_s']!r} or bandwidth_bytes_per_s "
                              f"{entry['bandwidth_bytes_per_s']!r} is not a number; {fix}") from None
    if not (math.isfinite(latency_s) and latency_s >= 0):
        raise GpipeInputError(f"the costs file's {what} latency_s {latency_s!r} is not a finite time of 0 s or "
                              f"more; {fix}")
    if not bandwidth > 0:
        raise GpipeInputError(f"the costs file's {what} bandwidth_bytes_per_s {bandwidth!r} is not positive; {fix}")
    return latency_s, bandwidth


def requested_options(model: str, options: dict[str, Any]) -> dict[str, Any]:
    """The model's full options as the executor builds it: built-in defaults overlaid (torch-free)."""
    from sim.workloads.model_defaults import DEFAULT_OPTIONS

    given = {k: v for k, v in options.items() if k not in ANALYSIS_OPTIONS}
    if model in DEFAULT_OPTIONS and model != "uniform":
        return {**DEFAULT_OPTIONS[model], **given}
    return given


def measured_precision(data: dict[str, Any]) -> str:
    """The precision a costs file was measured at (files written before it was recorded: fp32)."""
    return str(data.get("precision", DEFAULT_PRECISION))


def check_model(data: dict[str, Any], model: str | None, options: dict[str, Any], path: str) -> None:
    """The file's model must be ``model`` with ``options`` (None: the file's model, with the options
    given agreeing; defaults are not filled in, the file's own options stand), at the file's
    precision when ``options`` name one."""
    stored = data["model"]
    if "precision" in options and options["precision"] != measured_precision(data):
        raise GpipeInputError(f"costs file {path!r} was measured at {measured_precision(data)}, not "
                              f"{options['precision']}; run gpipe calibrate --precision {options['precision']}")
    if model is None:
        model = stored["name"]
        wanted = {k: v for k, v in options.items() if k not in ANALYSIS_OPTIONS}
    else:
        wanted = requested_options(model, options)
    same = stored["name"] == model and all(stored["options"].get(k) == v for k, v in wanted.items())
    if not same:
        raise GpipeInputError(
            f"costs file {path!r} was measured for {stored['name']} {stored['options']}, not {model} "
            f"{wanted}; pass the same model flags or run gpipe calibrate for this model")


def load_costs_workload(path: str, model: str | None, options: dict[str, Any]) -> MeasuredWorkload:
    """The measured workload of ``model`` with ``options`` from the costs file at ``path``.

    ``model`` None means the file's own model; ``options`` given must still match it. Its optimizer
    is the one calibration measured (its step time was fitted); ``optimizer_slots`` in ``options``
    (from ``--optimizer``) must agree with it.
    """
    data = read_costs(path)
    check_model(data, model, options, path)
    allreduce_link(data)  # a malformed entry is refused before any work starts
    workload = MeasuredWorkload(data)
    wanted = options.get("optimizer_slots")
    if wanted is not None and wanted != workload.optimizer_slots:
        raise GpipeInputError(
            f"costs file {path!r} was measured with {workload.optimizer} ({workload.optimizer_slots} state "
            f"tensors per parameter) but --optimizer asks for {wanted}; drop --optimizer or run gpipe "
            "calibrate --optimizer NAME for this optimizer")
    return workload


def costs_summary(data: dict[str, Any]) -> dict[str, Any]:
    """The fitted numbers without the bulky profile, for printing."""
    keep = {k: v for k, v in data.items() if k not in ("profile", "design", "fit_halves")}
    return json.loads(json.dumps(keep, default=lambda o: dataclasses.asdict(o)))
