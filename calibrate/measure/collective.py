"""The data-parallel gradient sum among n ranks, timed as the executor runs it: its cost in the simulator.
ZeRO-2/3's all-gather and reduce-scatter over the same groups are timed beside it (:func:`calibrate_sharded`).

The executor sums each stage's gradients over its data-parallel group with
:class:`executor.parallel.gradient_average.GradientAverage`: through shared memory where the group's ranks share a
host and each has a core (:mod:`executor.transport.shm_allreduce`), otherwise an all-reduce (sum, fp32) on its
backend, gloo for CPU tensors, NCCL for CUDA tensors (one GPU per rank), in buckets. Here n fresh
processes on this host, started by torchrun as the executor's workers are, sum one fp32 gradient per
size on each route the executor can take here (the backend always; shared memory on CPU): two
warm-up calls, then the median of ``repeats`` calls (launch and wait, with the gathering into
buckets and the copy back) as rank 0 timed them, each started right after a barrier.
:func:`calibrate.fit.least_squares.fit_ring_allreduce` turns each route's points into the latency and bandwidth of
the ring model the simulator predicts with; the simulator takes the shared-memory route's for a run
whose processes fit the cores, as the executor does (:meth:`sim.formats.costs.MeasuredWorkload.allreduce_link`).

Limits: the sum is measured idle, among processes doing nothing else, one gradient at a time; the
executor's buckets overlap the rest of the drain, and the ranks of a CPU run share cores with
compute, which this does not capture. Rank 0's clock stands for the group: the ranks leave the
barrier within microseconds of each other on one host. The shared-memory route is not a ring; the
ring form, fitted at the group sizes measured, stands for it there.
"""

from __future__ import annotations

import os

from calibrate.measure.rank_timing import join_measurement, launch_ranks, median_call_s, rank_main, write_points

DEFAULT_SIZES_BYTES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
QUICK_SIZES_BYTES = (4 << 10, 256 << 10, 4 << 20)
DEFAULT_REPEATS = 10
QUICK_REPEATS = 5
MAX_CPU_PARTIES = 8  # beyond this, starting the processes costs more than the measurement tells


def party_counts(available: int) -> list[int]:
    """The group sizes to measure: 2, and as many as this machine runs one rank per core or GPU."""
    if available < 2:
        return []
    return sorted({2, available})


def available_parties(device_type: str) -> int:
    """Ranks the machine gives one core (CPU, at most :data:`MAX_CPU_PARTIES`) or one GPU (CUDA) each."""
    from executor.device import device_api

    api = device_api(device_type)
    return api.ranks_per_host() if api.type != "cpu" else min(api.ranks_per_host(), MAX_CPU_PARTIES)


ROUTES = ("backend", "shared_memory")  # the costs entry's top level, and its "shared_memory" part


