"""The discrete-event model of one training step of D data-parallel replicas of a K-stage pipeline.

Each replica's forwards and backwards run as a SimPy model (:mod:`sim.engine.replica_run`): its K devices
walk their action lists from :func:`sim.schedules.schedule.build_schedule` (with the interleaved schedule, V
chunks per device), transfers cross the links between the devices :mod:`sim.engine.placement` gives them.
Replica d trains ``torch.chunk(global_batch, D)[d]``, which has one of at most two sizes, and its
links depend only on which of its devices share a node; replicas alike in both are simulated once.

After a device's last backward comes, in this order, the same on every replica:

1. the data-parallel all-reduce of its gradients (fp32) over its stage's group, the D devices
   holding the same stage: launched when the last of them has finished its last backward (later
   by the expected straggling of D replicas where calibration measured how a process's compute
   varies from step to step, :mod:`sim.engine.stragglers`), timed by
   :func:`sim.engine.allreduce.group_allreduce_s` (ring inside a node, hierarchical across nodes), or as a
   ring on ``allreduce_link`` when one is given (a calibrated collective);
2. the sum of each shared parameter's gradient among the stages holding a copy (a tied embedding
   and head, :class:`sim.workloads.workload.SharedParameter`): each owner waits until all have arrived, then a
   ring all-reduce of its bytes takes 2(n-1)/n x bytes / bandwidth + 2(n-1) x latency on the
   slowest link between the owners;
3. the optimizer step, then any fitted per-step overhead.

Why the data-parallel all-reduce starts after the last backward rather than inside it (bucket by
bucket, as DDP does): a stage's last backward is 1/M of its backward work, so little could overlap
there, while launching after it leaves accumulation and re-materialization untouched and is what
the executor does; the overlap that matters is with the rest of the drain, as stage k finishes
before stage k-1 and its all-reduce runs while the earlier stages still compute.

With ``dp_overlap`` (Megatron-LM's bucketed reduction, which published runs use) the all-reduce
instead runs during the device's last backward, as its layers' gradients become final: only what
outlasts that backward is exposed after it, and never less than one layer's share (the bucket the
backward finishes last).

Limits of the model: compute and communication overlap perfectly (sends are asynchronous, as with
copy engines and non-blocking NCCL calls); a device runs one action at a time and never stalls for
other reasons than a calibrated gap between two actions (:mod:`sim.engine.replica_run`): no kernel-launch
jitter, no thermal throttling, no interference from other processes (a CPU host's effects, where a
costs file measured them, are fenced off in :mod:`sim.engine.host`); a transfer holds its channel for
bytes / bandwidth and arrives a latency later, with no protocol or congestion effects. Replicas are simulated apart: their transfers never queue behind
each other on a shared PCIe channel, and all-reduces are not contended by anything. ZeRO-1 is
modelled in memory alone (each device keeps 1/D of its optimizer state): the step on 1/D of the
parameters and the parameter broadcast after it are taken to cancel, and neither is timed. ZeRO-2 and
ZeRO-3 (FSDP, HSDP) are timed unit by unit (:mod:`sim.engine.fsdp`): the gathers and reduce-scatters
their actions leave exposed, the last reduction in place of the all-reduce, the step on the shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Sequence

from sim.catalog.hardware import Link, System
from sim.engine.allreduce import data_parallel_group, exposed_allreduce_s, group_allreduce_s, ring_allreduce_s
from sim.engine.fsdp import FsdpPricing, ShardedMemory, sharded_layout
from sim.engine.host import HostPaid
from sim.engine.memory import expert_static_bytes, static_bytes
from sim.engine.placement import DEFAULT_PLACEMENT, device_of
from sim.engine.replica_run import ReplicaRun
from sim.errors import GpipeInputError
from sim.formats.layout import ParallelLayout, check_chunked_partition
from sim.formats.plan import validate_partition
from sim.schedules.microbatch import split_rows
from sim.schedules.schedule import (Action, build_schedule, check_interleaving,
                                    device_of_virtual_stage, virtual_stages_of_device)
from sim.engine.stage_costs import CostTable, StageCost, backward_time_s, stage_bounds, stage_of_layers
from sim.engine.stragglers import straggle_fraction
from sim.formats.timeline import (DP_ALLREDUCE, DP_REDUCE_SCATTER, OPTIMIZER, RECV_WAIT, SHARED_ALLREDUCE,
                                  STEP_OVERHEAD, MemorySample,
                                  Record, Timeline)
from sim.workloads.moe.expert_parallel import expert_replica_stride
from sim.workloads.workload import Workload, shared_parameters

__all__ = ["SimResult", "StageResult", "SharedReduction", "ring_allreduce_s", "shared_reductions", "simulate"]


@dataclass(frozen=True)
class StageResult:
    """One device: pipeline position ``stage`` of ``replica``, on global device ``device``."""

    stage: int
    layers: int  # over all of the device's chunks
    busy_s: float
    peak_memory_bytes: int  # static + peak activation
    peak_activation_bytes: int  # saved-for-backward tensors + stashed inputs, at their peak
    static_bytes: int  # parameters + gradients + optimizer state (1/D of it with ZeRO-1)
    memory_capacity_bytes: float
    fits: bool
    replica: int = 0
    device: int = 0
    # of busy_s, what a CPU host's effects added (sim.engine.host: the warm-up after waits); None where
    # the costs turn none on (the analytic and GPU models)
    host: HostPaid | None = None
    # ZeRO-2/3: its shards, the unsharded parameters in flight (sim.engine.fsdp); None otherwise
    sharded: ShardedMemory | None = None
    # expert parallelism: its (parameter, gradient, optimizer state) bytes, as the executor reports each rank's;
    # None otherwise
    state_bytes: tuple[int, int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        capacity = self.memory_capacity_bytes
        entry = {
            "stage": self.stage, "replica": self.replica, "device": self.device, "layers": self.layers,
            "busy_s": self.busy_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
            "static_bytes": self.static_bytes,
            "memory_capacity_bytes": None if math.isinf(capacity) else int(capacity),
            "fits": self.fits,
        }
        if self.host is not None:
            entry["host"] = self.host.to_dict()
        if self.sharded is not None:
            entry.update(self.sharded.to_dict())
        if self.state_bytes is not None:
            entry.update(zip(("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"), self.state_bytes))
        return entry


@dataclass
class SimResult:
    step_time_s: float
    bubble_fraction: float  # idle share of all D x K devices' time
    throughput_samples_per_s: float  # of the global batch
    partition: tuple[int, ...]  # layers per virtual stage: V x K entries
    batch_size: int  # the global mini-batch
    microbatches: int  # replica 0's, as executed: torch.chunk may make fewer than asked for
    microbatch_rows: list[int]  # replica 0's
    schedule: str
    checkpoint: str
    stages: list[StageResult]  # one per device, in device order
    timeline: Timeline = field(repr=False)
    replicas: int = 1
    virtual_stages: int = 1
    zero: int = 0
    placement: str = DEFAULT_PLACEMENT
    replica_rows: list[int] = field(default_factory=list)  # rows of the global batch each replica trains
    shard_group: int | None = None  # ZeRO-2/3 within groups of this many replicas (HSDP); None: all of them
    gradient_sync: str | None = None  # ZeRO-2/3: reduce-scattered once per "step" or per "microbatch"; None otherwise

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
            "replicas": self.replicas,
            "pipeline_stages": len(self.partition) // self.virtual_stages,
            "virtual_stages": self.virtual_stages,
            "zero": self.zero,
            "placement": self.placement,
            "replica_rows": self.replica_rows,
            **({"shard_group": self.shard_group} if self.shard_group else {}),
            **({"gradient_sync": self.gradient_sync} if self.gradient_sync else {}),
            "fits": self.fits,
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass(frozen=True)
class SharedReduction:
    """The all-reduce of one shared parameter's gradient among the pipeline positions holding it."""

    owners: tuple[int, ...]
    nbytes: int
    duration_s: float  # on replica 0's devices


