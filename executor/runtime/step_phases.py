"""One rank's step in phases: walk its action list, then the end-of-step phases in order.

The end of a step runs in phases, so that work across stages can sit between them::

    finish_sends -> reduce_shared_gradients -> grad_sq_norm -> (sum over stages) -> update
                                                                                   clip, optimizer step,
                                                                                   scheduler step, BN commit

:meth:`StepPhases.end_step` runs them all, summing over stages with the transport's all-reduce
(the multi-process worker); :class:`executor.runtime.pipeline.LocalPipeline` runs each phase on every stage
in turn and adds the stages' sums itself.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Protocol

import torch

from executor.runtime.recording import Recorder
from sim.formats.timeline import SHARED_ALLREDUCE
from sim.schedules.schedule import Action


class IdleWork(Protocol):
    """Work a stage can do while it waits (:class:`executor.runtime.prefetch.StepBatches`)."""

    def prefetch(self, wait: Hashable) -> None:
        """The stage is about to wait at ``wait`` (virtual stage, channel, micro-batch): work now, or not."""

    def waited(self, wait: Hashable, seconds: float) -> None:
        """How long the stage was idle there, chores included."""



class StepPhases:
    """One mini-batch of a rank: walk its action list, then the end-of-step phases in order (sends,
    the data-parallel average, shared gradients, the global norm when clipping, the update).

    Shared by a :class:`executor.runtime.stage.PipelineStage` and a device of several chunks
    (:mod:`executor.runtime.chunks`), which supply the phases themselves and :meth:`pipeline_sum`, the
    squared norm summed over the pipeline's ranks.
    """

    actions: list[Action]
    after_action: Callable[[int, Action], None] | None  # e.g. fault injection, the data-parallel launch
    sync_gradients: Callable[[], None] | None  # awaits the data-parallel average (executor.parallel.replicas)
    reduce_shared: Callable[[], None] | None  # sums shared parameters' gradients over their owners
    recorder: Recorder

    def pipeline_sum(self, local: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reduce_shared_gradients(self) -> None:
        """Sum the gradients of parameters other stages hold too (tied weights, executor.parallel.sharing).

        Runs after the sends have finished and before the gradient norm is taken, so that the norm,
        clipping and the optimizer see the summed gradients. The worker sets ``reduce_shared`` (an
        all-reduce over the owning ranks); the in-process pipeline sums over its stages itself and
        leaves it None.
        """
        if self.reduce_shared is not None:
            with self.recorder.span(SHARED_ALLREDUCE):
                self.reduce_shared()

    def end_step(self) -> float | None:
        """Every end-of-step phase, the norm summed over the pipeline's ranks; return the loss."""
        self.finish_sends()
        if self.sync_gradients is not None:
            self.sync_gradients()
        self.reduce_shared_gradients()
        grad_norm = None
        if self.needs_global_norm:
            grad_norm = math.sqrt(float(self.pipeline_sum(self.grad_sq_norm())))
        self.update(grad_norm)
        self.recorder.flush()
        return self.step_loss()

    def train_step(self, step: int, inputs: Any, targets: Any) -> float | None:
        """One mini-batch: walk the actions in order (receives block), then update."""
        self.begin_step(step, inputs, targets)
        for index, action in enumerate(self.actions):
            self.run(action)
            if self.after_action is not None:
                self.after_action(index, action)
        return self.end_step()

