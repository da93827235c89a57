"""A GPU layer timed kernel by kind: matrix multiplies, attention, memory-bound ops, collectives.

The roofline in :mod:`sim.workloads.models` times a layer as max(FLOPs, bytes) at one achieved fraction of
peak. A GPU runs a layer as a sequence of kernels, each bound by one resource, so this model sums
them, each kind at its own achieved fraction of the device's peak (:class:`KernelEfficiency`)::

    matmul_s      = matmul FLOPs / (peak x matmul) + matmuls x matmul_launch_s
                    (a mixture of experts' grouped expert matmuls at GROUPED_MATMUL_RELATIVE x matmul)
    attention_s   = the attention core's FLOPs / (peak x attention)   (flash; eager and fused
                    attention run it as two batched matrix multiplies, timed as matmul_s)
    memory_s      = (bytes moved - bytes the matrix multiplies move) / (bandwidth x memory)
    optimizer_s   = bytes the optimizer step moves / (bandwidth x optimizer)   (once a step)
    forward_s     = matmul_s + attention_s + memory_s + forward tensor-parallel collectives
    backward_s    = 2 matmul_s + 2 memory_s + attention backward + exposed backward collectives

``matmul_launch_s`` is a fixed cost per matrix-multiply kernel (launch and the last, partly filled
wave), so a small matrix multiply runs further from peak than a large one: its achieved fraction is
matmul x F / (F + peak x matmul x matmul_launch_s) for F FLOPs. The backward's tensor-parallel
collectives (the all-reduce of a column-parallel layer's input gradient, or with sequence
parallelism its reduce-scatter and the all-gather of its input) overlap the weight-gradient matrix
multiplies, as Megatron-LM issues them asynchronously beside those, so only what outlasts them is
exposed; the forward's cannot overlap the matrix multiplies that wait for them, nor can, with
sequence parallelism, the backward's all-gathers of the row-parallel layers' output gradients. Context
parallelism's ring exchange of keys and values runs beside the attention over the blocks already
received (:func:`ring_exposed_s`). Collectives run at
the system's links as :func:`sim.catalog.hardware.get_system` gives them (at their fitted fraction).

The fractions are fitted on published runs of the development set
(``benchmarks/published_runs/dev.json``, ``gpipe fit-gpu``) and kept in ``sim/catalog/gpu_efficiency.json``
per device; a device without a fitted entry keeps the roofline and its assumed efficiency.

Limits: kernels do not overlap one another (no concurrent streams beside the backward collectives);
the fraction of a kind does not depend on shape beyond the launch term (no wave quantisation, no
tile effects); fitted on three configurations of two devices, so a fraction no development row
constrains (flash attention's on the A100, memory-bound ops on the H100) is tied to another and said
so in the file's ``tied`` list.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from sim.errors import GpipeInputError
from sim.formats.timeline import read_devices_file

# Assumption, not fitted: the routed experts' grouped matmuls achieve this fraction of what a dense matmul
# achieves on the same device. MegaBlocks (Gale et al. 2023, "MegaBlocks: Efficient Sparse Training with
# Mixture-of-Experts", MLSys, section 6) measures its block-sparse expert matmuls within a few percent of
# cuBLAS's batched matmuls on large experts; fine-grained experts (a hundred or more of a few thousand wide,
# each with few tokens) lose more to partly filled tiles and per-expert scheduling. 0.8 sits between the two
# until published MoE runs in the development set fit it.
GROUPED_MATMUL_RELATIVE = 0.8
EFFICIENCY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_efficiency.json")
EFFICIENCY_ENV = "GPIPE_GPU_EFFICIENCY"  # names an efficiency file gpipe fit-gpu wrote, read in place of the package's
FRACTIONS = ("matmul", "attention", "memory", "collective", "optimizer")


@dataclass(frozen=True)
class KernelEfficiency:
    """Achieved fractions of a device's peaks by kind of kernel, and where they come from."""

    matmul: float  # large matrix multiplies: fraction of peak FLOP/s
    attention: float  # the flash attention kernel: fraction of peak FLOP/s
    memory: float  # memory-bound kernels (norms, elementwise, softmax): fraction of peak bandwidth
    collective: float  # NCCL collectives and sends: fraction of each link's bandwidth
    # the optimizer step's multi-tensor kernels (update, global norm, zeroing, master copy): fraction
    # of peak bandwidth; they stream hundreds of tensors a step, not one large one as a layer's ops do
    optimizer: float
    matmul_launch_s: float  # fixed seconds per matrix-multiply kernel
    source: str = ""
    tied: tuple[str, ...] = field(default_factory=tuple)  # fractions no development row constrains

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tied"] = list(self.tied)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> "KernelEfficiency":
        try:
            values = {key: float(data[key]) for key in (*FRACTIONS, "matmul_launch_s")}
        except (KeyError, TypeError, ValueError) as exc:
            raise GpipeInputError(f"{where}: each device needs numbers {', '.join(FRACTIONS)} and matmul_launch_s "
                                  f"({exc}); rewrite it with gpipe fit-gpu") from None
        for key in FRACTIONS:
            if not 0 < values[key] <= 1:
                raise GpipeInputError(f"{where}: {key}={values[key]} is not a fraction in (0, 1]; rewrite it with "
                                      "gpipe fit-gpu")
        if values["matmul_launch_s"] < 0:
            raise GpipeInputError(f"{where}: matmul_launch_s={values['matmul_launch_s']} is negative")
        return cls(**values, source=str(data.get("source", "")), tied=tuple(data.get("tied", ())))