def shared_reductions(workload: Workload, partition: Sequence[int], system: System, virtual_stages: int = 1,
                      devices: Sequence[int] | None = None, schedule: str = "interleaved") -> list[SharedReduction]:
    """One reduction per shared parameter whose layers sit on more than one device, in layer order.

    ``devices[k]`` is the global device of pipeline position k (default: device k); ``schedule``
    places the chunks (:func:`sim.schedules.schedule.device_of_virtual_stage`)."""
    stages = len(partition) // virtual_stages
    devices = list(range(stages)) if devices is None else devices
    stage_of = stage_of_layers(partition)
    reductions = []
    for parameter in shared_parameters(workload):
        owners = tuple(sorted({device_of_virtual_stage(stage_of[layer], stages, schedule)
                               for layer in parameter.layers}))
        if len(owners) < 2:
            continue
        reductions.append(SharedReduction(owners, parameter.param_bytes,
                                          _owners_ring_s(parameter.param_bytes, [devices[k] for k in owners], system)))
    return reductions


def _owners_ring_s(nbytes: int, devices: Sequence[int], system: System) -> float:
    nodes = {system.node_of(d) for d in devices}
    return ring_allreduce_s(nbytes, len(devices), system.intra_link if len(nodes) == 1 else system.inter_link)


