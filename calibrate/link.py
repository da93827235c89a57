"""Ping-pong between two ranks on the executor's own backend: one-way time per message size.

Two processes are spawned on this host (``torch.multiprocessing``), joined by
``torch.distributed`` over 127.0.0.1 with gloo for CPU tensors or NCCL for CUDA tensors (one GPU per
rank, as the executor places stages). Rank 0 sends a tensor, rank 1 sends it back; half the median
round trip is the one-way time. :func:`calibrate.fit.fit_link` turns the points into a latency and a
bandwidth. Limits: it measures the link idle, between two processes doing nothing else; the cost a
send adds inside a busy pipeline is fitted from executor runs instead.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta

DEFAULT_SIZES_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, port: int, device_type: str, sizes: list[int], repeats: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        results = []
        for size in sizes:
            buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
            times = []
            for i in range(repeats + 2):  # two warm-up round trips
                dist.barrier()
                if device_type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buffer, dst=1)
                    dist.recv(buffer, src=1)
                else:
                    dist.recv(buffer, src=0)
                    dist.send(buffer, dst=0)
                if device_type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 2:
                    times.append(time.perf_counter() - start)
            results.append({"bytes": buffer.numel() * 4, "one_way_s": statistics.median(times) / 2})
        if rank == 0:
            with open(out_path, "w") as handle:
                json.dump(results, handle)
    finally:
        dist.destroy_process_group()


def ping_pong(device_type: str = "cpu", sizes: tuple[int, ...] = DEFAULT_SIZES_BYTES,
              repeats: int = 20) -> list[dict[str, float]]:
    """``[{"bytes": n, "one_way_s": t}, ...]`` measured between two fresh local processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gpipe-link-") as directory:
        out_path = os.path.join(directory, "link.json")
        mp.spawn(_worker, args=(free_port(), device_type, list(sizes), repeats, out_path), nprocs=2,
                 join=True)
        with open(out_path) as handle:
            return list(json.load(handle))
