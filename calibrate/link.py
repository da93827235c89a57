"""Ping-pong between two ranks on the executor's own backend: one-way time per message size.

Two processes are started on this host by torchrun (as the executor's workers are), joined by
``torch.distributed`` over loopback with gloo for CPU tensors or NCCL for CUDA tensors (one GPU per
rank, as the executor places stages). Rank 0 sends a tensor, rank 1 sends it back; half the median
round trip is the one-way time. :func:`calibrate.fit.fit_link` turns the points into a latency and a
bandwidth. Limits: it measures the link idle, between two processes doing nothing else; the cost a
send adds inside a busy pipeline is fitted from executor runs instead.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

DEFAULT_SIZES_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def join_measurement(device_type: str):
    """A measuring rank (started by torchrun) joins the process group on the executor's backend for
    ``device_type``, one thread, its own GPU on CUDA; returns its torch device."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    return device


def _measure(device_type: str, sizes: list[int], repeats: int, out_path: str) -> None:
    """One rank's side of the ping-pong (started by torchrun); rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    device = join_measurement(device_type)
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
    from calibrate.runs import _env

    with tempfile.TemporaryDirectory(prefix="gpipe-link-") as directory:
        out_path = os.path.join(directory, "link.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "--monitor-interval", "0.2", "-m", "calibrate.link", device_type,
                   ",".join(map(str, sizes)), str(repeats), out_path]
        done = subprocess.run(command, env=_env(1), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError("link ping-pong failed: " + " | ".join(tail))
        with open(out_path) as handle:
            return list(json.load(handle))


if __name__ == "__main__":
    _measure(sys.argv[1], [int(v) for v in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4])
