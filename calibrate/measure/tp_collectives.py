"""The tensor-parallel collectives among T ranks on the executor's backend: what a split layer waits on.

A stage of T tensor-parallel ranks (:mod:`executor.parallel.tensor_parallel`) all-reduces the row-parallel
projections' outputs (forward) and the column-parallel inputs' gradients (backward); with sequence
parallelism those become reduce-scatters and all-gathers. Here T fresh processes on this host, started
by torchrun as the executor's workers are, run each of the three on one fp32 tensor per size (the
whole tensor's bytes: a reduce-scatter's input, an all-gather's output): two warm-up calls, then the
median of ``repeats`` calls as rank 0 timed them.

Two ring links are fitted (:func:`fit_tensor_parallel_links`): ``all_reduce`` on the all-reduces,
and ``sequence_parallel`` on each size's reduce-scatter plus all-gather, which the ring model counts
as one all-reduce of the same bytes (each is half of one: (T-1)/T of the bytes on the wire, T-1
steps) and which sequence parallelism runs in place of each all-reduce. They are fitted apart
because backends do not implement the halves as halves: gloo's reduce-scatter took longer than its
all-reduce here. The simulator prices a split layer's collectives on the link of its kind
(:func:`sim.formats.costs.tensor_parallel_link`) where the plan runs on the measured system; the costs file
keeps every measured point.

Limits: measured idle, among processes doing nothing else; in a CPU run the ranks share cores with
compute, which this does not capture.
"""

from __future__ import annotations

from calibrate.measure.collective import DEFAULT_REPEATS, DEFAULT_SIZES_BYTES, QUICK_REPEATS, QUICK_SIZES_BYTES
from calibrate.measure.rank_timing import join_measurement, median_call_s, rank_main, run_ranks, write_points

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _measure(device_type: str, sizes: list[int], repeats: int, out_path: str) -> None:
    """One rank's side (started by torchrun); rank 0 writes ``[{"op", "bytes", "seconds"}, ...]``."""
    import torch
    import torch.distributed as dist

    device = join_measurement(device_type)
    parties = dist.get_world_size()
    try:
        results = []
        for size in sizes:
            elements = max(parties, size // 4 // parties * parties)  # divides evenly among the ranks
            whole = torch.ones(elements, dtype=torch.float32, device=device)
            share = torch.empty(elements // parties, dtype=torch.float32, device=device)
            calls = {"all_reduce": lambda: dist.all_reduce(whole),
                     "reduce_scatter": lambda: dist.reduce_scatter_tensor(share, whole),
                     "all_gather": lambda: dist.all_gather_into_tensor(whole, share)}
            for op in OPS:
                results.append({"op": op, "bytes": elements * 4, "seconds": median_call_s(calls[op], device, repeats)})
        write_points(results, out_path)
    finally:
        dist.destroy_process_group()


def fit_tensor_parallel_links(parties: int, points: list[dict]) -> dict:
    """``{"all_reduce": link, "sequence_parallel": link}``: ring links (latency, bandwidth) among
    ``parties`` ranks, the second from each size's reduce-scatter plus all-gather."""
    from calibrate.fit.least_squares import fit_ring_allreduce

    seconds = {(p["op"], p["bytes"]): p["seconds"] for p in points}
    sizes = sorted({p["bytes"] for p in points})
    pairs = [seconds[("reduce_scatter", n)] + seconds[("all_gather", n)] for n in sizes]
    return {"all_reduce": fit_ring_allreduce([parties] * len(sizes), sizes,
                                             [seconds[("all_reduce", n)] for n in sizes]).to_dict(),
            "sequence_parallel": fit_ring_allreduce([parties] * len(sizes), sizes, pairs).to_dict()}


def calibrate_tensor_parallel(device_type: str = "cpu", quick: bool = False, parties: int = 2) -> dict:
    """The costs file's ``tensor_parallel`` entry: the measured points per collective among
    ``parties`` ranks and the one ring link fitted on them."""
    sizes = QUICK_SIZES_BYTES if quick else DEFAULT_SIZES_BYTES
    repeats = QUICK_REPEATS if quick else DEFAULT_REPEATS
    points = run_ranks("calibrate.measure.tp_collectives", parties, device_type, sizes, repeats,
                       f"tensor-parallel collectives among {parties} processes")
    from executor.device import device_api

    return {"backend": device_api(device_type).backend, "parties": parties,
            "sizes_bytes": sorted({int(p["bytes"]) for p in points}),
            "measured_s": {op: [float(p["seconds"]) for p in sorted(points, key=lambda p: p["bytes"])
                                if p["op"] == op] for op in OPS},
            **fit_tensor_parallel_links(parties, points)}


if __name__ == "__main__":
    rank_main(_measure)
