"""What ``--hardware`` and a run's ``hardware`` name: a catalog system, a user's system file, or an
object overriding some figures of a catalog system.

``--hardware h100-nvlink`` is the catalog's; ``--hardware cluster.json`` is a file in the catalog's
schema (:mod:`sim.catalog.system_schema`): a whole system, or ``{"base": "h100-nvlink", ...}`` with
only what differs. A runs file's ``hardware`` takes the same object inline, for instance the
torchtitan benchmark machines (H100 SXM with 96 GB of HBM2e at 2.4 TB/s)::

    {"base": "h100-nvlink", "name": "h100-96gb", "memory_gib": 96, "memory_bandwidth_tb_s": 2.4}

A system over a ``base`` keeps the fractions fitted for the base's device (``gpipe fit-gpu``): the
same silicon is assumed to reach the same fraction of its peaks, the peaks being the file's; where
the development set has rows of the object's own ``name`` (a variant the same peaks do not describe,
such as torchtitan's H100s held to a 500 W power limit), ``gpipe fit-gpu`` fits it under that name
as a device of its own, and the simulator reads those fractions (:func:`fitted_name`). A
whole file is fitted only where its ``device`` is a fitted catalog device's name (so a copy of a
catalog file predicts exactly what the catalog entry does); any other device keeps the assumed
efficiency. A run's ``gpus`` spreads that many devices evenly over its ``nodes`` (a partial NVL72
rack): the model keeps the same number of devices on every node.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any

from sim.catalog.hardware import (CATALOG_FILES, LINKS, SYSTEMS, System, build_system, fitted_device_named,
                                  fitted_devices, get_system, place)
from sim.catalog.kernel_model import KernelEfficiency
from sim.catalog.system_schema import DEVICE_FIGURES, KEYS, ONE_OF, check_keys, system_fields
from sim.errors import GpipeInputError, did_you_mean

_DOCS = "docs/planning.md#your-own-cluster"


def resolve_system(ref: Any, nodes: int = 1, kernels: KernelEfficiency | None = None, fitted: bool = True,
                   where: str = "--hardware") -> System:
    """The system ``ref`` names, joined ``nodes`` times: a catalog name, a path to a system file
    (``.json``) or a system object; ``kernels`` and ``fitted`` as in
    :func:`sim.catalog.hardware.get_system`. Every mistake is one line naming the key and the fix."""
    if isinstance(ref, dict):
        return _from_object(ref, nodes, kernels, fitted, where)
    if isinstance(ref, str) and ref not in SYSTEMS and is_system_file(ref):
        return _from_object(read_system_file(ref), nodes, kernels, fitted, f"hardware file {ref!r}")
    if not isinstance(ref, str):
        raise GpipeInputError(f"{where} must be a catalog system's name or a system object, got {ref!r}; {_DOCS}")
    return get_system(ref, nodes, kernels, fitted)


def is_system_file(ref: str) -> bool:
    """Whether ``--hardware`` names a file rather than a catalog system."""
    return ref.endswith(".json") or os.sep in ref or os.path.isfile(ref)


def read_system_file(path: str) -> Any:
    from sim.formats.timeline import read_json

    return read_json(path, "hardware file", f"give a system file ({_DOCS}) or a catalog system: {', '.join(SYSTEMS)}")


def catalog_name(ref: Any) -> str:
    """The catalog system ``ref`` stands on, as fitted fractions are keyed (``gpipe fit-gpu``): a
    name itself, an object's ``base``, else the object's own ``name``."""
    if isinstance(ref, dict):
        return str(ref.get("base") or ref.get("name") or "hardware object")
    return str(ref)


def fitted_name(ref: Any) -> str:
    """The name fitted fractions of ``ref``'s device are kept under (``gpipe fit-gpu``): a catalog
    name itself, a named object over a ``base`` its own ``name`` (a variant, fitted apart where the
    development set has its rows; spelt as the efficiency file spells it, whatever its case and
    punctuation), else as :func:`catalog_name`."""
    if isinstance(ref, dict) and ref.get("base") and ref.get("name"):
        return fitted_device_named(str(ref["name"])) or str(ref["name"])
    return catalog_name(ref)


def fractions_from(ref: Any) -> str | None:
    """The fitted device whose fractions ``ref``'s system is priced at: a variant fitted on its own
    rows, else the catalog device it stands on; None where neither has been fitted."""
    named = fitted_device_named(fitted_name(ref))
    if named:
        return named
    base = SYSTEMS.get(catalog_name(ref))
    return base.device.fitted_as if base is not None and base.device.kernels is not None else None


def run_system(ref: Any, nodes: Any, gpus: Any, kernels: KernelEfficiency | None, where: str) -> System:
    """A published run's system: ``ref`` as :func:`resolve_system` reads it, ``nodes`` of it (null:
    as many as ``gpus`` need, else one), cut to ``gpus`` devices where they are fewer than nodes x
    devices per node."""
    system = resolve_system(ref, 1, kernels, where=f"the hardware of {where}")
    gpus = _whole(gpus, "gpus", where)
    nodes = _whole(nodes, "nodes", where) or (math.ceil(gpus / system.devices_per_node) if gpus else 1)
    system = replace(system, nodes=nodes)
    return system if gpus is None else with_devices(system, gpus, where)


def _whole(value: Any, key: str, where: str) -> int | None:
    """A count of a run (a whole number, 2.0 too), or None for null."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GpipeInputError(f"{where}: {key} must be a whole number, 1 or more, or null; got {value!r}")
    return value


