"""Tensor parallelism: each layer split over T devices of one node, as Megatron-LM splits a GPT.

Devices are ordered TP innermost, then PP, then DP: the T devices of a tensor-parallel group are
consecutive devices of one node, and a pipeline stage (or a replica's stage) is one such group. So
a system of N devices, n per node, runs a plan of D x K groups of T devices, D x K x T <= N, and
the simulator sees each group as one device of a system with n / T devices per node
(:func:`tensor_parallel_system`): the engine, the placement of stages and replicas, the
data-parallel all-reduce and the planner need nothing else. What one group member does is in the
workload (:func:`sim.workloads.transformer.transformer_layers`): its share of the weights, gradients, optimizer
state, FLOPs and activations, plus the tensor-parallel collectives, ring all-reduces over the
node's link that the matmuls wait for (no overlap). Each member all-reduces its own 1/T of the
gradients with its data-parallel peers, one ring per member at the same time on the node's links
and network rails, which is the group's all-reduce on the per-device links the engine uses.

Context parallelism (``--context-parallel C``) splits each sequence over C more devices, T x C per
stage, laid out as Megatron-Core and Transformer Engine lay them out: TP innermost (T within a node),
then CP, then PP, then DP. Each device holds s/C tokens, its queries attend to all keys as ring
attention passes key/value blocks round the C devices (TE's ``p2p`` ring: each step sends a block to
the next CP rank while the attention runs over the one it has;
:func:`sim.workloads.transformer.transformer_layers`), and the C copies of the weights have their
gradients summed after the last backward. C must divide the sequence and the attention must be flash
(the ring runs on its kernels). T x C either divides a node (the whole ring on the node's link) or
fills whole nodes (:func:`context_parallel_span`): then the ring crosses the inter-node link, each of
the T members sending its share to its counterpart on the next node on its own NIC (the same rail),
so every step of the ring is priced on the inter-node link, the slowest hop the ring waits for; the
gradients are summed hierarchically (on the node's link among the CP ranks of a node, then across
nodes). Memory is the same either way. A stage of such a layout is a group of whole nodes: its
pipeline sends and its data-parallel all-reduce cross nodes, each member on its own NIC
(:func:`tensor_parallel_system`). Limits: the ring's steps are not contended by the data-parallel or
pipeline traffic on the same NICs; a T x C that neither divides a node nor fills whole ones (a group
straddling a node boundary), or that is more devices than the system has, is refused.

Measured costs (``--costs FILE``) split a stage as the file's profile of the layers split over T
ranks says (:mod:`calibrate.measure.tp_profile`): each layer's time there includes its collectives and the
per-operation cost of DTensor, so nothing is added for them; T with no such profile, sequence
parallelism (not profiled) and other hardware than the measured one are refused in one line.

Refused in one line: T that does not divide the heads, the key/value heads and the FFN width (every
head and hidden unit whole on one device), T larger than a node's devices (the collectives need the node's NVLink), and
T > 1 for models other than the transformer (the built-in one, or a Hugging Face decoder priced as one
of its shape: :mod:`sim.workloads.decoder_shape`); no split is modelled for the others yet.

Limits: stage-to-stage sends carry the full activation on each member without sequence parallelism
(Megatron's scatter-gather of the send is not modelled); the head's cross-entropy statistics over
the vocabulary slices are not counted; the collectives are timed on an idle link.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sim.catalog.hardware import Link, System
from sim.errors import GpipeInputError, require_positive
from sim.workloads.workload import Workload


def default_sequence_parallel(tensor_parallel: int, asked: bool | None, workload: Workload | None = None) -> bool:
    """Sequence parallelism wherever T > 1 unless told otherwise; never by default for measured
    costs, whose split layers were profiled without it (as ``gpipe train`` runs by default)."""
    if asked is not None:
        return asked
    return tensor_parallel > 1 and not _measured(workload)


def _measured(workload: Workload | None) -> bool:
    return workload is not None and workload.measured_costs  # sim.formats.measured_workload.MeasuredWorkload


def _require_builtin_transformer(flag: str, degree: int, kind: str, workload: Workload) -> None:
    """Only the transformer's layers (the built-in one's, or a Hugging Face model priced as one of its
    shape) have a split modelled; anything else is refused in one line."""
    from sim.workloads.models import AnalyticWorkload

    if not isinstance(workload, AnalyticWorkload) or not workload.is_transformer:
        raise GpipeInputError(f"{flag} {degree}: {kind} parallelism is modelled for the built-in transformer only, "
                              f"not {workload.name}; use {flag} 1")


def check_tensor_parallel(tensor_parallel: int, workload: Workload, system: System) -> None:
    """T positive, within a node, dividing the heads and the FFN width; one line each."""
    require_positive("--tensor-parallel", tensor_parallel, "use 1 (no tensor parallelism) or more")
    if tensor_parallel == 1:
        return
    if _measured(workload):
        _check_measured(tensor_parallel, workload, system)
        return
    _require_builtin_transformer("--tensor-parallel", tensor_parallel, "tensor", workload)
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


def _check_measured(tensor_parallel: int, workload: Any, system: System) -> None:
    """Measured costs split a stage as their profile of it over T ranks says, on the machine that
    measured it; one line otherwise."""
    if system.device.name != workload.device_name:
        raise GpipeInputError(f"--tensor-parallel {tensor_parallel} with --costs: the split layers were profiled on "
                              f"{workload.device_name}, not {system.device.name}; add --hardware "
                              f"{workload.data.get('system', 'cpu')}, or plan other hardware with --efficiency-from "
                              "COSTS, which splits the analytic model")
    if tensor_parallel not in workload.tensor_parallel_options:
        workload.split(tensor_parallel)  # refuses in one line, naming the T the file has


def check_context_parallel(context_parallel: int, workload: Workload, system: System,
                           tensor_parallel: int = 1) -> None:
    """C positive, dividing the sequence, with T x C inside a node, on flash attention; one line each."""
    require_positive("--context-parallel", context_parallel, "use 1 (no context parallelism) or more")
    if context_parallel == 1:
        return
    _require_builtin_transformer("--context-parallel", context_parallel, "context", workload)
    seq = workload.options["seq"]
    if seq % context_parallel:
        raise GpipeInputError(f"--context-parallel {context_parallel} does not divide seq={seq}: each device holds an "
                              f"equal block of every sequence; use a C that divides {seq}")
    if workload.options.get("attention") != "flash":
        raise GpipeInputError(f"--context-parallel {context_parallel} runs ring attention on flash kernels; add "
                              "--option attention=flash")
    if tensor_parallel > system.devices_per_node:
        raise GpipeInputError(f"--tensor-parallel {tensor_parallel} spans more than a node: {system.name} has "
                              f"{system.devices_per_node} devices per node and tensor parallelism stays inside one; "
                              f"use --tensor-parallel {system.devices_per_node} or less")
    context_parallel_span(system, tensor_parallel, context_parallel)
    group = tensor_parallel * context_parallel
    if group > system.total_devices:
        raise GpipeInputError(f"--tensor-parallel {tensor_parallel} x --context-parallel {context_parallel} = {group} "
                              f"devices per stage but {system.name} with {system.nodes} node(s) has "
                              f"{system.total_devices}; use --nodes {-(-group // system.devices_per_node)} or more, "
                              "or a smaller T or C")


def context_parallel_span(system: System, tensor_parallel: int, context_parallel: int) -> tuple[int, int]:
    """(CP ranks on one node, nodes the ring spans) of T x C devices laid out TP innermost: the
    group divides a node (all C on one node) or fills whole nodes; one line otherwise."""
    group, per_node = tensor_parallel * context_parallel, system.devices_per_node
    if group <= per_node and per_node % group == 0:
        return context_parallel, 1
    if group > per_node and group % per_node == 0 and per_node % tensor_parallel == 0:
        ranks = per_node // tensor_parallel
        return ranks, context_parallel // ranks
    raise GpipeInputError(f"--tensor-parallel {tensor_parallel} x --context-parallel {context_parallel} = {group} "
                          f"devices per stage must divide {system.name}'s {system.devices_per_node} devices per node "
                          "or fill whole nodes (tensor parallelism inside a node, the context-parallel ring across "
                          "them); use another T or C")


def tensor_parallel_system(system: System, tensor_parallel: int) -> System:
    """The system as the pipeline sees it: each group of T (T x C) consecutive devices of a node is
    one device; a group that fills whole nodes is one device per node, on as many fewer nodes, so
    its pipeline sends and data-parallel all-reduce cross the inter-node link (one NIC per member)."""
    if tensor_parallel == 1:
        return system
    if tensor_parallel <= system.devices_per_node:
        return replace(system, devices_per_node=system.devices_per_node // tensor_parallel)
    span = tensor_parallel // system.devices_per_node
    return replace(system, devices_per_node=1, nodes=max(1, system.nodes // span), nodes_per_device=span)


def with_tensor_parallel(workload: Workload, system: System, tensor_parallel: int,
                         sequence_parallel: bool = False, context_parallel: int = 1,
                         tp_link: Link | None = None) -> tuple[Workload, System]:
    """``workload`` split over T x C devices of ``system`` (one member's costs, the collectives and
    the ring exchange on the node's link, or on ``tp_link``: collectives a costs file measured; a ring
    that spans nodes on the inter-node link) and the system of groups the pipeline runs on."""
    check_tensor_parallel(tensor_parallel, workload, system)
    check_context_parallel(context_parallel, workload, system, tensor_parallel)
    if tensor_parallel == 1 and context_parallel == 1:  # sequence parallelism splits over the T group: nothing
        return workload, system
    if _measured(workload):
        if sequence_parallel:
            raise GpipeInputError(f"--sequence-parallel with --costs: the costs file profiled the layers split over "
                                  f"{tensor_parallel} ranks without it; drop --sequence-parallel")
        return workload.split(tensor_parallel), tensor_parallel_system(system, tensor_parallel)
    from sim.workloads.models import AnalyticWorkload

    assert isinstance(workload, AnalyticWorkload)
    sequence_parallel = sequence_parallel and tensor_parallel > 1
    ranks_per_node, nodes = context_parallel_span(system, tensor_parallel, context_parallel)
    split = workload.split_over(tensor_parallel, sequence_parallel, tp_link or system.intra_link, context_parallel,
                                system.inter_link if nodes > 1 else None, ranks_per_node)
    return split, tensor_parallel_system(system, tensor_parallel * context_parallel)
