"""Ping-pong between two ranks over the executor's own path: one-way time per message size.

Two processes are started on this host by torchrun (as the executor's workers are), joined by
``torch.distributed`` over loopback with gloo for CPU tensors or NCCL for CUDA tensors (one GPU per
rank, as the executor places stages); CPU messages go through shared memory as the executor's do
between ranks of one host (:mod:`executor.transport.shm_transport`). Rank 0 sends a tensor, rank 1 sends it back; half the median
round trip is the one-way time. :func:`calibrate.fit.least_squares.fit_link` turns the points into a latency and a
bandwidth. Limits: it measures the link idle, between two processes doing nothing else; the cost a
send adds inside a busy pipeline is fitted from executor runs instead.
"""

from __future__ import annotations

import os

from calibrate.measure.rank_timing import join_measurement, median_call_s, rank_main, run_ranks, write_points

DEFAULT_SIZES_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _measure(device_type: str, sizes: list[int], repeats: int, out_path: str) -> None:
    """One rank's side of the ping-pong (started by torchrun); rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    from executor.transport.shm_transport import host_links

    rank = int(os.environ["RANK"])
    device = join_measurement(device_type)
    try:
        links = host_links(device, "auto", 120.0)  # the executor's own path between ranks of one host
        transport = "shared memory" if links is not None else dist.get_backend()
        results = []
        for size in sizes:
            buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
            layout = [(tuple(buffer.shape), buffer.dtype)]

            def round_trip() -> None:
                if links is not None:  # as the executor takes a message: in place, released once used
                    if rank == 0:
                        links.send(1, 0, "act", 0, [buffer])
                        links.take(1, 0, "grad", 0, layout)
                        links.release()
                    else:
                        (received,) = links.take(0, 0, "act", 0, layout)
                        links.send(0, 0, "grad", 0, [received])
                        links.release()
                elif rank == 0:
                    dist.send(buffer, dst=1)
                    dist.recv(buffer, src=1)
                else:
                    dist.recv(buffer, src=0)
                    dist.send(buffer, dst=0)

            results.append({"bytes": buffer.numel() * 4, "transport": transport,
                            "one_way_s": median_call_s(round_trip, device, repeats) / 2})
        write_points(results, out_path)
    finally:
        dist.destroy_process_group()


def ping_pong(device_type: str = "cpu", sizes: tuple[int, ...] = DEFAULT_SIZES_BYTES,
              repeats: int = 20) -> list[dict[str, float]]:
    """``[{"bytes": n, "one_way_s": t}, ...]`` measured between two fresh local processes."""
    return run_ranks("calibrate.measure.link", 2, device_type, sizes, repeats, "link ping-pong")


if __name__ == "__main__":
    rank_main(_measure)
