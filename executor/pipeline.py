"""Build a run's stages from a :class:`RunConfig`, and run the whole pipeline in one process.

:func:`prepare` builds the model from its seed and checks it against the partition with a dry
forward (:mod:`executor.shapes`); :func:`make_stage` cuts one stage out of it. The multi-process
worker makes one stage per rank; :class:`LocalPipeline` makes all of them in one process, joined by
in-process mailboxes, and interleaves their action lists in a fixed order: it sweeps the stages
round-robin, running each stage's next actions while their inputs are present. Every action runs
exactly as in the distributed executor, so tests of the in-process pipeline test the real schedule
walk, receives and sends included (only the transport differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from executor.config import RunConfig
from executor.data import batch_for_step
from executor.models import build_model, check_loss, default_loss, loss_function
from executor.recording import Recorder
from executor.shapes import dry_run, stage_module
from executor.stage import Boundary, PipelineStage, StageConfig
from executor.transport import LocalMailboxes, Transport
from sim.errors import GpipeInputError
from sim.schedule import format_grid


@dataclass
class Prepared:
    model: nn.Sequential
    boundaries: list[Boundary]  # K+1: model input, each cut, model output
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def prepare(config: RunConfig) -> Prepared:
    """Build the model and validate it against the plan; raises GpipeInputError with one line."""
    config.validate()
    loss = check_loss(config.loss or default_loss(config.model))
    model = build_model(config.model, config.options, config.seed)
    if not config.partition:
        raise GpipeInputError("no partition; give --partition like 3,5 or --stages K")
    inputs, targets = batch_for_step(config.model, config.options, config.batch_size, config.seed, 0,
                                     config.data or None)
    loss_fn = loss_function(loss)
    boundaries = dry_run(model, tuple(config.partition), inputs, targets, loss_fn, config.precision)
    return Prepared(model, boundaries, loss_fn)


def make_stage(config: RunConfig, prepared: Prepared, stage: int, transport: Transport,
               device: torch.device = torch.device("cpu"), recorder: Recorder | None = None) -> PipelineStage:
    stages = config.stages
    stage_config = StageConfig(stage=stage, stages=stages, batch_size=config.batch_size,
                               microbatches=config.microbatches, schedule=config.schedule,
                               checkpoint=config.checkpoint, seed=config.seed, precision=config.precision)
    return PipelineStage(
        stage_config, stage_module(prepared.model, tuple(config.partition), stage), transport,
        prepared.loss_fn,
        incoming=prepared.boundaries[stage] if stage > 0 else None,
        outgoing=prepared.boundaries[stage + 1] if stage < stages - 1 else None,
        device=device, optimizer=config.optimizer, lr=config.lr, recorder=recorder)


def train_step_with_data(config: RunConfig, stage: PipelineStage, step: int) -> float | None:
    """One mini-batch on ``stage``: draw step ``step``'s data where the stage needs it, then train.

    The first stage keeps the inputs, the last the targets; the loss comes back on the last stage.
    """
    inputs = targets = None
    if stage.is_first or stage.is_last:
        inputs, targets = batch_for_step(config.model, config.options, config.batch_size, config.seed, step,
                                         config.data or None)
    return stage.train_step(step, inputs, targets)


class LocalPipeline:
    """All K stages in this process. ``stages[k].module`` holds stage k's (live) layers."""

    def __init__(self, config: RunConfig, prepared: Prepared | None = None) -> None:
        self.config = config
        self.prepared = prepared or prepare(config)
        mailboxes = LocalMailboxes()
        device = torch.device(config.device)
        self.stages = [make_stage(config, self.prepared, k, mailboxes.endpoint(k), device)
                       for k in range(config.stages)]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return batch_for_step(c.model, c.options, c.batch_size, c.seed, step, c.data or None)

    def run_step(self, step: int, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                 update: bool = True) -> float:
        """One mini-batch through every stage; with ``update=False`` gradients stay for inspection."""
        if inputs is None or targets is None:
            inputs, targets = self.batch(step)
        for stage in self.stages:
            stage.begin_step(step, inputs, targets)
        position = [0] * len(self.stages)
        while any(p < len(s.actions) for p, s in zip(position, self.stages)):
            progressed = False
            for k, stage in enumerate(self.stages):
                while position[k] < len(stage.actions):
                    action = stage.actions[position[k]]
                    need = stage.needs(action)
                    if need is not None and not stage.transport.ready(*need):
                        break
                    stage.run(action)
                    position[k] += 1
                    progressed = True
            if not progressed:
                stuck = self.stages[0].actions
                raise RuntimeError("pipeline deadlock:\n" + format_grid(
                    [s.actions for s in self.stages], highlight=stuck[min(position[0], len(stuck) - 1)]))
        losses = [stage.end_step() if update else stage.finish_without_update() for stage in self.stages]
        return float(losses[-1])  # type: ignore[arg-type]

    def model(self) -> nn.Sequential:
        """The whole (trained) model: every stage's layers in order."""
        return nn.Sequential(*[layer for stage in self.stages for layer in stage.module])
