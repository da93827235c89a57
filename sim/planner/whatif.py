"""What-if sweeps: one model on hardware you do not have, step time, bubble and memory against K and M.

A sweep simulates every (K, M) pair on one system with the memory-aware min-max partition (or, when
nothing fits, the balanced partition of an unlimited device, so the overflow shows in the memory
curve instead of a gap). The device's achieved efficiency is the catalog default
(``sim.catalog.hardware.DEFAULT_EFFICIENCY``), a value the user gives (``--efficiency``), or the one a
calibration fitted on a real machine: :func:`with_efficiency` swaps it in, and every cost derived
from the device follows. Torch-free; plotting lives in :mod:`sim.views.figures`.

Limits: a sweep reuses one efficiency for every layer and micro-batch size, whereas real kernels
get less efficient on small micro-batches; the simulator's own limits apply (:mod:`sim.engine.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from sim.catalog.hardware import System
from sim.engine.engine import SimResult, simulate
from sim.engine.stage_costs import CostTable
from sim.errors import GpipeInputError
from sim.planner.search import Candidate, default_partition
from sim.workloads.workload import Workload


def with_efficiency(system: System, efficiency: float | None,
                    bandwidth_efficiency: float | None = None) -> System:
    """``system`` whose device reaches these fractions of its peaks (None keeps the catalog's)."""
    device = system.device
    for flag, value, field_name in (("--efficiency", efficiency, "efficiency"),
                                    ("bandwidth efficiency", bandwidth_efficiency, "bandwidth_efficiency")):
        if value is None:
            continue
        # up to 1.5: a roofline fit may put a CPU above the catalog's nominal peak (calibrate.fit.least_squares.fit_roofline)
        if isinstance(value, bool) or not 0.0 < float(value) <= 1.5:
            raise GpipeInputError(f"{flag} {value} is not a fraction of peak; use a value in (0, 1.5]")
        device = replace(device, **{field_name: float(value)})
        if device.kernels is not None:  # a fitted GPU: the given fraction replaces the fitted matmul (or memory) one
            fractions = ({"matmul": float(value), "attention": float(value)} if field_name == "efficiency"
                         else {"memory": float(value)})
            device = replace(device, kernels=replace(device.kernels, **fractions))
    return replace(system, device=device)


def efficiency_from_costs(path: str) -> tuple[float, float | None]:
    """The roofline efficiencies (FLOP/s, bandwidth) ``gpipe calibrate`` fitted, from its costs file."""
    from sim.formats.costs import read_costs

    fitted = read_costs(path).get("efficiency")
    if not fitted:
        raise GpipeInputError(f"costs file {path!r} has no fitted efficiency (its model has no analytic form, "
                              "or it was measured at a precision the device has no peak for); "
                              "pass --efficiency instead")
    return float(fitted["efficiency"]), fitted.get("bandwidth_efficiency")


@dataclass(frozen=True)
class SweepPoint:
    """One simulated (K, M) on one system."""

    system: str
    stages: int
    microbatches: int
    step_time_s: float
    bubble_fraction: float
    throughput_samples_per_s: float
    peak_memory_bytes: int  # the fullest stage
    capacity_bytes: float
    fits: bool


def simulate_candidate(workload: Workload, system: System, batch_size: int, candidate: Candidate,
                       table: CostTable | None = None, record: bool = False) -> SimResult:
    """Simulate ``candidate`` with the memory-aware partition, or the balanced one if none fits."""
    table = table or CostTable(workload, system.device)
    partition = default_partition(workload, system, batch_size, candidate, table=table)
    return simulate(workload, system, partition, batch_size, candidate, costs=table, record=record)


def sweep(workload: Workload, system: System, batch_size: int, stage_options: Sequence[int],
          microbatch_options: Sequence[int], checkpoint: str = "except_last",
          schedule: str = "gpipe") -> list[SweepPoint]:
    """Every (K, M) with K no larger than the devices and layers, M no larger than the batch."""
    table = CostTable(workload, system.device)
    points = []
    for k in stage_options:
        if k > system.total_devices or k > workload.num_layers:
            continue
        for m in microbatch_options:
            if m > batch_size:
                continue
            policy = "never" if checkpoint == "except_last" and m == 1 else checkpoint
            result = simulate_candidate(workload, system, batch_size, Candidate(k, m, policy, schedule), table)
            points.append(SweepPoint(
                system=system.name if system.nodes == 1 else f"{system.name} x{system.nodes} nodes",
                stages=k, microbatches=m, step_time_s=result.step_time_s,
                bubble_fraction=result.bubble_fraction,
                throughput_samples_per_s=result.throughput_samples_per_s,
                peak_memory_bytes=max(s.peak_memory_bytes for s in result.stages),
                capacity_bytes=system.device.memory_bytes, fits=result.fits))
    return points


def write_whatif_html(workload: Workload, system: System, batch_size: int, stage_options: Sequence[int],
                      microbatch_options: Sequence[int], best, path: str) -> None:
    """``gpipe plan --html``: the sweep's curves over the searched K and M, and the best plan's timeline."""
    from sim.views.figures import timeline_figure, whatif_figure, write_html_many

    points = sweep(workload, system, batch_size, stage_options, microbatch_options)
    figures = [whatif_figure(points, title=f"{workload.name} on {system.name}: step time, bubble and "
                                           f"memory against M (batch {batch_size})")]
    if best is not None:
        c = best.candidate
        result = simulate(workload, system, best.partition, batch_size, c)
        figures.append(timeline_figure(result.timeline, title=f"Best plan: D={c.replicas}, K={c.stages}, "
                                                              f"V={c.virtual_stages}, M={c.microbatches}, "
                                                              f"{c.checkpoint}, {c.schedule}"))
    write_html_many(figures, path, title=f"gpipe what-if: {workload.name} on {system.name}")
