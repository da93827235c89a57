"""The system file: one accelerator system as flat JSON keys, units in their names, each figure sourced.

The catalog's systems (``sim/catalog/systems/*.json``), a user's ``--hardware FILE.json`` and a
run's ``hardware`` object in a runs file are read by this one schema::

    {"name": "h100-nvlink", "description": "8 x H100 SXM with NVLink 4", "device": "H100-SXM-80GB",
     "peak_tflops_bf16": 989.4, "peak_tflops_fp8": 1978.9, "memory_gib": 80,
     "memory_bandwidth_gb_s": 3350, "default_precision": "bf16", "flash_attention": true,
     "gpus_per_node": 8, "intra_link": "NVLink4", "inter_link": "InfiniBand-NDR",
     "price_per_device_hour": 2.99,
     "sources": {"device": "NVIDIA H100 datasheet ...", "system": "NVIDIA DGX H100 datasheet ..."}}

A link is a catalog link's name (``sim/catalog/links.json``) or an object of the same keys as
there; ``nic_gbit_s`` in place of ``inter_link`` is one NIC per device between nodes. ``sources``
maps ``device`` (the peaks, memory and bandwidth), ``system`` (the node's layout and links),
``price_per_device_hour`` and any single key to where it comes from. ``base`` names a catalog
system whose keys the others override (:mod:`sim.catalog.user_systems` merges them before this
module reads the result). Peaks are dense, per device.

This module checks and converts only: every mistake is one line naming the key and the fix (an
unknown key gets the keys it most resembles). It knows no dataclass, so the catalog can read its
own files with it.
"""

from __future__ import annotations

from typing import Any, Iterable

from sim.errors import GpipeInputError, did_you_mean
from sim.workloads.precision import PRECISIONS

GB = 1e9
GIB = 1 << 30
TERA = 1e12
NIC_LATENCY_S = 10e-6  # an assumption, as the catalog's InfiniBand links: NCCL's latency between nodes

PEAK_PREFIX = "peak_tflops_"
PEAK_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
_NUMBER = "a positive number"
# key -> (what it holds, the JSON types it takes)
KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "name": ("the system's name, as outputs print it", (str,)),
    "base": ("a catalog system whose figures the other keys override", (str,)),
    "description": ("one line on what the system is", (str,)),
    "device": ("the accelerator's name", (str,)),
    **{f"{PEAK_PREFIX}{dtype}": (f"dense {dtype} peak per device in TFLOP/s", (int, float)) for dtype in PEAK_DTYPES},
    "memory_gib": ("memory per device in GiB", (int, float)),
    "memory_gb": ("memory per device in GB", (int, float)),
    "memory_bandwidth_gb_s": ("memory bandwidth per device in GB/s", (int, float)),
    "memory_bandwidth_tb_s": ("memory bandwidth per device in TB/s", (int, float)),
    "efficiency": ("the achieved fraction of peak FLOP/s (default 0.5, assumed)", (int, float)),
    "kernels_of": ("a fitted device of the same silicon whose kernel fractions price this one (its source says "
                   "why)", (str,)),
    "bandwidth_efficiency": ("the achieved fraction of peak memory bandwidth (default 0.8, assumed)", (int, float)),
    "default_precision": ("the precision people train in here (default bf16 where a bf16 peak is given)", (str,)),
    "flash_attention": ("whether trainers run flash attention here (default false)", (bool,)),
    "gpus_per_node": ("devices per node: one scale-up domain (8 on NVLink, 72 in an NVL72 rack)", (int,)),
    "intra_link": ("the link inside a node: a catalog link's name or a link object", (str, dict)),
    "inter_link": ("the link between nodes, per device: a catalog link's name or a link object", (str, dict)),
    "nic_gbit_s": ("one NIC per device between nodes, Gbit/s per direction (in place of inter_link)", (int, float)),
    "price_per_device_hour": ("USD per device-hour, or null for no list price", (int, float, type(None))),
    "sources": ("where each figure comes from: keys device, system or any key of the file", (dict,)),
}
# Each of these pairs says one figure in two units (or two ways): exactly one of them is given
ONE_OF = (("memory_gib", "memory_gb"), ("memory_bandwidth_gb_s", "memory_bandwidth_tb_s"), ("inter_link", "nic_gbit_s"))
REQUIRED = ("name", "gpus_per_node", "intra_link")
LINK_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "name": ("the link's name", (str,)),
    "bandwidth_gb_s": ("GB/s one device drives into the link in one direction", (int, float)),
    "latency_s": ("seconds of latency per transfer", (int, float)),
    "shared": ("true: all transfers of one node share it (PCIe through the host)", (bool,)),
    "pair_bandwidth_gb_s": ("GB/s between one pair in a full mesh without a switch", (int, float)),
    "source": ("where the figures come from", (str,)),
}
LINK_REQUIRED = ("name", "bandwidth_gb_s", "latency_s")
DEVICE_FIGURES = (*(f"{PEAK_PREFIX}{d}" for d in PEAK_DTYPES), "memory_gib", "memory_gb", "memory_bandwidth_gb_s",
               "memory_bandwidth_tb_s", "efficiency", "bandwidth_efficiency", "default_precision", "flash_attention",
               "kernels_of")
