"""How much slower a stage's actions run right after its device waited, within one process.

Why: in a pipeline the first stage of a skewed partition ([1,5]: the embedding alone) waits about
9 ms for each gradient under 1F1B, then runs a backward and a forward of a few hundred microseconds.
Its measured busy time is 16-21% above the calibrated prediction in every held-out validation
(benchmarks/README.md), and ``cold_starts.py`` shows the forwards after backwards as the slow ones
there. This script takes the pipeline away to find what makes them slow: one process, one thread,
the calibration's transformer (4 blocks, d_model 128, 2 rows of 32 tokens, as at M=16), a stage of
the embedding alone, one block, or three blocks. Each repetition runs, for each wait length W, the
pattern a 1F1B stage runs: a forward, a wait of W (polling with ``os.sched_yield`` as
:mod:`executor.transport.shm_transport`'s receivers do), its backward, the next forward, that forward's
backward; and, separately, a forward right after a wait. The wait lengths take turns within each
repetition, so the machine's drift cancels; each figure is the median over repetitions.

What it cannot say directly: whether the slowdown comes from the caches (the other tenants of a
shared host's L2 and L3 while this process polls), from the core's clock or from the hypervisor;
this machine exposes no cycle counters (``perf stat -e cycles``: not supported). Two more modes
narrow it down:

* ``--ways``: at a 9 ms wait, how the wait is spent: polling with ``os.sched_yield`` (a system call
  each time), a pure spin on the clock (none), sleeping, and polling while running the stage's own
  forward without gradients every millisecond (its code and weights kept in use). If the clock or
  the system calls were the cause, the spin or the sleep would differ from polling; if what the
  stage uses is displaced while the core runs something else, only the last keeps it.
* ``--probes N --every S``: the 9 ms measurement (polling) N times, S seconds apart: how much the
  loss moves from one moment to the next on this machine, the noise a calibration's fitted warm-up
  carries into a validation minutes later.

    .venv/bin/python benchmarks/after_wait.py [--repeats 60] [out.json]
    .venv/bin/python benchmarks/after_wait.py --ways [--repeats 40] [out.json]
    .venv/bin/python benchmarks/after_wait.py --probes 12 --every 20 [--repeats 25] [out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from executor.models.build import build_model  # noqa: E402
from sim.formats.timeline import write_json_atomic  # noqa: E402

OPTIONS = {"layers": 4, "d_model": 128, "ff": 512, "heads": 4, "seq": 32, "vocab": 256}
ROWS = 2  # batch 32 in 16 micro-batches
STAGES = {"embedding": (0, 1), "one block": (1, 2), "three blocks": (1, 4)}  # layer ranges of the model
WAITS_MS = (0.0, 1.0, 3.0, 9.0)


def poll(seconds: float) -> None:
    """Wait as a pipeline receiver does before its message arrives: yield the core, look again."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        os.sched_yield()


def spin(seconds: float) -> None:
    """Wait without a system call: read the clock until it is time."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def kept_warm(stage: "TimedStage", every_s: float = 1e-3) -> Callable[[float], None]:
    """A wait that polls and runs ``stage``'s forward without gradients every ``every_s``."""
    def wait(seconds: float) -> None:
        until = time.perf_counter() + seconds
        due = time.perf_counter()
        while (now := time.perf_counter()) < until:
            if now >= due:
                with torch.no_grad():
                    stage.forward()
                due = now + every_s
            os.sched_yield()
    return wait


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


def measure(stage: TimedStage, wait_s: float, wait: Callable[[float], None] = poll) -> dict[str, float]:
    """One repetition at one wait length, the wait spent as ``wait`` spends it: the seconds of each
    timed action."""
    out, _ = stage.forward()
    wait(wait_s)
    backward_after_wait = stage.backward(out)
    out, forward_after_backward = stage.forward()
    stage.backward(out)
    wait(wait_s)
    out, forward_after_wait = stage.forward()
    stage.backward(out)
    return {"B after wait": backward_after_wait, "F after that B": forward_after_backward,
            "F after wait": forward_after_wait}


def medians_us(stage: TimedStage, cases: dict[Any, tuple[float, Callable[[float], None]]],
               repeats: int) -> dict[Any, dict[str, float]]:
    """Per case (a wait length and a way to spend it), each timed action's median microseconds over
    ``repeats`` repetitions, the cases taking turns within each so the machine's drift cancels."""
    for wait_s, wait in cases.values():  # warm-up
        measure(stage, wait_s, wait)
    samples: dict[Any, dict[str, list[float]]] = {key: {} for key in cases}
    for _ in range(repeats):
        for key, (wait_s, wait) in cases.items():
            for action, seconds in measure(stage, wait_s, wait).items():
                samples[key].setdefault(action, []).append(seconds)
    return {key: {action: statistics.median(values) * 1e6 for action, values in actions.items()}
            for key, actions in samples.items()}


