"""The hardware catalog: accelerators, links, and the systems users name with ``--hardware``.

The catalog is data: one JSON file per system in ``sim/catalog/systems/`` (their schema, also the
schema of a user's own file: :mod:`sim.catalog.system_schema`) and the links they name in
``sim/catalog/links.json``; this module holds the types and reads the files. Only ``ideal`` (a
bound) and ``cpu`` (this machine, counted when imported) are built here.

How the files are written: every public figure cites its source. Peaks are dense, per accelerator
(datasheets' sparse figures halved); fp8 where the datasheet lists fp8 tensor cores (Hopper,
Blackwell, CDNA3); TPU v2 and v3 per core, later TPUs per chip, their fp32 peaks assumed (a
quarter of bf16). ``default_precision`` is bf16 where the device has bf16 matrix units (A100 and
later, CDNA3, every TPU), fp32 on P100 and V100 (fp16 only). ``flash_attention`` on NVIDIA Ampere
and later and AMD CDNA3, where FlashAttention-2 and PyTorch's flash kernel run; not on TPUs, whose
attention XLA fuses by its own rules. Link latencies are typical end-to-end figures, an assumption.
A price is one cloud's on-demand list price with who lists it and when it was seen; a system with
none is priced with ``--price-per-device-hour``.

Vendor peaks are not what training achieves, so a device keeps its peak and an achieved efficiency
apart: ``efficiency`` (fraction of peak FLOP/s) and ``bandwidth_efficiency`` (fraction of peak
memory bandwidth). The defaults below are stated assumptions, not measurements; ``gpipe
calibrate`` fits them on a real machine. The development set's GPUs (A100 80 GB, H100 SXM) carry
fractions fitted on published runs by ``gpipe fit-gpu`` (``sim/catalog/gpu_efficiency.json``,
:mod:`sim.catalog.kernel_model`): their layers are timed kernel by kind and their links run at the
fitted collective fraction; every other device keeps the assumed figures.

Limits of the model: one device per stage; a link is characterised by latency plus bytes over a
per-direction bandwidth (no congestion control, no protocol overheads beyond that); PCIe traffic
between devices of one node goes through the host and shares one channel per direction, so
concurrent transfers queue; NVLink, ICI and InfiniBand links between neighbours are dedicated.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any

from sim.catalog.kernel_model import KernelEfficiency, efficiency_file, read_efficiencies
from sim.catalog.system_schema import GB, GIB, TERA, link_fields, system_fields
from sim.errors import GpipeInputError, did_you_mean
from sim.workloads.precision import PRECISIONS

CATALOG_DIR = os.path.dirname(os.path.abspath(__file__))
SYSTEMS_DIR = os.path.join(CATALOG_DIR, "systems")  # one JSON file per system (sim.catalog.system_schema)
LINKS_FILE = os.path.join(CATALOG_DIR, "links.json")

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
    # a fitted device of the same silicon whose kernel fractions price this one where it has none of its own
    # (the H200: the H100's compute with more and faster memory); None: its own name's
    kernels_of: str | None = None

    @property
    def fitted_as(self) -> str:
        """The name its fitted kernel fractions are kept under: its own, else the device it borrows them from."""
        return self.name if self.kernels_of is None or self.name in _FITTED else self.kernels_of

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
    # nodes one device of this system spans: 1, except in the pipeline's view of T x C groups that fill
    # whole nodes (sim.workloads.tensor_parallel.tensor_parallel_system), where each group is one device
    nodes_per_device: int = 1

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


def _local_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


# --- The two systems that are no hardware one buys: built here, not read from a file ----------
# The local CPU: a nominal x86 core with AVX2 (2 FMA units x 8 fp32 lanes x 2 FLOP = 32 FLOP/cycle)
# at 3 GHz, 20 GB/s of DRAM bandwidth. Nominal only: gpipe calibrate measures this machine instead.
# fp32 by default: bf16 matmuls are emulated on AVX2, far slower than fp32.
LOCAL_CPU = Device("local-CPU", {"fp32": 96e9 * (os.cpu_count() or 1)}, _local_memory_bytes(), 20 * GB,
                   source="nominal: AVX2 at 3 GHz, 20 GB/s; gpipe calibrate measures this machine")
# The ideal device: unlimited memory; its FLOP/s only matter for analytic models. fp32 by default,
# like the executor: it stands for no hardware in particular.
IDEAL_DEVICE = Device("ideal", {"fp32": 100 * TERA, "bf16": 100 * TERA, "fp16": 100 * TERA},
                      math.inf, 10_000 * GB, efficiency=1.0, bandwidth_efficiency=1.0,
                      source="no hardware: a bound")
FREE_LINK = Link("free", math.inf, 0.0)
# Processes on one host exchanging tensors through gloo over loopback TCP: nominal, calibrated later.
LOOPBACK = Link("loopback-gloo", 2 * GB, 50e-6, source="nominal; gpipe calibrate measures it")
BUILT_IN = [
    System("ideal", IDEAL_DEVICE, 1 << 20, FREE_LINK, FREE_LINK,
           description="infinitely fast links, unlimited memory", source="no hardware: a bound"),
    # one stage per core: more stages than cores would time-share cores, which is not modelled
    System("cpu", LOCAL_CPU, os.cpu_count() or 1, LOOPBACK, Link("tcp-10GbE", 1.25 * GB, 100e-6),
           description="processes on this machine's CPU over gloo, one per core (nominal until calibrated)",
           source="this machine: os.cpu_count() and its memory; figures nominal"),
]


# --- The catalog: a file per system (systems/*.json), the links they name (links.json) ----------
def _read(path: str) -> Any:
    with open(path) as handle:
        return json.load(handle)


def _catalog_files() -> dict[str, dict[str, Any]]:
    """Each catalog file's JSON by system name, in the order ``systems/index.json`` lists them (a
    file it does not list comes after, by name)."""
    listed = _read(os.path.join(SYSTEMS_DIR, "index.json"))["systems"]
    found = sorted(name[:-len(".json")] for name in os.listdir(SYSTEMS_DIR)
                   if name.endswith(".json") and name != "index.json")
    return {name: _read(os.path.join(SYSTEMS_DIR, f"{name}.json"))
            for name in [*(n for n in listed if n in found), *(n for n in found if n not in listed)]}


def build_system(fields: dict[str, Any], links: dict[str, Link]) -> System:
    """The System of :func:`sim.catalog.system_schema.system_fields`' output, its links named in
    ``links`` or given whole; no fitted fractions yet (:func:`place` adds them)."""
    def link(value: Any) -> Link:
        return links[value] if isinstance(value, str) else Link(**value)

    return System(fields["name"], Device(**fields["device"]), fields["devices_per_node"], link(fields["intra_link"]),
                  link(fields["inter_link"]), description=fields["description"], source=fields["source"],
                  price_per_device_hour=fields["price_per_device_hour"], price_source=fields["price_source"])


def _fitted(device: Device, fitted: dict[str, KernelEfficiency], key: str | None = None) -> Device:
    """``device`` with the fitted fractions (``gpipe fit-gpu``) the efficiency file has for it (by
    ``key``, default its own name): the roofline's efficiencies become the fitted matmul and memory
    fractions, for models the kernel model does not split (measured and meta workloads)."""
    kernels = fitted.get(device.fitted_as if key is None else key)
    if kernels is None:
        return device
    return replace(device, kernels=kernels, efficiency=kernels.matmul, bandwidth_efficiency=kernels.memory)


LINKS: dict[str, Link] = {link["name"]: Link(**link_fields(link, f"catalog link {link.get('name')!r}"))
                          for link in _read(LINKS_FILE)["links"]}
CATALOG_FILES = _catalog_files()  # the JSON of each catalog file, which a user's "base" starts from
_FITTED = read_efficiencies(efficiency_file())
_UNFITTED: dict[str, System] = {
    **{system.name: system for system in BUILT_IN},
    **{name: build_system(system_fields(data, f"catalog file systems/{name}.json", LINKS), LINKS)
       for name, data in CATALOG_FILES.items()},
}
# What --hardware names: each system with the fractions fitted for its device, if any
SYSTEMS: dict[str, System] = {name: replace(system, device=_fitted(system.device, _FITTED))
                              for name, system in _UNFITTED.items()}


def fitted_devices() -> frozenset[str]:
    """The device names the efficiency file has fitted fractions for (variants named apart included)."""
    return frozenset(_FITTED)


def device_name_key(name: str) -> str:
    """``name`` as device names are compared: lower case, letters and digits only, so that
    "H100 SXM 96GB HBM2e (500 W)" and "h100-sxm-96gb-hbm2e-500w" name one device."""
    return "".join(ch for ch in name.lower() if ch.isalnum())


def fitted_device_named(name: str) -> str | None:
    """The fitted device (:func:`fitted_devices`) ``name`` spells, however it is cased and
    punctuated (:func:`device_name_key`); None when the efficiency file has no such device."""
    key = device_name_key(name)
    return next((fitted for fitted in sorted(_FITTED) if device_name_key(fitted) == key), None)


def get_system(name: str, nodes: int = 1, kernels: KernelEfficiency | None = None, fitted: bool = True) -> System:
    """The catalog system ``name`` joined ``nodes`` times over its inter-node link; ``kernels``
    replaces its device's fitted fractions (what ``gpipe fit-gpu`` tries), and ``fitted=False``
    drops them: the roofline at the catalog's assumed efficiency, links at their peak. A system
    file or a run's hardware object: :func:`sim.catalog.user_systems.resolve_system`."""
    if name not in SYSTEMS:
        raise GpipeInputError(f"unknown hardware {name!r}{did_you_mean(name, SYSTEMS)}; choose one of "
                              f"{', '.join(SYSTEMS)}")
    return place(_UNFITTED[name], nodes, kernels, fitted)


def place(system: System, nodes: int = 1, kernels: KernelEfficiency | None = None, fitted: bool = True,
          fitted_as: str | None = None) -> System:
    """``system`` as read from its file, joined ``nodes`` times, with the fractions fitted for its
    device (or for the device ``fitted_as`` names: a catalog device a user's system overrides),
    ``kernels`` in their place, or none with ``fitted=False``; links at the fitted collective
    fraction where there are fractions."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes <= 0:
        raise GpipeInputError(f"nodes must be a positive integer, got {nodes!r}; use --nodes 1 or more")
    if not fitted:
        return replace(system, nodes=nodes)
    key = fitted_as or system.device.fitted_as
    device = _fitted(system.device, {key: kernels} if kernels is not None else _FITTED, key)
    return replace(achieved_links(replace(system, device=device)), nodes=nodes)


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