_FIX = "see docs/planning.md#your-own-cluster"


def system_fields(data: Any, where: str, link_names: Iterable[str]) -> dict[str, Any]:
    """The checked fields of one system file in SI units: ``device`` (the Device's fields), the
    System's, and each link as a catalog link's name (one of ``link_names``) or a Link's fields."""
    if not isinstance(data, dict):
        raise GpipeInputError(f"{where} is not a JSON object of a system's keys; {_FIX}")
    check_keys(data, KEYS, where)
    for key in REQUIRED:
        if key not in data:
            raise GpipeInputError(f"{where} has no {key!r} ({KEYS[key][0]}); add it, or give \"base\": a catalog "
                                  "system whose figures the file overrides")
    for pair in ONE_OF:
        if not any(key in data for key in pair):
            raise GpipeInputError(f"{where} has no {pair[0]} ({KEYS[pair[0]][0]}) nor {pair[1]}; add one, or "
                                  "give \"base\": a catalog system whose figures the file overrides")
    peaks = {key[len(PEAK_PREFIX):]: _positive(data, key, where) * TERA for key in data if key.startswith(PEAK_PREFIX)}
    if not peaks:
        raise GpipeInputError(f"{where} has no peak: give peak_tflops_bf16 (or another of {', '.join(PEAK_DTYPES)})")
    sources = _sources(data, where)
    default_precision = data.get("default_precision", "bf16" if "bf16" in peaks else "fp32")
    _check_precision(default_precision, peaks, where)
    device: dict[str, Any] = {
        "name": data.get("device", data["name"]),
        "peak_flops": peaks,
        "memory_bytes": (_positive(data, "memory_gib", where) * GIB if "memory_gib" in data
                         else _positive(data, "memory_gb", where) * GB),
        "memory_bandwidth_bytes_per_s": (_positive(data, "memory_bandwidth_gb_s", where) * GB
                                         if "memory_bandwidth_gb_s" in data
                                         else _positive(data, "memory_bandwidth_tb_s", where) * TERA),
        "default_precision": default_precision,
        "flash_attention": data.get("flash_attention", False),
        "source": _cited(sources, "device", DEVICE_FIGURES),
    }
    for key in ("efficiency", "bandwidth_efficiency"):
        if key in data:
            device[key] = _fraction(data, key, where)
    if "kernels_of" in data:
        device["kernels_of"] = data["kernels_of"]
    price = data.get("price_per_device_hour")
    if price is not None:
        price = _positive(data, "price_per_device_hour", where)
    links = set(link_names)
    inter = (data["inter_link"] if "inter_link" in data else
             {"name": f"NIC {data['nic_gbit_s']:g} Gbit/s", "bandwidth_bytes_per_s": _positive(data, "nic_gbit_s", where) / 8 * GB,
              "latency_s": NIC_LATENCY_S, "source": sources.get("nic_gbit_s", "")})
    return {
        "name": data["name"],
        "device": device,
        "devices_per_node": _count(data, "gpus_per_node", where),
        "intra_link": _link(data["intra_link"], f"{where} intra_link", links),
        "inter_link": inter if "nic_gbit_s" in data else _link(inter, f"{where} inter_link", links),
        "description": data.get("description", ""),
        "source": _cited(sources, "system", ("gpus_per_node", "intra_link", "inter_link", "nic_gbit_s")),
        "price_per_device_hour": price,
        "price_source": sources.get("price_per_device_hour", "") if price is not None else "",
    }


