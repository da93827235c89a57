"""Version 2 of the costs file, the one ``gpipe calibrate`` writes: its layout, read strictly.

Every key the simulator needs is written, so reading one has no defaults to guess: a key missing is
a one-line error naming it and the fix. Sections a calibration measures only where it can are
optional, each absent for a reason of its own (below), never because the file is older.

Top level (required): ``kind`` ("gpipe-costs"), ``version`` (2), ``machine`` (the stamp of where it
was measured, :mod:`calibrate.measure.machine`), ``system`` (the catalog system it was measured as),
``catalog_device``, ``model`` (``name``, ``options``, ``num_layers``), ``batch_size``, ``precision``,
``optimizer``, ``optimizer_slots``, ``shared_parameters``, ``profile`` (``rows``, ``times_s`` per
thread count and kind, ``memory`` per layer) and ``pipeline``: per K (as many processes as one
thread count ran), ``threads``, ``actions`` (per kind of action, ``slope``, ``intercept`` and
``cold_start_s``), ``send`` and ``optimizer`` (``slope``, ``intercept``), ``step_overhead_s`` and
``gap_after_s`` (per kind; empty where no design run had a gap).

Optional, and why each may be absent:

- ``pipeline[K].actions[kind].fixed_slope``: the design could not tell the profile's fixed part from
  the part that grows with rows (both take ``slope``);
- ``pipeline[K].first_input_s``, ``.full_backward_per_layer_s``: no split (zb-h1) or ``full`` design
  run (0: the executor's work around the first stage's I unmeasured; a ``full`` backward is the
  backward's and the recompute's lines summed);
- ``pipeline[K].replica_spread``: no design run of that K had more than one stage (none);
- ``pipeline[K].host`` (``warm_up_s``): a CPU host's effects (:mod:`sim.engine.host`), written where
  calibration ran on a CPU host; absent, they are off;
- ``link``, ``allreduce``, ``tensor_parallel``, ``tensor_parallel_profile``, ``tensor_parallel_fit``,
  ``sharded`` (ZeRO-2/3's fitted ``all_gather`` and ``reduce_scatter``, read by
  :func:`sim.formats.costs_links.sharded_links`): a machine with room for one process, or a quick
  calibration (``sharded`` also a file from before it was measured);
- ``expert_parallel`` (the all-to-all's fit, :func:`sim.formats.costs_links.expert_parallel_link`): as
  ``sharded``, though a quick calibration of a mixture of experts measures it;
- ``experts`` (each MoE block's routed experts timed apart and their bytes, read by
  :mod:`sim.formats.measured_experts`): a model without experts, or a file from before they were timed;
- ``efficiency``: a model without an analytic form, or a device without a peak to fit against;
- ``design``, ``fit_quality``, ``fit_halves``, ``fit_residuals``, ``speed``: calibration's record of
  itself, which the simulator does not read.
"""

from __future__ import annotations

from typing import Any

from sim.errors import GpipeInputError

VERSION = 2
FIX = "re-run gpipe calibrate --force to write it again"

REQUIRED = ("machine", "system", "catalog_device", "model", "batch_size", "precision", "optimizer",
            "optimizer_slots", "shared_parameters", "profile", "pipeline")
MODEL = ("name", "options", "num_layers")
PROFILE = ("rows", "times_s", "memory")
FIT = ("threads", "actions", "send", "optimizer", "step_overhead_s", "gap_after_s")
ACTION = ("slope", "intercept", "cold_start_s")
LINE = ("slope", "intercept")
HOST = ("warm_up_s",)


def _need(entry: Any, keys: tuple[str, ...], where: str, path: str) -> None:
    """Each of ``keys`` in ``entry`` (the part of the file at ``where``), else one line naming the first missing."""
    if not isinstance(entry, dict):
        raise GpipeInputError(f"costs file {path!r}: {where or 'the file'} is {type(entry).__name__}, not an "
                              f"object; {FIX}")
    for key in keys:
        if key not in entry:
            name = f"{where}.{key}" if where else key
            raise GpipeInputError(f"costs file {path!r} (version {VERSION}) has no {name}; {FIX}")


def check(data: dict[str, Any], path: str) -> dict[str, Any]:
    """``data`` if it holds every key version 2 requires; else a one-line error naming the first missing."""
    _need(data, REQUIRED, "", path)
    _need(data["model"], MODEL, "model", path)
    _need(data["profile"], PROFILE, "profile", path)
    _need(data["pipeline"], (), "pipeline", path)
    for k, fit in data["pipeline"].items():
        where = f"pipeline.{k}"
        _need(fit, FIT, where, path)
        _need(fit["actions"], (), f"{where}.actions", path)
        for kind, line in fit["actions"].items():
            _need(line, ACTION, f"{where}.actions.{kind}", path)
        _need(fit["send"], LINE, f"{where}.send", path)
        _need(fit["optimizer"], LINE, f"{where}.optimizer", path)
        if "host" in fit:
            _need(fit["host"], HOST, f"{where}.host", path)
    return data
