"""How much slower a stage's actions run right after its device waited, within one process.

Why: in a pipeline the first stage of a skewed partition ([1,5]: the embedding alone) waits about
9 ms for each gradient under 1F1B, then runs a backward and a forward of a few hundred microseconds.
Its measured busy time is 16-21% above the calibrated prediction in every held-out validation
(benchmarks/README.md), and ``cold_starts.py`` shows the forwards after backwards as the slow ones
there. This script takes the pipeline away to find what makes them slow: one process, one thread,
the calibration's transformer (4 blocks, d_model 128, 2 rows of 32 tokens, as at M=16), a stage of
the embedding alone, one block, or three blocks. Each repetition runs, for each wait length W, the
pattern a 1F1B stage runs: a forward, a wait of W (polling with ``os.sched_yield`` as
:mod:`executor.shm_transport`'s receivers do), its backward, the next forward, that forward's
backward; and, separately, a forward right after a wait. The wait lengths take turns within each
repetition, so the machine's drift cancels; each figure is the median over repetitions.

What it cannot say: whether the slowdown comes from the caches (the other tenants of a shared
host's L2 and L3 while this process polls), from the core's clock or from the hypervisor; this
machine exposes no cycle counters (``perf stat -e cycles``: not supported).

    .venv/bin/python benchmarks/after_wait.py [--repeats 60] [out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from executor.models import build_model  # noqa: E402
from sim.timeline import write_json_atomic  # noqa: E402

OPTIONS = {"layers": 4, "d_model": 128, "ff": 512, "heads": 4, "seq": 32, "vocab": 256}
ROWS = 2  # batch 32 in 16 micro-batches
STAGES = {"embedding": (0, 1), "one block": (1, 2), "three blocks": (1, 4)}  # layer ranges of the model
WAITS_MS = (0.0, 1.0, 3.0, 9.0)


def poll(seconds: float) -> None:
    """Wait as a pipeline receiver does before its message arrives: yield the core, look again."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        os.sched_yield()


class TimedStage:
    """A stage's layers and its input; ``forward()`` and ``backward(out)`` return their seconds."""

    def __init__(self, layers: torch.nn.Sequential, tokens: torch.Tensor, embedded: torch.Tensor | None) -> None:
        self.layers, self.tokens, self.embedded = layers, tokens, embedded

    def forward(self) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        x = self.tokens if self.embedded is None else self.embedded.detach().requires_grad_(True)
        out = self.layers(x)
        return out, time.perf_counter() - start

    @staticmethod
    def backward(out: torch.Tensor) -> float:
        start = time.perf_counter()
        out.backward(torch.ones_like(out))
        return time.perf_counter() - start


def measure(stage: TimedStage, wait_s: float) -> dict[str, float]:
    """One repetition at one wait length: the seconds of each timed action."""
    out, _ = stage.forward()
    poll(wait_s)
    backward_after_wait = stage.backward(out)
    out, forward_after_backward = stage.forward()
    stage.backward(out)
    poll(wait_s)
    out, forward_after_wait = stage.forward()
    stage.backward(out)
    return {"B after wait": backward_after_wait, "F after that B": forward_after_backward,
            "F after wait": forward_after_wait}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.path.join(ROOT, "benchmarks", "results", "after_wait.json"))
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as each rank of a 2-core pipeline runs
    model = build_model("transformer", OPTIONS)
    tokens = torch.randint(0, OPTIONS["vocab"], (ROWS, OPTIONS["seq"]))
    with torch.no_grad():
        embedded = model[0](tokens)
    rows = []
    for name, (first, end) in STAGES.items():
        stage = TimedStage(model[first:end], tokens, None if first == 0 else embedded)
        for wait_ms in WAITS_MS:  # warm-up
            measure(stage, wait_ms / 1e3)
        samples: dict[float, dict[str, list[float]]] = {w: {} for w in WAITS_MS}
        for _ in range(args.repeats):
            for wait_ms in WAITS_MS:
                for action, seconds in measure(stage, wait_ms / 1e3).items():
                    samples[wait_ms].setdefault(action, []).append(seconds)
        for wait_ms in WAITS_MS:
            for action, values in samples[wait_ms].items():
                median_us = statistics.median(values) * 1e6
                base_us = statistics.median(samples[0.0][action]) * 1e6
                rows.append({"stage": name, "layers": end - first, "wait_ms": wait_ms,
                             "action": action, "median_us": median_us, "over_no_wait_us": median_us - base_us})
        print(f"{name:>12}: " + "  ".join(
            f"{r['action']} {r['wait_ms']:.0f}ms {r['median_us']:.0f}us" for r in rows if r["stage"] == name))
    result = {"options": OPTIONS, "rows_per_microbatch": ROWS, "cores": os.cpu_count(), "repeats": args.repeats,
              "torch": torch.__version__, "rows": rows}
    write_json_atomic(args.out, result)
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
