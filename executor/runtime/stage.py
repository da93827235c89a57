"""One pipeline stage: its layers, and how it runs the forward, recompute and backward actions.

The schedule is data (:func:`sim.schedules.schedule.build_schedule`); a :class:`PipelineStage` only knows how
to run one :class:`~sim.schedules.schedule.Action` at a time, so the same code serves the multi-process
executor (:meth:`PipelineStage.train_step`, which walks its list in order, blocking on receives) and
the in-process pipeline (:class:`executor.runtime.pipeline.LocalPipeline`, which interleaves every
stage's list in one process).

Timing diagram of what one stage does for micro-batch m under re-materialization::

    F(m):  recv x_m -> stash x_m -> y = layers(x_m) under no_grad -> send y
    R(m):  y = layers(x_m) with grad, same RNG seed as F(m)     (needs no gradient: runs before it)
    B(m):  recv dy -> backward(y, dy) -> send dx_m -> free x_m and the saved tensors

Split-backward schedules (``zb-h1``) run B as two actions (:mod:`executor.runtime.split_backward`)::

    I(m):  recv dy -> the input gradient alone, the graph kept -> send dx_m
    W(m):  the weight gradients from what I kept -> free x_m and the saved tensors

Without re-materialization, F(m) runs with grad and keeps its graph until B(m). The last stage
computes the loss of micro-batch m, scaled by rows_m / batch rows, so the sum over micro-batches is
the mini-batch mean whatever M is. Dropout masks are drawn from a seed that is a pure function of
(seed, step, stage, micro-batch), so a recompute replays them exactly and a resumed run draws the
same ones.

The end of a step runs in phases (:mod:`executor.runtime.step_phases`), shared with a device of
several chunks (:mod:`executor.runtime.chunks`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from executor.device import device_api
from executor.models.moe_aux_loss import set_micro_batch_weight
from executor.runtime.batchnorm import DeferredBatchNorm, commit_all, recomputing
from executor.runtime.boundary import Boundary, map_tensors, tensors
from executor.runtime.data import MicroBatches, micro_batches, mix_seed, split_rows
from executor.runtime.memory import ActivationCounter
from executor.runtime.optim import (OptimSettings, clip_coefficient, gradients, make_optimizer, make_scheduler, scale_,
                                    squared_norm)
from executor.runtime.precision import autocast, check_boundary
from executor.runtime.recording import Recorder
from executor.runtime.selective import recompute_attention_core
from executor.runtime.split_backward import PendingWeights, WeightEdges, input_gradients, weight_gradients
from executor.runtime.step_phases import IdleWork, StepPhases
from executor.transport.p2p import ACT, GRAD, Transport
from sim.schedules.schedule import (Action, Kind, build_schedule, device_of_virtual_stage, receives_gradient,
                                    recomputes, recomputes_attention_core, recomputes_per_layer)
from sim.formats.layout import ParallelLayout
from sim.formats.timeline import OPTIMIZER, RECV_WAIT, SEND_ACTIVATION, SEND_GRADIENT

# actions whose autograd calls add to the parameters' .grad (a split I computes input gradients only)
ADDS_TO_GRAD = frozenset({Kind.BACKWARD, Kind.WEIGHT})


@dataclass(frozen=True)
class StageConfig:
    """What one (virtual) stage needs of its run: where it sits, its replica's rows, the run's layout."""

    stage: int  # the virtual stage under the multi-chunk schedules
    batch_size: int  # this replica's rows of a global batch
    layout: ParallelLayout  # the run's (M, schedule, checkpoint policy, V, K)
    seed: int = 0
    precision: str = "fp32"  # bf16: layers under autocast, loss in fp32 (executor.runtime.precision)

    @property
    def stages(self) -> int:
        """Stages in the pipeline: V*K virtual stages under the multi-chunk schedules."""
        return self.layout.virtual_stage_count


class PipelineStage(StepPhases):
    """Runs one stage's actions; ``incoming``/``outgoing`` are its boundary tensors (None at ends)."""

    def __init__(self, config: StageConfig, module: nn.Sequential, transport: Transport,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 incoming: Boundary | None, outgoing: Boundary | None,
                 device: torch.device = torch.device("cpu"), optim: OptimSettings = OptimSettings(),
                 recorder: Recorder | None = None, duplicates: list[nn.Parameter] | None = None) -> None:
        self.config = config
        self.module = DeferredBatchNorm.convert(module).to(device)
        self.module.train()
        self.transport = transport
        self.loss_fn = loss_fn
        self.incoming = incoming
        self.outgoing = outgoing
        self.device = device
        self.device_api = device_api(device)
        self.optim = optim
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(optim, self.params) if self.params else None
        self.scheduler = make_scheduler(optim, self.optimizer) if self.optimizer is not None else None
        self.grad_norm: float | None = None  # the last step's global gradient norm, before clipping
        self.lr: float | None = None  # the learning rate the last step used
        self.recorder = recorder or Recorder(config.stage, device)
        self.counter = ActivationCounter(list(self.module.parameters()) + list(self.module.buffers()))
        layout = config.layout
        self.rows = split_rows(config.batch_size, layout.microbatches)
        # This (virtual) stage's share of its device's list: all of it unless the device holds several
        # chunks (executor.runtime.chunks), placed in a loop or a V (sim.schedules.schedule.device_of_virtual_stage).
        device = device_of_virtual_stage(config.stage, layout.stages, layout.schedule)
        self.actions = [a for a in build_schedule(layout.stages, len(self.rows), layout.schedule, layout.checkpoint,
                                                  layout.virtual_stages)[device] if a.stage == config.stage]
        self.after_action: Callable[[int, Action], None] | None = None  # fault-injection hook
        self.weight_edges: WeightEdges | None = None  # the split backward's weight accumulators, found once
        # Work for idle time, offered each wait on a receive that has not arrived, and told how long
        # the wait lasted (executor.runtime.prefetch.StepBatches)
        self.while_waiting: IdleWork | None = None
        # Sums the gradients of parameters other stages hold too (executor.parallel.sharing); the in-process
        # pipeline does it for all stages at once instead.
        self.reduce_shared: Callable[[], None] | None = None
        # Waits for the data-parallel gradient average launched after the last backward
        # (executor.parallel.replicas); None with one replica.
        self.sync_gradients: Callable[[], None] | None = None
        # The global gradient norm counts each parameter once: copies another stage holds first are
        # left out of this stage's share.
        left_out = {id(p) for p in duplicates or []}
        self.norm_params = [p for p in self.params if id(p) not in left_out]
        self.step = 0
        self._receive_order: list[tuple[tuple[str, int], Any]] | None = None
        self._gradients_stale = False  # the last step's gradients are still on the parameters
        # what finished backwards left (outputs, graph nodes, the gradients sent), freed at the stage's
        # next wait, this step's or the next's (_backward); a stage that never waits frees it at the
        # end of its step
        self._finished: list[Any] = []
        self._freed_in_wait = False  # whether a wait of this step freed it (else the step's end does)
        self._reset()

    @property
    def is_first(self) -> bool:
        return self.config.stage == 0

    @property
    def is_last(self) -> bool:
        return self.config.stage == self.config.stages - 1

    def _reset(self) -> None:
        self.inputs: list[Any] = []  # stage 0: each micro-batch's input (a tensor, tuple or dict of them)
        self.targets: list[Any] = []
        self.stash: dict[int, list[torch.Tensor]] = {}  # received tensors kept for the recompute
        self.graph: dict[int, tuple[list[torch.Tensor], Any]] = {}  # (inputs needing a gradient, output)
        # --checkpoint full: (received, every layer's input, the RNG state before each layer) per micro-batch
        self.layer_inputs: dict[int, tuple[list[torch.Tensor], list[Any], list[Any]]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.pending_weights: dict[int, PendingWeights | None] = {}  # split backward: what each W needs, from its I
        # receives announced but not posted yet, (channel, micro-batch) -> shapes, in the order they are needed
        self._unposted: dict[tuple[str, int], Any] = {}

    # ------------------------------------------------------------------ step boundaries

    def begin_step(self, step: int, inputs: Any, targets: Any) -> None:
        """Take this step's data (stage 0 keeps inputs, the last stage targets; split into micro-batches
        here unless given as :class:`MicroBatches`) and announce the step's receives (the first posted
        now, the rest by :meth:`_post_through`). Last step's gradients are dropped at the stage's first
        wait or before its first backward (:meth:`_drop_gradients`), off the step's start."""
        self.step = step
        self._reset()
        self.recorder.begin_step(step)
        self._gradients_stale = self.optimizer is not None
        if self.is_first and inputs is not None:
            self.inputs = self._micro_batches(inputs)
        if self.is_last and targets is not None:
            self.targets = self._micro_batches(targets)
        # Receives in the order this stage consumes them; posted lazily (_post_through): the first at
        # once, the rest at the stage's first wait or when an action needs one, whichever comes first.
        self._unposted = dict(self._receives())
        if self.actions and self.needs(self.actions[0]) is not None:
            self._post_through(self.needs(self.actions[0]))

    def _micro_batches(self, value: Any) -> list[Any]:
        return value if isinstance(value, MicroBatches) else micro_batches(value, len(self.rows), self.device)

    def _receives(self) -> list[tuple[tuple[str, int], Any]]:
        """Every message a step receives, (channel, micro-batch) -> shapes, in consumption order: the
        same every step, found once."""
        if self._receive_order is None:
            self._receive_order = []
            for action in self.actions:
                need = self.needs(action)
                if need is not None:
                    channel, m = need
                    if channel == ACT:
                        shapes = self.incoming.shapes(self.rows[m])  # type: ignore[union-attr]
                    else:
                        shapes = self.outgoing.grad_shapes(self.rows[m])  # type: ignore[union-attr]
                    self._receive_order.append((need, shapes))
        return self._receive_order

    def _drop_gradients(self) -> None:
        """The optimizer's ``zero_grad`` (to None) for the step begun, once: at the stage's first wait on
        a receive, or before its first action that adds to ``.grad``, whichever comes first. At the
        step's start it would sit on the pipeline's critical path, right after the optimizer step
        (docs/notes/2026-11-27-figures-behind-the-code.md; the chores moved into waits:
        docs/notes/2026-11-25-executor-overhead.md)."""
        if self._gradients_stale:
            self._gradients_stale = False
            self.optimizer.zero_grad(set_to_none=True)  # type: ignore[union-attr]

    def _post_through(self, key: tuple[str, int] | None) -> None:
        """Post the announced receives in consumption order up to and including ``key`` (None: all).

        Why not all at the step's start: posting one costs this rank's time (a gloo receive is posted by
        the rank itself), and at the start of a step the first stage is on the pipeline's critical path;
        at its first wait the time is free (docs/notes/2026-11-27-figures-behind-the-code.md). Order is
        kept, so each direction's messages are posted in the order they are sent (what NCCL needs).
        """
        if key is not None and key not in self._unposted:
            return  # posted already
        while self._unposted:
            first = next(iter(self._unposted))
            self.transport.expect(*first, self._unposted.pop(first))
            if first == key:
                return

    def needs(self, action: Action) -> tuple[str, int] | None:
        """The tensor ``action`` must receive before it can run, as (channel, micro-batch)."""
        if action.kind == Kind.FORWARD and not self.is_first:
            return ACT, action.microbatch
        if receives_gradient(action.kind) and self._receives_gradients:
            return GRAD, action.microbatch
        return None

    @property
    def _receives_gradients(self) -> bool:
        """Whether a backward (or I) receives its output's gradient from the next stage."""
        return not self.is_last and self.outgoing.has_grad  # type: ignore[union-attr]

    def finish_sends(self) -> None:
        """Wait for this step's sends to complete (the first end-of-step phase: a stage that ran no
        backward drops last step's gradients here, as its first backward would have)."""
        self._drop_gradients()
        if not self._freed_in_wait:  # else the next wait frees what is left: at most a step's worth
            self._finished.clear()
        self._freed_in_wait = False
        with self.recorder.span(SEND_ACTIVATION if self.is_first else SEND_GRADIENT):
            self.transport.finish_step()

    def grad_sq_norm(self) -> torch.Tensor:
        """This stage's sum of squared gradient norms: a float64 scalar on its device. A copy of a
        parameter another stage holds first is left out: the global norm counts each parameter once."""
        with self.recorder.span(OPTIMIZER):
            return squared_norm(gradients(self.norm_params), self.device)

    def update(self, grad_norm: float | None) -> None:
        """Clip by the global ``grad_norm`` (None: no clipping asked for, no norm taken), step the
        optimizer and the schedule, commit batch norms."""
        with self.recorder.span(OPTIMIZER):
            self.grad_norm, self.lr = grad_norm, self.optim.lr_at(self.step)
            if self.optimizer is not None:
                if grad_norm is not None:
                    scale_(gradients(self.params), clip_coefficient(grad_norm, self.optim.clip_grad_norm))
                self.optimizer.step()
                self.scheduler.step()  # type: ignore[union-attr]  # exists with the optimizer
            commit_all(self.module)

    def step_loss(self) -> float | None:
        """The mini-batch loss on the last stage (None elsewhere)."""
        if not self.is_last:
            return None
        return float(sum(loss.detach() for loss in self.losses.values()))

    @property
    def needs_global_norm(self) -> bool:
        """Only clipping needs the norm over all stages: an all-reduce that makes every stage wait for
        the slowest before its optimizer step, so it is not taken otherwise."""
        return self.optim.clip_grad_norm is not None

    def pipeline_sum(self, local: torch.Tensor) -> torch.Tensor:
        with self.recorder.span(RECV_WAIT):  # every stage's sum, from the other ranks
            return self.transport.all_reduce_sum(local)

    # ------------------------------------------------------------------ actions

    def run(self, action: Action) -> None:
        if self._gradients_stale and action.kind in ADDS_TO_GRAD:
            self._drop_gradients()
        if action.kind == Kind.FORWARD:
            self._forward(action.microbatch)
        elif action.kind == Kind.RECOMPUTE:
            self._recompute(action.microbatch)
        elif action.kind == Kind.INPUT:
            self._backward_input(action.microbatch)
        elif action.kind == Kind.WEIGHT:
            self._backward_weight(action.microbatch)
        else:
            self._backward(action.microbatch)
        self.recorder.memory(self.counter.sample())

    def _receive(self, channel: str, m: int) -> list[torch.Tensor]:
        """The message, after the idle-time work if it has not arrived (that work is left out of the
        wait's span: the timeline shows only the time spent waiting)."""
        self._post_through((channel, m))
        transport = self.transport
        if transport.ready(channel, m):
            with self.recorder.span(RECV_WAIT, m):
                return transport.recv(channel, m)
        idle_from = time.perf_counter()
        # the chores, each only while the message is still away: one arriving during a chore waits at
        # most for that chore to end
        if self._unposted:
            self._post_through(None)
        if self._gradients_stale and not transport.ready(channel, m):
            self._drop_gradients()
        if self._finished and not transport.ready(channel, m):
            self._finished.clear()
            self._freed_in_wait = True
        wait = (self.config.stage, channel, m)
        if self.while_waiting is not None and not transport.ready(channel, m):
            self.while_waiting.prefetch(wait)
        with self.recorder.span(RECV_WAIT, m):
            received = transport.recv(channel, m)
        if self.while_waiting is not None:
            self.while_waiting.waited(wait, time.perf_counter() - idle_from)
        return received

    def _seed(self, m: int) -> None:
        """Seed the generators this stage draws from: the CPU's, and its GPU's on CUDA.

        Not ``torch.manual_seed``, which visits every backend's generators, many times the cost of
        seeding the CPU generator alone (docs/notes/2026-11-27-figures-behind-the-code.md); it runs
        before every forward.
        """
        self.device_api.seed(mix_seed(self.config.seed, self.step, self.config.stage, m))
        set_micro_batch_weight(self.rows[m] / self.config.batch_size)  # routers' auxiliary loss (models.moe_aux_loss)

    def _input(self, m: int, received: list[torch.Tensor], grad: bool) -> tuple[Any, list[torch.Tensor]]:
        """Micro-batch ``m``'s input value, and (with ``grad``) its tensors a gradient is sent back for."""
        if self.is_first:
            return self.inputs[m], []
        assert self.incoming is not None
        if not grad:
            return self.incoming.unflatten(received), []
        leaves = [t.detach().requires_grad_(True) if spec.carries_grad else t
                  for t, spec in zip(received, self.incoming.leaves)]
        return self.incoming.unflatten(leaves), [leaves[i] for i in self.incoming.grad_indices]

    def _output(self, m: int, y: Any) -> Any:
        """The loss on the last stage (scaled to the mini-batch mean), else ``y`` itself."""
        if not self.is_last:
            return y
        loss = self.loss_fn(y.float(), self.targets[m]) * (self.rows[m] / self.config.batch_size)
        self.losses[m] = loss.detach()  # not the graph: a split backward keeps it only until its W
        return loss

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's layers on ``x`` at the run's precision; forward and recompute alike. Under
        ``selective`` the attention cores keep no probabilities (:mod:`executor.runtime.selective`)."""
        with autocast(self.config.precision, self.device.type), \
                recompute_attention_core(recomputes_attention_core(self.config.layout.checkpoint)):
            return self.module(x)

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.device_api.rng_state(self.device)

    def _set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        self.device_api.set_rng_state(state, self.device)

    def _forward(self, m: int) -> None:
        received = [] if self.is_first else self._receive(ACT, m)
        rematerialize = recomputes(self.config.layout.checkpoint, m, len(self.rows))
        with self.recorder.span(Kind.FORWARD.value, m):
            self._seed(m)
            self.counter.stash(m, self.inputs[m] if self.is_first else received)
            if recomputes_per_layer(self.config.layout.checkpoint):
                out = self._forward_keeping_layer_inputs(m, received)
            elif rematerialize:
                self.stash[m] = received
                x, _ = self._input(m, received, grad=False)
                with torch.no_grad():
                    out = self._output(m, self._layers(x))
            else:
                x, needs_grad = self._input(m, received, grad=True)
                with self.counter.saving(m):
                    out = self._output(m, self._layers(x))
                self.graph[m] = (needs_grad, out)
        if not self.is_last:
            assert self.outgoing is not None
            leaves = self.outgoing.flatten(out)
            check_boundary(leaves, self.outgoing, self.config.stage)
            with self.recorder.span(SEND_ACTIVATION, m):
                self.transport.send(ACT, m, leaves)


    def _forward_keeping_layer_inputs(self, m: int, received: list[torch.Tensor]) -> Any:
        """``full``: the layers without gradients, keeping each layer's input (counted as held by
        ``m`` until that layer's backward) and the random state before it, for its recompute."""
        y, _ = self._input(m, received, grad=False)
        inputs, states = [], []
        with torch.no_grad(), autocast(self.config.precision, self.device.type):
            for index, layer in enumerate(self.module):
                inputs.append(y)
                states.append(self._rng_state())
                if index:
                    self.counter.stash((m, index), y)
                y = layer(y)
            out = self._output(m, y)
        self.layer_inputs[m] = (received, inputs, states)
        return out

    def _backward_layer_by_layer(self, m: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``full``: last layer first, recompute the layer from its kept input and random state with
        gradients on, then its backward; returns the stage input's tensors that need a gradient (their
        ``.grad`` set). Each layer's recomputed tensors and input are freed after its backward."""
        received, inputs, states = self.layer_inputs.pop(m)
        set_micro_batch_weight(self.rows[m] / self.config.batch_size)
        layers = list(self.module)
        needs_grad: list[torch.Tensor] = []
        for index in reversed(range(len(layers))):
            if index == 0:
                x, needs_grad = self._input(m, received, grad=True)
                leaves = needs_grad
            else:
                x = map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), inputs[index])
                leaves = tensors(x)
            self._set_rng_state(states[index])
            with torch.enable_grad(), recomputing(), self.counter.saving((m, "layer")):
                with autocast(self.config.precision, self.device.type):
                    y = layers[index](x)
                if index == len(layers) - 1:
                    y = self._output(m, y)  # the loss on the last stage, outside autocast as always
            self.counter.sample()  # the held inputs and this layer's recomputed tensors: the backward's peak
            if index == len(layers) - 1:
                roots, root_grads = self._roots(y, grads)
            else:
                pairs = [(t, g) for t, g in zip(tensors(y), grads) if t.requires_grad and g is not None]
                roots, root_grads = [p[0] for p in pairs], [p[1] for p in pairs]
            if roots:
                torch.autograd.backward(roots, root_grads)
            grads = [leaf.grad if leaf.requires_grad else None for leaf in leaves]
            self.counter.release((m, "layer"))
            self.counter.release((m, index))
        return needs_grad

    def _roots(self, out: Any, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """What the stage's backward starts from: the loss on the last stage, else the sent tensors
        that carry a gradient, with the gradients received for them."""
        if self.is_last:
            return [out], None
        assert self.outgoing is not None
        leaves = self.outgoing.flatten(out)
        pairs = [(leaves[i], g) for i, g in zip(self.outgoing.grad_indices, grads) if leaves[i].requires_grad]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _recompute(self, m: int) -> None:
        with self.recorder.span(Kind.RECOMPUTE.value, m):
            x, needs_grad = self._input(m, self.stash.pop(m), grad=True)
            self._seed(m)
            with torch.enable_grad(), recomputing(), self.counter.saving(m):
                out = self._output(m, self._layers(x))
            self.graph[m] = (needs_grad, out)

    def _backward(self, m: int) -> None:
        grads = self._receive(GRAD, m) if self._receives_gradients else []
        with self.recorder.span(Kind.BACKWARD.value, m):
            if recomputes_per_layer(self.config.layout.checkpoint):
                needs_grad = self._backward_layer_by_layer(m, grads)
            else:
                needs_grad, out = self.graph.pop(m)
                roots, root_grads = self._roots(out, grads)
                roots_with_grad = [r for r in roots if r.requires_grad]
                if roots_with_grad:
                    torch.autograd.backward(roots_with_grad, root_grads)
                # what is left of the micro-batch's graph (the output and the nodes; the saved tensors
                # went in the backward) is freed in the stage's next wait: tens of microseconds of
                # Python and allocator calls on caches the backward just filled, which between two
                # actions would delay the next one
                self._finished.append(out)
            self.counter.release(m)
        self._send_input_gradients(m, needs_grad, [x.grad for x in needs_grad])
        self._finished.append(needs_grad)

    def _send_input_gradients(self, m: int, needs_grad: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """Send the previous stage the gradients of the inputs it sent (zeros for an unused one)."""
        if not self.is_first and self.incoming is not None and self.incoming.has_grad:
            dx = [g if g is not None else torch.zeros_like(x) for x, g in zip(needs_grad, grads)]
            with self.recorder.span(SEND_GRADIENT, m):
                self.transport.send(GRAD, m, dx)

    def _backward_input(self, m: int) -> None:
        """I: the gradients of the stage's inputs alone, sent back at once; what the weight gradients
        need is kept for this micro-batch's W (:mod:`executor.runtime.split_backward`), its tensors with it."""
        grads = self._receive(GRAD, m) if self._receives_gradients else []
        with self.recorder.span(Kind.INPUT.value, m):
            needs_grad, out = self.graph.pop(m)
            roots, root_grads = self._roots(out, grads)  # sent tensors: those that carry a gradient
            roots = [r for r in roots if r.requires_grad]  # the loss, unless nothing it depends on trains
            dx: list[torch.Tensor | None] = [None] * len(needs_grad)
            self.pending_weights[m] = None
            if roots:
                if self.weight_edges is None:
                    self.weight_edges = WeightEdges(self.params)
                dx, self.pending_weights[m] = input_gradients(roots, root_grads, needs_grad, self.weight_edges)
        self._send_input_gradients(m, needs_grad, dx)

    def _backward_weight(self, m: int) -> None:
        """W: micro-batch ``m``'s weight gradients, added to ``.grad``; its tensors are freed."""
        with self.recorder.span(Kind.WEIGHT.value, m):
            pending = self.pending_weights.pop(m)
            if pending is not None:
                weight_gradients(pending)
            self.counter.release(m)
