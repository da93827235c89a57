"""What ZeRO-2/3 (FSDP2, :mod:`executor.parallel.fully_sharded`) cannot run, refused in one line before
any worker starts; kept apart so that checking a run's settings does not import FSDP and DTensor."""

from __future__ import annotations

from typing import Protocol, Sequence

from torch import nn

from sim.errors import GpipeInputError
from sim.formats.layout import check_gradient_sync, check_sharding
from sim.schedules.schedule import SPLIT_BACKWARD_SCHEDULES


class ShardingSettings(Protocol):
    """What this module reads of a run's settings (an :class:`executor.config.RunConfig`)."""

    zero: int
    replicas: int
    shard_group: int | None
    gradient_sync: str | None
    schedule: str
    checkpoint: str
    stages: int


def check_fully_sharded(config: ShardingSettings) -> None:
    """ZeRO-2/3's needs of the settings, one line each: a shard group dividing D, no split-backward
    schedule (its weight pass adds to the sharded parameters, not the gathered ones FSDP computes
    with: :mod:`executor.parallel.fully_sharded`); a gradient sync only with ZeRO-2/3."""
    check_gradient_sync(config.layout.gradient_sync, config.layout.zero)
    if config.layout.zero < 2:
        return
    check_sharding(config.layout.zero, config.layout.replicas, config.layout.shard_group)
    if config.layout.schedule in SPLIT_BACKWARD_SCHEDULES:
        raise GpipeInputError(f"--zero {config.layout.zero} with --schedule {config.layout.schedule}: the split backward adds weight "
                              "gradients to the sharded parameters, not the gathered ones FSDP computes with; use "
                              "gpipe, 1f1b or interleaved, or --zero 1")


def check_wrappable(model: nn.Sequential, partition: Sequence[int], zero: int, checkpoint: str) -> None:
    """What FSDP cannot wrap in ``model`` (on the meta device), one line: a parameter of no dimension,
    or (``--checkpoint full``) a chunk whose layers share a parameter."""
    if zero < 2:
        return
    for index, layer in enumerate(model):
        for name, parameter in layer.named_parameters():
            if parameter.dim() == 0:
                raise GpipeInputError(f"--zero {zero} shards every parameter along its first dimension, but "
                                      f"{name!r} of layer {index} is a scalar; give it shape (1,) or use --zero 1")
    if checkpoint != "full":
        return
    first = 0
    for size in partition:
        chunk = list(model)[first:first + size]
        if root_held(chunk):
            raise GpipeInputError(f"--zero {zero} with --checkpoint full: layers {first}-{first + size - 1} of one "
                                  "stage share a parameter (a tied embedding and head?), which only the stage's root "
                                  "unit can hold, and the layer-by-layer recompute never runs the root; use "
                                  "--checkpoint except_last or never, or more stages")
        first += size


def root_held(layers: Sequence[nn.Module]) -> set[int]:
    """Ids of the parameters two of ``layers`` share: FSDP keeps them in the root unit."""
    users: dict[int, set[int]] = {}
    for index, layer in enumerate(layers):
        for parameter in layer.parameters():
            users.setdefault(id(parameter), set()).add(index)
    return {key for key, holders in users.items() if len(holders) > 1}


def units_of(module: nn.Sequential) -> list[nn.Module]:
    """The layers of a chunk that are units of their own: those with parameters, none shared with
    another layer of the chunk."""
    shared = root_held(list(module))
    return [layer for layer in module
            if any(True for _ in layer.parameters()) and not any(id(p) in shared for p in layer.parameters())]


def reshards_after_forward(zero: int, stages: int) -> bool:
    """Whether units free their gathered parameters after each forward: ZeRO-3 with one pipeline
    stage only (torchtitan's policy keeps them from forward to backward under a pipeline)."""
    return zero == 3 and stages == 1
