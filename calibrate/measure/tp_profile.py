"""Every layer as one rank of a T-way tensor-parallel stage runs it: the profile split stages are priced from.

A layer split over T ranks does not take 1/T of its time. Each rank runs its shard of the matmuls,
waits in the all-reduces its row-parallel outputs and column-parallel input gradients need, and pays
DTensor's dispatch on every operation of a sharded weight: on a CPU a T = 2 forward takes several
times one rank's share of the work (docs/notes/2026-11-25-calibrating-new-features.md). So the split
layer is measured, not
derived: T processes on this host, started by torchrun as the executor's T ranks of a stage are,
each build the model from the same seed, shard every layer over a one-dimensional mesh exactly as
the executor does (:func:`executor.parallel.tensor_parallel.parallelize_stage`) and profile it with
:func:`calibrate.measure.profile.profile_model`: F, R, B and C per layer and row count at each thread count a
run with T ranks per stage gives its processes, and the rank's exact saved bytes and parameter
bytes (its shard). The collectives are inside the layer's times, as they are inside the executor's
actions. Every rank times the same fixed number of runs of every (layer, rows), no time budget, so
their collectives stay paired; rank 0's table is kept (the ranks hold equal shares and leave each
collective together).

The costs file keeps it as ``tensor_parallel_profile: {"T": profile}``;
:class:`sim.formats.costs.MeasuredWorkload` prices ``--tensor-parallel T`` from it.

Limits: without sequence parallelism (costs without it refuse ``--sequence-parallel``); the
pipeline's per-action factors and overheads are those fitted for K stages of one rank each, not
fitted on tensor-parallel runs; measured with the T ranks alone on the host.
"""

from __future__ import annotations

import json
import os
from typing import Any

from calibrate.measure.rank_timing import join_measurement, launch_ranks, write_points

# timed runs of every (layer, rows) after the warm-up ones: the same on every rank, no budget
RUNS, QUICK_RUNS = 8, 3
ROUNDS, QUICK_ROUNDS = 3, 1


def thread_counts(parties: int, stage_counts: list[int], cores: int) -> list[int]:
    """Threads per process of runs with ``parties`` ranks per stage and K in ``stage_counts``:
    cores / (K x T), at least one (the executor's workers take cores / local processes)."""
    return sorted({max(1, cores // (k * parties)) for k in stage_counts}, reverse=True)


def profile_tensor_parallel(model: str, options: dict[str, Any], batch_size: int, rows: list[int],
                            threads: list[int], parties: int = 2, device: str = "cpu", quick: bool = False,
                            precision: str = "fp32") -> dict[str, Any]:
    """The :class:`calibrate.measure.profile.Profile` (as a dict) of ``model``'s layers split over
    ``parties`` ranks, as rank 0 measured it."""
    request = {"model": model, "options": options, "batch_size": batch_size, "rows": rows, "threads": threads,
               "device": device, "precision": precision, "runs": QUICK_RUNS if quick else RUNS,
               "rounds": QUICK_ROUNDS if quick else ROUNDS}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpipe-tp-profile-") as directory:
        path = os.path.join(directory, "request.json")
        with open(path, "w") as handle:
            json.dump(request, handle)
        return dict(launch_ranks("calibrate.measure.tp_profile", parties, [path],
                                 f"the layers' profile split over {parties} tensor-parallel ranks", timeout_s=1800.0))


def _measure(request_path: str, out_path: str) -> None:
    """One rank's side (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from calibrate.measure.profile import Repeats, profile_model
    from calibrate.noise.speed import SpeedProbe
    from executor.models.build import build_model, default_loss, example_batch, loss_function
    from executor.parallel.tensor_parallel import TP, check_model, parallelize_stage

    with open(request_path) as handle:
        request = json.load(handle)
    device = join_measurement(request["device"])
    try:
        model, options = request["model"], request["options"]
        parties = dist.get_world_size()
        mesh = init_device_mesh(device.type, (parties,), mesh_dim_names=(TP,))
        net = build_model(model, options, seed=0)
        check_model(net, parties)
        parallelize_stage(net.to(device), mesh)
        repeats = Repeats(min_runs=request["runs"], max_runs=request["runs"], budget_s=0.0, rounds=request["rounds"])
        profile = profile_model(net, lambda r: example_batch(model, options, r, seed=1),
                                loss_function(default_loss(model)), request["rows"], request["threads"],
                                torch.device(device), repeats,
                                probe=SpeedProbe.model(model, options, request["batch_size"], device=device),
                                precision=request["precision"])
        write_points(profile.to_dict(), out_path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    _measure(sys.argv[1], sys.argv[2])
