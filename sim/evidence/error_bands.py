"""Error bands: how far the replayed published runs of a device fell from their measured step times.

A GPU prediction is only as good as the published runs behind it, so every GPU step time is printed
with the spread of the validation set's replay errors on that device (``gpipe error-bands`` builds the
file from ``benchmarks/published_runs/validation.json`` alone; the development set, which the
kernel fractions are fitted on, would flatter the band and never enters it).

A mixture of experts is banded apart from the dense models on the same device (its device key is
``<device> mixture-of-experts``, built from the mixture-of-experts validation runs): its all-to-alls,
load imbalance and grouped matmuls miss in ways a dense model's layers do not, and a dense band would
flatter it. The regime key is small on purpose: the precision the trainers ran (``bf16`` or ``fp8``) and whether
the layout is pipelined (``pipelined`` for more than one stage, else ``flat``). Precision changes
which kernels dominate; a pipeline adds the bubble and the stage boundaries the model times
differently from the layers. A cell with fewer than :data:`MIN_RUNS` runs falls back to the device's
band over all its runs. The band is the 5th to 95th percentile of the signed errors (predicted /
measured - 1), linearly interpolated (numpy's default), with the count behind it.

Limits: a band says how the model did on the published runs it has seen, not a guarantee on a new
layout; a few runs make a wide or a lucky band, and the count says how many there were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from sim.errors import GpipeInputError
from sim.formats.timeline import read_devices_file

MIN_RUNS = 5  # a regime cell with fewer runs falls back to the device's band
MOE_FAMILY = "mixture-of-experts"  # appended to a device's name for the bands of mixtures of experts
LOW_PERCENTILE, HIGH_PERCENTILE = 5, 95
UNKNOWN = "no published run replayed: error unknown"
BANDS_FILE = "error_bands.json"  # in this package, next to this module


@dataclass(frozen=True)
class Band:
    """The spread of replayed errors behind one device and regime."""

    device: str
    regime: str  # a regime key, or "all" for the device over every regime
    low: float  # 5th percentile of predicted / measured - 1
    high: float  # 95th percentile
    count: int

    def text(self) -> str:
        where = "" if self.regime == "all" else f" {self.regime}"
        return (f"published {self.device}{where} runs replayed within {self.low:+.0%} .. {self.high:+.0%} "
                f"({HIGH_PERCENTILE - LOW_PERCENTILE}% of {self.count})")

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "regime": self.regime, "low": self.low, "high": self.high,
                "count": self.count, "text": self.text()}


def device_key(device: str, experts: bool = False) -> str:
    """The bands file's key of ``device``'s dense runs, or of its mixtures of experts'."""
    return f"{device} {MOE_FAMILY}" if experts else device


def regime_key(precision: str, pipeline_stages: int) -> str:
    """``fp8`` or ``bf16`` (every 16-bit mixed precision), then ``pipelined`` or ``flat``."""
    kind = "fp8" if str(precision).startswith("fp8") else "bf16"
    return f"{kind} {'pipelined' if int(pipeline_stages) > 1 else 'flat'}"


def _cell(errors: list[float]) -> dict[str, Any]:
    values = np.asarray(errors, dtype=float)
    return {"low": round(float(np.percentile(values, LOW_PERCENTILE)), 6),
            "high": round(float(np.percentile(values, HIGH_PERCENTILE)), 6), "count": len(errors)}


def build_bands(rows: Iterable[tuple[str, str, float]], source: str) -> dict[str, Any]:
    """The bands file's content from (device name, regime key, error) of each modelled run."""
    by_device: dict[str, dict[str, list[float]]] = {}
    for device, regime, error in rows:
        by_device.setdefault(device, {}).setdefault(regime, []).append(float(error))
    devices = {}
    for device in sorted(by_device):
        regimes = by_device[device]
        every = [e for errors in regimes.values() for e in errors]
        devices[device] = {"all": _cell(every),
                           "regimes": {key: _cell(regimes[key]) for key in sorted(regimes)
                                       if len(regimes[key]) >= MIN_RUNS}}
    return {"about": f"Replay errors (predicted / measured - 1) of the published runs of {source}, per device (its "
                     f"mixtures of experts apart, '<device> {MOE_FAMILY}') and "
                     f"regime (precision, pipelined or flat; a regime with fewer than {MIN_RUNS} runs is left to the "
                     f"device's 'all'): the {LOW_PERCENTILE}th..{HIGH_PERCENTILE}th percentile and the count. Built "
                     f"from the validation set alone; rebuild with: gpipe error-bands {source} --out "
                     f"sim/evidence/{BANDS_FILE}",
            "source": source, "devices": devices}


def bands_path() -> str:
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), BANDS_FILE)


def load_bands(path: str | None = None) -> dict[str, Any]:
    """A bands file checked for the fields :func:`band_for` reads; one line naming what is wrong."""
    path = path or bands_path()
    data = read_devices_file(path, "error bands file", "rebuild it with gpipe error-bands")
    for device, entry in data["devices"].items():
        cells = [("all", entry.get("all") if isinstance(entry, dict) else None)]
        regimes = entry.get("regimes", {}) if isinstance(entry, dict) else {}
        if not isinstance(regimes, dict):
            raise GpipeInputError(f"error bands file {path!r}: {device}'s \"regimes\" is not an object")
        cells += list(regimes.items())
        for name, cell in cells:
            if not (isinstance(cell, dict) and all(isinstance(cell.get(k), (int, float)) for k in ("low", "high"))
                    and isinstance(cell.get("count"), int) and cell["count"] > 0):
                raise GpipeInputError(f"error bands file {path!r}: {device}'s {name!r} needs numbers low, high and "
                                      "a positive count; rebuild it with gpipe error-bands")
    return data


def band_for(device: str, precision: str, pipeline_stages: int, bands: dict[str, Any] | None = None,
             experts: bool = False) -> Band | None:
    """The band of ``device`` in its regime, else over all its runs; None where no run was replayed;
    ``experts``: of its mixtures of experts."""
    device = device_key(device, experts)
    entry = (bands if bands is not None else load_bands())["devices"].get(device)
    if entry is None:
        return None
    regime = regime_key(precision, pipeline_stages)
    key, cell = (regime, entry["regimes"][regime]) if regime in entry.get("regimes", {}) else ("all", entry["all"])
    return Band(device, key, float(cell["low"]), float(cell["high"]), int(cell["count"]))


def band_text(band: Band | None) -> str:
    return band.text() if band else UNKNOWN


def has_band(system_name: str) -> bool:
    """Every accelerator's prediction carries a band (or says none is known); the CPU's and the ideal
    machine's carry none: the CPU is calibrated on this machine, the ideal one is a bound."""
    return system_name not in ("cpu", "ideal")


def band_field(system_name: str, device: str, precision: str, pipeline_stages: int,
               bands: dict[str, Any] | None = None, experts: bool = False) -> dict[str, Any] | None:
    """The ``error_band`` of a ``--json`` output: None off accelerators, ``known`` false where no
    published run of the device (of its mixtures of experts, with ``experts``) was replayed."""
    if not has_band(system_name):
        return None
    band = band_for(device, precision, pipeline_stages, bands, experts)
    return ({"known": True, **band.to_dict()} if band else
            {"known": False, "device": device_key(device, experts), "text": UNKNOWN})