def _measure(device_type: str, sizes: list[int], repeats: int, out_path: str) -> None:
    """One rank's side (started by torchrun); rank 0 writes ``{route: [{"bytes", "seconds"}, ...]}``."""
    import torch
    import torch.distributed as dist

    from executor.runtime.recording import Recorder
    from executor.parallel.gradient_average import GradientAverage
    from executor.transport.shm_transport import host_links

    device = join_measurement(device_type)
    try:
        parties = dist.get_world_size()
        links = host_links(device, "auto", timeout_s=120.0)  # collective; None where the executor has none
        results = {}
        for route, route_links in (("backend", None), ("shared_memory", links)):
            if route == "shared_memory" and route_links is None:
                continue
            points = []
            for size in sizes:
                param = torch.nn.Parameter(torch.zeros(max(1, size // 4), dtype=torch.float32, device=device))
                param.grad = torch.ones_like(param)
                average = GradientAverage([param], dist.group.WORLD, 1.0 / parties, Recorder(0, device),
                                          links=route_links)

                def call() -> None:
                    average.launch()
                    average.wait()

                points.append({"bytes": param.numel() * 4, "seconds": median_call_s(call, device, repeats)})
            results[route] = points
        write_points(results, out_path)
    finally:
        dist.destroy_process_group()


def measure_allreduce(parties: int, device_type: str = "cpu", sizes: tuple[int, ...] = DEFAULT_SIZES_BYTES,
                      repeats: int = DEFAULT_REPEATS) -> dict[str, list[dict[str, float]]]:
    """``{route: [{"bytes": n, "seconds": t}, ...]}``: the gradient sum among ``parties`` fresh local
    processes on each route the executor can take here (``"backend"``; ``"shared_memory"`` on CPU)."""
    return dict(launch_ranks("calibrate.measure.collective", parties, [device_type, ",".join(map(str, sizes)), str(repeats)],
                             f"all-reduce among {parties} processes"))


def calibrate_allreduce(device_type: str = "cpu", quick: bool = False,
                        parties: list[int] | None = None) -> dict | None:
    """The costs file's ``allreduce`` entry (:func:`sim.formats.costs.allreduce_link` reads it): the backend
    route's measured points per group size and the ring model fitted on all of them, and the same
    for the shared-memory route under ``"shared_memory"`` where it was measured; None on a one-core
    machine."""
    from calibrate.fit.least_squares import fit_ring_allreduce

    counts = parties if parties is not None else party_counts(available_parties(device_type))
    if not counts:
        return None
    sizes = QUICK_SIZES_BYTES if quick else DEFAULT_SIZES_BYTES
    repeats = QUICK_REPEATS if quick else DEFAULT_REPEATS
    measured = [measure_allreduce(n, device_type, sizes, repeats) for n in counts]
    sizes_bytes = [int(p["bytes"]) for p in measured[0]["backend"]]
    from executor.device import device_api

    entry: dict = {"backend": device_api(device_type).backend, "parties": list(counts), "sizes_bytes": sizes_bytes}
    for route in ROUTES:
        if not all(route in row for row in measured):
            continue
        seconds = [[float(p["seconds"]) for p in row[route]] for row in measured]
        fit = fit_ring_allreduce([n for n in counts for _ in sizes_bytes], sizes_bytes * len(counts),
                                 [t for row in seconds for t in row])
        part = {"measured_s": seconds, **fit.to_dict()}
        if route == "backend":
            entry.update(part)
        else:
            entry[route] = part
    return entry


SHARDED_OPS = ("all_gather", "reduce_scatter")  # what ZeRO-2/3 runs over a stage's shard group (sim.engine.fsdp)


def calibrate_sharded(device_type: str = "cpu", quick: bool = False, parties: list[int] | None = None) -> dict | None:
    """The costs file's ``sharded`` entry (:func:`sim.formats.costs_links.sharded_links` reads it): the
    all-gather (``all_gather_into_tensor``) and reduce-scatter (``reduce_scatter_tensor``) of one fp32
    tensor per size among each group size, on the executor's backend as FSDP2 runs them over the
    data-parallel group, each fitted as a ring; None on a one-core machine. The sizes span a
    stage's units, from a norm's weights to a block's; measured as the tensor-parallel collectives
    are (:mod:`calibrate.measure.tp_collectives`)."""
    from calibrate.fit.least_squares import fit_ring_gather
    from calibrate.measure.rank_timing import run_ranks
    from executor.device import device_api

    counts = parties if parties is not None else party_counts(available_parties(device_type))
    if not counts:
        return None
    sizes = QUICK_SIZES_BYTES if quick else DEFAULT_SIZES_BYTES
    repeats = QUICK_REPEATS if quick else DEFAULT_REPEATS
    measured = {n: run_ranks("calibrate.measure.tp_collectives", n, device_type, sizes, repeats,
                             f"all-gather and reduce-scatter among {n} processes") for n in counts}
    entry: dict = {"backend": device_api(device_type).backend, "parties": list(counts)}
    for op in SHARDED_OPS:
        points = [(n, p["bytes"], p["seconds"]) for n, rows in measured.items() for p in rows if p["op"] == op]
        fit = fit_ring_gather([n for n, _, _ in points], [b for _, b, _ in points], [t for _, _, t in points])
        entry[op] = {"measured": [{"parties": n, "bytes": b, "seconds": t} for n, b, t in points], **fit.to_dict()}
    return entry


if __name__ == "__main__":
    rank_main(_measure)