def with_devices(system: System, gpus: int, where: str) -> System:
    """``system`` with ``gpus`` devices in all, the same number on each of its nodes."""
    if gpus == system.total_devices:
        return system
    if gpus > system.total_devices:
        raise GpipeInputError(f"{where}: gpus {gpus} is more than {system.nodes} node(s) x {system.devices_per_node} "
                              f"devices of {system.name}; raise nodes to {math.ceil(gpus / system.devices_per_node)}")
    if gpus % system.nodes:
        raise GpipeInputError(f"{where}: gpus {gpus} do not split evenly over {system.nodes} nodes; the model puts "
                              "as many devices on every node, so give a multiple of nodes")
    return replace(system, devices_per_node=gpus // system.nodes)


def _from_object(data: Any, nodes: int, kernels: KernelEfficiency | None, fitted: bool, where: str) -> System:
    if not isinstance(data, dict):
        raise GpipeInputError(f"{where} is not a JSON object of a system's keys; {_DOCS}")
    check_keys(data, KEYS, where)  # before a merge, so the user's own mistake is the one named
    base = data.get("base")
    if base is None:
        data = _sourced(data, where)
        fitted_as = None
    else:
        if base not in CATALOG_FILES:
            raise GpipeInputError(f"{where}: base {base!r} is not a catalog system{did_you_mean(base, CATALOG_FILES)}; "
                                  f"choose one of {', '.join(CATALOG_FILES)}")
        fitted_as = SYSTEMS[base].device.fitted_as
        data = _over_base(CATALOG_FILES[base], data, SYSTEMS[base].device.name, where)
        if kernels is not None:  # the fractions being fitted for this variant (gpipe fit-gpu)
            fitted_as = data["name"]
        elif fitted_device_named(data["name"]):  # a variant fitted on its own rows, however its name is spelt
            fitted_as = fitted_device_named(data["name"])
    borrowed = data.get("kernels_of")
    if borrowed is not None and borrowed not in fitted_devices():
        raise GpipeInputError(f"{where}: kernels_of {borrowed!r} names no device with fitted kernel fractions"
                              f"{did_you_mean(str(borrowed), fitted_devices())}; choose one of "
                              f"{', '.join(sorted(fitted_devices()))}, or leave it out")
    system = build_system(system_fields(data, where, LINKS), LINKS)
    return place(system, nodes, kernels, fitted, fitted_as)


def _over_base(base: dict[str, Any], override: dict[str, Any], base_device: str, where: str) -> dict[str, Any]:
    """The base's keys with ``override``'s in their place (a figure in another unit replaces the
    base's), each overridden figure cited with the override's source or as given; unnamed, the
    system and its device are named after the base and the keys that changed (:func:`short_name`),
    a key given with the base's own value changing nothing; named, a changed device takes the name too."""
    merged = {key: value for key, value in base.items() if key != "sources"}
    given = override.get("sources", {})
    sources = {**base.get("sources", {}), **given}
    changed = [key for key in override if key not in ("base", "sources", "name", "description", "device")
               and not (key in base and base[key] == override[key])]
    for key in changed:
        for pair in ONE_OF:
            if key in pair:
                for other in pair:
                    merged.pop(other, None)
        merged[key] = override[key]
        sources[key] = given.get(key, f"given in {where}")
    what = ", ".join(f"{key} {override[key]}" for key in changed if not isinstance(override[key], dict))
    merged["name"] = override.get("name", short_name(override["base"], changed))
    merged["description"] = override.get("description", f"{base.get('description', override['base'])}, with {what}"
                                          if what else base.get("description", ""))
    device_changed = [key for key in changed if key in DEVICE_FIGURES]
    named = override.get("name") if device_changed else None  # a named variant's device is that variant
    merged["device"] = override.get("device", named or short_name(base_device, device_changed))
    merged["sources"] = sources
    return merged


SHORT_NAME_KEYS = 3  # overridden keys an automatic name lists before it counts the rest


def short_name(base: str, keys: list[str]) -> str:
    """An override's automatic name: the base's and the keys it changes, ``h100-nvlink+memory_gib``
    (the values are in the description and the sources), the fourth key on counted."""
    if not keys:
        return base
    more = len(keys) - SHORT_NAME_KEYS
    return "+".join([base, *keys[:SHORT_NAME_KEYS]]) + (f"+{more} more" if more > 0 else "")


def _sourced(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A whole user's system with "given in FILE" where it cites no source."""
    sources = dict(data.get("sources", {}))
    for key in ("device", "system"):
        sources.setdefault(key, f"given in {where}")
    if data.get("price_per_device_hour") is not None:
        sources.setdefault("price_per_device_hour", f"given in {where}")
    return {**data, "sources": sources}


def system_record(ref: str) -> dict[str, Any]:
    """What a plan file keeps of a ``--hardware`` beyond the system's name: nothing for a catalog
    system; a system file's object whole (``definition``), so the plan is priced alike wherever it
    is read, even after the file moves or changes."""
    if ref in SYSTEMS or not is_system_file(ref):
        return {}
    return {"definition": read_system_file(ref)}
