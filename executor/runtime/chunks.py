"""One device of a multi-chunk schedule: V chunks of layers walking the device's one action list.

Under ``--schedule interleaved --virtual-stages V`` device d of K holds the V non-adjacent chunks
d, d+K, ..., d+(V-1)K of a V*K-entry partition (virtual stage s = c*K + d is chunk c of device d,
:mod:`sim.schedules.schedule`); under ``zbv`` and ``dualpipev`` it holds chunks d and 2K-1-d, a V whose turn
(virtual stages K-1 and K) stays on device K-1. Each chunk is an ordinary :class:`~executor.runtime.stage.PipelineStage` of virtual
stage s among V*K: its own layers, optimizer, boundary tensors and transport, and its share of the
device's actions. :class:`ChunkedDevice` walks the device's list in order and gives each action to
the chunk ``action.stage // K``; the end of a step runs each phase over the chunks, the device's
squared gradient norm summed over them before the one sum over devices. What is per device, not
per chunk:

* the timeline: one :class:`~executor.runtime.recording.Recorder` whose rows are the device, every span
  tagged with the chunk's virtual stage (:class:`ChunkRecorder`);
* activation memory: one :class:`~executor.runtime.memory.ActivationCounter` over all the chunks' saved
  and stashed tensors, a storage held by two chunks counted once (:class:`ChunkCounter`).

Hand-offs between consecutive virtual stages go to the device of the next (or previous) virtual
stage through the chunk's transport: in-process mailboxes when K = 1 (every chunk on one device, so
nothing passes through a process group) and in the in-process pipeline, point-to-point otherwise
(:mod:`executor.runtime.interleaved`). Gradients of parameters several chunks share are summed over the
chunks by the caller (the in-process pipeline over all virtual stages, the worker with
``reduce_shared``).

Limits: each chunk keeps its own optimizer, which is the same update as one optimizer over the
device's parameters for the per-parameter optimizers the executor offers (sgd, adam, adamw).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from executor.runtime.memory import ActivationCounter
from executor.runtime.recording import Recorder
from executor.runtime.stage import PipelineStage
from executor.runtime.step_phases import StepPhases
from sim.formats.timeline import RECV_WAIT
from sim.schedules.schedule import Action, build_schedule, virtual_stages_of_device


class ChunkRecorder:
    """A chunk's view of its device's :class:`Recorder`: spans carry the chunk's virtual stage.

    Everything else is the device recorder's own; ``begin_step`` and ``flush`` reach it once per
    chunk, which changes nothing (within a step both are idempotent).
    """

    def __init__(self, device: Recorder, virtual_stage: int) -> None:
        self.device = device
        self.virtual_stage = virtual_stage

    def span(self, kind: str, microbatch: int = -1) -> contextlib.AbstractContextManager[None]:
        return self.device.span(kind, microbatch, self.virtual_stage)

    def open_span(self, kind: str, microbatch: int = -1) -> Callable[[], None]:
        return self.device.open_span(kind, microbatch, self.virtual_stage)

    def memory(self, nbytes: int) -> None:  # after every action: not through __getattr__'s miss
        self.device.memory(nbytes)

    def __getattr__(self, name: str) -> Any:
        if name == "device":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.device, name)


class ChunkCounter:
    """A chunk's view of its device's :class:`ActivationCounter`: micro-batch m of chunk c is entry
    ``c * M + m``, so chunks' micro-batches stay apart while the peak is the device's. An entry may be
    (m, tag), for what a micro-batch holds per layer under ``--checkpoint full``."""

    def __init__(self, device: ActivationCounter, offset: int) -> None:
        self.device = device
        self.offset = offset

    def _key(self, microbatch: Any) -> Any:
        if isinstance(microbatch, tuple):
            return (self.offset + microbatch[0], *microbatch[1:])
        return self.offset + microbatch

    def stash(self, microbatch: Any, value: Any) -> None:
        self.device.stash(self._key(microbatch), value)

    def saving(self, microbatch: Any) -> contextlib.AbstractContextManager[None]:
        return self.device.saving(self._key(microbatch))

    def release(self, microbatch: Any) -> None:
        self.device.release(self._key(microbatch))

    def sample(self) -> int:
        return self.device.sample()

    def exclude(self, tensors: list[torch.Tensor]) -> None:
        self.device.exclude(tensors)

    def reset_peak(self) -> None:
        self.device.reset_peak()

    @property
    def peak_bytes(self) -> int:
        return self.device.peak_bytes

    @property
    def current_bytes(self) -> int:
        return self.device.current_bytes


def chunks_of_device(stages: list[Any], device: int, devices: int, schedule: str = "interleaved") -> list[Any]:
    """Device ``device``'s chunks among all virtual stages ``stages``, chunk 0 first: d, d+K, d+2K, ...
    in a loop, d and 2K-1-d in a V."""
    return [stages[s] for s in virtual_stages_of_device(device, devices, len(stages) // devices, schedule)]


class ChunkedDevice(StepPhases):
    """Device d's V chunks (virtual stages d, d+K, ...), run as one pipeline stage is.

    Offers what the worker and the in-process pipeline use of a :class:`PipelineStage`:
    ``actions``, ``train_step`` and the end-of-step phases, ``recorder``, ``counter``, ``is_first``,
    ``is_last``, ``grad_norm``, ``lr``, ``after_action`` and ``reduce_shared``.
    """

    def __init__(self, chunks: list[PipelineStage], recorder: Recorder | None = None) -> None:
        first = chunks[0].config
        self.chunks = chunks
        self.virtual_stages = len(chunks)  # V
        self.devices = first.stages // self.virtual_stages  # K
        self.index = first.stage  # d: chunk 0 is virtual stage d
        expected = virtual_stages_of_device(self.index, self.devices, self.virtual_stages, first.layout.schedule)
        if [chunk.config.stage for chunk in chunks] != expected:
            raise ValueError(f"device {self.index} needs chunks of virtual stages {expected}, "
                             f"got {[chunk.config.stage for chunk in chunks]}")
        self.recorder = recorder or Recorder(self.index, chunks[0].device)
        tensors = [t for chunk in chunks for t in [*chunk.module.parameters(), *chunk.module.buffers()]]
        self.counter = ActivationCounter(tensors)
        microbatches = len(chunks[0].rows)
        for c, chunk in enumerate(chunks):
            chunk.recorder = ChunkRecorder(self.recorder, chunk.config.stage)  # type: ignore[assignment]
            chunk.counter = ChunkCounter(self.counter, c * microbatches)  # type: ignore[assignment]
        self.actions = build_schedule(self.devices, microbatches, first.layout.schedule, first.layout.checkpoint,
                                      self.virtual_stages)[self.index]
        self.after_action: Callable[[int, Action], None] | None = None  # fault-injection hook
        self.reduce_shared: Callable[[], None] | None = None  # set by the worker (executor.runtime.interleaved)
        self.sync_gradients: Callable[[], None] | None = None  # data-parallel average (executor.parallel.replicas)

    def chunk(self, action: Action) -> PipelineStage:
        """The chunk that runs ``action``: ``action.stage // K``."""
        return self.chunks[action.stage // self.devices]

    @property
    def is_first(self) -> bool:
        return self.chunks[0].is_first

    @property
    def is_last(self) -> bool:
        return self.chunks[-1].is_last

    @property
    def device(self) -> torch.device:
        return self.chunks[0].device

    @property
    def grad_norm(self) -> float | None:
        return self.chunks[-1].grad_norm

    @property
    def lr(self) -> float | None:
        return self.chunks[-1].lr

    @property
    def needs_global_norm(self) -> bool:
        return self.chunks[0].needs_global_norm

    def begin_step(self, step: int, inputs: Any, targets: Any) -> None:
        for chunk in self.chunks:
            chunk.begin_step(step, inputs, targets)

    def needs(self, action: Action) -> tuple[str, int] | None:
        return self.chunk(action).needs(action)

    def run(self, action: Action) -> None:
        self.chunk(action).run(action)

    def finish_sends(self) -> None:
        for chunk in self.chunks:
            chunk.finish_sends()

    def grad_sq_norm(self) -> torch.Tensor:
        """The device's share of the squared global norm: its chunks' shares added."""
        return torch.stack([chunk.grad_sq_norm() for chunk in self.chunks]).sum()

    def update(self, grad_norm: float | None) -> None:
        for chunk in self.chunks:
            chunk.update(grad_norm)

    def step_loss(self) -> float | None:
        return self.chunks[-1].step_loss()

    def pipeline_sum(self, local: torch.Tensor) -> torch.Tensor:
        """The norm is summed over the chunks already (:meth:`grad_sq_norm`); then over the devices by
        the transport (with K = 1 there is no other device)."""
        if self.devices == 1:
            return local
        with self.recorder.span(RECV_WAIT):
            return self.chunks[0].transport.all_reduce_sum(local)


def shards(device: PipelineStage | ChunkedDevice) -> list[PipelineStage]:
    """The stages a rank saves and restores one checkpoint shard each of: its chunks, or itself."""
    return device.chunks if isinstance(device, ChunkedDevice) else [device]