@dataclass(frozen=True)
class PlacedLayout:
    """D replicas of K devices with V chunks each, placed on the system; validated at construction."""

    replicas: int
    stages: int
    virtual_stages: int
    placement: str
    schedule: str = "gpipe"  # places the chunks: in a loop, or in a V (sim.schedules.schedule.device_of_virtual_stage)

    def devices(self, replica: int) -> list[int]:
        return [device_of(replica, k, self.replicas, self.stages, self.placement) for k in range(self.stages)]

    def chunks(self, stage: int) -> list[int]:
        """The virtual stages device position ``stage`` runs, chunk 0 first."""
        return virtual_stages_of_device(stage, self.stages, self.virtual_stages, self.schedule)

    def positions(self) -> list[int]:
        """The device position of each virtual stage."""
        return [device_of_virtual_stage(s, self.stages, self.schedule) for s in range(self.stages * self.virtual_stages)]


def check_layout(workload: Workload, system: System, partition: Sequence[int],
                 layout: ParallelLayout) -> tuple[tuple[int, ...], PlacedLayout]:
    """What :class:`sim.formats.layout.ParallelLayout` cannot check alone, one line each, before any
    work: the partition against the model and the layout's K and V, and the system's devices."""
    partition = validate_partition(partition, workload.num_layers)
    check_chunked_partition(partition, layout.virtual_stages)
    if len(partition) != layout.virtual_stage_count:
        raise GpipeInputError(f"partition has {len(partition)} entries but the layout has K={layout.stages} "
                              f"stages of V={layout.virtual_stages} chunks; give V x K entries")
    system.check_fits(layout.stages, layout.replicas)
    return partition, PlacedLayout(layout.replicas, layout.stages, layout.virtual_stages, layout.placement,
                                   layout.schedule)


def replica_microbatch_rows(batch_size: int, replicas: int, microbatches: int) -> list[list[int]]:
    """Each replica's micro-batch rows: ``torch.chunk`` of the global batch into D, then into M."""
    replica_rows = split_rows(batch_size, replicas)
    if len(replica_rows) < replicas:
        raise GpipeInputError(f"a global batch of {batch_size} rows splits (like torch.chunk) into only "
                              f"{len(replica_rows)} parts, too few for {replicas} replicas; use --batch "
                              f"{replicas} or more with a batch torch.chunk splits into {replicas} parts")
    return [split_rows(rows, microbatches) for rows in replica_rows]


def simulate(workload: Workload, system: System, partition: Sequence[int], batch_size: int,
             layout: ParallelLayout, costs: CostTable | None = None, record: bool = True,
             allreduce_link: Link | None = None, dp_overlap: bool = False,
             actions: Sequence[Sequence[Action]] | None = None) -> SimResult:
    """Simulate one step of ``workload`` split by ``partition`` (V x K entries) on ``system`` in ``layout``.

    ``batch_size`` is the global mini-batch, which the layout's replicas split like torch.chunk.
    The layout's T and C are the workload's to price (:mod:`sim.workloads.tensor_parallel`).
    ``costs`` lets a caller (the planner) share one cost cache across many simulations;
    ``record=False`` skips building the timeline when only the figures are wanted.
    ``allreduce_link``, when given, times the data-parallel all-reduce as a ring on that link.
    ``dp_overlap`` runs it bucket by bucket inside each device's last backward, as Megatron-LM's
    trainers do (:func:`sim.engine.allreduce.exposed_allreduce_s`), instead of after it as the executor does.
    ``actions``, when given, are each device's list to walk in place of ``schedule``'s (a schedule
    read from a file, :mod:`sim.schedules.torch_schedule`; ``schedule`` then only names its shape).
    """
    microbatches, checkpoint, schedule = layout.microbatches, layout.checkpoint, layout.schedule
    virtual_stages, replicas, zero = layout.virtual_stages, layout.replicas, layout.zero
    partition, placed = check_layout(workload, system, partition, layout)
    per_replica_rows = replica_microbatch_rows(batch_size, replicas, microbatches)
    if schedule == "interleaved":
        for rows in {tuple(r) for r in per_replica_rows}:
            if len(rows) != microbatches and len(rows) % placed.stages:
                raise GpipeInputError(
                    f"{sum(rows)} rows split (like torch.chunk) into {len(rows)} micro-batches, not "
                    f"{microbatches}, and the interleaved schedule needs a multiple of K={placed.stages}; "
                    f"choose --batch and --microbatches that split evenly")
            check_interleaving(placed.stages, len(rows), virtual_stages, workload.num_layers)
    table = costs if costs is not None else CostTable(workload, system.device)
    given = tuple(tuple(device) for device in actions) if actions is not None else None
    fsdp = (FsdpPricing(table, system, layout, partition, placed.positions(), workload.sharded_links(system))
            if sharded_layout(layout) else None)
    runs = _run_replicas(system, placed, partition, per_replica_rows, table, schedule, checkpoint, record, given, fsdp)
    step = _Step(workload, system, placed, partition, table, per_replica_rows, runs, zero, allreduce_link, record,
                 checkpoint if dp_overlap else None, fsdp)
    result = step.result(batch_size, schedule, checkpoint, zero)
    result.shard_group = layout.shard_group if fsdp is not None else None
    result.gradient_sync = layout.resolved_gradient_sync if fsdp is not None else None
    return result


