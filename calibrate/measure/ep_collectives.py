"""Expert parallelism's all-to-all among E ranks on the executor's backend: what a token exchange waits on.

A block under ``--expert-parallel E`` (:mod:`executor.parallel.expert_exchange`) sends each routed
assignment's hidden state to the rank holding its expert and brings the output back, each an
``all_to_all_single`` of fp32 rows over the stage's expert-parallel group. Here E fresh processes on this
host, started by torchrun as the executor's workers are, exchange one fp32 tensor per size (the bytes
each rank holds before the exchange, an equal part for every rank, its own included): two warm-up
calls, then the median of ``repeats`` calls as rank 0 timed them.

The fit is the pairwise exchange's: each rank sends (E-1)/E of its bytes in E-1 steps, the form of a
ring all-gather of the same bytes (:func:`calibrate.fit.least_squares.fit_ring_gather`), so one call
of ``bytes`` per rank takes ``(E-1) x latency_s + (E-1)/E x bytes / bytes_per_s``. The costs file
keeps it as its ``expert_parallel`` entry, ``{"all_to_all": {"latency_s", "bytes_per_s", "measured"}}``.

Limits: measured idle, among processes doing nothing else, with equal parts; the executor's exchanges
are uneven (each rank sends what its router chose) and its ranks share cores with compute, which this
does not capture.
"""

from __future__ import annotations

from calibrate.measure.collective import (DEFAULT_REPEATS, DEFAULT_SIZES_BYTES, QUICK_REPEATS, QUICK_SIZES_BYTES,
                                          available_parties, party_counts)
from calibrate.measure.rank_timing import join_measurement, median_call_s, rank_main, write_points


def _measure(device_type: str, sizes: list[int], repeats: int, out_path: str) -> None:
    """One rank's side (started by torchrun); rank 0 writes ``[{"bytes", "seconds"}, ...]``."""
    import torch
    import torch.distributed as dist

    device = join_measurement(device_type)
    parties = dist.get_world_size()
    try:
        results = []
        for size in sizes:
            elements = max(parties, size // 4 // parties * parties)  # an equal part for every rank
            sent = torch.ones(elements, dtype=torch.float32, device=device)
            received = torch.empty_like(sent)
            seconds = median_call_s(lambda: dist.all_to_all_single(received, sent), device, repeats)
            results.append({"bytes": elements * 4, "seconds": seconds})
        write_points(results, out_path)
    finally:
        dist.destroy_process_group()


def calibrate_expert_parallel(device_type: str = "cpu", quick: bool = False,
                              parties: list[int] | None = None) -> dict | None:
    """The costs file's ``expert_parallel`` entry: the all-to-all's measured points among each group
    size and the pairwise-exchange link fitted on all of them; None on a one-core machine."""
    from calibrate.fit.least_squares import fit_ring_gather
    from calibrate.measure import rank_timing
    from executor.device import device_api

    counts = parties if parties is not None else party_counts(available_parties(device_type))
    if not counts:
        return None
    sizes = QUICK_SIZES_BYTES if quick else DEFAULT_SIZES_BYTES
    repeats = QUICK_REPEATS if quick else DEFAULT_REPEATS
    points = [(n, p["bytes"], p["seconds"]) for n in counts
              for p in rank_timing.run_ranks("calibrate.measure.ep_collectives", n, device_type, sizes, repeats,
                                             f"all-to-all among {n} processes")]
    fit = fit_ring_gather([n for n, _, _ in points], [b for _, b, _ in points], [t for _, _, t in points])
    return {"backend": device_api(device_type).backend, "parties": list(counts),
            "all_to_all": {"latency_s": fit.latency_s, "bytes_per_s": fit.bandwidth_bytes_per_s,
                           "measured": [{"parties": n, "bytes": b, "seconds": t} for n, b, t in points]}}


if __name__ == "__main__":
    rank_main(_measure)
