"""How much slower a small stage's forward runs when something displaced its caches since the last one.

Why: the layer profile times each layer in a tight loop, where its weights, its input and its
output buffer stay in the caches from one call to the next. In a pipeline a stage does other work
between two forwards: it copies its output into the message for the next stage (the executor's
shared-memory send), runs its own loop, and waits. On the calibration's transformer the stage of
the embedding alone forwards 16 rows in the pipeline in 168-234 us, against about 40 us in the
profile's loop. This script takes the pipeline away and times that stage's forward (no graph, one
thread, ``executor.transport.host_allocator.keep_freed_memory`` as the executor's ranks set it) right after
the previous one, after copying its output as a send does, and after streaming a buffer of a few
MiB (what a larger stage's weights or another process would push through the shared caches), at
2 to 16 rows. Median microseconds over the repetitions; the cases take turns within each repetition.

What it cannot say: which cache level or what else (the TLB, the hypervisor) the time goes to;
this machine exposes no cycle counters.

    .venv/bin/python benchmarks/cold_caches.py [--repeats 200] [out.json]
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

from executor.transport.host_allocator import keep_freed_memory  # noqa: E402
from executor.models.build import build_model  # noqa: E402
from sim.formats.timeline import write_json_atomic  # noqa: E402

OPTIONS = {"layers": 4, "d_model": 128, "ff": 512, "heads": 4, "seq": 32, "vocab": 256}
ROWS = (2, 4, 8, 16)
STREAM_BYTES = 8 << 20  # more than this machine's L2 and its share of L3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.path.join(ROOT, "benchmarks", "results", "cold_caches.json"))
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    keep_freed_memory()
    torch.set_num_threads(1)
    embedding = build_model("transformer", OPTIONS)[0]
    stream = torch.ones(STREAM_BYTES // 4)
    rows_out = []
    for rows in ROWS:
        tokens = torch.randint(0, OPTIONS["vocab"], (rows, OPTIONS["seq"]))
        with torch.no_grad():
            message = torch.empty_like(embedding(tokens))  # where a send copies the output

        def forward_s() -> tuple[torch.Tensor, float]:
            start = time.perf_counter()
            with torch.no_grad():
                out = embedding(tokens)
            return out, time.perf_counter() - start

        cases = {"right after the last": lambda out: None,
                 "after copying its output (a send)": lambda out: message.copy_(out),
                 f"after streaming {STREAM_BYTES >> 20} MiB": lambda out: stream.add_(1.0)}
        samples: dict[str, list[float]] = {name: [] for name in cases}
        out, _ = forward_s()
        for _ in range(args.repeats):
            for name, between in cases.items():
                between(out)
                out, seconds = forward_s()
                samples[name].append(seconds)
        for name, values in samples.items():
            rows_out.append({"rows": rows, "case": name, "median_us": statistics.median(values) * 1e6})
        print(f"{rows:2d} rows: " + "  ".join(f"{r['case']} {r['median_us']:.0f} us"
                                              for r in rows_out if r["rows"] == rows))
    result = {"options": OPTIONS, "stage": "embedding", "stream_bytes": STREAM_BYTES, "cores": os.cpu_count(),
              "repeats": args.repeats, "torch": torch.__version__, "rows": rows_out}
    write_json_atomic(args.out, result)
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
