"""Timing one communication call among fresh local ranks, as the link and all-reduce measurements do.

The measuring processes are started on this host as the executor's workers are
(:func:`executor.launch.agent.launch_captured`), and
join ``torch.distributed`` on the executor's backend (gloo for CPU tensors, NCCL for CUDA tensors,
one GPU per rank). Each timed call starts right after a barrier and, on CUDA, between two
synchronisations; the first calls warm up and are left out. Rank 0 writes the points to a JSON file
the launching process reads back. Limits: rank 0's clock stands for the group (the ranks leave the
barrier within microseconds of each other on one host), and the call is measured idle.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable

WARMUP_CALLS = 2


def join_measurement(device_type: str):
    """A measuring rank joins the process group on the executor's backend for ``device_type``, one
    thread, its own GPU on CUDA; returns its torch device."""
    import torch
    import torch.distributed as dist

    from executor.device import device_api

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    api = device_api(device_type)
    device = api.select(rank)
    api.prepare_process()
    dist.init_process_group(api.backend, timeout=timedelta(seconds=120))
    return device


def median_call_s(call: Callable[[], None], device: Any, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``call`` after :data:`WARMUP_CALLS` warm-up ones."""
    import torch.distributed as dist

    from executor.device import device_api

    api = device_api(device)
    times = []
    for i in range(repeats + WARMUP_CALLS):
        dist.barrier()
        api.synchronize(device)
        start = time.perf_counter()
        call()
        api.synchronize(device)
        if i >= WARMUP_CALLS:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_points(points: Any, out_path: str) -> None:
    """Rank 0 writes the points (any JSON value)."""
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as handle:
            json.dump(points, handle)


def run_ranks(module: str, ranks: int, device_type: str, sizes: tuple[int, ...], repeats: int,
              what: str) -> list[dict[str, float]]:
    """Run ``python -m module DEVICE SIZES REPEATS OUT`` as ``ranks`` ranks on this host and return
    the points rank 0 wrote; a failure raises RuntimeError naming ``what`` and the last lines."""
    return list(launch_ranks(module, ranks, [device_type, ",".join(map(str, sizes)), str(repeats)], what))


def launch_ranks(module: str, ranks: int, args: list[str], what: str, timeout_s: float = 300.0) -> Any:
    """Run ``python -m module *args OUT`` as ``ranks`` ranks on this host, one thread each, and
    return the JSON rank 0 wrote to OUT; a failure raises RuntimeError naming ``what`` and the last
    lines of its output."""
    from calibrate.measure.runs import _env
    from executor.launch.agent import launch_captured
    from executor.transport.shm_transport import SHM_DIR_ENV, shared_directory

    with tempfile.TemporaryDirectory(prefix="gpipe-measure-") as directory:
        out_path = os.path.join(directory, "points.json")
        with shared_directory() as shared:  # the message files of ranks that talk as the executor's do
            outcome, output = launch_captured(module, [*args, out_path], ranks, {**_env(1), SHM_DIR_ENV: shared},
                                              timeout_s)
        if outcome.failed:
            tail = output.strip().splitlines()[-3:] or [outcome.agent_error or f"exit code {outcome.exitcode}"]
            raise RuntimeError(f"{what} failed: " + " | ".join(tail))
        with open(out_path) as handle:
            return json.load(handle)


def rank_main(measure: Callable[[str, list[int], int, str], None]) -> None:
    """A measuring module's ``__main__``: ``measure(device_type, sizes, repeats, out_path)``."""
    measure(sys.argv[1], [int(v) for v in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4])