def _signature(system: System, devices: Sequence[int], rows: Sequence[int]) -> tuple:
    """What a replica's simulation depends on: its micro-batch rows, and which devices share a node."""
    first_seen: dict[int, int] = {}
    pattern = tuple(first_seen.setdefault(system.node_of(d), len(first_seen)) for d in devices)
    return tuple(rows), pattern


@lru_cache(maxsize=64)
def _schedule(stages: int, microbatches: int, schedule: str, checkpoint: str,
              virtual_stages: int) -> tuple[tuple[Action, ...], ...]:
    """:func:`sim.schedules.schedule.build_schedule`, kept for the planner's many candidates of one shape."""
    return tuple(tuple(actions) for actions in build_schedule(stages, microbatches, schedule, checkpoint,
                                                              virtual_stages))


def _run_replicas(system: System, layout: PlacedLayout, partition: tuple[int, ...], per_replica_rows: list[list[int]],
                  table: CostTable, schedule: str, checkpoint: str, record: bool,
                  given: tuple[tuple[Action, ...], ...] | None = None,
                  fsdp: FsdpPricing | None = None) -> list[ReplicaRun]:
    """One :class:`ReplicaRun` per replica; replicas with the same signature share one; under
    ZeRO-2/3 each stage's costs carry the communication ``fsdp`` leaves exposed."""
    bounds = stage_bounds(partition)
    done: dict[tuple, ReplicaRun] = {}
    runs = []
    for d, rows in enumerate(per_replica_rows):
        devices = layout.devices(d)
        key = _signature(system, devices, rows)
        if key not in done:
            stage_costs = {r: [table.stage(r, a, b) for a, b in bounds] for r in set(rows)}
            if fsdp is not None:
                stage_costs = {r: [fsdp.stage_cost(r, s, cost) for s, cost in enumerate(row)]
                               for r, row in stage_costs.items()}
            actions = given if given is not None else _schedule(layout.stages, len(rows), schedule, checkpoint,
                                                                 layout.virtual_stages)
            done[key] = ReplicaRun(system, devices, layout.virtual_stages, rows, stage_costs, checkpoint,
                                   record, layout.positions()).run(actions)
        runs.append(done[key])
    return runs


