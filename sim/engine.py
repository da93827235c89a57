"""The SimPy discrete-event model of one training step of a pipeline.

Each stage is a SimPy process walking its action list from :func:`sim.schedule.build_schedule`. A
forward waits for the previous stage's activation, a backward for the next stage's gradient; a
recompute waits for nothing but the device, so it can run before the gradient arrives (the GPipe
paper's observation). Finished activations and gradients travel over first-come-first-served link
channels: a dedicated one per neighbour pair and direction, or, for PCIe through the host, one per
node and direction that every transfer on that node queues for (see :class:`_Links`).

Limits of the model: compute and communication overlap perfectly (sends are asynchronous, as with
copy engines and non-blocking NCCL calls); a device runs one action at a time and never stalls for
other reasons (no kernel-launch jitter, no thermal throttling, no interference from other
processes); a transfer holds its channel for bytes / bandwidth and arrives a latency later, with no protocol or
congestion effects.
The optimizer update runs once per step after a stage's last backward. A parameter shared by
layers on several stages (a tied embedding and head, :class:`sim.workload.SharedParameter`) has its
gradient summed among the owning stages first: each owner waits until all have finished their
backwards, then a ring all-reduce of its bytes takes 2(n-1)/n x bytes / bandwidth + 2(n-1) x latency
on the slowest link between the owners (not contended by other transfers), and every owner then
runs its optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import simpy

from sim.hardware import Link, System
from sim.microbatch import split_rows
from sim.plan import validate_partition
from sim.schedule import Kind, build_schedule, recomputes
from sim.stage_costs import CostTable, StageCost, stage_of_layers
from sim.timeline import (OPTIMIZER, RECV_WAIT, SEND_ACTIVATION, SEND_GRADIENT, SHARED_ALLREDUCE, STEP_OVERHEAD,
                          MemorySample, Record, Timeline)
from sim.workload import Workload, shared_parameters


@dataclass(frozen=True)
class StageResult:
    stage: int
    layers: int
    busy_s: float
    peak_memory_bytes: int  # static + peak activation
    peak_activation_bytes: int  # saved-for-backward tensors + stashed inputs, at their peak
    static_bytes: int  # parameters + gradients + optimizer state
    memory_capacity_bytes: float
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        capacity = self.memory_capacity_bytes
        return {
            "stage": self.stage, "layers": self.layers, "busy_s": self.busy_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
            "static_bytes": self.static_bytes,
            "memory_capacity_bytes": None if math.isinf(capacity) else int(capacity),
            "fits": self.fits,
        }


@dataclass
class SimResult:
    step_time_s: float
    bubble_fraction: float
    throughput_samples_per_s: float
    partition: tuple[int, ...]
    batch_size: int
    microbatches: int  # as executed: torch.chunk may make fewer than asked for
    microbatch_rows: list[int]
    schedule: str
    checkpoint: str
    stages: list[StageResult]
    timeline: Timeline = field(repr=False)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "bubble_fraction": self.bubble_fraction,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "partition": list(self.partition),
            "batch_size": self.batch_size,
            "microbatches": self.microbatches,
            "microbatch_rows": self.microbatch_rows,
            "schedule": self.schedule,
            "checkpoint": self.checkpoint,
            "fits": self.fits,
            "stages": [s.to_dict() for s in self.stages],
        }


class _Links:
    """The links as FIFO channels: one per neighbour pair and direction, or one per node and
    direction where the link is shared (PCIe through the host).

    A transfer occupies its channel for bytes / bandwidth, from the moment the channel is free; its
    latency is pipelined (it delays arrival, not the next transfer). Requests reach a channel in
    simulated-time order, so a first-come-first-served resource reduces to the time the channel
    next falls free: that closed form is what is kept, which saves most of SimPy's resource events.
    """

    def __init__(self, system: System, stages: int) -> None:
        self.system = system
        self.links: list[Link] = [system.link_between(k) for k in range(stages - 1)]
        self._free_at_s: dict[tuple, float] = {}

    def is_free(self, boundary: int) -> bool:
        link = self.links[boundary]
        return link.latency_s == 0.0 and math.isinf(link.bandwidth_bytes_per_s)

    def reserve(self, boundary: int, forward: bool, now_s: float, nbytes: int) -> tuple[float, float]:
        """Book a transfer of ``nbytes`` over ``boundary``: (start_s, arrival_s)."""
        link = self.links[boundary]
        direction = "forward" if forward else "backward"
        key: tuple = ((self.system.node_of(boundary), direction) if link.shared else (boundary, direction, 0))
        start_s = max(now_s, self._free_at_s.get(key, 0.0))
        wire_s = 0.0 if math.isinf(link.bandwidth_bytes_per_s) else nbytes / link.bandwidth_bytes_per_s
        self._free_at_s[key] = start_s + wire_s
        return start_s, start_s + wire_s + link.latency_s


def simulate(workload: Workload, system: System, partition: Sequence[int], batch_size: int,
             microbatches: int, checkpoint: str = "except_last", schedule: str = "gpipe",
             costs: CostTable | None = None, record: bool = True) -> SimResult:
    """Simulate one step of ``workload`` split by ``partition`` on ``system``.

    ``costs`` lets a caller (the planner) share one cost cache across many simulations;
    ``record=False`` skips building the timeline when only the figures are wanted.
    """
    partition = validate_partition(partition, workload.num_layers)
    stages = len(partition)
    system.check_fits(stages)
    rows = split_rows(batch_size, microbatches)
    table = costs if costs is not None else CostTable(workload, system.device)
    stage_costs = {r: table.stages(r, partition) for r in set(rows)}
    per_stage_actions = build_schedule(stages, len(rows), schedule, checkpoint)
    run = _Run(system, stages, rows, stage_costs, checkpoint, record,
               shared_reductions(workload, partition, system))
    for k in range(stages):
        run.env.process(run.stage_process(k, per_stage_actions[k]))
    run.env.run()
    return run.result(partition, batch_size, schedule, checkpoint)


@dataclass(frozen=True)
class SharedReduction:
    """The all-reduce of one shared parameter's gradient among the stages holding a copy."""

    owners: tuple[int, ...]
    duration_s: float


