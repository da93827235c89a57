"""Timing of a stage's actions in the shared timeline format (``sim.formats.timeline``), source "measured".

On CPU every span is two ``time.perf_counter`` reads kept as a plain tuple, made a :class:`Record` when
the timeline is read: a stage opens and closes several spans between two actions, when the caches hold
the compute's matrices and every object built is a miss (a generator-based span and a named tuple cost
measurably more there: docs/notes/2026-11-27-figures-behind-the-code.md). On CUDA a span is a pair of
CUDA events on the current stream, read once per step in :meth:`Recorder.flush` (after one synchronize),
so timing never serializes the stream mid-step; event times are placed on the host clock through an event
recorded at the step's start. Times are seconds since ``origin_s``, a ``perf_counter`` reading taken
right after a barrier on every rank, so ranks of one run share a time axis to within the barrier's skew
(on one machine perf_counter is the same monotonic clock in every process).
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from executor.device import device_api
from sim.formats.timeline import MemorySample, Record, Timeline
from sim.schedules.schedule import COMPUTE_KINDS


def host_id() -> str:
    """What names this host's monotonic clock: the kernel's boot id where there is one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return socket.gethostname()


def shared_origin_s() -> float:
    """A time origin for this rank's :class:`Recorder`: after a barrier, the ``perf_counter`` reading
    of the lowest rank on this rank's host. Collective over the default group."""
    dist.barrier()
    mine = (host_id(), time.perf_counter())
    readings: list = [None] * dist.get_world_size()
    dist.all_gather_object(readings, mine)
    return next(reading for host, reading in readings if host == mine[0])