class _Step:
    """The rest of the step after each device's last backward, and the result: a closed form, since
    nothing after the last backward depends on anything but when each device got there."""

    def __init__(self, workload: Workload, system: System, layout: PlacedLayout, partition: tuple[int, ...],
                 table: CostTable, per_replica_rows: list[list[int]], runs: list[ReplicaRun], zero: int,
                 allreduce_link: Link | None, record: bool, overlap_checkpoint: str | None = None,
                 fsdp: FsdpPricing | None = None) -> None:
        self.system, self.layout, self.partition, self.runs = system, layout, partition, runs
        self.fsdp = fsdp
        self.sharded: list[ShardedMemory | None] = [None] * layout.stages
        self.state_bytes: list[tuple[int, int, int] | None] = [None] * layout.stages
        self.per_replica_rows = per_replica_rows
        self.record = record
        self.records: list[tuple] = []
        bounds = stage_bounds(partition)
        rows0 = per_replica_rows[0][0]
        K, D = layout.stages, layout.replicas
        self.chunk_costs: list[list[StageCost]] = [[table.stage(rows0, *bounds[s]) for s in layout.chunks(k)]
                                                   for k in range(K)]
        self.static: list[int] = []
        self.allreduce_s: list[float] = []
        self.expert_fraction: list[float] = []  # the routed experts' share of each device's gradients
        for k in range(K):
            state = [table.gradient_and_optimizer_bytes(rows0, *bounds[s]) for s in layout.chunks(k)]
            gradient_bytes = sum(g for g, _ in state)
            optimizer_bytes = sum(o for _, o in state)
            chunk_static = sum(c.static_bytes for c in self.chunk_costs[k])
            expert_bytes = sum(table.expert_gradient_bytes(rows0, *bounds[s]) for s in layout.chunks(k))
            self.expert_fraction.append(expert_bytes / gradient_bytes if gradient_bytes else 0.0)
            if fsdp is not None:  # ZeRO-2/3: shards, gathered units and reductions (sim.engine.fsdp)
                self.sharded[k] = fsdp.memory(rows0, layout.chunks(k), len(per_replica_rows[0]))
                self.static.append(self.sharded[k].total_bytes)
                last = backward_time_s(self.chunk_costs[k][0], fsdp.layout.checkpoint)  # chunk 0 ends last
                self.allreduce_s.append(fsdp.tail_s(rows0, layout.chunks(k), last))
                continue
            group = data_parallel_group(k, D, K, layout.placement)
            if expert_bytes:  # expert parallelism: routed experts over their expert-data-parallel group
                stride = expert_replica_stride(workload)
                self.static.append(expert_static_bytes(chunk_static, optimizer_bytes, gradient_bytes, expert_bytes, D,
                                                       zero, stride))
                params = chunk_static - gradient_bytes - optimizer_bytes
                self.state_bytes[k] = (params, gradient_bytes, self.static[-1] - params - gradient_bytes)
                allreduce_s = (group_allreduce_s(gradient_bytes - expert_bytes, group, system, allreduce_link)
                               + group_allreduce_s(expert_bytes, group[::stride], system, allreduce_link))
            else:
                self.static.append(static_bytes(chunk_static, optimizer_bytes, D, zero))
                allreduce_s = group_allreduce_s(gradient_bytes, group, system, allreduce_link)
            if overlap_checkpoint is not None:  # the last backward on device k is its first chunk's
                last = self.chunk_costs[k][0]
                layers = sum(partition[s] for s in layout.chunks(k))
                allreduce_s = exposed_allreduce_s(allreduce_s, backward_time_s(last, overlap_checkpoint), layers)
            self.allreduce_s.append(allreduce_s)
        self.reductions = shared_reductions(workload, partition, system, layout.virtual_stages,
                                            schedule=layout.schedule)
        self.end_s, self.busy_s = self._tail()

    def _tail(self) -> tuple[list[list[float]], list[list[float]]]:
        """Per replica and position: when the device ends, and its busy seconds (optimizer included)."""
        K, layout = self.layout.stages, self.layout
        # the slowest replica's compute runs past the typical one's by what calibration measured of a
        # process's step-to-step deviations (sim.engine.stragglers; nothing with one replica or none measured)
        start_s = [max(run.last_backward_s[k] for run in self.runs)
                   + straggle_fraction(self.chunk_costs[k][0].replica_spread, layout.replicas)
                   * sum(run.busy_s[k] for run in self.runs) / len(self.runs) for k in range(K)]
        reduced_s = [start_s[k] + self.allreduce_s[k] for k in range(K)]
        ends, busy = [], []
        for d, run in enumerate(self.runs):
            devices = layout.devices(d)
            t = list(reduced_s)
            for k in range(K):
                self._span(d, k, RECV_WAIT, run.last_backward_s[k], start_s[k])
                self._span(d, k, DP_ALLREDUCE if self.fsdp is None else DP_REDUCE_SCATTER, start_s[k], reduced_s[k])
            for reduction in self.reductions:
                begin = max(t[k] for k in reduction.owners)
                finish = begin + _owners_ring_s(reduction.nbytes, [devices[k] for k in reduction.owners], self.system)
                for k in reduction.owners:
                    self._span(d, k, RECV_WAIT, t[k], begin)
                    self._span(d, k, SHARED_ALLREDUCE, begin, finish)
                    t[k] = finish
            replica_busy = list(run.busy_s)
            for k in range(K):
                optimizer_s = sum(c.optimizer_s for c in self.chunk_costs[k])
                if self.fsdp is not None:
                    optimizer_s = self.fsdp.optimizer_s(optimizer_s, self.expert_fraction[k])  # on the shard
                overhead_s = max(c.step_overhead_s for c in self.chunk_costs[k])
                self._span(d, k, OPTIMIZER, t[k], t[k] + optimizer_s)
                replica_busy[k] += optimizer_s
                t[k] += optimizer_s
                self._span(d, k, STEP_OVERHEAD, t[k], t[k] + overhead_s)  # not busy: not known to compute
                t[k] += overhead_s
            ends.append(t)
            busy.append(replica_busy)
        return ends, busy

    def _span(self, replica: int, stage: int, kind: str, start_s: float, end_s: float) -> None:
        if self.record and end_s > start_s:
            self.records.append(Record(stage, kind, -1, start_s, end_s, 0, replica))

    def result(self, batch_size: int, schedule: str, checkpoint: str, zero: int) -> SimResult:
        layout = self.layout
        K, D = layout.stages, layout.replicas
        step_s = max(max(t) for t in self.end_s)
        devices_total = K * D
        idle_s = sum(step_s - b for busy in self.busy_s for b in busy)
        bubble = idle_s / (devices_total * step_s) if step_s > 0 else 0.0
        capacity = self.system.device.memory_bytes
        layers = [sum(self.partition[s] for s in layout.chunks(k)) for k in range(K)]
        stage_results = []
        for d, run in enumerate(self.runs):
            for k, device in enumerate(layout.devices(d)):
                peak = self.static[k] + run.peak_bytes[k]
                stage_results.append(StageResult(
                    stage=k, layers=layers[k], busy_s=self.busy_s[d][k], peak_memory_bytes=peak,
                    peak_activation_bytes=run.peak_bytes[k], static_bytes=self.static[k],
                    memory_capacity_bytes=capacity, fits=peak <= capacity, replica=d, device=device,
                    host=run.host_paid(k), sharded=self.sharded[k], state_bytes=self.state_bytes[k]))
        stage_results.sort(key=lambda s: s.device)
        rows0 = self.per_replica_rows[0]
        return SimResult(
            step_time_s=step_s, bubble_fraction=bubble,
            throughput_samples_per_s=batch_size / step_s if step_s > 0 else math.inf,
            partition=self.partition, batch_size=batch_size, microbatches=len(rows0),
            microbatch_rows=list(rows0), schedule=schedule, checkpoint=checkpoint,
            stages=stage_results, timeline=self._timeline(schedule, checkpoint), replicas=D,
            virtual_stages=layout.virtual_stages, zero=zero, placement=layout.placement,
            replica_rows=[sum(rows) for rows in self.per_replica_rows])

    def _timeline(self, schedule: str, checkpoint: str) -> Timeline:
        layout = self.layout
        meta = {"schedule": schedule, "checkpoint": checkpoint, "partition": list(self.partition),
                "system": self.system.name, "replicas": layout.replicas, "virtual_stages": layout.virtual_stages,
                "placement": layout.placement}
        if not self.record:
            return Timeline(source="simulated", meta=meta)
        spans = [tuple(r) for r in self.records]
        interleaved = layout.virtual_stages > 1
        for d, run in enumerate(self.runs):
            spans.extend(_span_fields(d, k, kind, m, start, end, s if interleaved else None)
                         for k, kind, m, start, end, s in run.records)
        memory = [MemorySample(k, time_s, held) for k, time_s, held in self.runs[0].memory]  # as the executor samples
        spans.sort(key=_by_start_then_row)
        return Timeline(records=[Record(*fields) for fields in spans], memory=memory, source="simulated",
                        meta=meta)


def _span_fields(replica: int, stage: int, kind: str, microbatch: int, start_s: float, end_s: float,
                 virtual_stage: int | None) -> tuple:
    """A span's :class:`Record` fields as the executor records them: the row is (replica, stage),
    and under the interleaved schedule the span names its virtual stage."""
    return stage, kind, microbatch, start_s, end_s, 0, replica, virtual_stage


def _by_start_then_row(fields: tuple) -> tuple:
    return fields[3], fields[6], fields[0]
