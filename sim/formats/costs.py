"""The costs file: what ``gpipe calibrate`` measured and fitted on a machine, read by every command's ``--costs``.

The costs file is the contract between calibration, which writes it (:func:`write_costs`), and the
simulator, which reads it (:func:`read_costs`, :func:`load_costs_workload`): reading one needs
neither torch nor calibration's code. It is JSON, ``kind`` "gpipe-costs", with a ``version``:

- version 2 (:mod:`sim.formats.costs_v2`, what is written now): every key the simulator needs,
  read strictly; its layout is the record every part of gpipe works on in memory;
- version 1 (:mod:`sim.formats.costs_v1`): the files written before, read into that record with
  the defaults their reader used to guess, so they predict what they always did.

What the record holds: the machine stamp, the model and its options, its precision and optimizer,
the per-layer profile (times per row count and thread count, exact saved bytes), the fitted link,
the per-K pipeline fits (:mod:`sim.formats.costs_fits`), a CPU host's effects where it had any
(:mod:`sim.engine.host`), the fitted roofline efficiency, the measured all-reduce and tensor-parallel
collectives (:mod:`sim.formats.costs_links`), a mixture of experts' routed experts timed apart
(:mod:`sim.formats.measured_experts`) and calibration's own record of how well its fit holds
(:mod:`sim.formats.fit_quality`). The workload the simulator runs from it is
:class:`sim.formats.measured_workload.MeasuredWorkload`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from sim.errors import GpipeInputError
from sim.formats import costs_v1, costs_v2
from sim.formats.costs_fits import (BACKWARD_WITH_RECOMPUTE, FIRST_STAGE_WEIGHT, FORWARD_WITH_GRAPH, IDENTITY,
                                    ActionFit, Affine, PipelineFit, interpolate)
from sim.formats.costs_links import allreduce_link, tensor_parallel_link
from sim.formats.fit_quality import (DESIGN_FIT_GOAL, design_step_errors, fit_quality, fit_quality_warning,
                                     warn_once)
from sim.formats.measured_workload import MeasuredWorkload
from sim.formats.timeline import read_json

# every name of the costs file's modules that callers take from here
__all__ = ["ANALYSIS_OPTIONS", "BACKWARD_WITH_RECOMPUTE", "COSTS_KIND", "COSTS_VERSION", "DESIGN_FIT_GOAL",
           "FIRST_STAGE_WEIGHT", "FORWARD_WITH_GRAPH", "IDENTITY", "ActionFit", "Affine", "MeasuredWorkload",
           "PipelineFit", "allreduce_link", "check_model", "costs_summary", "design_step_errors", "fit_quality",
           "fit_quality_warning", "interpolate", "load_costs_workload", "measured_precision", "read_costs",
           "record_of", "requested_options", "tensor_parallel_link", "write_costs"]

COSTS_VERSION = costs_v2.VERSION  # what write_costs writes
COSTS_KIND = "gpipe-costs"
# options that describe the simulator's analysis, not the model torch builds
ANALYSIS_OPTIONS = ("precision", "optimizer_slots")
READERS = {costs_v1.VERSION: costs_v1.upgrade}  # older versions, each read into the current record


def record_of(data: dict[str, Any], path: str = "the costs file") -> dict[str, Any]:
    """A costs file's content as the current record: a version 1 file through its reader, a version 2
    file checked strictly; any other version is refused with one line."""
    version = data.get("version")
    if version in READERS:
        data = READERS[version](data)
    elif version != COSTS_VERSION:
        raise GpipeInputError(f"costs file version {version!r} is not supported; this gpipe reads versions "
                              f"{', '.join(map(str, sorted([*READERS, COSTS_VERSION])))} (re-run gpipe calibrate --force)")
    return costs_v2.check(data, path)


def read_costs(path: str | os.PathLike[str], warn: bool = True) -> dict[str, Any]:
    """The costs file as the current record (:func:`record_of`), checked for kind and version, with
    one-line errors; with ``warn``, a fit past its goal (:func:`fit_quality_warning`) is said once
    per file on stderr."""
    data = read_json(path, "costs file", "create it with gpipe calibrate --out FILE")
    if not isinstance(data, dict) or data.get("kind") != COSTS_KIND:
        raise GpipeInputError(f"{os.fspath(path)!r} is not a gpipe costs file; "
                              "create one with gpipe calibrate --out FILE")
    data = record_of(data, os.fspath(path))
    if warn:
        warn_once(data, os.fspath(path))
    return data


def write_costs(data: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write the record ``data`` as a version 2 costs file (a record that lacks a key is a bug: ValueError)."""
    from sim.formats.timeline import write_json_atomic

    record = {**data, "kind": COSTS_KIND, "version": COSTS_VERSION}
    try:
        costs_v2.check(record, os.fspath(path))
    except GpipeInputError as error:  # calibration's record, not the user's input
        raise ValueError(f"refusing to write an incomplete costs record: {error}") from None
    write_json_atomic(path, {"kind": COSTS_KIND, "version": COSTS_VERSION,
                             **{k: v for k, v in data.items() if k not in ("kind", "version")}})