def link_fields(data: Any, where: str) -> dict[str, Any]:
    """A link object's checked fields in SI units (the Link's fields)."""
    if not isinstance(data, dict):
        raise GpipeInputError(f"{where} is not a link: give a catalog link's name or an object with "
                              f"{', '.join(LINK_REQUIRED)}")
    check_keys(data, LINK_KEYS, where)
    for key in LINK_REQUIRED:
        if key not in data:
            raise GpipeInputError(f"{where} has no {key!r} ({LINK_KEYS[key][0]}); add it")
    latency = data["latency_s"]
    if not latency >= 0:
        raise GpipeInputError(f"{where}: latency_s must be zero or more seconds, got {latency!r}")
    pair = data.get("pair_bandwidth_gb_s")
    return {"name": data["name"], "bandwidth_bytes_per_s": _positive(data, "bandwidth_gb_s", where) * GB,
            "latency_s": latency, "shared": data.get("shared", False),
            "pair_bandwidth_bytes_per_s": None if pair is None else _positive(data, "pair_bandwidth_gb_s", where) * GB,
            "source": data.get("source", "")}


def check_keys(data: dict[str, Any], keys: dict[str, tuple[str, tuple[type, ...]]], where: str) -> None:
    """One line for the first unknown key (with the keys it most resembles), value of a wrong type,
    figure given in two units, or source of no key."""
    for key, value in data.items():
        if key not in keys:
            hint = did_you_mean(key, keys)
            known = "" if hint else f"; the keys are {', '.join(keys)}"
            gpus = "; gpus is a key of the run, beside nodes" if key == "gpus" else ""
            raise GpipeInputError(f"{where}: unknown key {key!r}{hint}{gpus}{known}")
        what, types = keys[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise GpipeInputError(f"{where}: {key} must be {_type_names(types)} ({what}), got {value!r}")
    if keys is not KEYS:
        return
    for pair in ONE_OF:
        if all(key in data for key in pair):
            raise GpipeInputError(f"{where} gives both {pair[0]} and {pair[1]}; keep one")
    _sources(data, where)


def _type_names(types: tuple[type, ...]) -> str:
    names = {str: "a string", int: "a number", float: "a number", bool: "true or false", dict: "an object",
             type(None): "null"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def _positive(data: dict[str, Any], key: str, where: str) -> float:
    value = data[key]
    if not value > 0 or value == float("inf"):
        raise GpipeInputError(f"{where}: {key} must be {_NUMBER} ({KEYS.get(key, LINK_KEYS.get(key, ('',)))[0]}), "
                              f"got {value!r}")
    return value


def _fraction(data: dict[str, Any], key: str, where: str) -> float:
    value = data[key]
    if not 0 < value <= 1:
        raise GpipeInputError(f"{where}: {key} must be a fraction in (0, 1], got {value!r}")
    return value


def _count(data: dict[str, Any], key: str, where: str) -> int:
    value = data[key]
    if not isinstance(value, int) or value < 1:
        raise GpipeInputError(f"{where}: {key} must be a whole number of devices, 1 or more, got {value!r}")
    return value


def _check_precision(precision: str, peaks: dict[str, float], where: str) -> None:
    if precision not in PRECISIONS:
        raise GpipeInputError(f"{where}: default_precision {precision!r} is not a precision"
                              f"{did_you_mean(precision, PRECISIONS)}; use one of {', '.join(PRECISIONS)}")
    peak = PRECISIONS[precision].peak
    if peak not in peaks:
        raise GpipeInputError(f"{where}: default_precision {precision} runs at the {peak} peak, which the file does "
                              f"not give; add {PEAK_PREFIX}{peak}")


def _sources(data: dict[str, Any], where: str) -> dict[str, str]:
    sources = data.get("sources", {})
    for key, text in sources.items():
        if key not in ("device", "system") and key not in KEYS:
            raise GpipeInputError(f"{where}: sources has {key!r}{did_you_mean(key, ('device', 'system', *KEYS))}; "
                                  "cite device, system or a key of the file")
        if not isinstance(text, str):
            raise GpipeInputError(f"{where}: sources.{key} must be a string (where the figure comes from), got {text!r}")
    return sources


def _cited(sources: dict[str, str], group: str, keys: Iterable[str]) -> str:
    """The source of a group of figures: the group's, then any single figure's own."""
    parts = [sources[group]] if sources.get(group) else []
    parts += [f"{key}: {sources[key]}" for key in keys if sources.get(key)]
    return "; ".join(parts)


def _link(value: Any, where: str, link_names: set[str]) -> Any:
    if isinstance(value, str):
        if value not in link_names:
            raise GpipeInputError(f"{where}: no catalog link {value!r}{did_you_mean(value, sorted(link_names))}; name one of "
                                  f"{', '.join(sorted(link_names))} or give a link object with "
                                  f"{', '.join(LINK_REQUIRED)}")
        return value
    return link_fields(value, where)
