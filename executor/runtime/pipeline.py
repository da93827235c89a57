"""Build a run's stages from a :class:`RunConfig`, and run the whole pipeline in one process.

:func:`prepare` builds the model on the meta device and checks it against the partition with a dry
forward of meta tensors (:mod:`executor.runtime.shapes`): nothing is allocated, so ``gpipe train`` and every
worker can check a model larger than one host's memory. :func:`make_stage` gives real values to one
stage's layers only, from where the run's first weights come from (:mod:`executor.models.initial_weights`:
``factory()``'s values by default). The multi-process
worker makes one stage per rank; :class:`LocalPipeline` makes all of them in one process, joined by
in-process mailboxes, and interleaves their action lists in a fixed order: it sweeps the stages
round-robin, running each stage's next actions while their inputs are present. Every action runs
exactly as in the distributed executor, so tests of the in-process pipeline test the real schedule
walk, receives and sends included (only the transport differs). The end of a step runs phase by
phase over all stages, the stages' squared gradient norms added here where the worker all-reduces.
"""

from __future__ import annotations

from collections import OrderedDict
import math
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from executor.config import RunConfig
from executor.models.build import build_meta_model, check_loss, checkpoint_names, default_loss, loss_function
from executor.models.initial_weights import WeightSource, check_source, weight_source
from executor.runtime.batchnorm import DeferredBatchNorm
from executor.runtime.boundary import Boundary, map_tensors
from executor.runtime.chunks import ChunkedDevice, chunks_of_device, shards
from executor.runtime.data import batch_for_step
from executor.runtime.prefetch import StepBatches
from executor.runtime.recording import Recorder
from executor.runtime.shapes import dry_run
from executor.parallel.expert_checks import check_model_experts
from executor.parallel.sharding_checks import check_wrappable
from executor.parallel.sharing import (SharedGroup, dist_reducer, duplicates_on, find_shared, process_groups,
                                       reduce_in_process)
from executor.runtime.stage import PipelineStage, StageConfig
from executor.transport.p2p import LocalMailboxes, Peers, Transport, boundary_groups
from executor.transport.shm_transport import host_links
from executor.transport.stage_transport import stage_transport
from sim.engine.stage_costs import stage_bounds
from sim.errors import GpipeInputError
from sim.formats.plan import validate_partition
from sim.schedules.schedule import Action, format_grid, walk_in_rounds

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from executor.parallel.expert_parallel import ExpertSharding
    from executor.parallel.fully_sharded import Sharding
    from executor.parallel.replicas import Layout


@dataclass
class Prepared:
    model: nn.Sequential  # on the meta device: the structure every stage materialises its layers from
    boundaries: list[Boundary]  # K+1: model input, each cut, model output
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    shared: list[SharedGroup]  # parameters layers on different stages share
    source: WeightSource | None = None  # where the stages' first values come from, once asked (weights_of)


def prepare(config: RunConfig) -> Prepared:
    """Build the model on the meta device and validate it against the plan; raises GpipeInputError
    with one line. Allocates nothing but one mini-batch of data."""
    config.validate()
    loss = check_loss(config.loss or default_loss(config.model))
    model = build_meta_model(config.model, config.options)
    if not config.partition:
        raise GpipeInputError("no partition; give --partition like 3,5 or --stages K")
    inputs, targets = batch_for_step(config.model, config.options, config.batch_size, config.seed, 0,
                                     config.data or None)
    loss_fn = loss_function(loss)
    validate_partition(tuple(config.partition), len(model))
    if config.layout.tensor_parallel > 1:  # DTensor is slow to import (loaded_types): tensor-parallel runs only
        from executor.parallel.tensor_parallel import check_model

        check_model(model, config.layout.tensor_parallel, config.layout.sequence_parallel)
    check_model_experts(model, config.layout.expert_parallel, config.layout.zero)
    shared = find_shared(model, tuple(config.partition))
    check_wrappable(model, tuple(config.partition), config.layout.zero, config.layout.checkpoint)  # what FSDP cannot wrap (ZeRO-2/3)
    check_source(model, config.init, config.init_from, checkpoint_names(config.model, config.options))
    to_meta = partial(map_tensors, lambda t: t.to("meta"))
    boundaries = dry_run(model, tuple(config.partition), to_meta(inputs), to_meta(targets), loss_fn,
                         config.precision)
    return Prepared(model, boundaries, loss_fn, shared)


