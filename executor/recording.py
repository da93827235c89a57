"""Timing of a stage's actions in the shared timeline format (``sim.timeline``), source "measured".

On CPU every span is two ``time.perf_counter`` reads. On CUDA a span is a pair of CUDA events on
the current stream, read once per step in :meth:`Recorder.flush` (after one synchronize), so timing
never serializes the stream mid-step; event times are placed on the host clock through an event
recorded at the step's start. Times are seconds since ``origin_s``, a ``perf_counter`` reading
taken right after a barrier on every rank, so ranks of one run share a time axis to within the
barrier's skew (on one machine perf_counter is the same monotonic clock in every process).
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from executor.device import device_api
from sim.schedule import COMPUTE_KINDS
from sim.timeline import MemorySample, Record, Timeline


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
        # a traced tensor-parallel run: each compute span records its collectives (executor.tp_trace)
        self.collectives = collectives
        self.replica = replica  # which data-parallel copy of the pipeline (executor.replicas)
        self.tp = tp  # which of the stage's tensor-parallel ranks (executor.tensor_parallel)
        self.api = device_api(device)
        self.on_events = self.api.events  # spans timed by the device's events (CUDA), else the host's clock
        self.origin_s = time.perf_counter() if origin_s is None else origin_s
        self.timeline = Timeline(source="measured")
        self.step = 0
        self._events: list[tuple[str, int, Any, Any, int | None]] = []
        self._memory: list[tuple[Any, int]] = []
        self._step_event: Any = None
        self._step_host_s = 0.0

    def restart(self, origin_s: float | None = None) -> None:
        """Put the time origin at ``origin_s`` (a ``perf_counter`` reading; default: now)."""
        self.origin_s = time.perf_counter() if origin_s is None else origin_s

    def now_s(self) -> float:
        return time.perf_counter() - self.origin_s

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.on_events:
            self.api.synchronize()
            self._step_host_s = self.now_s()
            self._step_event = self.api.event()
            self._step_event.record()

    @contextlib.contextmanager
    def span(self, kind: str, microbatch: int = -1, virtual_stage: int | None = None) -> Iterator[None]:
        """Time the block as ``kind`` of ``microbatch``; ``virtual_stage``: the chunk it ran on, under
        the interleaved schedule (:mod:`executor.chunks`)."""
        if self.collectives and kind in COMPUTE_KINDS:
            from executor.tp_trace import CollectiveSpans

            with self._span(kind, microbatch, virtual_stage), CollectiveSpans(self, microbatch):
                yield
            return
        with self._span(kind, microbatch, virtual_stage):
            yield

    @contextlib.contextmanager
    def _span(self, kind: str, microbatch: int, virtual_stage: int | None) -> Iterator[None]:
        if self.on_events:
            start, end = self.api.event(), self.api.event()
            start.record()
            yield
            end.record()
            self._events.append((kind, microbatch, start, end, virtual_stage))
            return
        start_s = self.now_s()
        yield
        self.timeline.records.append(Record(self.stage, kind, microbatch, start_s, self.now_s(), self.step,
                                            self.replica, virtual_stage, self.tp))

    def open_span(self, kind: str, microbatch: int = -1) -> Callable[[], None]:
        """A span that starts now and ends when the returned function is called: for work that runs
        in the background between two calls (an asynchronous all-reduce from launch to its wait)."""
        if self.on_events:
            start = self.api.event()
            start.record()

            def close_cuda() -> None:
                end = self.api.event()
                end.record()
                self._events.append((kind, microbatch, start, end, None))

            return close_cuda
        start_s, step = self.now_s(), self.step

        def close() -> None:
            self.timeline.records.append(Record(self.stage, kind, microbatch, start_s, self.now_s(), step,
                                                self.replica, None, self.tp))

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
        self.timeline.memory.append(MemorySample(self.stage, self.now_s(), nbytes))

    def flush(self) -> None:
        """End of step: turn CUDA events into records (one synchronize); no-op on CPU."""
        if not self.on_events or self._step_event is None:
            return
        self.api.synchronize()
        base_event, base_s = self._step_event, self._step_host_s
        for kind, microbatch, start, end, virtual_stage in self._events:
            self.timeline.records.append(Record(
                self.stage, kind, microbatch, base_s + base_event.elapsed_time(start) / 1e3,
                base_s + base_event.elapsed_time(end) / 1e3, self.step, self.replica, virtual_stage, self.tp))
        for event, nbytes in self._memory:
            self.timeline.memory.append(
                MemorySample(self.stage, base_s + base_event.elapsed_time(event) / 1e3, nbytes))
        self._events.clear()
        self._memory.clear()
