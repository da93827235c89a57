"""The ``--report`` JSON of a measured run, computed from the merged timeline.

Fields: ``step_time_s`` (median over the steps after ``warmup_steps``), ``step_times_s`` (every
step), ``losses`` (one per step, from step 0 when resumed), ``grad_norms`` (the global L2 norm of
every step's gradients over all stages, before clipping; taken only with ``--clip-grad-norm``), ``stages`` (per stage:
``peak_activation_bytes`` as defined in :mod:`executor.runtime.memory`, ``busy_s`` the median per-step
compute time, ``peak_allocated_bytes`` on CUDA; under the interleaved schedule a stage is a device,
its ``layers`` summed over its chunks, listed per chunk in ``chunk_layers``), ``actions`` (median
duration of every (stage, kind, micro-batch) over the measured steps, with its rows: what
calibration fits; under the interleaved schedule one per chunk, with its ``virtual_stage``), the
``plan``, the run ``config`` and the ``timeline`` itself.

With D data-parallel replicas (:mod:`executor.parallel.replicas`), ``stages`` and ``actions`` are replica
0's (what one pipeline of the run did, on replica 0's rows), ``ranks`` lists every (replica, stage)
with its ``peak_activation_bytes``, ``busy_s``, ``optimizer_state_bytes`` (the optimizer state
it holds after the last step: with ``--zero 1`` its shard) and ``gradient_sum`` (how its gradients
were summed over the replicas: ``"shared memory"`` or the backend's name), and the timeline holds
every rank's spans, each record carrying its ``replica`` (the data-parallel all-reduce is the kind ``allreduce_dp``).
With ``--zero 2`` or ``3`` (:mod:`executor.parallel.fully_sharded`) each rank's entry also has
``parameter_bytes``, ``gradient_bytes`` (its padded shards), ``optimizer_state_bytes`` (state of a
parameter's shape at the shard's size; scalar step counters left out) and
``gathered_parameter_bytes_peak`` (the most gathered unit parameters it held at once) and
``accumulated_gradient_bytes`` (the most unsharded gradients it held after an action: those of a
step's micro-batches with ``--gradient-sync step``, none with ``microbatch``), its gradient
sum is ``"reduce-scatter (gloo)"``, and the gathers and reduce-scatters are spans of the kinds
``all_gather_dp`` and ``reduce_scatter_dp``. With ``--expert-parallel E``
(:mod:`executor.parallel.expert_parallel`) each entry has ``parameter_bytes``, ``gradient_bytes`` and
``optimizer_state_bytes`` counted the same way (its stage's non-expert parameters whole, n/E of its
routed experts; with ZeRO-1 the optimizer state of its shards, the experts' sharded over their D/E
replicas, the rest over D; with ZeRO-2/3 as above, the experts' shards over their D/E replicas), and a traced run's
token exchanges are spans of the kinds ``dispatch_ep`` and ``combine_ep``.

A step's time is the gap between the end of its last span on any rank and the end of the
previous step's (the first measured step counts from its first span), so steady-state step times
include the inherent pipeline bubble and every overhead.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from executor.runtime.data import split_rows
from sim.formats.timeline import OPTIMIZER, Timeline
from sim.schedules.schedule import COMPUTE_KINDS, virtual_stages_of_device


def step_times_s(timeline: Timeline) -> dict[int, float]:
    ends: dict[int, float] = {}
    starts: dict[int, float] = {}
    for r in timeline.records:
        ends[r.step] = max(ends.get(r.step, r.end_s), r.end_s)
        starts[r.step] = min(starts.get(r.step, r.start_s), r.start_s)
    result, previous_end = {}, None
    for step in sorted(ends):
        begin = starts[step] if previous_end is None else previous_end
        result[step] = ends[step] - begin
        previous_end = ends[step]
    return result


def build_report(timeline: Timeline, losses: list[float], config: dict[str, Any], plan: dict[str, Any],
                 peak_activation_bytes: list[int], peak_allocated_bytes: list[int] | None = None,
                 first_step: int = 0, grad_norms: list[float] | None = None,
                 optimizer_state_bytes: list[int] | None = None,
                 gradient_sums: list[str | None] | None = None,
                 sharded_bytes: list[dict[str, int] | None] | None = None) -> dict[str, Any]:
    """The run's report. ``stages`` are replica 0's devices (under the interleaved schedule a device
    lists its chunks' layers) and ``actions`` replica 0's median durations; with several replicas,
    ``ranks`` has every rank's peak activation bytes and busy time, in (replica, stage) order."""
    times = step_times_s(timeline)
    measured = [s for s in sorted(times) if s >= first_step + config.get("warmup_steps", 1)]
    if not measured:
        measured = sorted(times)
    busy: dict[tuple[int, int, int], float] = defaultdict(float)  # (replica, stage, step)
    durations: dict[tuple[int, int, str, int], list[float]] = defaultdict(list)  # (stage, virtual, kind, m)
    for r in timeline.records:
        if r.step not in measured or r.tp:  # a stage's figures are its tensor-parallel rank 0's
            continue
        if r.kind in COMPUTE_KINDS or r.kind == OPTIMIZER:
            busy[(r.replica, r.stage, r.step)] += r.duration_s
        if r.kind in COMPUTE_KINDS and r.replica == 0:
            virtual = r.stage if r.virtual_stage is None else r.virtual_stage
            durations[(r.stage, virtual, r.kind, r.microbatch)].append(r.duration_s)
    replicas = config.get("replicas", 1)
    virtual_stages = config.get("virtual_stages", 1)
    interleaved = virtual_stages > 1
    rows = split_rows(split_rows(config["batch_size"], replicas)[0], config["microbatches"])
    devices = len(config["partition"]) // virtual_stages  # K
    stage_count = len(peak_activation_bytes) // replicas

    def chunk_layers(k: int) -> list[int]:
        """Layers of device k's chunks, chunk 0 first (loop or V placement, sim.schedules.schedule)."""
        return [config["partition"][s] for s in virtual_stages_of_device(k, devices, virtual_stages,
                                                                          config.get("schedule", "gpipe"))]

    def busy_s(replica: int, stage: int) -> float:
        return statistics.median([busy[(replica, stage, s)] for s in measured]) if measured else 0.0

    stages = []
    for k in range(stage_count):
        entry: dict[str, Any] = {
            "stage": k,
            "layers": sum(chunk_layers(k)),
            "peak_activation_bytes": peak_activation_bytes[k],
            "busy_s": busy_s(0, k),
        }
        if interleaved:
            entry["chunk_layers"] = chunk_layers(k)
        if peak_allocated_bytes is not None:
            entry["peak_allocated_bytes"] = peak_allocated_bytes[k]
        stages.append(entry)
    actions = [{"stage": k, **({"virtual_stage": s} if interleaved else {}), "kind": kind, "microbatch": m,
                "rows": rows[m], "duration_s": statistics.median(values)}
               for (k, s, kind, m), values in sorted(durations.items())]
    step_time = statistics.median([times[s] for s in measured]) if measured else 0.0
    extra: dict[str, Any] = {}
    if replicas > 1:  # peak bytes in (replica, stage) order
        extra["ranks"] = [{"replica": i // stage_count, "stage": i % stage_count, "peak_activation_bytes": peak,
                           "busy_s": busy_s(i // stage_count, i % stage_count)}
                          for i, peak in enumerate(peak_activation_bytes)]
        for entry, nbytes in zip(extra["ranks"], optimizer_state_bytes or []):
            entry["optimizer_state_bytes"] = nbytes
        for entry, route in zip(extra["ranks"], gradient_sums or []):
            entry["gradient_sum"] = route
        for entry, sharded in zip(extra["ranks"], sharded_bytes or []):
            entry.update(sharded or {})
    return {
        "step_time_s": step_time,
        "step_times_s": [times[s] for s in sorted(times)],
        "measured_steps": measured,
        "losses": losses,
        "grad_norms": grad_norms or [],
        "stages": stages,
        "actions": actions,
        "plan": plan,
        "config": config,
        "timeline": timeline.to_dict(),
        **extra,
    }
