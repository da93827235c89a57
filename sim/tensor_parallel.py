"""Tensor parallelism: each layer split over T devices of one node, as Megatron-LM splits a GPT.

Devices are ordered TP innermost, then PP, then DP: the T devices of a tensor-parallel group are
consecutive devices of one node, and a pipeline stage (or a replica's stage) is one such group. So
a system of N devices, n per node, runs a plan of D x K groups of T devices, D x K x T <= N, and
the simulator sees each group as one device of a system with n / T devices per node
(:func:`tensor_parallel_system`): the engine, the placement of stages and replicas, the
data-parallel all-reduce and the planner need nothing else. What one group member does is in the
workload (:func:`sim.models.transformer_layers`): its share of the weights, gradients, optimizer
state, FLOPs and activations, plus the tensor-parallel collectives, ring all-reduces over the
node's link that the matmuls wait for (no overlap). Each member all-reduces its own 1/T of the
gradients with its data-parallel peers, one ring per member at the same time on the node's links
and network rails, which is the group's all-reduce on the per-device links the engine uses.

Refused in one line: T that does not divide the heads, the key/value heads and the FFN width (every
head and hidden unit whole on one device), T larger than a node's devices (the collectives need the node's NVLink), and
T > 1 for models other than the built-in transformer (no split is modelled for them yet).

Limits: stage-to-stage sends carry the full activation on each member without sequence parallelism
(Megatron's scatter-gather of the send is not modelled); the head's cross-entropy statistics over
the vocabulary slices are not counted; the collectives are timed on an idle link.
"""

from __future__ import annotations

from dataclasses import replace

from sim.errors import GpipeInputError, require_positive
from sim.hardware import System
from sim.workload import Workload


def default_sequence_parallel(tensor_parallel: int, asked: bool | None) -> bool:
    """Sequence parallelism wherever T > 1 unless told otherwise."""
    return tensor_parallel > 1 if asked is None else asked


def check_tensor_parallel(tensor_parallel: int, workload: Workload, system: System) -> None:
    """T positive, within a node, dividing the heads and the FFN width; one line each."""
    require_positive("--tensor-parallel", tensor_parallel, "use 1 (no tensor parallelism) or more")
    if tensor_parallel == 1:
        return
    from sim.models import AnalyticWorkload

    if not isinstance(workload, AnalyticWorkload) or workload.name != "transformer":
        raise GpipeInputError(f"--tensor-parallel {tensor_parallel}: tensor parallelism is modelled for the built-in "
                              f"transformer only, not {getattr(workload, 'name', 'this model')}; use "
                              "--tensor-parallel 1")
    if tensor_parallel > system.devices_per_node:
        raise GpipeInputError(f"--tensor-parallel {tensor_parallel} spans more than a node: {system.name} has "
                              f"{system.devices_per_node} devices per node and tensor-parallel collectives run on "
                              f"the node's own links; use --tensor-parallel {system.devices_per_node} or less")
    if system.devices_per_node % tensor_parallel:
        raise GpipeInputError(f"--tensor-parallel {tensor_parallel} does not divide {system.name}'s "
                              f"{system.devices_per_node} devices per node; use a divisor of it")
    options = dict(workload.options)
    options["kv_heads"] = options.get("kv_heads") or options["heads"]
    for key in ("heads", "kv_heads", "ff"):
        if options[key] % tensor_parallel:
            raise GpipeInputError(f"--tensor-parallel {tensor_parallel} does not divide {key}={options[key]}: "
                                  f"each device holds whole heads, key/value heads and FFN units; use a T that "
                                  f"divides heads={options['heads']}, kv_heads={options['kv_heads']} and "
                                  f"ff={options['ff']}")


def tensor_parallel_system(system: System, tensor_parallel: int) -> System:
    """The system as the pipeline sees it: each group of T consecutive devices of a node is one."""
    if tensor_parallel == 1:
        return system
    return replace(system, devices_per_node=system.devices_per_node // tensor_parallel)


def with_tensor_parallel(workload: Workload, system: System, tensor_parallel: int,
                         sequence_parallel: bool = False) -> tuple[Workload, System]:
    """``workload`` split over T devices of one of ``system``'s nodes (one member's costs, the
    collectives on the node's link) and the system of groups the pipeline runs on."""
    check_tensor_parallel(tensor_parallel, workload, system)
    if tensor_parallel == 1:  # sequence parallelism splits over the tensor-parallel group: nothing to split
        return workload, system
    from sim.models import AnalyticWorkload, transformer_layers

    assert isinstance(workload, AnalyticWorkload)
    layers = transformer_layers(workload.options, tensor_parallel, sequence_parallel)
    split = AnalyticWorkload(workload.name, workload.options, layers, tensor_parallel, sequence_parallel,
                             system.intra_link)
    return split, tensor_parallel_system(system, tensor_parallel)