def by_wait_length(stages: dict[str, TimedStage], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, stage in stages.items():
        table = medians_us(stage, {w: (w / 1e3, poll) for w in WAITS_MS}, repeats)
        for wait_ms, actions in table.items():
            for action, median_us in actions.items():
                rows.append({"stage": name, "layers": len(stage.layers), "wait_ms": wait_ms, "action": action,
                             "median_us": median_us, "over_no_wait_us": median_us - table[0.0][action]})
        print(f"{name:>12}: " + "  ".join(
            f"{r['action']} {r['wait_ms']:.0f}ms {r['median_us']:.0f}us" for r in rows if r["stage"] == name))
    return rows


def by_way(stages: dict[str, TimedStage], repeats: int, wait_ms: float = 9.0) -> list[dict[str, Any]]:
    """At one wait length, each way of spending it against no wait at all."""
    rows = []
    for name, stage in stages.items():
        ways = {"poll": poll, "spin": spin, "sleep": time.sleep, "poll, stage kept warm": kept_warm(stage)}
        cases = {"no wait": (0.0, poll), **{way: (wait_ms / 1e3, wait) for way, wait in ways.items()}}
        table = medians_us(stage, cases, repeats)
        for way in ways:
            for action, median_us in table[way].items():
                rows.append({"stage": name, "layers": len(stage.layers), "wait_ms": wait_ms, "way": way,
                             "action": action, "median_us": median_us, "no_wait_us": table["no wait"][action],
                             "over_no_wait_us": median_us - table["no wait"][action]})
            print(f"{name:>12} {way:>22}: " + "  ".join(
                f"{r['action']} +{r['over_no_wait_us']:.0f}us" for r in rows if r["stage"] == name and r["way"] == way))
    return rows


def over_time(stages: dict[str, TimedStage], repeats: int, probes: int, every_s: float,
              wait_ms: float = 9.0) -> list[dict[str, Any]]:
    """The loss after a wait of ``wait_ms`` (polling), measured ``probes`` times ``every_s`` apart."""
    rows = []
    for probe in range(probes):
        if probe:
            time.sleep(every_s)
        clock = time.strftime("%H:%M:%S")
        for name, stage in stages.items():
            table = medians_us(stage, {0.0: (0.0, poll), wait_ms: (wait_ms / 1e3, poll)}, repeats)
            for action, median_us in table[wait_ms].items():
                rows.append({"probe": probe, "time": clock, "stage": name, "layers": len(stage.layers),
                             "wait_ms": wait_ms, "action": action, "median_us": median_us,
                             "no_wait_us": table[0.0][action], "over_no_wait_us": median_us - table[0.0][action]})
        print(f"{clock}: " + "  ".join(f"{r['stage']} {r['action']} +{r['over_no_wait_us']:.0f}us"
                                       for r in rows if r["probe"] == probe), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="results file (default: results/after_wait[_ways|_over_time].json)")
    parser.add_argument("--repeats", type=int, default=60)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--ways", action="store_true", help="how a 9 ms wait is spent, not its length")
    mode.add_argument("--probes", type=int, default=0, help="the 9 ms loss this many times, --every seconds apart")
    parser.add_argument("--every", type=float, default=20.0, help="seconds between probes")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.probes < 0 or args.every < 0:
        parser.error(f"--repeats must be at least 1 and --probes and --every at least 0, got {args.repeats}, "
                     f"{args.probes} and {args.every}")
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    torch.set_num_threads(1)  # as each rank of a 2-core pipeline runs
    model = build_model("transformer", OPTIONS)
    tokens = torch.randint(0, OPTIONS["vocab"], (ROWS, OPTIONS["seq"]))
    with torch.no_grad():
        embedded = model[0](tokens)
    chosen = STAGES if not (args.ways or args.probes) else {k: STAGES[k] for k in ("embedding", "three blocks")}
    stages = {name: TimedStage(model[first:end], tokens, None if first == 0 else embedded)
              for name, (first, end) in chosen.items()}
    if args.ways:
        rows, suffix = by_way(stages, args.repeats), "_ways"
    elif args.probes:
        rows, suffix = over_time(stages, args.repeats, args.probes, args.every), "_over_time"
    else:
        rows, suffix = by_wait_length(stages, args.repeats), ""
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"after_wait{suffix}.json")
    result = {"options": OPTIONS, "rows_per_microbatch": ROWS, "cores": os.cpu_count(), "repeats": args.repeats,
              "torch": torch.__version__, "started": started, "rows": rows}
    write_json_atomic(out, result)
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
