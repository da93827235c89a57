"""The hardware catalog: accelerators, links, and the systems users name with ``--hardware``.

Every public figure cites its source. Vendor peaks are not what training achieves, so a device keeps
its peak and an achieved efficiency apart: ``efficiency`` (fraction of peak FLOP/s) and
``bandwidth_efficiency`` (fraction of peak memory bandwidth). The defaults below are stated
assumptions, not measurements; ``gpipe calibrate`` fits them on a real machine. The development
set's GPUs (A100 80 GB, H100 SXM) carry fractions fitted on published runs by ``gpipe fit-gpu``
(``sim/gpu_efficiency.json``, :mod:`sim.kernel_model`): their layers are timed kernel by kind and
their links run at the fitted collective fraction; every other device keeps the assumed figures.

Limits of the model: one device per stage; a link is characterised by latency plus bytes over a
per-direction bandwidth (no congestion control, no protocol overheads beyond that); PCIe traffic
between devices of one node goes through the host and shares one channel per direction, so
concurrent transfers queue; NVLink, ICI and InfiniBand links between neighbours are dedicated.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from sim.errors import GpipeInputError
from sim.kernel_model import KernelEfficiency, read_efficiencies
from sim.precision import PRECISIONS

GB = 1e9
GIB = 1 << 30
TERA = 1e12

PEAK_DTYPES = {name: p.peak for name, p in PRECISIONS.items()}  # a precision's name -> the peak it runs at
DEFAULT_EFFICIENCY = 0.5  # assumption: large dense training layers reach roughly half of peak
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8  # assumption: streaming kernels reach roughly 80% of peak


@dataclass(frozen=True)
class Device:
    """One accelerator (or the local CPU). ``peak_flops`` maps a dtype name to dense FLOP/s.

    ``default_precision`` is the precision people train in on this device (:mod:`sim.precision`),
    the what-if default: ``bf16`` where the device has bf16 matrix units, ``fp32`` elsewhere.
    ``flash_attention`` marks the GPUs FlashAttention-2 and PyTorch's flash kernel run on (Ampere and
    later), where the built-in transformer's attention defaults to ``flash``.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float  # math.inf for "unlimited"
    memory_bandwidth_bytes_per_s: float
    efficiency: float = DEFAULT_EFFICIENCY
    bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY
    default_precision: str = "fp32"
    kernels: KernelEfficiency | None = None  # fitted fractions by kind of kernel (sim.kernel_model)
    flash_attention: bool = False  # trainers run flash attention here: the transformer's default kernel

    def achieved_flops(self, dtype: str) -> float:
        dtype = PEAK_DTYPES.get(dtype, dtype)
        if dtype not in self.peak_flops:
            known = ", ".join(sorted(self.peak_flops))
            raise GpipeInputError(f"device {self.name} has no {dtype} peak; choose one of {known}")
        return self.peak_flops[dtype] * self.efficiency

    def achieved_bandwidth(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.bandwidth_efficiency


@dataclass(frozen=True)
class Link:
    """A connection between neighbouring stages: one direction's bandwidth and a fixed latency."""

    name: str
    bandwidth_bytes_per_s: float  # per direction; math.inf for a free link
    latency_s: float
    shared: bool = False  # True: all transfers of one node share this link (PCIe through the host)

    def transfer_s(self, nbytes: int) -> float:
        if math.isinf(self.bandwidth_bytes_per_s):
            return self.latency_s
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class System:
    """``nodes`` nodes of ``devices_per_node`` identical devices, numbered node by node: device i is
    on node i // devices_per_node (:mod:`sim.placement` says which device runs which stage)."""

    name: str
    device: Device
    devices_per_node: int
    intra_link: Link
    inter_link: Link
    nodes: int = 1
    description: str = ""

    @property
    def total_devices(self) -> int:
        return self.devices_per_node * self.nodes

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def link_between(self, device: int, other: int | None = None) -> Link:
        """The link between ``device`` and ``other`` (default ``device + 1``): intra-node inside a
        node, else inter-node."""
        other = device + 1 if other is None else other
        return self.intra_link if self.node_of(device) == self.node_of(other) else self.inter_link

    def check_fits(self, stages: int, replicas: int = 1, tensor_parallel: int = 1) -> None:
        """T devices per stage of each replica: D x K x T devices at most."""
        needed = stages * replicas * tensor_parallel
        if needed <= self.total_devices:
            return
        what = f"{stages} stages" if replicas == 1 else f"{replicas} replicas x {stages} stages"
        fewer = "fewer stages" if replicas == 1 else "fewer replicas or stages"
        if tensor_parallel > 1:
            what += f" x {tensor_parallel} tensor-parallel devices"
            fewer += " or a smaller --tensor-parallel"
        raise GpipeInputError(
            f"{what} need {needed} devices but {self.name} with {self.nodes} node(s) has "
            f"{self.total_devices}; use --nodes {math.ceil(needed / self.devices_per_node)} or {fewer}"
        )


# --- Devices -----------------------------------------------------------------------------------
# Default precisions: bf16 on devices with bf16 matrix units (A100 and later, every TPU: their
# datasheets and papers below list bf16 peaks); fp32 on P100 and V100, which have none (fp16 only),
# and on the CPU, where bf16 matmuls are emulated (70x slower than fp32 on this machine's AVX2).
# NVIDIA P100 PCIe 16 GB: 9.3 TFLOP/s fp32, 18.7 fp16, 732 GB/s HBM2 (NVIDIA Tesla P100 datasheet).
P100 = Device("P100-PCIe-16GB", {"fp32": 9.3 * TERA, "fp16": 18.7 * TERA}, 16 * GIB, 732 * GB)
# NVIDIA V100 SXM2 32 GB: 15.7 TFLOP/s fp32, 125 fp16 tensor, 900 GB/s (NVIDIA V100 datasheet).
V100 = Device("V100-SXM2-32GB", {"fp32": 15.7 * TERA, "fp16": 125 * TERA}, 32 * GIB, 900 * GB)
# NVIDIA A100 SXM: 19.5 TFLOP/s fp32, 156 tf32, 312 bf16/fp16 dense; 40 GB at 1,555 GB/s,
# 80 GB at 2,039 GB/s (NVIDIA A100 datasheet).
_A100_FLOPS = {"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA}
A100_40GB = Device("A100-SXM-40GB", _A100_FLOPS, 40 * GIB, 1555 * GB, default_precision="bf16",
                    flash_attention=True)
A100_80GB = Device("A100-SXM-80GB", _A100_FLOPS, 80 * GIB, 2039 * GB, default_precision="bf16",
                    flash_attention=True)
# NVIDIA H100 SXM5 80 GB: 67 TFLOP/s fp32, 494.7 tf32, 989.4 bf16/fp16 dense, 1,978.9 fp8 dense;
# 3.35 TB/s HBM3 (NVIDIA H100 datasheet; sparse figures halved to dense).
_H100_SXM_FLOPS = {"fp32": 67 * TERA, "tf32": 494.7 * TERA, "bf16": 989.4 * TERA,
                   "fp16": 989.4 * TERA, "fp8": 1978.9 * TERA}
H100_SXM = Device("H100-SXM-80GB", _H100_SXM_FLOPS, 80 * GIB, 3350 * GB, default_precision="bf16",
                   flash_attention=True)
# NVIDIA H100 PCIe 80 GB: 51 TFLOP/s fp32, 756 bf16 dense, 2 TB/s HBM2e (NVIDIA H100 datasheet).
H100_PCIE = Device("H100-PCIe-80GB", {"fp32": 51 * TERA, "tf32": 378 * TERA, "bf16": 756 * TERA,
                                      "fp16": 756 * TERA}, 80 * GIB, 2000 * GB, default_precision="bf16",
                   flash_attention=True)
# NVIDIA H200 SXM 141 GB: H100 SXM compute, 4.8 TB/s HBM3e (NVIDIA H200 datasheet).
H200 = Device("H200-SXM-141GB", _H100_SXM_FLOPS, 141 * GB, 4800 * GB, default_precision="bf16",
               flash_attention=True)
# Google TPU v2, per core (a chip has two): 45 TFLOP/s bf16, 16 GiB HBM and 600 GB/s per chip
# (Jouppi et al., "A Domain-Specific Supercomputer for Training Deep Neural Networks", CACM 2020).
# TPU fp32 peaks are an assumption: the MXUs multiply bf16, fp32 takes several passes (a quarter).
TPU_V2 = Device("TPUv2-core", {"bf16": 22.5 * TERA, "fp32": 22.5 * TERA / 4}, 8 * GIB, 300 * GB,
                default_precision="bf16")
# Google TPU v3, per core: 123 TFLOP/s bf16, 32 GiB HBM and 900 GB/s per chip of two cores (same
# source); 16 GB per core as in the GPipe paper (Huang et al. 2019, section 3).
TPU_V3 = Device("TPUv3-core", {"bf16": 61.5 * TERA, "fp32": 61.5 * TERA / 4}, 16 * GIB, 450 * GB,
                default_precision="bf16")
# Google TPU v4 chip (one megacore): 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s
# (Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer", ISCA 2023).
TPU_V4 = Device("TPUv4", {"bf16": 275 * TERA, "fp32": 275 * TERA / 4}, 32 * GIB, 1200 * GB,
                default_precision="bf16")


def _local_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GIB




def _fitted(device: Device, fitted: dict[str, KernelEfficiency]) -> Device:
    """``device`` with its fitted fractions (``gpipe fit-gpu``), if the efficiency file has them: the
    roofline's efficiencies become the fitted matmul and memory fractions, for models the kernel model
    does not split (measured and meta workloads)."""
    kernels = fitted.get(device.name)
    if kernels is None:
        return device
    return replace(device, kernels=kernels, efficiency=kernels.matmul, bandwidth_efficiency=kernels.memory)


_FITTED = read_efficiencies()
_UNFITTED = {device.name: device for device in (A100_80GB, H100_SXM)}
A100_80GB, H100_SXM = _fitted(A100_80GB, _FITTED), _fitted(H100_SXM, _FITTED)

# The local CPU: a nominal x86 core with AVX2 (2 FMA units x 8 fp32 lanes x 2 FLOP = 32 FLOP/cycle)
# at 3 GHz, 20 GB/s of DRAM bandwidth. Nominal only: gpipe calibrate measures this machine instead.
LOCAL_CPU = Device("local-CPU", {"fp32": 96e9 * (os.cpu_count() or 1)}, _local_memory_bytes(), 20 * GB)

# The ideal device: unlimited memory; its FLOP/s only matter for analytic models. fp32 by default,
# like the executor: it stands for no hardware in particular.
IDEAL_DEVICE = Device("ideal", {"fp32": 100 * TERA, "bf16": 100 * TERA, "fp16": 100 * TERA},
                      math.inf, 10_000 * GB, efficiency=1.0, bandwidth_efficiency=1.0)

# --- Links (bandwidth per direction; latencies are typical end-to-end figures, an assumption) ----
FREE_LINK = Link("free", math.inf, 0.0)
# NVLink 1.0 (P100): 4 links x 20 GB/s per direction (NVIDIA Pascal architecture whitepaper).
NVLINK1 = Link("NVLink1", 80 * GB, 5e-6)
# NVLink 2.0 (V100): 300 GB/s total bidirectional, 150 per direction (NVIDIA V100 datasheet).
NVLINK2 = Link("NVLink2", 150 * GB, 5e-6)
# NVLink 3.0 (A100): 600 GB/s total, 300 per direction (NVIDIA A100 datasheet).
NVLINK3 = Link("NVLink3", 300 * GB, 5e-6)
# NVLink 4.0 (H100 SXM): 900 GB/s total, 450 per direction (NVIDIA H100 datasheet).
NVLINK4 = Link("NVLink4", 450 * GB, 5e-6)
# PCIe x16 per direction: gen3 15.75 GB/s, gen4 31.5, gen5 63 (PCI-SIG specifications, 128b/130b).
PCIE3 = Link("PCIe3-x16 (through host)", 15.75 * GB, 10e-6, shared=True)
PCIE4 = Link("PCIe4-x16 (through host)", 31.5 * GB, 10e-6, shared=True)
PCIE5 = Link("PCIe5-x16 (through host)", 63 * GB, 10e-6, shared=True)
# TPU inter-core interconnect. v3: 656 Gbit/s per link (CACM 2020, as above) ~ 82 GB/s;
# v4: 50 GB/s per link per direction (ISCA 2023, as above). Latency assumed.
ICI_V3 = Link("ICI-v3", 82 * GB, 5e-6)
ICI_V4 = Link("ICI-v4", 50 * GB, 5e-6)
# InfiniBand between nodes, per port and direction: HDR 200 Gbit/s = 25 GB/s, NDR 400 Gbit/s =
# 50 GB/s (NVIDIA ConnectX-6/-7 product briefs). Latency with NCCL assumed ~ 10 us.
IB_HDR = Link("InfiniBand-HDR", 25 * GB, 10e-6)
IB_NDR = Link("InfiniBand-NDR", 50 * GB, 10e-6)
# Processes on one host exchanging tensors through gloo over loopback TCP: nominal, calibrated later.
LOOPBACK = Link("loopback-gloo", 2 * GB, 50e-6)

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in [
        System("ideal", IDEAL_DEVICE, 1 << 20, FREE_LINK, FREE_LINK,
               description="infinitely fast links, unlimited memory"),
        # one stage per core: more stages than cores would time-share cores, which is not modelled
        System("cpu", LOCAL_CPU, os.cpu_count() or 1, LOOPBACK, Link("tcp-10GbE", 1.25 * GB, 100e-6),
               description="processes on this machine's CPU over gloo, one per core (nominal until calibrated)"),
        System("p100-pcie", P100, 8, PCIE3, IB_HDR, description="8 x P100 over PCIe gen3 through the host"),
        System("v100-nvlink", V100, 8, NVLINK2, IB_HDR, description="8 x V100 SXM2 with NVLink 2"),
        System("a100-nvlink", A100_80GB, 8, NVLINK3, IB_HDR, description="8 x A100 80GB SXM with NVLink 3"),
        System("a100-40gb-nvlink", A100_40GB, 8, NVLINK3, IB_HDR, description="8 x A100 40GB SXM with NVLink 3"),
        System("h100-nvlink", H100_SXM, 8, NVLINK4, IB_NDR, description="8 x H100 SXM with NVLink 4"),
        System("h100-pcie", H100_PCIE, 8, PCIE5, IB_NDR, description="8 x H100 PCIe gen5 through the host"),
        System("h200-nvlink", H200, 8, NVLINK4, IB_NDR, description="8 x H200 SXM with NVLink 4"),
        System("tpu-v2", TPU_V2, 512, ICI_V3, ICI_V3, description="TPUv2 cores over ICI, 8 GB per core"),
        System("tpu-v3", TPU_V3, 2048, ICI_V3, ICI_V3, description="TPUv3 cores over ICI, 16 GB per core"),
        System("tpu-v4", TPU_V4, 4096, ICI_V4, ICI_V4, description="TPUv4 chips over ICI"),
    ]
}


def get_system(name: str, nodes: int = 1, kernels: KernelEfficiency | None = None, fitted: bool = True) -> System:
    """The catalog system ``name`` joined ``nodes`` times over its inter-node link; ``kernels``
    replaces its device's fitted fractions (what ``gpipe fit-gpu`` tries), and ``fitted=False``
    drops them: the roofline at the catalog's assumed efficiency, links at their peak."""
    if name not in SYSTEMS:
        raise GpipeInputError(f"unknown hardware {name!r}; choose one of {', '.join(SYSTEMS)}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes <= 0:
        raise GpipeInputError(f"nodes must be a positive integer, got {nodes!r}; use --nodes 1 or more")
    system = SYSTEMS[name]
    if not fitted:
        return replace(system, device=_UNFITTED.get(system.device.name, system.device), nodes=nodes)
    if kernels is not None:
        system = replace(system, device=_fitted(replace(system.device, kernels=None), {system.device.name: kernels}))
    return replace(achieved_links(system), nodes=nodes)


def achieved_links(system: System) -> System:
    """``system`` with its links at the fitted collective fraction of their bandwidth, where its
    device has fitted fractions (NCCL's collectives and sends do not reach a link's peak)."""
    kernels = system.device.kernels
    if kernels is None:
        return system

    def achieved(link: Link) -> Link:
        return replace(link, name=f"{link.name} at {kernels.collective:.0%}",
                       bandwidth_bytes_per_s=link.bandwidth_bytes_per_s * kernels.collective)

    return replace(system, intra_link=achieved(system.intra_link), inter_link=achieved(system.inter_link))
