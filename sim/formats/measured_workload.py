"""The measured :class:`Workload` the simulator runs from a costs file (``--costs FILE``).

:class:`MeasuredWorkload` answers ``layer_costs(rows, device)`` from the profile, interpolating
piecewise-linearly between measured row counts (linear extrapolation beyond them), and gives the
simulator exact per-stage sums through ``stage_cost`` (see :class:`sim.engine.stage_costs.CostTable`):
the union of saved storages of consecutive layers, and the per-action and per-step constants the
pipeline fits found (:mod:`sim.formats.costs_fits`), which a sum over layers cannot express. ``bind``
picks the fits for a stage count K (CPU runs give each of K processes cores/K threads, so K changes
every time) and puts the fitted link into the ``cpu`` system. On any other catalog device,
``layer_costs`` falls back to the analytic model with the fitted efficiency (built-in models only) at
the file's precision: a what-if, not a measurement. A CPU host's effects, where the file measured
them, ride on each stage's cost (:mod:`sim.engine.host`). Split by ``--expert-parallel E``
(:meth:`MeasuredWorkload.split_experts`), a mixture of experts' blocks are priced as
:mod:`sim.formats.measured_experts` says: the most loaded rank's excess of routed work, the all-to-alls
on the fitted exchange, each rank's n/E experts' bytes.

It reads a costs record in the current layout (:func:`sim.formats.costs.read_costs`, or the dict
calibration builds) without defaults for the keys that layout requires (:mod:`sim.formats.costs_v2`).

Limits: a stage's forwards use one time whatever the micro-batch; under ``except_last`` it is the
average of M-1 no-grad forwards and one forward with grad. Row counts far outside the profiled range
are extrapolated. Stage 0 of the executor stashes views of the whole input batch, which it counts
once; here each micro-batch stashes its own rows (identical when the input is small, as token ids).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from sim.catalog.hardware import Device, Link, System
from sim.engine.stage_costs import StageCost, layer_weight_grad_s, per_layer_bytes
from sim.errors import GpipeInputError
from sim.formats.costs_fits import (FIRST_STAGE_WEIGHT, FORWARD_WITH_GRAPH, IDENTITY, ActionFit, Affine, PipelineFit,
                                    interpolate)
from sim.formats.costs_links import allreduce_link, sharded_links
from sim.formats.measured_experts import MeasuredExperts, measured_experts
from sim.schedules.schedule import COMPUTE_KINDS
from sim.workloads.precision import DEFAULT_PRECISION, FP32_BYTES
from sim.workloads.moe.expert_parallel import ExpertSplit
from sim.workloads.workload import LayerCost, SharedParameter, WorkloadCapabilities


def _positive(value: float, floor: float) -> float:
    return value if value > floor else floor


class MeasuredWorkload(WorkloadCapabilities):
    """A model's measured costs on this machine, bound to a stage count K (default: the largest)."""

    measured_costs = True

    def __init__(self, data: dict[str, Any], stages: int | None = None, checkpoint: str = "except_last",
                 microbatches: int | None = None, tensor_parallel: int = 1, replicas: int = 1,
                 experts_split: ExpertSplit | None = None) -> None:
        self.data = data
        model = data["model"]
        self.tensor_parallel = tensor_parallel
        self.replicas = replicas  # D copies of the pipeline sharing the machine: D x K x T processes
        self.sequence_parallel = False  # the split layers were profiled without it
        self.context_parallel = 1  # nor with context parallelism
        self.name = f"{model['name']} (measured{f', T={tensor_parallel}' if tensor_parallel > 1 else ''})"
        self.model_name = model["name"]
        self.options = dict(model["options"])
        self.num_layers = int(model["num_layers"])
        # T > 1: one rank of a stage split over T ranks, as calibrate.measure.tp_profile measured it
        profile = data["profile"] if tensor_parallel == 1 else data["tensor_parallel_profile"][str(tensor_parallel)]
        # the split stage's in-pipeline factor per kind, fitted on calibration's split runs (1: none)
        self.split_factor = {kind: float(v) for kind, v in
                             data.get("tensor_parallel_fit", {}).get(str(tensor_parallel), {}).items()}  # optional
        self.rows = [int(r) for r in profile["rows"]]
        self.times = {int(t): kinds for t, kinds in profile["times_s"].items()}
        self.memory = profile["memory"]
        self.fits = {int(k): PipelineFit.from_dict(v) for k, v in data["pipeline"].items()}
        self.stages = stages if stages is not None else max(self.fits, default=1)
        self.checkpoint = checkpoint
        self.microbatches = microbatches
        self.device_name = str(data["catalog_device"])
        self.optimizer = str(data["optimizer"])  # the one calibration trained with
        self.optimizer_slots = int(data["optimizer_slots"])
        # fp32 weights, their gradient and optimizer state (the executor trains fp32 master weights)
        self.shared_parameters = tuple(
            SharedParameter(str(p["name"]), tuple(int(i) for i in p["layers"]), int(p["param_bytes"]),
                            int(p["param_bytes"]) * (2 + self.optimizer_slots))
            for p in data["shared_parameters"])
        self.precision = str(data["precision"])
        self.batch_size = int(data["batch_size"]) if data["batch_size"] else None  # the calibrated batch
        # --checkpoint selective: the profile measured what each layer's attention core saves and what
        # rerunning it inside the backward takes (calibrate.measure.profile's core_bytes and C)
        self.has_attention_core = (all("C" in kinds for kinds in self.times.values())
                                   and any(any(m.get("core_bytes", ())) for m in self.memory))
        self.has_experts = bool(self.options.get("experts"))  # a mixture of experts (the built-in transformer's)
        self.experts_profiled = "experts" in data  # its routed experts timed apart (calibrate.measure.expert_profile)
        # --expert-parallel E: the routed experts over E ranks (sim.formats.measured_experts); None: E = 1
        self.experts_split = experts_split
        self.experts: MeasuredExperts | None = (None if experts_split is None else
                                                measured_experts(data, self.options, experts_split, True))

    @property
    def expert_parallel(self) -> int:  # type: ignore[override]
        """E: the ranks each MoE block's routed experts are split over (1 without expert parallelism)."""
        return self.experts.expert_parallel if self.experts is not None else 1

    def split_experts(self, split: ExpertSplit) -> "MeasuredWorkload":
        """This workload with its routed experts split as ``split`` says
        (:func:`sim.workloads.moe.expert_parallel.with_expert_parallel`); one line where the costs file
        cannot price it (:func:`sim.formats.measured_experts.measured_experts`)."""
        return MeasuredWorkload(self.data, self.stages, self.checkpoint, self.microbatches, self.tensor_parallel,
                                self.replicas, split)

    def param_bytes(self, layer: int) -> int:
        """One rank's parameter bytes of ``layer``: the profile's, its routed experts' divided by E."""
        params = int(self.memory[layer]["param_bytes"])
        if self.experts is None:
            return params
        return params - self.experts.param_bytes(layer) + self.experts.held_bytes(layer)

    # ------------------------------------------------------------------ binding to a plan

    def bind(self, system: System, stages: int, checkpoint: str = "except_last",
             microbatches: int | None = None, replicas: int = 1) -> tuple["MeasuredWorkload", System]:
        """This workload for K=``stages`` in D=``replicas`` pipelines, and ``system`` with the
        fitted link if it is the one measured."""
        bound = MeasuredWorkload(self.data, stages, checkpoint, microbatches, self.tensor_parallel, replicas,
                                 self.experts_split)
        link = self.data.get("link")
        if link and system.name == self.data["system"]:
            fitted = Link(f"fitted {link.get('name', 'link')}", float(link["bandwidth_bytes_per_s"]),
                          float(link["latency_s"]))
            system = replace(system, intra_link=fitted)
        return bound, system

    def allreduce_link(self, system: System) -> Link | None:
        """The calibrated all-reduce link for ``system`` if it is the one measured, else None: the
        shared-memory route's where the file has one and this run's D x K x T processes fit the
        measured machine's cores (where the executor sums through shared memory), else the backend's."""
        if system.name != self.data["system"]:
            return None
        cores = self.data["machine"].get("cpu_cores")  # none on a machine stamp without it
        return allreduce_link(self.data, shared_memory=cores is not None and self._processes <= int(cores))

    def sharded_links(self, system: System) -> tuple[Link | None, Link | None, Link | None]:
        """ZeRO-2/3's fitted (all-gather, reduce-scatter) links and the all-reduce (HSDP's across the
        groups) for ``system`` if it is the one measured, else None each: the catalog's links."""
        if system.name != self.data["system"]:
            return None, None, None
        gather, reduce = sharded_links(self.data)
        return gather, reduce, self.allreduce_link(system)

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
                                self.replicas, self.experts_split)

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
        cores = int(self.data["machine"].get("cpu_cores", max(self.times)))
        return min(self.times, key=lambda t: (abs(t - max(1, cores // self._processes)), t))

    @property
    def _processes(self) -> int:
        """The run's D x K x T processes."""
        return max(1, self.stages) * self.tensor_parallel * self.replicas

    # ------------------------------------------------------------------ per layer

    def profiled_s(self, kind: str, layer: int, rows: int) -> float:
        """The isolated layer's median time for ``kind`` (calibrate.measure.profile.KINDS), interpolated in
        rows; under expert parallelism with the most loaded rank's excess of routed work
        (:meth:`sim.formats.measured_experts.MeasuredExperts.excess_s`)."""
        values = self.times[self._threads()][kind][layer]
        excess = 0.0 if self.experts is None else self.experts.excess_s(kind, layer, rows, self._threads())
        return _positive(interpolate(self.rows, values, rows), 1e-9) + excess

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
            params = self.param_bytes(i)
            ep_forward_s, ep_backward_s = (0.0, 0.0) if self.experts is None else self.experts.exchange_s(i, rows)
            own = self._mem("own_bytes", i, rows)
            inp, out = self._mem("input_bytes", i, rows), self._mem("output_bytes", i, rows)
            saved = own + inp + (out if self.memory[i]["saves_output"] else 0)
            core_bytes, core_s = self._core(i, rows)
            costs.append(LayerCost(
                name=self.memory[i]["name"],
                forward_s=self._forward_s(fit, range(i, i + 1), rows, with_intercept=False) + ep_forward_s,
                backward_s=fit.actions["B"].scale(*backward) + ep_backward_s,
                recompute_s=fit.actions["R"].scale(*self.profiled_parts_s("R", i, rows)) + ep_forward_s,
                saved_bytes=saved, output_bytes=out, input_bytes=inp, param_bytes=params,
                grad_bytes=params, optimizer_bytes=self.optimizer_slots * params,
                optimizer_s=fit.optimizer.slope * params, saves_input=bool(self.memory[i]["saves_input"]),
                core_saved_bytes=core_bytes, core_recompute_s=in_pipeline * core_s,
                ep_forward_s=ep_forward_s, ep_backward_s=ep_backward_s,
                expert_grad_bytes=0 if self.experts is None else self.experts.held_bytes(i)))
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
        layer_params = [self.param_bytes(i) for i in layers]
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
        # expert parallelism: the all-to-alls, after the in-pipeline lines (communication, not compute)
        exchanges = [(0.0, 0.0) if self.experts is None else self.experts.exchange_s(i, rows) for i in layers]
        ep_forward_s, ep_backward_s = sum(f for f, _ in exchanges), sum(b for _, b in exchanges)
        backward_s, recompute_s = backward_s + ep_backward_s, recompute_s + ep_forward_s
        full_backward = backward_s + recompute_s + (len(layers) - 1) * fit.full_backward_per_layer_s
        held, transient = per_layer_bytes([self._mem("input_bytes", i, rows) for i in layers],
                                          [self.stage_saved_bytes(rows, i, i + 1) for i in layers])
        cores = [self._core(i, rows) for i in layers]
        return StageCost(
            forward_s=self._forward_s(fit, layers, rows) + ep_forward_s, backward_s=backward_s,
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
            replica_spread=fit.replica_spread, ep_forward_s=ep_forward_s, ep_backward_s=ep_backward_s)

    # ------------------------------------------------------------------ what-if on catalog devices

    def efficient_device(self, device: Device) -> Device:
        """``device`` with the efficiency fitted on the calibrated device (see module limits)."""
        eff = self.data.get("efficiency")
        if not eff:
            why = (f"model {self.model_name!r} has no analytic form" if self.precision == DEFAULT_PRECISION
                   else f"the measured device has no {self.precision} peak to fit it against")
            raise GpipeInputError(
                f"the costs file has no fitted efficiency ({why}); simulate it on the machine it was "
                f"measured on (--hardware {self.data['system']})")
        return replace(device, efficiency=float(eff["efficiency"]),
                       bandwidth_efficiency=float(eff["bandwidth_efficiency"]))

    def _what_if(self, rows: int, device: Device) -> Sequence[LayerCost]:
        from sim.workloads.moe.workload import builtin_workload

        analytic = builtin_workload(self.model_name, {**self.options, "precision": self.precision})
        if self.experts_split is not None:  # the analytic MoE workload split as this one is
            analytic = analytic.split_experts(self.experts_split)  # type: ignore[attr-defined]
        return analytic.layer_costs(rows, self.efficient_device(device))

    def describe(self) -> dict:
        return {"name": self.model_name, "options": dict(self.options), "num_layers": self.num_layers,
                "parameter_count": (sum(int(m["param_bytes"]) for m in self.data["profile"]["memory"])
                                    - sum((len(p.layers) - 1) * p.param_bytes for p in self.shared_parameters))
                                   // FP32_BYTES,
                "costs": {"machine": self.data["machine"], "stages": self.stages}}