def efficiency_file() -> str:
    """The efficiency file the simulator reads: the one ``$GPIPE_GPU_EFFICIENCY`` names (written by
    ``gpipe fit-gpu --out``; one line if it is missing), else the package's."""
    path = os.environ.get(EFFICIENCY_ENV)
    if not path:
        return EFFICIENCY_FILE
    if not os.path.isfile(path):
        raise GpipeInputError(f"{EFFICIENCY_ENV}={path} names no file; give the file gpipe fit-gpu --out wrote, or "
                              f"unset {EFFICIENCY_ENV} for the package's fitted fractions")
    return path


def read_efficiencies(path: str = EFFICIENCY_FILE) -> dict[str, KernelEfficiency]:
    """Fitted fractions per device name from ``path`` (``{"devices": {name: {...}}}``); none if absent."""
    if not os.path.exists(path):
        return {}
    devices = read_devices_file(path, "efficiency file", "rewrite it with gpipe fit-gpu")["devices"]
    return {name: KernelEfficiency.from_dict(entry, f"{path} [{name}]") for name, entry in devices.items()}


@dataclass(frozen=True)
class KernelTimes:
    forward_s: float
    backward_s: float
    core_recompute_s: float  # the attention core rerun by selective recompute
    op_recompute_s: float = 0.0  # what selective_op reruns: its matmuls and every elementwise op of the forward


def layer_times(spec: Any, rows: int, peak_flops: float, bandwidth: float, kernels: KernelEfficiency,
                collective_s: float, overhead_s: float, ring_send_s: float = 0.0,
                projection_peak_flops: float | None = None) -> KernelTimes:
    """One pass of ``spec`` (a :class:`sim.workloads.layer_spec.LayerSpec`) over ``rows`` on a device of
    ``peak_flops`` and peak ``bandwidth``; ``collective_s`` is one tensor-parallel all-reduce of the
    layer's activation (0 without tensor parallelism); ``overhead_s`` the per-pass dispatch;
    ``ring_send_s`` one send of the device's keys and values to its context-parallel neighbour;
    ``projection_peak_flops`` the peak of the matmuls other than the attention core (fp8's), if not
    ``peak_flops``: they run at the same fitted fraction of it, an assumption no published row checks."""
    gemm_rate = peak_flops * kernels.matmul
    projection_rate = (projection_peak_flops or peak_flops) * kernels.matmul
    attention = spec.attention_flops_per_row * rows
    projections = spec.flops_per_row * rows - attention
    flash = spec.backward_extra_flops_per_row > 0  # only the flash kernel recomputes in its backward
    launches = spec.matmuls * kernels.matmul_launch_s
    grouped = getattr(spec, "grouped_matmul_flops_per_row", 0.0) * rows  # a mixture of experts' expert matmuls
    projection_s = (projections - grouped) / projection_rate + grouped / (projection_rate * GROUPED_MATMUL_RELATIVE)
    if flash:
        attention_rate = peak_flops * kernels.attention
        attention_forward_s = attention / attention_rate
        attention_backward_s = (2 * attention + spec.backward_extra_flops_per_row * rows) / attention_rate
    else:
        attention_forward_s = attention / gemm_rate
        attention_backward_s = 2 * attention_forward_s
    memory_bytes = max(0.0, (spec.traffic_bytes_per_row - spec.matmul_traffic_bytes_per_row) * rows)
    memory_s = memory_bytes / (bandwidth * kernels.memory)
    forward_s = projection_s + attention_forward_s + launches + memory_s + overhead_s
    forward_s += spec.tp_allreduces_forward * collective_s
    # beside the weight gradients, except those the next input-gradient matmul waits for
    waited_s = spec.tp_allreduces_backward_waited * collective_s
    exposed_s = waited_s + max(0.0, spec.tp_allreduces_backward * collective_s - waited_s - projection_s)
    backward_s = (2 * projection_s + attention_backward_s + 2 * launches + 2 * memory_s + 2 * overhead_s
                  + exposed_s)
    forward_ring_s, backward_ring_s = ring_exposed_s(spec.cp_steps, ring_send_s, attention_forward_s,
                                                     attention_backward_s)
    forward_s += forward_ring_s
    backward_s += backward_ring_s
    core_s = 0.0
    if spec.core_flops_per_row:
        core_bytes = max(0.0, (spec.core_traffic_bytes_per_row - spec.core_matmul_traffic_bytes_per_row) * rows)
        core_s = (spec.core_flops_per_row * rows / gemm_rate + 2 * kernels.matmul_launch_s
                  + core_bytes / (bandwidth * kernels.memory))
    op_s = 0.0
    if spec.op_checkpointed:
        recomputed = spec.op_recompute_flops_per_row * rows
        op_s = (recomputed / projection_rate + memory_s + overhead_s
                + kernels.matmul_launch_s * spec.matmuls * min(1.0, recomputed / max(projections, 1e-30)))
    return KernelTimes(forward_s, backward_s, core_s, op_s)


def ring_exposed_s(steps: int, send_s: float, attention_forward_s: float,
                   attention_backward_s: float) -> tuple[float, float]:
    """What ring attention's exchange adds to a layer's forward and backward: ``steps`` = C - 1
    sends of a key/value block (backward, the blocks and their gradients: twice the bytes), each
    beside the attention over one block already there (1/C of the attention), the rest exposed."""
    if steps <= 0:
        return 0.0, 0.0
    share = steps / (steps + 1)
    return (max(0.0, steps * send_s - attention_forward_s * share),
            max(0.0, 2 * steps * send_s - attention_backward_s * share))


def achieved_matmul_fraction(kernels: KernelEfficiency, flops: float, peak_flops: float) -> float:
    """What one matrix multiply of ``flops`` achieves of peak under this model (for reports)."""
    if flops <= 0:
        return 0.0
    seconds = flops / (peak_flops * kernels.matmul) + kernels.matmul_launch_s
    return flops / seconds / peak_flops if math.isfinite(seconds) else 0.0
