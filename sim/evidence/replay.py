"""Published GPU runs replayed: each run's predicted step time against the one its source measured.

Our machines have no GPU, so published measurements of real runs are the GPU truth. A runs file
(``benchmarks/published_runs/dev.json`` is the development set) holds one object per run in a fixed
schema, so that other files can be fed to the same command::

    {"runs": [{"id": "korth-22b-full", "source": "Korthikanti et al. 2022, Table 5",
      "hardware": "a100-nvlink", "nodes": 1, "model": "transformer",
      "options": {"layers": 48, "d_model": 6144, "ff": 24576, "heads": 64, "seq": 2048, "vocab": 51200},
      "tensor_parallel": 8, "pipeline_stages": 1, "replicas": 1, "context_parallel": 1,
      "virtual_stages": null, "microbatch_size": 4, "global_batch": 4, "checkpoint": "full",
      "sequence_parallel": false, "precision": "bf16", "measured_step_s": 1.42}]}

``model`` is any ``--model`` value and ``options`` its ``--option`` keys. ``null`` means the source
does not say: the replay then takes the fastest fitting plan the planner finds within the stated
layout (micro-batches, virtual stages) and says so in ``assumed``. Unknown keys (a note, a
confidence) are ignored. A run the simulator cannot model yet (context parallelism on eager attention, an option the
model does not know, more devices than the hardware has) is listed as not modelled, with the
reason, never dropped. ``error`` is predicted / measured - 1.

The data-parallel all-reduce is bucketed inside each stage's last backward, as Megatron-LM runs it
(``dp_overlap`` of :func:`sim.engine.engine.simulate`). A device with fractions fitted on the development
set (:mod:`sim.catalog.kernel_model`, ``gpipe fit-gpu``) is timed kernel by kind; any other keeps the
catalog's assumed efficiency, and ``assumed`` says which. Limits, stated in every run's
``assumed``: a distributed optimizer is ZeRO-1; a transformer run whose options do not name its
attention kernel is timed with torch's unfused materialised scores (``attention: eager``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from sim.catalog.hardware import get_system
from sim.catalog.kernel_model import KernelEfficiency
from sim.errors import GpipeInputError
from sim.formats.timeline import read_json
from sim.workloads.workload import Workload

REQUIRED = ("id", "hardware", "nodes", "model", "options", "tensor_parallel", "pipeline_stages", "replicas",
            "context_parallel", "virtual_stages", "microbatch_size", "global_batch", "checkpoint",
            "sequence_parallel", "precision", "measured_step_s")
# Every run: what the simulator takes that the source's trainer does differently
ALWAYS_ASSUMED = ("data-parallel all-reduce bucketed inside each stage's last backward, as Megatron-LM runs it; "
                  "a distributed optimizer taken as ZeRO-1, searched beside none",)


@dataclass
class Replayed:
    id: str
    modelled: bool
    measured_step_s: float
    predicted_step_s: float | None = None
    error: float | None = None  # predicted / measured - 1
    assumed: list[str] = field(default_factory=list)
    reason: str = ""  # why a run is not modelled
    layout: dict[str, Any] = field(default_factory=dict)  # what was simulated: T, D, K, V, M, partition

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_runs(path: str) -> list[dict[str, Any]]:
    """The runs of a runs file, each with every key of the schema; one line naming what is wrong."""
    data = read_json(path, "runs file", "give a JSON file like benchmarks/published_runs/dev.json")
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise GpipeInputError(f"runs file {path!r} has no \"runs\" list; see benchmarks/published_runs/dev.json")
    for index, run in enumerate(data["runs"]):
        if not isinstance(run, dict):
            raise GpipeInputError(f"run {index} of {path!r} is not an object")
        missing = [key for key in REQUIRED if key not in run]
        if missing:
            raise GpipeInputError(f"run {run.get('id', index)!r} of {path!r} has no {', '.join(missing)}; every run "
                                  f"gives {', '.join(REQUIRED)} (null where the source does not say)")
        if not isinstance(run["measured_step_s"], (int, float)) or run["measured_step_s"] <= 0:
            raise GpipeInputError(f"run {run['id']!r}: measured_step_s must be a positive number of seconds, got "
                                  f"{run['measured_step_s']!r}")
    return data["runs"]


Resolve = Callable[[str, dict[str, Any]], Workload]


def replay(run: dict[str, Any], resolve: Resolve, kernels: dict[str, KernelEfficiency] | None = None) -> Replayed:
    """Predict one run; ``resolve(model, options)`` gives its workload (the composition root
    supplies one that can measure torch models); ``kernels`` (per hardware name) replaces the fitted
    fractions, as ``gpipe fit-gpu`` does while it fits."""
    out = Replayed(run["id"], False, float(run["measured_step_s"]), assumed=list(ALWAYS_ASSUMED))
    try:
        _predict(run, resolve, out, (kernels or {}).get(run["hardware"]))
    except GpipeInputError as exc:
        out.reason = str(exc)
        return out
    out.modelled = True
    out.error = out.predicted_step_s / out.measured_step_s - 1  # type: ignore[operator]
    return out


def _predict(run: dict[str, Any], resolve: Resolve, out: Replayed, kernels: KernelEfficiency | None) -> None:
    from sim.engine.engine import simulate
    from sim.schedules.microbatch import split_rows
    from sim.planner.search import Candidate, default_partition, search
    from sim.workloads.tensor_parallel import check_context_parallel, check_tensor_parallel, with_tensor_parallel
    from sim.workloads.workload import check_checkpoint_for

    tensor, stages, replicas, context = (int(run[key] or 1) for key in ("tensor_parallel", "pipeline_stages",
                                                                         "replicas", "context_parallel"))
    system = get_system(run["hardware"], int(run["nodes"] or 1), kernels)
    fitted = system.device.kernels
    out.assumed.append(f"{system.device.name}: kernels timed by kind at fractions fitted on the development set"
                       if fitted is not None else
                       f"{system.device.name}: efficiency assumed ({system.device.efficiency:.0%} of peak FLOP/s), "
                       "not fitted")
    workload = resolve(run["model"], {**run["options"], "precision": run["precision"]})
    out.assumed.extend(getattr(workload, "assumed", ()))  # what a model priced by its shape leaves out
    if run["model"] == "transformer" and "attention" not in run["options"]:
        out.assumed.append("attention as torch's unfused ops run it (its (heads, seq, seq) scores saved and moved): "
                           "the run's options do not name the kernel (eager, fused or flash)")
    checkpoint = check_checkpoint_for(workload, run["checkpoint"])
    sequence = bool(run["sequence_parallel"])
    check_tensor_parallel(tensor, workload, system)
    check_context_parallel(context, workload, system, tensor)
    system.check_fits(stages, replicas, tensor * context)
    workload, groups = with_tensor_parallel(workload, system, tensor, sequence, context)
    batch = int(run["global_batch"])
    virtual = run["virtual_stages"]
    if virtual is None and stages > 1:
        out.assumed.append("virtual stages not given: the best of 1, 2 and 4 found by the planner")
    schedules = ["interleaved"] if virtual and virtual > 1 else ["gpipe", "1f1b"] if virtual == 1 or stages == 1 \
        else ["gpipe", "1f1b", "interleaved"]
    virtual_options = [virtual] if virtual else [2, 4]
    if run["microbatch_size"]:
        per_replica = batch // replicas
        microbatches = max(1, per_replica // int(run["microbatch_size"]))
        microbatch_options = [microbatches]
    else:
        per_replica = batch // replicas
        microbatch_options = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
        out.assumed.append("micro-batch size not given: the fastest fitting one the planner finds")
    zero_options = [0, 1] if replicas > 1 else [0]  # Megatron's distributed optimizer shards as ZeRO-1 does
    found = search(workload, groups, batch, [stages], microbatch_options, [checkpoint], schedules, top=1,
                   replica_options=[replicas], virtual_options=virtual_options, zero_options=zero_options,
                   dp_overlap=True)
    best = found.best
    if best is None:
        schedule = "1f1b" if "1f1b" in schedules else schedules[0]  # the fewest micro-batches in flight
        candidate = Candidate(stages, microbatch_options[-1], checkpoint, schedule, replicas,
                              virtual_options[0] if schedule == "interleaved" else 1, zero_options[-1])
        partition = default_partition(workload, groups, batch, candidate)
        result = simulate(workload, groups, partition, batch, candidate.microbatches, checkpoint, candidate.schedule,
                          record=False, virtual_stages=candidate.virtual_stages, replicas=replicas,
                          zero=candidate.zero, dp_overlap=True)
        peak = max(s.peak_memory_bytes for s in result.stages)
        if not all(s.fits for s in result.stages):
            out.assumed.append(f"{run['id']} does not fit the simulated memory ({peak / 2**30:.1f} GiB on the "
                               "fullest device): timed all the same")
    else:
        candidate, partition, result = best.candidate, best.partition, best.result
        assert result is not None
    out.predicted_step_s = result.step_time_s
    out.layout = {"tensor_parallel": tensor, "sequence_parallel": sequence, "context_parallel": context,
                  "replicas": replicas,
                  "pipeline_stages": stages, "virtual_stages": candidate.virtual_stages,
                  "microbatches": candidate.microbatches, "zero": candidate.zero, "microbatch_rows": split_rows(batch // replicas,
                                                                                        candidate.microbatches)[0],
                  "schedule": candidate.schedule, "partition": list(partition or [])}


def summary(results: list[Replayed]) -> dict[str, Any]:
    """The JSON ``gpipe replay --json`` prints: every run, and the median and worst absolute error
    over the modelled ones (None when none is)."""
    errors = [abs(r.error) for r in results if r.modelled and r.error is not None]
    return {"runs": [r.to_dict() for r in results],
            "median_abs_error": statistics.median(errors) if errors else None,
            "worst_abs_error": max(errors) if errors else None}