def requested_options(model: str, options: dict[str, Any]) -> dict[str, Any]:
    """The model's full options as the executor builds it: built-in defaults overlaid (torch-free)."""
    from sim.workloads.model_defaults import DEFAULT_OPTIONS

    given = {k: v for k, v in options.items() if k not in ANALYSIS_OPTIONS}
    if model in DEFAULT_OPTIONS and model != "uniform":
        return {**DEFAULT_OPTIONS[model], **given}
    return given


def measured_precision(data: dict[str, Any]) -> str:
    """The precision a costs record was measured at."""
    return str(data["precision"])


def check_model(data: dict[str, Any], model: str | None, options: dict[str, Any], path: str) -> None:
    """The file's model must be ``model`` with ``options`` (None: the file's model, with the options
    given agreeing; defaults are not filled in, the file's own options stand), at the file's
    precision when ``options`` name one."""
    stored = data["model"]
    if "precision" in options and options["precision"] != measured_precision(data):
        raise GpipeInputError(f"costs file {path!r} was measured at {measured_precision(data)}, not "
                              f"{options['precision']}; run gpipe calibrate --precision {options['precision']}")
    if model is None:
        model = stored["name"]
        wanted = {k: v for k, v in options.items() if k not in ANALYSIS_OPTIONS}
    else:
        wanted = requested_options(model, options)
    # a file from before an option existed was measured at the option's default
    measured = {**requested_options(stored["name"], {}), **stored["options"]}
    same = stored["name"] == model and all(measured.get(k) == v for k, v in wanted.items())
    if not same:
        raise GpipeInputError(
            f"costs file {path!r} was measured for {stored['name']} {stored['options']}, not {model} "
            f"{wanted}; pass the same model flags or run gpipe calibrate for this model")


def load_costs_workload(path: str, model: str | None, options: dict[str, Any]) -> MeasuredWorkload:
    """The measured workload of ``model`` with ``options`` from the costs file at ``path``.

    ``model`` None means the file's own model; ``options`` given must still match it. Its optimizer
    is the one calibration measured (its step time was fitted); ``optimizer_slots`` in ``options``
    (from ``--optimizer``) must agree with it.
    """
    data = read_costs(path)
    check_model(data, model, options, path)
    allreduce_link(data)  # a malformed entry is refused before any work starts
    workload = MeasuredWorkload(data)
    wanted = options.get("optimizer_slots")
    if wanted is not None and wanted != workload.optimizer_slots:
        raise GpipeInputError(
            f"costs file {path!r} was measured with {workload.optimizer} ({workload.optimizer_slots} state "
            f"tensors per parameter) but --optimizer asks for {wanted}; drop --optimizer or run gpipe "
            "calibrate --optimizer NAME for this optimizer")
    return workload


def costs_summary(data: dict[str, Any]) -> dict[str, Any]:
    """The fitted numbers without the bulky profile, for printing."""
    keep = {k: v for k, v in data.items() if k not in ("profile", "design", "fit_halves")}
    return json.loads(json.dumps(keep, default=lambda o: dataclasses.asdict(o)))
