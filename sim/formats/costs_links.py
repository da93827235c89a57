"""The links a costs file measured, as the simulator prices them: the all-reduce, the tensor-parallel
collectives, ZeRO-2/3's all-gather and reduce-scatter and expert parallelism's all-to-all.

Each is fitted as a ring (latency, bandwidth) by calibration (:mod:`calibrate.measure.collective`,
:mod:`calibrate.measure.tp_collectives`); an entry that is not a link is refused with one line.
"""

from __future__ import annotations

import math
from typing import Any

from sim.catalog.hardware import Link
from sim.errors import GpipeInputError


def tensor_parallel_link(data: dict[str, Any], sequence_parallel: bool) -> Link | None:
    """The tensor-parallel collectives the costs file measured (``calibrate.measure.tp_collectives``) as a
    ring :class:`Link`: the all-reduce's, or with ``sequence_parallel`` the reduce-scatter plus
    all-gather pair's; None when it has none. Limits: measured idle among T ranks on one host."""
    entry = data.get("tensor_parallel")
    if not entry:
        return None
    kind = "sequence_parallel" if sequence_parallel else "all_reduce"
    try:
        fit = entry[kind]
        latency_s, bandwidth = float(fit["latency_s"]), float(fit["bandwidth_bytes_per_s"])
    except (KeyError, TypeError, ValueError):
        raise GpipeInputError(f"the costs file's tensor_parallel entry has no usable {kind} fit; re-run gpipe "
                              "calibrate --force to measure it again") from None
    if not (math.isfinite(latency_s) and latency_s >= 0 and bandwidth > 0):
        raise GpipeInputError(f"the costs file's tensor_parallel {kind} fit (latency {latency_s!r} s, bandwidth "
                              f"{bandwidth!r} B/s) is not a link; re-run gpipe calibrate --force")
    what = "reduce-scatter + all-gather" if sequence_parallel else "all-reduce"
    return Link(f"calibrated {what} ({entry.get('backend', '?')})", bandwidth, latency_s)


def allreduce_link(data: dict[str, Any], shared_memory: bool = False) -> Link | None:
    """The all-reduce the costs file measured as a :class:`Link` for the ring model, or None when
    it has none (a one-core machine, or a file from before it was measured). ``shared_memory``: the
    shared-memory route's fit (:mod:`calibrate.measure.collective`) where the file has one, else the backend's.

    The simulator prices a data-parallel group of D ranks as ``2(D-1)/D * bytes / bandwidth +
    2(D-1) * latency`` on this link instead of the slowest link the group crosses. Limits: it was
    measured idle on one host (:mod:`calibrate.measure.collective`); across nodes the catalog's links apply.
    """
    entry = data.get("allreduce")
    if entry is None:
        return None
    latency_s, bandwidth = _fitted_ring(entry, "allreduce")
    shared = entry.get("shared_memory")  # checked whichever is asked for: a bad file fails before any work
    if shared is not None:
        shared_latency_s, shared_bandwidth = _fitted_ring(shared, "allreduce shared_memory")
        if shared_memory:
            return Link("fitted shared-memory all-reduce", shared_bandwidth, shared_latency_s)
    return Link(f"fitted {entry.get('backend', 'all-reduce')} all-reduce", bandwidth, latency_s)


def sharded_links(data: dict[str, Any]) -> tuple[Link | None, Link | None]:
    """ZeRO-2/3's (all-gather, reduce-scatter) the costs file measured over the data-parallel group
    (:func:`calibrate.measure.collective.calibrate_sharded`), each a ring :class:`Link`; None each
    where the file has none (a quick calibration, one core, or a file from before they were measured).
    Limits: measured idle on one host; across nodes the catalog's links apply."""
    entry = data.get("sharded")
    if entry is None:
        return None, None
    links = []
    for op in ("all_gather", "reduce_scatter"):
        if not isinstance(entry, dict) or op not in entry:
            raise GpipeInputError(f"the costs file's sharded entry has no {op} fit; re-run gpipe calibrate --force")
        latency_s, bandwidth = _fitted_ring(entry[op], f"sharded {op}")
        links.append(Link(f"fitted {entry.get('backend', '?')} {op.replace('_', '-')}", bandwidth, latency_s))
    return links[0], links[1]


def expert_parallel_link(data: dict[str, Any]) -> Link | None:
    """The all-to-all the costs file measured over the expert-parallel group (its ``expert_parallel``
    entry, ``{"all_to_all": {"latency_s": ..., "bytes_per_s": ...}}``, what one rank sends of its
    payload per second) as a :class:`Link`; None where the file has none, and then the catalog's links
    price the all-to-all (:mod:`sim.workloads.moe.expert_parallel`). Limits: measured idle on one host."""
    entry = data.get("expert_parallel")
    if entry is None:
        return None
    fit = entry.get("all_to_all") if isinstance(entry, dict) else None
    if not isinstance(fit, dict):
        raise GpipeInputError("the costs file's expert_parallel entry has no all_to_all fit; re-run gpipe calibrate "
                              "--force")
    renamed = {"latency_s": fit.get("latency_s"), "bandwidth_bytes_per_s": fit.get("bytes_per_s")}
    if renamed["bandwidth_bytes_per_s"] is None:
        raise GpipeInputError("the costs file's expert_parallel all_to_all entry has no bytes_per_s; re-run gpipe "
                              "calibrate --force to measure it again")
    latency_s, bandwidth = _fitted_ring(renamed, "expert_parallel all_to_all")
    return Link(f"fitted {entry.get('backend', '?')} all-to-all", bandwidth, latency_s)


def _fitted_ring(entry: Any, what: str) -> tuple[float, float]:
    """(latency_s, bandwidth_bytes_per_s) of a costs file's fitted ring link; ``what`` names the
    entry in the one-line error a malformed one gets."""
    fix = "re-run gpipe calibrate --force to measure it again"
    if not isinstance(entry, dict):
        raise GpipeInputError(f"the costs file's {what} entry is {type(entry).__name__}, not an object; {fix}")
    try:
        latency_s = float(entry["latency_s"])
        bandwidth = float(entry["bandwidth_bytes_per_s"])
    except KeyError as exc:
        raise GpipeInputError(f"the costs file's {what} entry has no {exc.args[0]}; {fix}") from None
    except (TypeError, ValueError):
        raise GpipeInputError(f"the costs file's {what} latency_s {entry['latency_s']!r} or bandwidth_bytes_per_s "
                              f"{entry['bandwidth_bytes_per_s']!r} is not a number; {fix}") from None
    if not (math.isfinite(latency_s) and latency_s >= 0):
        raise GpipeInputError(f"the costs file's {what} latency_s {latency_s!r} is not a finite time of 0 s or "
                              f"more; {fix}")
    if not bandwidth > 0:
        raise GpipeInputError(f"the costs file's {what} bandwidth_bytes_per_s {bandwidth!r} is not positive; {fix}")
    return latency_s, bandwidth