def ring_allreduce_s(nbytes: int, parties: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` among ``parties`` over ``link``: 2(n-1)/n of the bytes on the
    wire per party and 2(n-1) latencies (reduce-scatter then all-gather)."""
    if parties < 2:
        return 0.0
    wire_s = 0.0 if math.isinf(link.bandwidth_bytes_per_s) else nbytes / link.bandwidth_bytes_per_s
    return 2 * (parties - 1) / parties * wire_s + 2 * (parties - 1) * link.latency_s


def shared_reductions(workload: Workload, partition: Sequence[int], system: System) -> list[SharedReduction]:
    """One reduction per shared parameter whose layers sit on more than one stage, in layer order."""
    stage_of = stage_of_layers(partition)
    reductions = []
    for parameter in shared_parameters(workload):
        owners = tuple(sorted({stage_of[layer] for layer in parameter.layers}))
        if len(owners) < 2:
            continue
        nodes = {system.node_of(k) for k in owners}
        link = system.intra_link if len(nodes) == 1 else system.inter_link
        reductions.append(SharedReduction(owners, ring_allreduce_s(parameter.param_bytes, len(owners), link)))
    return reductions


class _Reduction:
    """A shared reduction in flight: owners that have arrived, and the event of its end."""

    def __init__(self, env: simpy.Environment) -> None:
        self.arrived = 0
        self.start_s = 0.0
        self.done = env.event()


class _Run:
    """State of one simulation: the environment, arrival events, busy times and memory."""

    def __init__(self, system: System, stages: int, rows: list[int],
                 stage_costs: dict[int, list[StageCost]], checkpoint: str, record: bool,
                 reductions: Sequence[SharedReduction] = ()) -> None:
        self.env = simpy.Environment()
        self.system = system
        self.stages = stages
        self.rows = rows
        self.costs = stage_costs
        self.checkpoint = checkpoint
        self.record = record
        self.links = _Links(system, stages)
        m = len(rows)
        # activation_in[k][m]: stage k has micro-batch m's input; gradient_in[k][m]: its output grad
        self.activation_in = [[self.env.event() for _ in range(m)] for _ in range(stages)]
        self.gradient_in = [[self.env.event() for _ in range(m)] for _ in range(stages)]
        self.busy_s = [0.0] * stages
        self.held_bytes = [0] * stages
        self.peak_bytes = [0] * stages
        self.records: list[tuple] = []  # Record fields; tuples are cheaper in the hot loop
        self.memory: list[tuple] = []  # MemorySample fields
        self.end_s = [0.0] * stages
        self.reductions = [(r, _Reduction(self.env)) for r in reductions]

    def cost(self, stage: int, microbatch: int) -> StageCost:
        return self.costs[self.rows[microbatch]][stage]

    def _hold(self, stage: int, delta: int) -> None:
        self.held_bytes[stage] += delta
        if self.held_bytes[stage] > self.peak_bytes[stage]:
            self.peak_bytes[stage] = self.held_bytes[stage]
        if self.record:
            self.memory.append((stage, self.env.now, self.held_bytes[stage]))

    def stage_process(self, stage: int, actions):
        env = self.env
        microbatches = len(self.rows)
        if self.record:
            self.memory.append((stage, 0.0, 0))
        for action in actions:
            m = action.microbatch
            cost = self.cost(stage, m)
            kind = action.kind
            waiting_on = None
            if kind is Kind.FORWARD and stage > 0:
                waiting_on = self.activation_in[stage][m]
            elif kind is Kind.BACKWARD and stage < self.stages - 1:
                waiting_on = self.gradient_in[stage][m]
            if waiting_on is not None and not waiting_on.processed:
                wait_start = env.now
                yield waiting_on
                if self.record and env.now > wait_start:
                    self.records.append((stage, RECV_WAIT, m, wait_start, env.now))
            if kind is Kind.FORWARD:
                duration = cost.forward_s
            elif kind is Kind.RECOMPUTE:
                duration = cost.recompute_s
            else:
                duration = cost.backward_s
            start = env.now
            if duration > 0:
                yield env.timeout(duration)
            self.busy_s[stage] += duration
            if self.record:
                self.records.append((stage, kind.value, m, start, env.now))
            if kind is Kind.FORWARD:
                stashed = recomputes(self.checkpoint, m, microbatches)
                self._hold(stage, cost.stash_bytes if stashed else cost.saved_bytes)
                if stage < self.stages - 1:
                    self._send(stage, stage + 1, m, cost.output_bytes, forward=True)
            elif kind is Kind.RECOMPUTE:
                self._hold(stage, cost.saved_bytes - cost.stash_bytes)
            else:
                self._hold(stage, -cost.saved_bytes)
                if stage > 0:
                    input_bytes = cost.stash_bytes
                    self._send(stage, stage - 1, m, input_bytes, forward=False)
        for reduction, state in self.reductions:
            if stage in reduction.owners:
                yield from self._reduce(stage, reduction, state)
        per_step = self.costs[self.rows[0]][stage]
        if per_step.optimizer_s > 0:
            start = env.now
            yield env.timeout(per_step.optimizer_s)
            self.busy_s[stage] += per_step.optimizer_s
            if self.record:
                self.records.append((stage, OPTIMIZER, -1, start, env.now))
        if per_step.step_overhead_s > 0:  # not busy: the device is not known to compute then
            start = env.now
            yield env.timeout(per_step.step_overhead_s)
            if self.record:
                self.records.append((stage, STEP_OVERHEAD, -1, start, env.now))
        self.end_s[stage] = env.now

    def _reduce(self, stage: int, reduction: SharedReduction, state: _Reduction):
        """Join a shared gradient's all-reduce; it starts when the last owner joins."""
        env = self.env
        joined_s = env.now
        state.arrived += 1
        if state.arrived == len(reduction.owners):
            state.start_s = joined_s
            env.timeout(reduction.duration_s).callbacks.append(lambda _event: state.done.succeed())
        if not state.done.processed:
            yield state.done
        if self.record:
            if state.start_s > joined_s:
                self.records.append((stage, RECV_WAIT, -1, joined_s, state.start_s))
            if env.now > state.start_s:
                self.records.append((stage, SHARED_ALLREDUCE, -1, state.start_s, env.now))

    def _send(self, source: int, target: int, microbatch: int, nbytes: int, forward: bool) -> None:
        boundary = min(source, target)
        arrived = (self.activation_in if forward else self.gradient_in)[target][microbatch]
        if self.links.is_free(boundary):
            arrived.succeed()
            return
        now = self.env.now
        start, arrival = self.links.reserve(boundary, forward, now, nbytes)
        if self.record:
            kind = SEND_ACTIVATION if forward else SEND_GRADIENT
            self.records.append((source, kind, microbatch, start, arrival))
        self.env.timeout(arrival - now).callbacks.append(lambda _event: arrived.succeed())

    def result(self, partition: tuple[int, ...], batch_size: int, schedule: str,
               checkpoint: str) -> SimResult:
        step_s = max(self.end_s)
        idle_s = sum(step_s - busy for busy in self.busy_s)
        bubble = idle_s / (self.stages * step_s) if step_s > 0 else 0.0
        capacity = self.system.device.memory_bytes
        stage_results = []
        for k in range(self.stages):
            static = self.costs[self.rows[0]][k].static_bytes
            peak = static + self.peak_bytes[k]
            stage_results.append(StageResult(
                stage=k, layers=partition[k], busy_s=self.busy_s[k], peak_memory_bytes=peak,
                peak_activation_bytes=self.peak_bytes[k], static_bytes=static,
                memory_capacity_bytes=capacity, fits=peak <= capacity))
        records = [Record(*fields) for fields in sorted(self.records, key=lambda r: (r[3], r[0]))]
        memory = [MemorySample._make(fields) for fields in self.memory]
        timeline = Timeline(records=records, memory=memory, source="simulated",
                            meta={"schedule": schedule, "checkpoint": checkpoint,
                                  "partition": list(partition), "system": self.system.name})
        return SimResult(
            step_time_s=step_s, bubble_fraction=bubble,
            throughput_samples_per_s=batch_size / step_s if step_s > 0 else math.inf,
            partition=partition, batch_size=batch_size, microbatches=len(self.rows),
            microbatch_rows=list(self.rows), schedule=schedule, checkpoint=checkpoint,
            stages=stage_results, timeline=timeline)
