"""The hardware catalog: accelerators, links, and the systems users name with ``--hardware``.

Every public figure cites its source. Vendor peaks are not what training achieves, so a device keeps
its peak and an achieved efficiency apart: ``efficiency`` (fraction of peak FLOP/s) and
``bandwidth_efficiency`` (fraction of peak memory bandwidth). The defaults below are stated
assumptions, not measurements; ``gpipe calibrate`` fits them on a real machine. The development
set's GPUs (A100 80 GB, H100 SXM) carry fractions fitted on published runs by ``gpipe fit-gpu``
(``sim/catalog/gpu_efficiency.json``, :mod:`sim.catalog.kernel_model`): their layers are timed kernel by kind and
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

from sim.catalog.kernel_model import KernelEfficiency, efficiency_file, read_efficiencies
from sim.errors import GpipeInputError, did_you_mean
from sim.workloads.precision import PRECISIONS

GB = 1e9
GIB = 1 << 30
TERA = 1e12

PEAK_DTYPES = {name: p.peak for name, p in PRECISIONS.items()}  # a precision's name -> the peak it runs at
DEFAULT_EFFICIENCY = 0.5  # assumption: large dense training layers reach roughly half of peak
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8  # assumption: streaming kernels reach roughly 80% of peak


@dataclass(frozen=True)
class Device:
    """One accelerator (or the local CPU). ``peak_flops`` maps a dtype name to dense FLOP/s.

    ``default_precision`` is the precision people train in on this device (:mod:`sim.workloads.precision`),
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
    kernels: KernelEfficiency | None = None  # fitted fractions by kind of kernel (sim.catalog.kernel_model)
    flash_attention: bool = False  # trainers run flash attention here: the transformer's default kernel
    source: str = ""  # where the public figures come from

    def achieved_flops(self, dtype: str) -> float:
        dtype = PEAK_DTYPES.get(dtype, dtype)
        if dtype not in self.peak_flops:
            known = ", ".join(sorted(self.peak_flops))
            raise GpipeInputError(f"device {self.name} has no {dtype} peak; choose one of {known}")
        return self.peak_flops[dtype] * self.efficiency

    def achieved_bandwidth(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.bandwidth_efficiency

    def optimizer_bandwidth(self) -> float:
        """Bytes/s of the optimizer step's kernels: their own fitted fraction on a GPU with fitted
        kernels (sim.catalog.kernel_model), the streaming-kernel fraction elsewhere."""
        fraction = self.kernels.optimizer if self.kernels is not None else self.bandwidth_efficiency
        return self.memory_bandwidth_bytes_per_s * fraction


@dataclass(frozen=True)
class Link:
    """A connection between neighbouring stages: one direction's bandwidth and a fixed latency.

    ``bandwidth_bytes_per_s`` is what one device drives into the link in one direction, which rings
    and collectives use. In a full mesh without a switch (AMD's Infinity Fabric: seven links per GPU,
    one to each peer) one pair of devices has one link only: ``pair_bandwidth_bytes_per_s`` is
    then a point-to-point transfer's bandwidth, while a collective among p devices spreads its rings
    over the p - 1 links between them.
    """

    name: str
    bandwidth_bytes_per_s: float  # per direction; math.inf for a free link
    latency_s: float
    shared: bool = False  # True: all transfers of one node share this link (PCIe through the host)
    pair_bandwidth_bytes_per_s: float | None = None  # one pair's share in a full mesh; None: the whole link
    source: str = ""

    @property
    def point_to_point_bytes_per_s(self) -> float:
        """Bandwidth of one transfer between two devices, per direction."""
        return self.bandwidth_bytes_per_s if self.pair_bandwidth_bytes_per_s is None else self.pair_bandwidth_bytes_per_s

    def collective_bytes_per_s(self, parties: int) -> float:
        """What each of ``parties`` devices drives per direction in a ring collective: the whole link
        behind a switch; in a full mesh, its links to the other parties - 1 devices (RCCL and NCCL
        spread their rings over them), at most the whole link."""
        if self.pair_bandwidth_bytes_per_s is None:
            return self.bandwidth_bytes_per_s
        return min(self.bandwidth_bytes_per_s, max(1, parties - 1) * self.pair_bandwidth_bytes_per_s)

    def transfer_s(self, nbytes: int) -> float:
        if math.isinf(self.point_to_point_bytes_per_s):
            return self.latency_s
        return self.latency_s + nbytes / self.point_to_point_bytes_per_s


@dataclass(frozen=True)
class System:
    """``nodes`` nodes of ``devices_per_node`` identical devices, numbered node by node: device i is
    on node i // devices_per_node (:mod:`sim.engine.placement` says which device runs which stage).

    A "node" is one scale-up domain: 8 GPUs on NVLink or Infinity Fabric, 72 on a GB200 NVL72 rack's
    NVLink switches, a TPU pod on ICI. ``price_per_device_hour`` is one cloud's on-demand list price
    on the date in ``price_source`` (prices move month to month and differ by provider, region and
    commitment: ``gpipe plan --price-per-device-hour`` overrides it)."""

    name: str
    device: Device
    devices_per_node: int
    intra_link: Link
    inter_link: Link
    nodes: int = 1
    description: str = ""
    source: str = ""  # where the node's layout (devices, links, NICs) comes from
    price_per_device_hour: float | None = None  # USD, on-demand; None where no list price was found
    price_source: str = ""  # who lists the price, and when it was seen

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
# Peaks are dense (datasheets' sparse figures halved), per accelerator. Default precisions: bf16 on
# devices with bf16 matrix units (A100 and later, AMD CDNA3, every TPU); fp32 on P100 and V100, which
# have none (fp16 only), and on the CPU, where bf16 matmuls are emulated (70x slower than fp32 on
# this machine's AVX2). fp8 where the datasheet lists fp8 tensor cores (Hopper, Blackwell, CDNA3).
# flash_attention on NVIDIA Ampere and later and on AMD CDNA3 (FlashAttention-2 and PyTorch's SDPA
# flash kernel run there); not on TPUs, whose attention XLA fuses by its own rules.
P100 = Device("P100-PCIe-16GB", {"fp32": 9.3 * TERA, "fp16": 18.7 * TERA}, 16 * GIB, 732 * GB,
              source="NVIDIA Tesla P100 datasheet: 9.3 TFLOP/s fp32, 18.7 fp16, 732 GB/s HBM2")
V100 = Device("V100-SXM2-32GB", {"fp32": 15.7 * TERA, "fp16": 125 * TERA}, 32 * GIB, 900 * GB,
              source="NVIDIA V100 datasheet: 15.7 TFLOP/s fp32, 125 fp16 tensor, 900 GB/s")
_A100_FLOPS = {"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA}
_A100_SOURCE = ("NVIDIA A100 datasheet: 19.5 TFLOP/s fp32, 156 tf32, 312 bf16/fp16 dense; 40 GB at 1,555 GB/s, "
                "80 GB at 2,039 GB/s")
A100_40GB = Device("A100-SXM-40GB", _A100_FLOPS, 40 * GIB, 1555 * GB, default_precision="bf16",
                   flash_attention=True, source=_A100_SOURCE)
A100_80GB = Device("A100-SXM-80GB", _A100_FLOPS, 80 * GIB, 2039 * GB, default_precision="bf16",
                   flash_attention=True, source=_A100_SOURCE)
_H100_SXM_FLOPS = {"fp32": 67 * TERA, "tf32": 494.7 * TERA, "bf16": 989.4 * TERA,
                   "fp16": 989.4 * TERA, "fp8": 1978.9 * TERA}
H100_SXM = Device("H100-SXM-80GB", _H100_SXM_FLOPS, 80 * GIB, 3350 * GB, default_precision="bf16",
                  flash_attention=True,
                  source="NVIDIA H100 datasheet (SXM5): 67 TFLOP/s fp32, 494.7 tf32, 989.4 bf16/fp16, "
                         "1,978.9 fp8 dense; 3.35 TB/s HBM3")
H100_PCIE = Device("H100-PCIe-80GB", {"fp32": 51 * TERA, "tf32": 378 * TERA, "bf16": 756 * TERA,
                                      "fp16": 756 * TERA, "fp8": 1513 * TERA}, 80 * GIB, 2000 * GB,
                   default_precision="bf16", flash_attention=True,
                   source="NVIDIA H100 datasheet (PCIe): 51 TFLOP/s fp32, 378 tf32, 756 bf16/fp16, 1,513 fp8 "
                          "dense; 2 TB/s HBM2e")
H200 = Device("H200-SXM-141GB", _H100_SXM_FLOPS, 141 * GB, 4800 * GB, default_precision="bf16",
              flash_attention=True,
              source="NVIDIA H200 datasheet (SXM): H100 SXM's compute (989 TFLOP/s bf16, 1,979 fp8 dense), "
                     "141 GB HBM3e at 4.8 TB/s")
# Blackwell: NVIDIA's HGX B200 and GB200 NVL72 specification tables, per GPU (sparse halved).
B200 = Device("B200-SXM-180GB", {"fp32": 75 * TERA, "tf32": 1100 * TERA, "bf16": 2250 * TERA,
                                 "fp16": 2250 * TERA, "fp8": 4500 * TERA}, 180 * GB, 7700 * GB,
              default_precision="bf16", flash_attention=True,
              source="NVIDIA HGX B200 specifications, per GPU: 75 TFLOP/s fp32, 1.1 PFLOP/s tf32, 2.25 bf16/fp16, "
                     "4.5 fp8 dense; 180 GB HBM3e at 7.7 TB/s")
GB200_GPU = Device("B200-in-GB200-186GB", {"fp32": 80 * TERA, "tf32": 1250 * TERA, "bf16": 2500 * TERA,
                                           "fp16": 2500 * TERA, "fp8": 5000 * TERA}, 186 * GB, 8000 * GB,
                   default_precision="bf16", flash_attention=True,
                   source="NVIDIA GB200 NVL72 specifications, per GPU: 80 TFLOP/s fp32, 1.25 PFLOP/s tf32, 2.5 "
                          "bf16/fp16, 5 fp8 dense; 186 GB HBM3e at 8 TB/s")
# AMD CDNA3: the Instinct MI300X and MI325X datasheets (same compute die; the MI325X has HBM3e).
_CDNA3_FLOPS = {"fp32": 163.4 * TERA, "tf32": 653.7 * TERA, "bf16": 1307.4 * TERA, "fp16": 1307.4 * TERA,
                "fp8": 2614.9 * TERA}
MI300X = Device("MI300X-192GB", _CDNA3_FLOPS, 192 * GB, 5300 * GB, default_precision="bf16", flash_attention=True,
                source="AMD Instinct MI300X datasheet: 163.4 TFLOP/s fp32, 653.7 tf32, 1,307.4 bf16/fp16, "
                       "2,614.9 fp8 dense; 192 GB HBM3 at 5.3 TB/s")
MI325X = Device("MI325X-256GB", _CDNA3_FLOPS, 256 * GB, 6000 * GB, default_precision="bf16", flash_attention=True,
                source="AMD Instinct MI325X datasheet: MI300X's compute, 256 GB HBM3e at 6 TB/s")
# Google TPUs. fp32 peaks are an assumption: the MXUs multiply bf16, fp32 takes several passes (a
# quarter). v2 and v3 are per core (a chip has two), v4 and later per chip (one megacore).
TPU_V2 = Device("TPUv2-core", {"bf16": 22.5 * TERA, "fp32": 22.5 * TERA / 4}, 8 * GIB, 300 * GB,
                default_precision="bf16",
                source="Jouppi et al., 'A Domain-Specific Supercomputer for Training Deep Neural Networks', CACM "
                       "2020: 45 TFLOP/s bf16, 16 GiB and 600 GB/s per chip of two cores")
TPU_V3 = Device("TPUv3-core", {"bf16": 61.5 * TERA, "fp32": 61.5 * TERA / 4}, 16 * GIB, 450 * GB,
                default_precision="bf16",
                source="Jouppi et al., CACM 2020: 123 TFLOP/s bf16, 32 GiB and 900 GB/s per chip of two cores; "
                       "16 GB per core as in the GPipe paper (Huang et al. 2019, section 3)")
TPU_V4 = Device("TPUv4", {"bf16": 275 * TERA, "fp32": 275 * TERA / 4}, 32 * GIB, 1200 * GB,
                default_precision="bf16",
                source="Jouppi et al., 'TPU v4: An Optically Reconfigurable Supercomputer', ISCA 2023: 275 "
                       "TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s")
TPU_V5E = Device("TPUv5e", {"bf16": 197 * TERA, "fp32": 197 * TERA / 4}, 16 * GB, 819 * GB,
                 default_precision="bf16",
                 source="Google Cloud TPU documentation, TPU v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s per chip")
TPU_V5P = Device("TPUv5p", {"bf16": 459 * TERA, "fp32": 459 * TERA / 4}, 95 * GB, 2765 * GB,
                 default_precision="bf16",
                 source="Google Cloud TPU documentation, TPU v5p: 459 TFLOP/s bf16, 95 GB HBM2e at 2,765 GB/s per "
                        "chip")
TPU_V6E = Device("TPUv6e", {"bf16": 918 * TERA, "fp32": 918 * TERA / 4}, 32 * GB, 1640 * GB,
                 default_precision="bf16",
                 source="Google Cloud TPU documentation, TPU v6e (Trillium): 918 TFLOP/s bf16, 32 GB HBM at 1,640 "
                        "GB/s per chip")


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


_FITTED = read_efficiencies(efficiency_file())
_UNFITTED = {device.name: device for device in (A100_80GB, H100_SXM)}
A100_80GB, H100_SXM = _fitted(A100_80GB, _FITTED), _fitted(H100_SXM, _FITTED)

# The local CPU: a nominal x86 core with AVX2 (2 FMA units x 8 fp32 lanes x 2 FLOP = 32 FLOP/cycle)
# at 3 GHz, 20 GB/s of DRAM bandwidth. Nominal only: gpipe calibrate measures this machine instead.
LOCAL_CPU = Device("local-CPU", {"fp32": 96e9 * (os.cpu_count() or 1)}, _local_memory_bytes(), 20 * GB,
                   source="nominal: AVX2 at 3 GHz, 20 GB/s; gpipe calibrate measures this machine")

# The ideal device: unlimited memory; its FLOP/s only matter for analytic models. fp32 by default,
# like the executor: it stands for no hardware in particular.
IDEAL_DEVICE = Device("ideal", {"fp32": 100 * TERA, "bf16": 100 * TERA, "fp16": 100 * TERA},
                      math.inf, 10_000 * GB, efficiency=1.0, bandwidth_efficiency=1.0,
                      source="no hardware: a bound")

# --- Links (bandwidth per direction; latencies are typical end-to-end figures, an assumption) ----
FREE_LINK = Link("free", math.inf, 0.0)
NVLINK1 = Link("NVLink1", 80 * GB, 5e-6, source="NVIDIA Pascal architecture whitepaper: 4 links x 20 GB/s per direction")
NVLINK2 = Link("NVLink2", 150 * GB, 5e-6, source="NVIDIA V100 datasheet: 300 GB/s total, 150 per direction")
NVLINK3 = Link("NVLink3", 300 * GB, 5e-6, source="NVIDIA A100 datasheet: 600 GB/s total, 300 per direction")
NVLINK4 = Link("NVLink4", 450 * GB, 5e-6, source="NVIDIA H100 datasheet: 900 GB/s total, 450 per direction")
NVLINK5 = Link("NVLink5", 900 * GB, 5e-6,
               source="NVIDIA HGX B200 and GB200 NVL72 specifications: 1.8 TB/s per GPU total, 900 GB/s per direction")
# AMD Infinity Fabric on an 8-GPU MI300X/MI325X platform: a full mesh, 7 links per GPU at 64 GB/s per
# direction each (128 GB/s bidirectional), 448 GB/s per direction in all; one pair has one link.
INFINITY_FABRIC = Link("InfinityFabric", 7 * 64 * GB, 5e-6, pair_bandwidth_bytes_per_s=64 * GB,
                       source="AMD Instinct MI300X platform datasheet: 7 x 128 GB/s Infinity Fabric links per GPU, "
                              "fully connected")
_PCIE_SOURCE = "PCI-SIG specifications, x16 per direction with 128b/130b encoding"
PCIE3 = Link("PCIe3-x16 (through host)", 15.75 * GB, 10e-6, shared=True, source=_PCIE_SOURCE)
PCIE4 = Link("PCIe4-x16 (through host)", 31.5 * GB, 10e-6, shared=True, source=_PCIE_SOURCE)
PCIE5 = Link("PCIe5-x16 (through host)", 63 * GB, 10e-6, shared=True, source=_PCIE_SOURCE)
# TPU inter-chip interconnect, per link and direction: a chip's ICI figure over its links (v5e and v6e
# on a 2-D torus, 4 links; v5p and v4 on a 3-D torus, 6 links). Latency assumed.
ICI_V3 = Link("ICI-v3", 82 * GB, 5e-6, source="Jouppi et al., CACM 2020: 656 Gbit/s per link")
ICI_V4 = Link("ICI-v4", 50 * GB, 5e-6, source="Jouppi et al., ISCA 2023: 50 GB/s per link per direction")
ICI_V5E = Link("ICI-v5e", 50 * GB, 5e-6, source="Google Cloud TPU documentation, TPU v5e: 1,600 Gbit/s ICI per chip over 4 links")
ICI_V5P = Link("ICI-v5p", 100 * GB, 5e-6, source="Google Cloud TPU documentation, TPU v5p: 4,800 Gbit/s ICI per chip over 6 links")
ICI_V6E = Link("ICI-v6e", 112 * GB, 5e-6, source="Google Cloud TPU documentation, TPU v6e: 3,584 Gbit/s ICI per chip over 4 links")
# Between nodes, one NIC per accelerator (DGX-style): HDR 200 Gbit/s = 25 GB/s, NDR 400 Gbit/s = 50 GB/s
# per port and direction. Latency with NCCL assumed ~ 10 us.
IB_HDR = Link("InfiniBand-HDR", 25 * GB, 10e-6, source="NVIDIA ConnectX-6 product brief: HDR 200 Gbit/s per port")
IB_NDR = Link("InfiniBand-NDR", 50 * GB, 10e-6, source="NVIDIA ConnectX-7 product brief: NDR 400 Gbit/s per port")
# Processes on one host exchanging tensors through gloo over loopback TCP: nominal, calibrated later.
LOOPBACK = Link("loopback-gloo", 2 * GB, 50e-6, source="nominal; gpipe calibrate measures it")

# On-demand list prices, USD per device-hour, each with who lists it and when it was seen. Cloud prices
# differ by provider, region and commitment and change month to month: a date and a provider, not a
# market. Systems with none (GB200 NVL72 racks, TPUs, P100, V100) are priced with --price-per-device-hour.
_CLIFF = "cliffcenter.com's AMD inference economics note, 2026-05-18"
_TECHBYTES = "techbytes.app's GPU cloud pricing matrix, verified 2026-05-07"
_PACKET = "packet.ai's GPU pricing page, June 2026"
_DGX = "one NIC per GPU as in NVIDIA's DGX systems"

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in [
        System("ideal", IDEAL_DEVICE, 1 << 20, FREE_LINK, FREE_LINK,
               description="infinitely fast links, unlimited memory", source="no hardware: a bound"),
        # one stage per core: more stages than cores would time-share cores, which is not modelled
        System("cpu", LOCAL_CPU, os.cpu_count() or 1, LOOPBACK, Link("tcp-10GbE", 1.25 * GB, 100e-6),
               description="processes on this machine's CPU over gloo, one per core (nominal until calibrated)",
               source="this machine: os.cpu_count() and its memory; figures nominal"),
        System("p100-pcie", P100, 8, PCIE3, IB_HDR, description="8 x P100 over PCIe gen3 through the host",
               source="a PCIe server of the P100's time, with HDR between nodes (assumed)"),
        System("v100-nvlink", V100, 8, NVLINK2, IB_HDR, description="8 x V100 SXM2 with NVLink 2",
               source="NVIDIA DGX-1 with V100 (8 GPUs on NVLink 2); HDR between nodes (assumed)"),
        System("a100-nvlink", A100_80GB, 8, NVLINK3, IB_HDR, description="8 x A100 80GB SXM with NVLink 3",
               source=f"NVIDIA DGX A100 datasheet: 8 GPUs, 8 x HDR 200 Gbit/s, {_DGX}",
               price_per_device_hour=2.50, price_source=f"Modal, on demand; {_TECHBYTES}"),
        System("a100-40gb-nvlink", A100_40GB, 8, NVLINK3, IB_HDR, description="8 x A100 40GB SXM with NVLink 3",
               source=f"NVIDIA DGX A100 datasheet: 8 GPUs, 8 x HDR 200 Gbit/s, {_DGX}",
               price_per_device_hour=1.48, price_source=f"Lambda, on demand; {_TECHBYTES}"),
        System("h100-nvlink", H100_SXM, 8, NVLINK4, IB_NDR, description="8 x H100 SXM with NVLink 4",
               source=f"NVIDIA DGX H100 datasheet: 8 GPUs, 8 x NDR 400 Gbit/s, {_DGX}",
               price_per_device_hour=2.99, price_source=f"Lambda, on demand; {_CLIFF}"),
        System("h100-pcie", H100_PCIE, 8, PCIE5, IB_NDR, description="8 x H100 PCIe gen5 through the host",
               source="an 8-GPU PCIe gen5 server with one NDR NIC per GPU (assumed)",
               price_per_device_hour=2.86, price_source=f"Lambda, on demand; {_TECHBYTES}"),
        System("h200-nvlink", H200, 8, NVLINK4, IB_NDR, description="8 x H200 SXM with NVLink 4",
               source=f"NVIDIA DGX H200 datasheet: 8 GPUs, 8 x NDR 400 Gbit/s, {_DGX}",
               price_per_device_hour=2.25, price_source=f"on demand; {_PACKET}"),
        System("b200-nvlink", B200, 8, NVLINK5, IB_NDR, description="8 x B200 with NVLink 5",
               source=f"NVIDIA DGX B200 datasheet: 8 GPUs, 8 x 400 Gbit/s ConnectX-7, {_DGX}",
               price_per_device_hour=3.75, price_source=f"on demand; {_PACKET}"),
        System("gb200-nvl72", GB200_GPU, 72, NVLINK5, IB_NDR,
               description="GB200 NVL72 racks: 72 Blackwell GPUs in one NVLink 5 domain",
               source="NVIDIA GB200 NVL72 specifications: 72 GPUs on NVLink switches, one 400 Gbit/s NIC per GPU"),
        System("mi300x", MI300X, 8, INFINITY_FABRIC, IB_NDR, description="8 x MI300X on Infinity Fabric",
               source="AMD Instinct MI300X platform: 8 GPUs fully connected, 8 x 400 Gbit/s NICs per node",
               price_per_device_hour=1.85, price_source=f"Vultr, on demand; {_CLIFF}"),
        System("mi325x", MI325X, 8, INFINITY_FABRIC, IB_NDR, description="8 x MI325X on Infinity Fabric",
               source="AMD Instinct MI325X platform: 8 GPUs fully connected, 8 x 400 Gbit/s NICs per node",
               price_per_device_hour=1.95, price_source=f"TensorWave, on demand; {_CLIFF}"),
        System("tpu-v2", TPU_V2, 512, ICI_V3, ICI_V3, description="TPUv2 cores over ICI, 8 GB per core",
               source="a TPU v2 pod: 256 chips, 512 cores (Jouppi et al., CACM 2020)"),
        System("tpu-v3", TPU_V3, 2048, ICI_V3, ICI_V3, description="TPUv3 cores over ICI, 16 GB per core",
               source="a TPU v3 pod: 1,024 chips, 2,048 cores (Jouppi et al., CACM 2020)"),
        System("tpu-v4", TPU_V4, 4096, ICI_V4, ICI_V4, description="TPUv4 chips over ICI",
               source="a TPU v4 pod: 4,096 chips (Jouppi et al., ISCA 2023)"),
        System("tpu-v5e", TPU_V5E, 256, ICI_V5E, ICI_V5E, description="TPU v5e chips over ICI, a 256-chip pod",
               source="Google Cloud TPU documentation: a v5e pod has 256 chips"),
        System("tpu-v5p", TPU_V5P, 8960, ICI_V5P, ICI_V5P, description="TPU v5p chips over ICI, an 8,960-chip pod",
               source="Google Cloud TPU documentation: a v5p pod has 8,960 chips"),
        System("tpu-v6e", TPU_V6E, 256, ICI_V6E, ICI_V6E, description="TPU v6e (Trillium) chips over ICI, a 256-chip pod",
               source="Google Cloud TPU documentation: a v6e pod has 256 chips"),
    ]
}


def get_system(name: str, nodes: int = 1, kernels: KernelEfficiency | None = None, fitted: bool = True) -> System:
    """The catalog system ``name`` joined ``nodes`` times over its inter-node link; ``kernels``
    replaces its device's fitted fractions (what ``gpipe fit-gpu`` tries), and ``fitted=False``
    drops them: the roofline at the catalog's assumed efficiency, links at their peak."""
    if name not in SYSTEMS:
        raise GpipeInputError(f"unknown hardware {name!r}{did_you_mean(name, SYSTEMS)}; choose one of "
                              f"{', '.join(SYSTEMS)}")
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
        pair = link.pair_bandwidth_bytes_per_s
        return replace(link, name=f"{link.name} at {kernels.collective:.0%}",
                       bandwidth_bytes_per_s=link.bandwidth_bytes_per_s * kernels.collective,
                       pair_bandwidth_bytes_per_s=None if pair is None else pair * kernels.collective)

    return replace(system, intra_link=achieved(system.intra_link), inter_link=achieved(system.inter_link))
