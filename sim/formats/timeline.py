"""The timeline format shared by the simulator and the executor.

A timeline is a list of :class:`Record` (one span of work or communication on one stage) plus
:class:`MemorySample` points. Simulated and measured runs use this one format, so the same exporters
(Chrome trace JSON that opens in Perfetto, plotly figures in :mod:`sim.views.figures`) serve both.
Times are seconds from the start of the step (or of the run, for multi-step measurements).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

from sim.errors import GpipeInputError
from sim.schedules.schedule import COMPUTE_KINDS

# Kinds of span beyond the compute kinds F/R/B/I/W of sim.schedules.schedule.Kind (COMPUTE_KINDS).
SEND_ACTIVATION = "send_act"
SEND_GRADIENT = "send_grad"
RECV_WAIT = "recv_wait"  # time a stage sat waiting for a neighbour's tensor
OPTIMIZER = "optimizer"
STEP_OVERHEAD = "overhead"  # simulated only: calibration's fitted per-step constant
SHARED_ALLREDUCE = "allreduce_shared"  # summing a shared parameter's gradient among the stages holding it
DP_ALLREDUCE = "allreduce_dp"  # averaging a stage's gradients over its data-parallel group (D replicas)
# ZeRO-2/3 (FSDP): a unit's parameters gathered over its shard group, its gradients reduce-scattered
# (and with HSDP all-reduced across the groups); simulated spans show the part no compute hides
DP_ALL_GATHER = "all_gather_dp"
DP_REDUCE_SCATTER = "reduce_scatter_dp"
# a tensor-parallel collective among a stage's T ranks, inside the F/R/B/I/W span that issued it (traced runs)
TP_ALL_REDUCE = "tp_all_reduce"
TP_REDUCE_SCATTER = "tp_reduce_scatter"
TP_ALL_GATHER = "tp_all_gather"
TP_COLLECTIVES = (TP_ALL_REDUCE, TP_REDUCE_SCATTER, TP_ALL_GATHER)
# expert parallelism: the all-to-alls sending each token's hidden state to the ranks holding its experts and
# bringing the outputs back (in a backward, their gradients the same way), inside the F/B span that issued
# them; simulated spans show the part no compute hides
EP_DISPATCH = "dispatch_ep"
EP_COMBINE = "combine_ep"

KIND_NAMES = {
    "F": "forward",
    "R": "recompute",
    "B": "backward",
    "I": "input gradient",
    "W": "weight gradients",
    SEND_ACTIVATION: "send activation",
    SEND_GRADIENT: "send gradient",
    RECV_WAIT: "wait for neighbour",
    OPTIMIZER: "optimizer step",
    STEP_OVERHEAD: "fitted step overhead",
    SHARED_ALLREDUCE: "all-reduce shared gradients",
    DP_ALLREDUCE: "all-reduce data-parallel gradients",
    DP_ALL_GATHER: "all-gather sharded parameters",
    DP_REDUCE_SCATTER: "reduce-scatter sharded gradients",
    TP_ALL_REDUCE: "tensor-parallel all-reduce",
    TP_REDUCE_SCATTER: "tensor-parallel reduce-scatter",
    TP_ALL_GATHER: "tensor-parallel all-gather",
    EP_DISPATCH: "expert dispatch (all-to-all)",
    EP_COMBINE: "expert combine (all-to-all)",
}


class Record(NamedTuple):
    """One span: ``stage`` did ``kind`` for ``microbatch`` (-1 when none) from start_s to end_s.

    ``stage`` is the row the span sits on: the device. Under the interleaved schedule a device runs
    several chunks, and ``virtual_stage`` names the one the span belongs to (chunk c of device d is
    virtual stage c*K + d); None where stage and virtual stage are one.

    A named tuple rather than a dataclass: simulations of large pipelines create hundreds of
    thousands of these, and tuples are several times cheaper to build.
    """

    stage: int
    kind: str
    microbatch: int
    start_s: float
    end_s: float
    step: int = 0
    replica: int = 0  # which of D data-parallel copies of the pipeline (0 with one)
    virtual_stage: int | None = None
    tp: int = 0  # which of the stage's T tensor-parallel ranks (0 with one; the simulator's device is the group)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class MemorySample(NamedTuple):
    """Bytes held on ``stage`` from ``time_s`` on (until the next sample of that stage); with several
    replicas, replica 0's stage (the executor samples replica 0 only)."""

    stage: int
    time_s: float
    bytes: int


