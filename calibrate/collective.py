"""All-reduce among n ranks on the executor's own backend: the data-parallel gradient average's cost.

The executor averages each stage's gradients over its data-parallel group with an all-reduce (sum,
fp32) on its backend: gloo for CPU tensors, NCCL for CUDA tensors (one GPU per rank). Here n fresh
processes on this host, started by torchrun as the executor's workers are, all-reduce one fp32
tensor per size: two warm-up calls, then the median of ``repeats`` calls as rank 0 timed them, each
started right after a barrier. :func:`calibrate.fit.fit_ring_allreduce` turns the points into the
latency and bandwidth of the ring model the simulator predicts with.

Limits: the collective is measured idle, among processes doing nothing else, one tensor at a time;
the executor's buckets overlap each other and the rest of the drain, and the ranks of a CPU run
share cores with compute, which this does not capture. Rank 0's clock stands for the group: the
ranks leave the barrier within microseconds of each other on one host.
"""

from __future__ import annotations

import os

from calibrate.rank_timing import join_measurement, median_call_s, rank_main, run_ranks, write_points

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


def _measure(device_type: str, sizes: list[int], repeats: int, out_path: str) -> None:
    """One rank's side (started by torchrun); rank 0 writes ``[{"bytes", "seconds"}, ...]``."""
    import torch
    import torch.distributed as dist

    device = join_measurement(device_type)
    try:
        results = []
        for size in sizes:
            buffer = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
            seconds = median_call_s(lambda: dist.all_reduce(buffer, op=dist.ReduceOp.SUM), device, repeats)
            results.append({"bytes": buffer.numel() * 4, "seconds": seconds})
        write_points(results, out_path)
    finally:
        dist.destroy_process_group()


def measure_allreduce(parties: int, device_type: str = "cpu", sizes: tuple[int, ...] = DEFAULT_SIZES_BYTES,
                      repeats: int = DEFAULT_REPEATS) -> list[dict[str, float]]:
    """``[{"bytes": n, "seconds": t}, ...]``: one all-reduce among ``parties`` fresh local processes."""
    return run_ranks("calibrate.collective", parties, device_type, sizes, repeats,
                     f"all-reduce among {parties} processes")


def calibrate_allreduce(device_type: str = "cpu", quick: bool = False,
                        parties: list[int] | None = None) -> dict | None:
    """The costs file's ``allreduce`` entry (:func:`sim.costs.allreduce_link` reads it): the measured
    points per group size and the ring model fitted on all of them; None on a one-core machine."""
    from calibrate.fit import fit_ring_allreduce

    counts = parties if parties is not None else party_counts(available_parties(device_type))
    if not counts:
        return None
    sizes = QUICK_SIZES_BYTES if quick else DEFAULT_SIZES_BYTES
    repeats = QUICK_REPEATS if quick else DEFAULT_REPEATS
    measured = [measure_allreduce(n, device_type, sizes, repeats) for n in counts]
    sizes_bytes = [int(p["bytes"]) for p in measured[0]]
    seconds = [[float(p["seconds"]) for p in row] for row in measured]
    fit = fit_ring_allreduce([n for n in counts for _ in sizes_bytes], sizes_bytes * len(counts),
                             [t for row in seconds for t in row])
    from executor.device import device_api

    return {"backend": device_api(device_type).backend, "parties": list(counts),
            "sizes_bytes": sizes_bytes, "measured_s": seconds, **fit.to_dict()}


if __name__ == "__main__":
    rank_main(_measure)
