"""One pipeline stage: its layers, and how it runs the forward, recompute and backward actions.

The schedule is data (:func:`sim.schedule.build_schedule`); a :class:`PipelineStage` only knows how
to run one :class:`~sim.schedule.Action` at a time, so the same code serves the multi-process
executor (:meth:`PipelineStage.train_step`, which walks its list in order, blocking on receives) and
the in-process pipeline (:mod:`executor.local`, which interleaves every stage's list in one process).

Timing diagram of what one stage does for micro-batch m under re-materialization::

    F(m):  recv x_m -> stash x_m -> y = layers(x_m) under no_grad -> send y
    R(m):  y = layers(x_m) with grad, same RNG seed as F(m)     (needs no gradient: runs before it)
    B(m):  recv dy -> backward(y, dy) -> send dx_m -> free x_m and the saved tensors

Without re-materialization, F(m) runs with grad and keeps its graph until B(m). The last stage
computes the loss of micro-batch m, scaled by rows_m / batch rows, so the sum over micro-batches is
the mini-batch mean whatever M is. Dropout masks are drawn from a seed that is a pure function of
(seed, step, stage, micro-batch), so a recompute replays them exactly and a resumed run draws the
same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from executor.batchnorm import DeferredBatchNorm, commit_all, recomputing
from executor.data import mix_seed, split, split_rows
from executor.memory import ActivationCounter
from executor.precision import autocast, check_boundary
from executor.recording import Recorder
from executor.transport import ACT, GRAD, Transport
from sim.schedule import Action, Kind, build_schedule, recomputes
from sim.timeline import OPTIMIZER, RECV_WAIT, SEND_ACTIVATION, SEND_GRADIENT


@dataclass(frozen=True)
class Boundary:
    """A tensor crossing into or out of a stage: shape after the row dimension, and dtype."""

    tail: tuple[int, ...]
    dtype: torch.dtype

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows, *self.tail)

    @property
    def has_grad(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True)
class StageConfig:
    stage: int
    stages: int
    batch_size: int
    microbatches: int
    schedule: str = "gpipe"
    checkpoint: str = "except_last"
    seed: int = 0
    precision: str = "fp32"  # bf16: layers under autocast, loss in fp32 (executor.precision)


def make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


class PipelineStage:
    """Runs one stage's actions; ``incoming``/``outgoing`` are its boundary tensors (None at ends)."""

    def __init__(self, config: StageConfig, module: nn.Sequential, transport: Transport,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 incoming: Boundary | None, outgoing: Boundary | None,
                 device: torch.device = torch.device("cpu"), optimizer: str = "sgd", lr: float = 0.01,
                 recorder: Recorder | None = None) -> None:
        self.config = config
        self.module = DeferredBatchNorm.convert(module).to(device)
        self.module.train()
        self.transport = transport
        self.loss_fn = loss_fn
        self.incoming = incoming
        self.outgoing = outgoing
        self.device = device
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(optimizer, params, lr) if params else None
        self.recorder = recorder or Recorder(config.stage, device)
        self.counter = ActivationCounter(list(self.module.parameters()) + list(self.module.buffers()))
        self.rows = split_rows(config.batch_size, config.microbatches)
        self.actions = build_schedule(config.stages, len(self.rows), config.schedule,
                                      config.checkpoint)[config.stage]
        self.after_action: Callable[[int, Action], None] | None = None  # fault-injection hook
        self.step = 0
        self._reset()

    @property
    def is_first(self) -> bool:
        return self.config.stage == 0

    @property
    def is_last(self) -> bool:
        return self.config.stage == self.config.stages - 1

    def _reset(self) -> None:
        self.inputs: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.stash: dict[int, torch.Tensor] = {}
        self.graph: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ step boundaries

    def begin_step(self, step: int, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> None:
        """Take this step's data (stage 0 keeps inputs, the last stage targets) and post receives."""
        self.step = step
        self._reset()
        self.recorder.begin_step(step)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        m_count = len(self.rows)
        if self.is_first and inputs is not None:
            self.inputs = [c.to(self.device, non_blocking=True) for c in split(inputs, m_count)]
        if self.is_last and targets is not None:
            self.targets = [c.to(self.device, non_blocking=True) for c in split(targets, m_count)]
        for action in self.actions:
            need = self.needs(action)
            if need is not None:
                channel, m = need
                boundary = self.incoming if channel == ACT else self.outgoing
                assert boundary is not None
                self.transport.expect(channel, m, boundary.shape(self.rows[m]), boundary.dtype)

    def needs(self, action: Action) -> tuple[str, int] | None:
        """The tensor ``action`` must receive before it can run, as (channel, micro-batch)."""
        if action.kind == Kind.FORWARD and not self.is_first:
            return ACT, action.microbatch
        if action.kind == Kind.BACKWARD and not self.is_last and self.outgoing.has_grad:  # type: ignore[union-attr]
            return GRAD, action.microbatch
        return None

    def end_step(self) -> float | None:
        """Wait for sends, apply one optimizer step and the deferred BN update; return the loss."""
        with self.recorder.span(SEND_ACTIVATION if self.is_first else SEND_GRADIENT):
            self.transport.finish_step()
        with self.recorder.span(OPTIMIZER):
            commit_all(self.module)
            if self.optimizer is not None:
                self.optimizer.step()
        self.recorder.flush()
        if not self.is_last:
            return None
        return float(sum(loss.detach() for loss in self.losses.values()))

    def finish_without_update(self) -> float | None:
        """End the step but keep gradients and running statistics as they are (for tests)."""
        self.transport.finish_step()
        self.recorder.flush()
        if not self.is_last:
            return None
        return float(sum(loss.detach() for loss in self.losses.values()))

    def train_step(self, step: int, inputs: torch.Tensor | None,
                   targets: torch.Tensor | None) -> float | None:
        """One mini-batch: walk this stage's actions in order (receives block), then update."""
        self.begin_step(step, inputs, targets)
        for index, action in enumerate(self.actions):
            self.run(action)
            if self.after_action is not None:
                self.after_action(index, action)
        return self.end_step()

    # ------------------------------------------------------------------ actions

    def run(self, action: Action) -> None:
        if action.kind == Kind.FORWARD:
            self._forward(action.microbatch)
        elif action.kind == Kind.RECOMPUTE:
            self._recompute(action.microbatch)
        else:
            self._backward(action.microbatch)
        self.recorder.memory(self.counter.sample())

    def _receive(self, channel: str, m: int) -> torch.Tensor:
        with self.recorder.span(RECV_WAIT, m):
            return self.transport.recv(channel, m)

    def _seed(self, m: int) -> None:
        """Seed the generators this stage draws from: the CPU's, and its GPU's on CUDA.

        Not ``torch.manual_seed``, which visits every backend's generators and costs about 100 us
        per call here, against about 2 us for the CPU generator alone; it runs before every forward.
        """
        seed = mix_seed(self.config.seed, self.step, self.config.stage, m)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)  # the current device, which is this stage's

    def _leaf(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first or not x.dtype.is_floating_point:
            return x
        return x.detach().requires_grad_(True)

    def _output(self, m: int, y: torch.Tensor) -> torch.Tensor:
        """The loss on the last stage (scaled to the mini-batch mean), else ``y`` itself."""
        if not self.is_last:
            return y
        loss = self.loss_fn(y.float(), self.targets[m]) * (self.rows[m] / self.config.batch_size)
        self.losses[m] = loss
        return loss

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's layers on ``x`` at the run's precision; forward and recompute alike."""
        with autocast(self.config.precision, self.device.type):
            return self.module(x)

    def _forward(self, m: int) -> None:
        x = self.inputs[m] if self.is_first else self._receive(ACT, m)
        rematerialize = recomputes(self.config.checkpoint, m, len(self.rows))
        with self.recorder.span(Kind.FORWARD.value, m):
            self._seed(m)
            if rematerialize:
                self.stash[m] = x
                self.counter.stash(m, x)
                with torch.no_grad():
                    out = self._output(m, self._layers(x))
            else:
                x = self._leaf(x)
                self.counter.stash(m, x)
                with self.counter.saving(m):
                    out = self._output(m, self._layers(x))
                self.graph[m] = (x, out)
        if not self.is_last:
            check_boundary(out, self.outgoing.dtype, self.config.stage)  # type: ignore[union-attr]
            with self.recorder.span(SEND_ACTIVATION, m):
                self.transport.send(ACT, m, out)

    def _recompute(self, m: int) -> None:
        with self.recorder.span(Kind.RECOMPUTE.value, m):
            x = self._leaf(self.stash.pop(m))
            self._seed(m)
            with torch.enable_grad(), recomputing(), self.counter.saving(m):
                out = self._output(m, self._layers(x))
            self.graph[m] = (x, out)

    def _backward(self, m: int) -> None:
        grad = self._receive(GRAD, m) if self.needs(Action(self.config.stage, Kind.BACKWARD, m)) else None
        with self.recorder.span(Kind.BACKWARD.value, m):
            x, out = self.graph.pop(m)
            if out.requires_grad:
                torch.autograd.backward(out, None if self.is_last else grad)
            self.counter.release(m)
        if not self.is_first and self.incoming is not None and self.incoming.has_grad:
            dx = x.grad if x.grad is not None else torch.zeros_like(x)
            with self.recorder.span(SEND_GRADIENT, m):
                self.transport.send(GRAD, m, dx)