def weights_of(config: RunConfig, prepared: Prepared) -> WeightSource:
    """The run's source of first values in this process, made once (``factory()`` may be built here)."""
    if prepared.source is None:
        prepared.source = weight_source(config, prepared.model, checkpoint_names(config.model, config.options))
    return prepared.source


def stage_layers(config: RunConfig, prepared: Prepared, stage: int) -> nn.Sequential:
    """Stage ``stage``'s layers with their first values, keyed by their index in the whole model."""
    first, end = stage_bounds(config.partition)[stage]
    indices = list(range(first, end))
    layers = weights_of(config, prepared).layers(prepared.model, indices)
    return nn.Sequential(OrderedDict((str(i), layer) for i, layer in zip(indices, layers)))


def make_stage(config: RunConfig, prepared: Prepared, stage: int, transport: Transport,
               device: torch.device = torch.device("cpu"), recorder: Recorder | None = None,
               tp_mesh: "DeviceMesh | None" = None, sharding: "Sharding | None" = None,
               experts: "ExpertSharding | None" = None) -> PipelineStage:
    """Stage ``stage`` with its first values; with ``experts`` only its share of the routed experts
    (:mod:`executor.parallel.expert_parallel`), with ``tp_mesh`` (its T ranks) its layers sharded over
    them (:mod:`executor.parallel.tensor_parallel`) and with ``sharding`` (ZeRO-2/3) over its
    data-parallel ranks (:mod:`executor.parallel.fully_sharded`), all before its optimizer is made."""
    stage_config = StageConfig(stage=stage, batch_size=config.batch_size, layout=config.layout, seed=config.seed,
                               precision=config.precision)
    module = stage_layers(config, prepared, stage)
    if experts is not None:
        from executor.parallel.expert_parallel import keep_local_experts

        keep_local_experts(module, experts)
    if tp_mesh is not None:
        from executor.parallel.tensor_parallel import parallelize_stage

        parallelize_stage(module.to(device), tp_mesh, config.layout.sequence_parallel)
    if sharding is not None:
        from executor.parallel.fully_sharded import shard_module

        module = shard_module(DeferredBatchNorm.convert(module).to(device), sharding)
    return PipelineStage(
        stage_config, module, transport, prepared.loss_fn,
        incoming=prepared.boundaries[stage] if stage > 0 else None,
        outgoing=prepared.boundaries[stage + 1] if stage < stage_config.stages - 1 else None,
        device=device, optim=config.optim_settings(), recorder=recorder,
        duplicates=duplicates_on(stage, module, prepared.shared))


def make_dist_stage(config: RunConfig, prepared: Prepared, rank: int, device: torch.device,
                    recorder: Recorder | None = None, groups: dict | None = None,
                    layout: "Layout | None" = None) -> PipelineStage:
    """Rank ``rank``'s stage over ``torch.distributed`` (rank == stage), its shared parameters'
    gradients summed with the other owners. Collective: every rank calls it at the same point.
    ``groups`` reuses boundary groups made before (:func:`executor.transport.p2p.boundary_groups`).
    With ``layout`` (:mod:`executor.parallel.replicas`) the stage is ``layout.stage`` of one of D replicas,
    on that replica's rows of the global batch, with the replica's groups and neighbours."""
    ranks = pipeline_group = None
    if layout is not None:
        config = replace(config, batch_size=layout.rows)
        rank, groups, ranks, pipeline_group = layout.stage, layout.boundary_groups, layout.stage_ranks, layout.pp_group
    groups = groups if groups is not None else boundary_groups(config.stages)
    shared_groups = layout.shared_groups if layout is not None else process_groups(prepared.shared)
    links = host_links(device, config.transport, config.timeout_s)
    transport = stage_transport(Peers(rank, config.stages, groups, ranks), device, pipeline_group, links)
    stage = make_stage(config, prepared, rank, transport, device, recorder,
                       layout.tp_mesh if layout is not None else None, layout.sharding if layout is not None else None,
                       layout.experts if layout is not None else None)
    if any(rank in group.owners for group in prepared.shared):
        stage.reduce_shared = dist_reducer(rank, stage.module, prepared.shared, shared_groups)
    return stage