@dataclass
class Timeline:
    """Spans and memory samples of one run; ``source`` is ``"simulated"`` or ``"measured"``."""

    records: list[Record] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    source: str = "simulated"
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def stages(self) -> int:
        seen = [r.stage for r in self.records] + [s.stage for s in self.memory]
        return max(seen) + 1 if seen else 0

    @property
    def end_s(self) -> float:
        return max((r.end_s for r in self.records), default=0.0)

    def compute_records(self) -> list[Record]:
        return [r for r in self.records if r.kind in COMPUTE_KINDS]

    def busy_s(self, stage: int) -> float:
        """Seconds ``stage`` spent computing (forward, recompute, backward or its I and W, optimizer);
        a tensor-parallel stage's rank 0 stands for it."""
        return sum(r.duration_s for r in self.records
                   if r.stage == stage and not r.tp and (r.kind in COMPUTE_KINDS or r.kind == OPTIMIZER))

    def peak_memory_bytes(self, stage: int) -> int:
        return max((s.bytes for s in self.memory if s.stage == stage), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "meta": self.meta,
            "records": [_fields(r) for r in self.records],
            "memory": [s._asdict() for s in self.memory],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Timeline":
        return cls(
            records=[Record(**r) for r in data.get("records", [])],
            memory=[MemorySample(**s) for s in data.get("memory", [])],
            source=data.get("source", "simulated"),
            meta=dict(data.get("meta", {})),
        )

    @property
    def replicas(self) -> int:
        """D, data-parallel copies of the pipeline the timeline holds (1 for one pipeline)."""
        return max((r.replica for r in self.records), default=0) + 1

    @property
    def tensor_parallel(self) -> int:
        """T, tensor-parallel ranks per stage the timeline has rows for (1 without)."""
        return max((r.tp for r in self.records), default=0) + 1

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON: one thread per stage (per replica and stage with several
        replicas: thread d*K + k; times T plus t per tensor-parallel rank); opens in Perfetto and
        chrome://tracing."""
        pid = 0
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"gpipe ({self.source})"}}
        ]
        stages, replicas, parts = self.stages, self.replicas, self.tensor_parallel
        for replica in range(replicas):
            for stage in range(stages):
                for tp in range(parts):
                    events.append({"ph": "M", "pid": pid, "tid": (replica * stages + stage) * parts + tp,
                                   "name": "thread_name", "args": {"name": row_name(replica, stage, replicas, tp, parts)}})
        for r in self.records:
            label = KIND_NAMES.get(r.kind, r.kind)
            name = f"{label} {r.microbatch}" if r.microbatch >= 0 else label
            args = {"microbatch": r.microbatch, "step": r.step}
            if r.virtual_stage is not None:
                name += f" (virtual stage {r.virtual_stage})"
                args["virtual_stage"] = r.virtual_stage
            events.append({
                "ph": "X", "pid": pid, "tid": (r.replica * stages + r.stage) * parts + r.tp, "name": name, "cat": r.kind,
                "ts": r.start_s * 1e6, "dur": max(r.duration_s, 0.0) * 1e6, "args": args,
            })
        for s in self.memory:
            events.append({"ph": "C", "pid": pid, "tid": s.stage * parts,
                           "name": f"memory {row_name(0, s.stage, replicas, 0, parts)}",
                           "ts": s.time_s * 1e6, "args": {"bytes": s.bytes}})
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"meta": self.meta}}

    def write_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_chrome_trace())


def row_name(replica: int, stage: int, replicas: int, tp: int = 0, parts: int = 1) -> str:
    """A stage row's label: ``stage k``, or ``replica d stage k`` when there are several replicas,
    with `` tp t`` when the stage has several tensor-parallel ranks."""
    name = f"replica {replica} stage {stage}" if replicas > 1 else f"stage {stage}"
    return f"{name} tp {tp}" if parts > 1 else name


def _fields(record: Record) -> dict[str, Any]:
    """A record as a dict; ``replica`` only when not 0 and ``virtual_stage`` only when set, so one
    pipeline's JSON is unchanged."""
    data = record._asdict()
    if not data["replica"]:
        del data["replica"]
    if data["virtual_stage"] is None:
        del data["virtual_stage"]
    if not data["tp"]:
        del data["tp"]
    return data


def merge(timelines: Iterable[Timeline], source: str = "measured") -> Timeline:
    """Join per-rank timelines (each holding its own stages) into one, records sorted by start."""
    merged = Timeline(source=source)
    for t in timelines:
        merged.records.extend(t.records)
        merged.memory.extend(t.memory)
        merged.meta.update(t.meta)
    merged.records.sort(key=lambda r: (r.start_s, r.replica, r.stage, r.tp))
    merged.memory.sort(key=lambda s: (s.time_s, s.stage))
    return merged


def read_json(path: str | os.PathLike[str], what: str, missing_fix: str) -> Any:
    """The JSON document at ``path``; one line naming ``what`` it is when it is missing (with
    ``missing_fix``) or not JSON."""
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise GpipeInputError(f"{what} {os.fspath(path)!r} does not exist; {missing_fix}") from None
    except json.JSONDecodeError as exc:
        raise GpipeInputError(f"{what} {os.fspath(path)!r} is not valid JSON ({exc})") from None


def read_devices_file(path: str | os.PathLike[str], what: str, fix: str) -> dict[str, Any]:
    """A JSON file of one entry per device, ``{"devices": {name: {...}}, ...}`` (the GPU fit's kernel
    fractions, the error bands), whole; one line naming ``what`` it is and ``fix`` where it cannot be
    read, is not JSON or has no ``devices`` object. Its entries are for the caller to check."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise GpipeInputError(f"{what} {os.fspath(path)!r} cannot be read ({exc}); {fix}") from None
    if not isinstance(data.get("devices") if isinstance(data, dict) else None, dict):
        raise GpipeInputError(f"{what} {os.fspath(path)!r} has no \"devices\" object; {fix}")
    return data


def write_atomic(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, flushed to disk, then renamed to ``path``:
    a crash mid-write never leaves a truncated file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write JSON atomically (:func:`write_atomic`), ending in a newline as a text file does."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as handle:
            json.dump(data, handle, indent=1)
            handle.write("\n")

    write_atomic(path, write)