class Recorder:
    """Collects :class:`Record` spans and :class:`MemorySample` points of one stage."""

    def __init__(self, stage: int, device: torch.device, origin_s: float | None = None, replica: int = 0,
                 tp: int = 0, collectives: bool = False) -> None:
        self.stage = stage
        # a traced tensor-parallel run: each compute span records its collectives (executor.parallel.tp_trace)
        self.collectives = collectives
        self.replica = replica  # which data-parallel copy of the pipeline (executor.parallel.replicas)
        self.tp = tp  # which of the stage's tensor-parallel ranks (executor.parallel.tensor_parallel)
        self.api = device_api(device)
        self.on_events = self.api.events  # spans timed by the device's events (CUDA), else the host's clock
        self._host_spans = not self.on_events and not collectives  # every span a _HostSpan
        self.origin_s = time.perf_counter() if origin_s is None else origin_s
        self._timeline = Timeline(source="measured")
        # host-clock spans and samples not yet in the timeline: (kind, microbatch, start, end, step,
        # virtual stage) and (time, bytes), raw perf_counter readings
        self._spans: list[tuple[str, int, float, float, int, int | None]] = []
        self._samples: list[tuple[float, int]] = []
        self.step = 0
        self._events: list[tuple[str, int, Any, Any, int | None]] = []
        self._memory: list[tuple[Any, int]] = []
        self._step_event: Any = None
        self._step_host_s = 0.0

    def restart(self, origin_s: float | None = None) -> None:
        """Put the time origin at ``origin_s`` (a ``perf_counter`` reading; default: now); what was
        recorded before keeps the origin it was recorded against."""
        self._settle()
        self.origin_s = time.perf_counter() if origin_s is None else origin_s

    @property
    def timeline(self) -> Timeline:
        """Every span and memory sample so far."""
        self._settle()
        return self._timeline

    def _settle(self) -> None:
        """Turn the raw host-clock spans and samples into the timeline's records and samples."""
        origin = self.origin_s
        for kind, microbatch, start, end, step, virtual_stage in self._spans:
            self._timeline.records.append(Record(self.stage, kind, microbatch, start - origin, end - origin, step,
                                                 self.replica, virtual_stage, self.tp))
        for at, nbytes in self._samples:
            self._timeline.memory.append(MemorySample(self.stage, at - origin, nbytes))
        self._spans.clear()
        self._samples.clear()

    def now_s(self) -> float:
        return time.perf_counter() - self.origin_s

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.on_events:
            self.api.synchronize()
            self._step_host_s = self.now_s()
            self._step_event = self.api.event()
            self._step_event.record()

    def span(self, kind: str, microbatch: int = -1,
             virtual_stage: int | None = None) -> contextlib.AbstractContextManager[None]:
        """Time the block as ``kind`` of ``microbatch``; ``virtual_stage``: the chunk it ran on, under
        the interleaved schedule (:mod:`executor.runtime.chunks`). A block that raises records nothing."""
        if self._host_spans:
            return _HostSpan(self, kind, microbatch, virtual_stage)
        if self.collectives and kind in COMPUTE_KINDS:
            return self._traced_span(kind, microbatch, virtual_stage)
        return self._plain_span(kind, microbatch, virtual_stage)

    def _plain_span(self, kind: str, microbatch: int,
                    virtual_stage: int | None) -> contextlib.AbstractContextManager[None]:
        if self.on_events:
            return self._event_span(kind, microbatch, virtual_stage)
        return _HostSpan(self, kind, microbatch, virtual_stage)

    @contextlib.contextmanager
    def _traced_span(self, kind: str, microbatch: int, virtual_stage: int | None) -> Iterator[None]:
        from executor.parallel.tp_trace import CollectiveSpans

        with self._plain_span(kind, microbatch, virtual_stage), CollectiveSpans(self, microbatch):
            yield

    @contextlib.contextmanager
    def _event_span(self, kind: str, microbatch: int, virtual_stage: int | None) -> Iterator[None]:
        start, end = self.api.event(), self.api.event()
        start.record()
        yield
        end.record()
        self._events.append((kind, microbatch, start, end, virtual_stage))

    def open_span(self, kind: str, microbatch: int = -1, virtual_stage: int | None = None) -> Callable[[], None]:
        """A span that starts now and ends when the returned function is called: for work that runs
        in the background between two calls (an asynchronous all-reduce from launch to its wait);
        ``virtual_stage`` as :meth:`span` takes it."""
        if self.on_events:
            start = self.api.event()
            start.record()

            def close_cuda() -> None:
                end = self.api.event()
                end.record()
                self._events.append((kind, microbatch, start, end, virtual_stage))

            return close_cuda
        start, step = time.perf_counter(), self.step

        def close() -> None:
            self._spans.append((kind, microbatch, start, time.perf_counter(), step, virtual_stage))

        return close

    def memory(self, nbytes: int) -> None:
        """A memory sample; replica 0's only (a sample names its stage, not its replica; every rank's
        peak is in the report's ``ranks``)."""
        if self.replica or self.tp:
            return
        if self.on_events:
            event = self.api.event()
            event.record()
            self._memory.append((event, nbytes))
            return
        self._samples.append((time.perf_counter(), nbytes))

    def flush(self) -> None:
        """End of step: turn CUDA events into records (one synchronize); no-op on CPU."""
        if not self.on_events or self._step_event is None:
            return
        self.api.synchronize()
        base_event, base_s = self._step_event, self._step_host_s
        for kind, microbatch, start, end, virtual_stage in self._events:
            self._timeline.records.append(Record(
                self.stage, kind, microbatch, base_s + base_event.elapsed_time(start) / 1e3,
                base_s + base_event.elapsed_time(end) / 1e3, self.step, self.replica, virtual_stage, self.tp))
        for event, nbytes in self._memory:
            self._timeline.memory.append(
                MemorySample(self.stage, base_s + base_event.elapsed_time(event) / 1e3, nbytes))
        self._events.clear()
        self._memory.clear()


class _HostSpan:
    """A span on the host's clock: two ``perf_counter`` reads and a tuple (:class:`Recorder`)."""

    __slots__ = ("recorder", "kind", "microbatch", "virtual_stage", "start")

    def __init__(self, recorder: Recorder, kind: str, microbatch: int, virtual_stage: int | None) -> None:
        self.recorder, self.kind, self.microbatch, self.virtual_stage = recorder, kind, microbatch, virtual_stage

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, error: type | None, value: Any, traceback: Any) -> None:
        if error is None:
            recorder = self.recorder
            recorder._spans.append((self.kind, self.microbatch, self.start, time.perf_counter(), recorder.step,
                                    self.virtual_stage))
