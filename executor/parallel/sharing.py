"""Parameters that layers on different stages share (a tied embedding and output head).

Every stage holding such a parameter keeps a copy of its own (each stage materialises its own
layers, :mod:`executor.models.materialize`, in the in-process pipeline as across processes). After a step's last backward the copies' gradients
are summed over exactly the owning stages (as Megatron-LM does for its embedding group), so each
copy holds the gradient the unpipelined model computes, and identical optimizer steps from
identical values keep the copies identical. Groups are reduced in the order of the parameter's
first layer on every rank, so collectives on overlapping groups never cross.

What cannot be made correct this way is refused with one line before training: a buffer shared by
layers on different stages (each stage would update its own running statistics, silently apart).

Limits: a parameter a stage holds but does not use in some step gets a zero gradient from that
stage; the copies cost one extra parameter, gradient and optimizer state per owner beyond the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from executor.models.loaded_types import is_dtensor
from sim.engine.stage_costs import stage_of_layers
from sim.errors import GpipeInputError


@dataclass(frozen=True)
class SharedGroup:
    """One parameter held by several stages, and its name inside each owner's stage module."""

    owners: tuple[int, ...]  # stages, ascending
    names: dict[int, str]  # stage -> parameter name in that stage's nn.Sequential

    @property
    def first(self) -> int:
        return self.owners[0]


def shared_tensors(model: nn.Sequential) -> list[tuple[str, tuple[int, ...], int]]:
    """(name in its first layer, layers using it, element count) of every parameter that more than
    one top-level layer uses, in the order of first use."""
    seen: dict[int, tuple[str, list[int], int]] = {}
    for index, layer in enumerate(model):
        for name, parameter in layer.named_parameters():
            entry = seen.setdefault(id(parameter), (name, [], parameter.numel()))
            if index not in entry[1]:
                entry[1].append(index)
    return [(name, tuple(layers), numel) for name, layers, numel in seen.values() if len(layers) > 1]


def find_shared(model: nn.Sequential, partition: Sequence[int]) -> list[SharedGroup]:
    """The parameters layers on different stages share; a buffer shared so is refused in one line."""
    stage_of = stage_of_layers(partition)
    names = list(model._modules)  # the children's keys: "0", "1", ... for a plain nn.Sequential
    buffers: dict[int, tuple[int, str]] = {}
    for index, layer in enumerate(model):
        for name, buffer in layer.named_buffers():
            first = buffers.setdefault(id(buffer), (index, name))
            if stage_of[first[0]] != stage_of[index]:
                raise GpipeInputError(
                    f"buffer {name!r} of layer {index} (stage {stage_of[index]}) is also buffer {first[1]!r} of "
                    f"layer {first[0]} (stage {stage_of[first[0]]}); stages cannot share a buffer, so put both "
                    "layers on one stage or give each its own")
    modules: dict[int, int] = {}
    for index, layer in enumerate(model):
        for module in layer.modules():
            if all(p is None for p in module._parameters.values()):  # a shared ReLU holds nothing
                continue
            first = modules.setdefault(id(module), index)
            if stage_of[first] != stage_of[index]:
                raise GpipeInputError(
                    f"layer {index} (stage {stage_of[index]}) contains a {type(module).__name__} that layer {first} "
                    f"(stage {stage_of[first]}) contains too; stages can share parameters but not modules that hold them, so "
                    "give each layer its own module and tie the parameters")
    owners: dict[int, dict[int, str]] = {}
    for index, layer in enumerate(model):
        for name, parameter in layer.named_parameters():
            owners.setdefault(id(parameter), {}).setdefault(stage_of[index], f"{names[index]}.{name}")
    return [SharedGroup(tuple(sorted(by_stage)), by_stage) for by_stage in owners.values() if len(by_stage) > 1]


def _parameter_at(module: nn.Module, name: str) -> nn.Parameter:
    """The parameter ``name`` (``"<layer index>.<path>"`` in the whole model) of a stage module:
    a slice of the whole ``nn.Sequential`` keeps its children's indices."""
    return module.get_parameter(name)


def duplicates_on(stage: int, module: nn.Module, groups: Sequence[SharedGroup]) -> list[nn.Parameter]:
    """The copies ``stage`` holds that another stage holds first: left out of a global gradient norm,
    which must count each parameter once."""
    return [_parameter_at(module, g.names[stage]) for g in groups if stage in g.owners and stage != g.first]


def _grad_or_zeros(parameter: nn.Parameter) -> torch.Tensor:
    if parameter.grad is None:
        parameter.grad = torch.zeros_like(parameter)
    return parameter.grad


def reduce_in_process(modules: Sequence[nn.Module], groups: Sequence[SharedGroup]) -> None:
    """Sum each shared parameter's gradient over the owners' copies (stage k's layers in ``modules[k]``)."""
    for group in groups:
        grads = [_grad_or_zeros(_parameter_at(modules[k], group.names[k])) for k in group.owners]
        total = torch.stack(grads).sum(dim=0) if len(grads) > 1 else grads[0]
        for grad in grads:
            grad.copy_(total)


def process_groups(groups: Sequence[SharedGroup]) -> list[dist.ProcessGroup]:
    """One process group of exactly the owning ranks per shared parameter (rank == stage).

    Every rank must call this, in the same order, since ``new_group`` is collective.
    """
    return [dist.new_group(list(group.owners)) for group in groups]


def dist_reducer(stage: int, module: nn.Module, groups: Sequence[SharedGroup],
                 process_group_of: Sequence[dist.ProcessGroup]) -> Callable[[], None]:
    """For rank ``stage``: all-reduce (sum) its shared parameters' gradients, in group order."""
    mine = [(_parameter_at(module, g.names[stage]), pg) for g, pg in zip(groups, process_group_of)
            if stage in g.owners]

    def reduce() -> None:
        for parameter, group in mine:
            grad = _grad_or_zeros(parameter)  # under ZeRO-2/3 this rank's shard: the same rows on every owner
            dist.all_reduce(grad.to_local() if is_dtensor(grad) else grad, op=dist.ReduceOp.SUM, group=group)

    return reduce
