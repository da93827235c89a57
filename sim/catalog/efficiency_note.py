"""What a prediction's device efficiency rests on, said beside the figures it moves.

A prediction's layer times are *measured* (``--costs``), or come from a device's achieved fraction of its peak FLOP/s,
*given* (``--efficiency``), *calibrated* on a real machine (``--efficiency-from COSTS``), *fitted* on
published runs (the A100, H100, B200 and GB200: ``sim/catalog/gpu_efficiency.json``; the H200 at the
H100's, its file's ``kernels_of``) or *assumed* (the catalog's 50% for every other accelerator). An
assumed fraction comes with a range, :data:`ASSUMED_EFFICIENCY_RANGE`, at whose ends
:mod:`sim.planner.efficiency_range` prices a plan again. The ``cpu`` entry's figures are nominal, not
this machine's: without a costs file a CPU prediction can be several times off, so it is called
*uncalibrated*, with the ``gpipe calibrate`` command that measures it.
"""

from __future__ import annotations

from typing import Any

from sim.catalog.hardware import SYSTEMS, System
from sim.workloads.model_defaults import DEFAULT_BATCH, DEFAULT_OPTIONS, MODEL_FLAGS

# The fractions of peak FLOP/s an assumed device is priced at beside its point figure. The top is
# just above the best matmul fraction fitted on published runs (H100 SXM 73%, A100 66%:
# sim/catalog/gpu_efficiency.json); the bottom is 15 points under the 50% assumption, for kernels not
# yet tuned for a device.
ASSUMED_EFFICIENCY_RANGE = (0.35, 0.75)

# What each kind of efficiency is called in the output and in --json
KINDS = ("measured", "given", "calibrated", "fitted", "assumed", "uncalibrated", "ideal")


def efficiency_kind(system: System, given: float | None = None, calibrated_from: str | None = None,
                    costs: str | None = None) -> str:
    """One of :data:`KINDS`: what ``system``'s figures rest on (``costs``: a costs file's measurements)."""
    if costs:
        return "measured"
    if given is not None:
        return "given"
    if calibrated_from:
        return "calibrated"
    if system.device.kernels is not None:
        return "fitted"
    if system.name == "ideal":
        return "ideal"
    return "uncalibrated" if system.name == "cpu" else "assumed"


def efficiency_text(system: System, kind: str, calibrated_from: str | None = None) -> str:
    """``efficiency given (70% of peak FLOP/s, --efficiency)`` and the like, for a note line."""
    share = f"{system.device.efficiency:.0%} of peak FLOP/s"
    if kind == "measured":
        return "layer times measured by gpipe calibrate (--costs)"
    if kind == "given":
        return f"efficiency given ({share}, --efficiency)"
    if kind == "calibrated":
        return f"efficiency calibrated ({share}, fitted by gpipe calibrate in {calibrated_from})"
    if kind == "fitted":
        if system.device.fitted_as != system.device.name:
            return (f"efficiency fitted on published runs of the {system.device.fitted_as} "
                    "(the same silicon: kernels_of)")
        return "efficiency fitted on published runs"
    if kind == "uncalibrated":
        return f"efficiency uncalibrated (the catalog's nominal {share} for a CPU, not measured here)"
    if kind == "ideal":
        return "efficiency ideal (the peak, by definition)"
    return f"efficiency assumed ({share}; no published run of it has been fitted)"


def calibrate_command(workload: Any, batch: int | None = None, out: str = "costs.json") -> str:
    """The ``gpipe calibrate`` command that measures this machine on ``workload``'s model: its name,
    the options that differ from the model's defaults, and the batch where it is not the default."""
    described = workload.describe()
    name, options = described["name"], described["options"]
    defaults = DEFAULT_OPTIONS.get(name, {})
    flag_of = {option: flag for flag, (option, _, _) in MODEL_FLAGS.items()}
    words = ["gpipe", "calibrate", "--model", name]
    for key, value in options.items():
        if key in ("precision", "optimizer_slots") or defaults.get(key) == value:
            continue  # the precision and the optimizer are flags of their own, the CPU's defaults here
        words += [flag_of[key], str(value)] if key in flag_of else ["--option", f"{key}={value}"]
    if batch is not None and batch != DEFAULT_BATCH.get(name):
        words += ["--batch", str(batch)]
    return " ".join(words + ["--out", out])


def uncalibrated_note(system: System, workload: Any, batch: int | None, costs_path: str | None) -> str | None:
    """One line where a CPU prediction comes from the catalog's nominal figures, with the command that
    calibrates this machine; None with a costs file, a given or calibrated efficiency, or the
    ``uniform`` model (whose layer times are given, not the device's)."""
    if system.name != "cpu" or costs_path or system.device != SYSTEMS["cpu"].device:
        return None
    if workload.measured_costs or workload.describe()["name"] == "uniform":
        return None
    return (f"cpu: uncalibrated, from the catalog's nominal CPU figures, not this machine's: they can be several "
            f"times off; measure it with {calibrate_command(workload, batch)}, then add "
            f"--costs costs.json")