def train_step_with_data(config: RunConfig, stage: PipelineStage | ChunkedDevice, step: int,
                         layout: "Layout | None" = None, batches: StepBatches | None = None) -> float | None:
    """One mini-batch on ``stage``: take step ``step``'s data where the stage needs it, then train.

    The first stage keeps the inputs, the last the targets; the loss comes back on the last stage.
    With ``layout``, the stage's replica keeps its rows of the global batch (its loss: their mean).
    ``batches`` (from :func:`step_batches`) holds the next step's data when the stage drew it while
    waiting; without it the step draws its own.
    """
    batches = batches or step_batches(config, stage, layout)
    inputs, targets = batches.take(step)
    return stage.train_step(step, inputs, targets)


def step_batches(config: RunConfig, stage: PipelineStage | ChunkedDevice,
                 layout: "Layout | None" = None) -> StepBatches:
    """The stage's source of step data; its stages draw the next step's while they wait on a receive."""
    batches = StepBatches(config, stage.is_first or stage.is_last, layout.share if layout is not None else None,
                          stage.device)
    for shard in shards(stage):
        shard.while_waiting = batches
    return batches


class LocalPipeline:
    """All K stages in this process. ``stages[k].module`` holds stage k's (live) layers; under the
    interleaved schedule ``stages[s]`` is virtual stage s, and ``devices[d]`` walks device d's list
    over its chunks (:mod:`executor.runtime.chunks`)."""

    def __init__(self, config: RunConfig, prepared: Prepared | None = None) -> None:
        self.config = config
        self.prepared = prepared or prepare(config)
        mailboxes = LocalMailboxes()
        device = torch.device(config.device)
        self.stages = [make_stage(config, self.prepared, s, mailboxes.endpoint(s), device)
                       for s in range(len(config.partition))]
        self.prepared.source = None  # a factory() model built here is not needed once the stages hold copies
        self.devices: list[PipelineStage] | list[ChunkedDevice] = self.stages
        if config.layout.virtual_stages > 1:
            self.devices = [ChunkedDevice(chunks_of_device(self.stages, d, config.stages, config.layout.schedule))
                            for d in range(config.stages)]
        self.grad_norms: list[float] = []  # global gradient norm (before clipping) of each clipping step

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return batch_for_step(c.model, c.options, c.batch_size, c.seed, step, c.data or None)

    def run_step(self, step: int, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                 update: bool = True) -> float:
        """One mini-batch through every stage; its loss.

        With ``update=False`` the step ends after the sends: gradients, parameters and batch-norm
        running statistics stay as the backward left them, for inspection.
        """
        if inputs is None or targets is None:
            inputs, targets = self.batch(step)
        for stage in self.stages:
            stage.begin_step(step, inputs, targets)
        walks = [d.actions for d in self.devices]  # each device's list; actions name (virtual) stages

        def run(device: int, action: Action) -> bool:
            stage = self.stages[action.stage]
            need = stage.needs(action)
            if need is not None and not stage.transport.ready(*need):
                return False
            stage.run(action)
            return True

        position = walk_in_rounds(walks, run)
        if position != [len(actions) for actions in walks]:
            stuck = walks[0]
            raise RuntimeError("pipeline deadlock:\n" + format_grid(
                walks, highlight=stuck[min(position[0], len(stuck) - 1)]))
        for stage in self.stages:
            stage.finish_sends()
        reduce_in_process([stage.module for stage in self.stages], self.prepared.shared)
        if update:
            self._update()
        for stage in self.stages:
            stage.recorder.flush()
        return float(self.stages[-1].step_loss())  # type: ignore[arg-type]

    def _update(self) -> None:
        """The update phases of :meth:`PipelineStage.end_step`, with the shared gradients and the norm
        summed over stages here."""
        grad_norm = None
        if self.stages[0].needs_global_norm:
            grad_norm = math.sqrt(sum(float(stage.grad_sq_norm()) for stage in self.stages))
            self.grad_norms.append(grad_norm)
        for stage in self.stages:
            stage.update(grad_norm)

    def model(self) -> nn.Sequential:
        """The whole (trained) model: every stage's layers in order."""
        return nn.Sequential(*[layer for stage in self.stages for layer in stage.module])
