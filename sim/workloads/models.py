"""Analytic workloads for the built-in models: per-layer FLOPs, bytes and memory against a roofline.

Each model's layer list mirrors the torch model the executor builds, layer for layer, so a partition
(``balance``) means the same thing to the simulator and to the executor. Torch-free: ``gpipe
simulate`` must not import torch.

Time of one layer pass on ``device`` (the roofline, Williams et al., CACM 2009; a GPU with fractions
fitted on published runs is timed kernel by kind instead, :mod:`sim.catalog.kernel_model`)::

    forward_s  = max(F / achieved_flops(precision), B / achieved_bandwidth) + LAYER_OVERHEAD_S
    backward_s = max(2F / achieved_flops(precision), 2B / achieved_bandwidth) + 2 * LAYER_OVERHEAD_S
    recompute_s = forward_s

How each layer's F, B and memory are counted, in what precision, and what the counts leave out:
:mod:`sim.workloads.layer_spec`; the layer lists: :mod:`sim.workloads.transformer` and
:mod:`sim.workloads.mlp_and_cnn`; the options and their checks: :mod:`sim.workloads.model_options`.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from typing import Any, Callable, Sequence

from sim.catalog.hardware import Device, Link
from sim.catalog.kernel_model import GROUPED_MATMUL_RELATIVE, layer_times, ring_exposed_s
from sim.engine.allreduce import hierarchical_allreduce_s, ring_allreduce_s
from sim.errors import GpipeInputError, did_you_mean
from sim.workloads.layer_spec import LayerSpec
from sim.workloads.mlp_and_cnn import cnn_layers, mlp_layers
from sim.workloads.model_options import resolve_options
from sim.workloads.moe.builtin import check_moe_options, is_moe
from sim.workloads.precision import FP32_BYTES, precision_of
from sim.workloads.transformer import transformer_layers
from sim.workloads.workload import LayerCost, SharedParameter, UniformWorkload, Workload, WorkloadCapabilities

BUILTIN_MODELS = ("uniform", "mlp", "transformer", "cnn")

# Assumption: a layer's pass costs a few eager-mode kernel launches that do not overlap with the
# device's work, ~5 us of CPU dispatch each (PyTorch eager, CUDA launch latency); 10 us in all.
LAYER_OVERHEAD_S = 10e-6

_HAS_OPTIMIZER_S = "optimizer_s" in {f.name for f in dataclasses.fields(LayerCost)}


class AnalyticWorkload(WorkloadCapabilities):
    """A built-in model as a list of :class:`LayerSpec`, costed on any device by the roofline."""

    def __init__(self, name: str, options: dict[str, Any], layers: Sequence[LayerSpec],
                 tensor_parallel: int = 1, sequence_parallel: bool = False, tp_link: Link | None = None,
                 context_parallel: int = 1) -> None:
        self.name = name
        self.options = dict(options)
        self.layers = tuple(layers)
        self.num_layers = len(self.layers)
        self.precision: str = options["precision"]
        self.optimizer_slots: int = options["optimizer_slots"]
        # layers split over T devices of one node (sim.workloads.tensor_parallel); costs are one device's
        self.tensor_parallel = tensor_parallel
        self.sequence_parallel = sequence_parallel
        self.tp_link = tp_link
        self.context_parallel = context_parallel  # C devices share each sequence; weights replicated over them
        # a ring that spans nodes (T x C beyond a node): the inter-node link its steps cross, and the CP
        # ranks of one node (sim.workloads.tensor_parallel.context_parallel_span); None: the ring is on tp_link
        self.cp_link: Link | None = None
        self.cp_ranks_per_node = context_parallel
        self.planned_from: str | None = None  # a Hugging Face model planned by its shape (gpipe.workload_flags)
        # its layers are transformer_layers(options), which tensor and context parallelism split
        self.is_transformer = name == "transformer"
        self.has_attention_core = self.is_transformer  # what --checkpoint selective recomputes

    @property
    def checkpoints_ops(self) -> bool:  # type: ignore[override]
        """Whether its blocks price ``selective_op`` (a dense transformer's with flash attention)."""
        return not self.has_experts and any(spec.op_checkpointed for spec in self.layers)

    @property
    def parameter_count(self) -> int:
        """The whole model's parameters (a tensor-parallel layer's whole, not one device's share; a
        tied embedding and head's weight once)."""
        if self.tensor_parallel > 1 or self.sequence_parallel or self.context_parallel > 1:
            layers = (transformer_layers if self.is_transformer else _BUILDERS[self.name])(self.options)
        else:
            layers = list(self.layers)
        tied = self.options["vocab"] * self.options["d_model"] if self._tied else 0  # the head's, counted twice
        return sum(spec.params for spec in layers) - tied

    @property
    def _tied(self) -> bool:
        return self.is_transformer and bool(self.options.get("tied"))

    @property
    def shared_parameters(self) -> tuple[SharedParameter, ...]:
        """A tied embedding and head (``tied``): one token table, on the first and last layer."""
        if not self._tied:
            return ()
        numel = -(-self.options["vocab"] // self.tensor_parallel) * self.options["d_model"]
        p = precision_of(self.precision)
        static = numel * (p.weight_bytes + FP32_BYTES + (self.optimizer_slots + p.master_copy) * FP32_BYTES)
        return (SharedParameter("embedding.weight", (0, self.num_layers - 1), numel * p.weight_bytes, static),)

    def split_over(self, tensor_parallel: int, sequence_parallel: bool, tp_link: Link | None,
                   context_parallel: int = 1, cp_link: Link | None = None,
                   cp_ranks_per_node: int | None = None) -> "AnalyticWorkload":
        """The transformer split over T x C devices (:mod:`sim.workloads.tensor_parallel`): one
        member's layers, the same model otherwise; ``cp_link`` the inter-node link a ring spanning
        nodes crosses, ``cp_ranks_per_node`` its ranks on one node (default all C)."""
        split = copy.copy(self)
        split.layers = tuple(transformer_layers(self.options, tensor_parallel, sequence_parallel, context_parallel))
        split.tensor_parallel, split.sequence_parallel = tensor_parallel, sequence_parallel
        split.tp_link, split.context_parallel = tp_link, context_parallel
        split.cp_link = cp_link
        split.cp_ranks_per_node = context_parallel if cp_ranks_per_node is None else cp_ranks_per_node
        return split

    def layer_costs(self, rows: int, device: Device) -> Sequence[LayerCost]:
        if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows <= 0:
            raise GpipeInputError(f"micro-batch rows must be a positive integer, got {rows!r}")
        flops_s = device.achieved_flops(self.precision)
        bytes_s = device.achieved_bandwidth()
        priced: dict[LayerSpec, LayerCost] = {}  # a model's blocks are mostly alike: each distinct one priced once
        for spec in self.layers:
            if spec not in priced:
                priced[spec] = self._cost(spec, rows, flops_s, bytes_s, device)
        return [priced[spec] for spec in self.layers]

    def _cost(self, spec: LayerSpec, rows: int, flops_s: float, bytes_s: float, device: Device) -> LayerCost:
        collective_s = 0.0
        if self.tp_link is not None and self.tensor_parallel > 1:
            collective_s = ring_allreduce_s(spec.tp_allreduce_bytes_per_row * rows, self.tensor_parallel,
                                            self.tp_link)
        ring_send_s = 0.0
        if self.tp_link is not None and spec.cp_steps:  # each step waits for the slowest hop: across nodes if any
            ring_send_s = (self.cp_link or self.tp_link).transfer_s(spec.cp_exchange_bytes_per_row * rows)
        core_s = None
        precision = precision_of(self.precision)
        # fp8: the projections at the fp8 peak, the attention core at the precision's own
        matmul_peak = precision.matmul_peak if spec.fp8_matmuls else precision.peak
        if device.kernels is not None:  # a GPU with fitted fractions: kernels by kind (sim.catalog.kernel_model)
            times = layer_times(spec, rows, device.peak_flops[precision.peak],
                                device.memory_bandwidth_bytes_per_s, device.kernels, collective_s, LAYER_OVERHEAD_S,
                                ring_send_s, projection_peak_flops=device.peak_flops[matmul_peak])
            forward_s, backward_s, core_s = times.forward_s, times.backward_s, times.core_recompute_s
            op_s = times.op_recompute_s
            bytes_s = device.memory_bandwidth_bytes_per_s * device.kernels.memory
        else:  # the roofline; the matmuls wait for the collectives: no overlap
            attention = spec.attention_flops_per_row * rows
            grouped = spec.grouped_matmul_flops_per_row * rows  # expert matmuls, further from peak (kernel_model)
            projections_s = ((spec.flops_per_row * rows - attention - grouped + grouped / GROUPED_MATMUL_RELATIVE)
                             / device.achieved_flops(matmul_peak))
            compute_s = projections_s + attention / flops_s
            extra_s = spec.backward_extra_flops_per_row * rows / flops_s
            moved = spec.traffic_bytes_per_row * rows + spec.fixed_traffic_bytes
            forward_s = max(compute_s, moved / bytes_s) + LAYER_OVERHEAD_S
            backward_s = max(2 * compute_s + extra_s, 2 * moved / bytes_s) + 2 * LAYER_OVERHEAD_S
            forward_s += spec.tp_allreduces_forward * collective_s
            backward_s += spec.tp_allreduces_backward * collective_s
            attention_s = spec.attention_flops_per_row * rows / flops_s
            ring_forward_s, ring_backward_s = ring_exposed_s(spec.cp_steps, ring_send_s, attention_s, 2 * attention_s)
            forward_s += ring_forward_s
            backward_s += ring_backward_s
            elementwise = max(0.0, (spec.traffic_bytes_per_row - spec.matmul_traffic_bytes_per_row) * rows)
            op_s = max(spec.op_recompute_flops_per_row * rows / device.achieved_flops(matmul_peak),
                       elementwise / bytes_s) + LAYER_OVERHEAD_S
        param_bytes = spec.params * precision.weight_bytes  # fp32 weights (the master copy) unless a bf16 model
        grad_bytes = spec.params * FP32_BYTES  # fp32 gradients (a bf16 model's main gradients too)
        optimizer_bytes = (self.optimizer_slots + precision.master_copy) * spec.params * FP32_BYTES
        extra = {}
        if _HAS_OPTIMIZER_S:
            # Elementwise update: read weight, grad and slots, write weight and slots; a bf16 model's trainer
            # also zeroes its fp32 main gradients, reads them for the global norm and copies the master
            # weights to the bf16 ones (read 4, write 2) every step
            megatron = precision.master_copy * (2 * FP32_BYTES + FP32_BYTES + precision.weight_bytes)
            extra["optimizer_s"] = (((3 + 2 * self.optimizer_slots) * FP32_BYTES + megatron) * spec.params
                                    / device.optimizer_bandwidth())
            if self.context_parallel > 1 and self.tp_link is not None:
                # the C devices of a sequence hold the same weights: their gradients are summed after the
                # last backward, before the data-parallel reduction: on the node's link, and across nodes
                # (each member on its own NIC) where the ring spans them
                nodes = self.context_parallel // self.cp_ranks_per_node
                extra["optimizer_s"] += hierarchical_allreduce_s(grad_bytes, self.cp_ranks_per_node, nodes,
                                                                 self.tp_link, self.cp_link or self.tp_link)
        if spec.core_flops_per_row and core_s is not None:
            extra["core_recompute_s"] = core_s
            extra["core_saved_bytes"] = round(spec.core_saved_bytes_per_row * rows)
        elif spec.core_flops_per_row:
            extra["core_recompute_s"] = max(spec.core_flops_per_row * rows / flops_s,
                                            spec.core_traffic_bytes_per_row * rows / bytes_s)
            extra["core_saved_bytes"] = round(spec.core_saved_bytes_per_row * rows)
        saved_bytes = round(spec.saved_bytes_per_row * rows + spec.fixed_saved_bytes)
        if spec.op_checkpointed:  # selective_op: the block keeps its input and the outputs of the ops it saves
            extra["op_recompute_s"] = op_s
            extra["op_dropped_bytes"] = max(0, saved_bytes - round(spec.op_kept_bytes_per_row * rows))
        return LayerCost(
            name=spec.name, forward_s=forward_s, backward_s=backward_s, recompute_s=forward_s,
            saved_bytes=saved_bytes,
            output_bytes=round(spec.output_bytes_per_row * rows),
            input_bytes=round(spec.input_bytes_per_row * rows),
            param_bytes=param_bytes, grad_bytes=grad_bytes,
            optimizer_bytes=optimizer_bytes, saves_input=spec.saves_input, **extra,
        )

    def describe(self) -> dict:
        return {"name": self.name, "options": dict(self.options), "num_layers": self.num_layers,
                "parameter_count": self.parameter_count}


# --- registry ------------------------------------------------------------------------------------
_BUILDERS: dict[str, Callable[[dict[str, Any]], list[LayerSpec]]] = {
    "mlp": mlp_layers, "transformer": transformer_layers, "cnn": cnn_layers,
}


def get_workload(name: str, options: dict[str, Any] | None = None) -> Workload:
    """The built-in model ``name`` with ``options`` over its defaults (``DEFAULT_OPTIONS``).

    Values may be strings (as typed on the command line); they are converted and checked.
    Raises GpipeInputError, one line naming the value and the fix, for anything invalid.
    """
    if name not in BUILTIN_MODELS:
        raise GpipeInputError(f"unknown model {name!r}{did_you_mean(name, BUILTIN_MODELS)}; choose one of "
                              f"{', '.join(BUILTIN_MODELS)}")
    options = dict(options or {})
    moe = check_moe_options(options) if name == "transformer" else {}
    merged = resolve_options(name, {k: v for k, v in options.items() if k not in moe})
    if is_moe(moe):  # priced by sim.workloads.moe.workload.builtin_workload, which callers use
        raise GpipeInputError("the built-in transformer with experts is priced by "
                              "sim.workloads.moe.workload.builtin_workload, not get_workload")
    if name == "uniform":
        return UniformWorkload(num_layers=merged["layers"], optimizer_slots=merged["optimizer_slots"])
    return AnalyticWorkload(name, merged, _BUILDERS[name](merged))
