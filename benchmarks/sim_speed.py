"""How fast the simulator and the planner are, and how simulation cost grows with K x M.

Writes benchmarks/results/sim_speed.json and prints a table. Wall times are the best of several
repetitions (the minimum is the least noisy estimate on a shared machine).

    .venv/bin/python benchmarks/sim_speed.py
"""

from __future__ import annotations

import os
import platform
import sys
import time

import numpy as np

from sim.catalog.hardware import get_system
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.formats.timeline import write_json_atomic
from sim.planner.search import default_replica_options, default_stage_options, search
from sim.workloads.models import get_workload
from sim.workloads.workload import UniformWorkload

RESULTS = os.path.join(os.path.dirname(__file__), "results", "sim_speed.json")


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def simulate_case(stages: int, microbatches: int, system: str, checkpoint: str, schedule: str,
                  record: bool = True) -> float:
    workload = UniformWorkload(stages)
    sys_ = get_system(system, nodes=max(1, -(-stages // get_system(system).devices_per_node)))
    return best_of(5 if stages * microbatches < 4096 else 3, lambda: simulate(workload, sys_, [1] * stages,
                                                                              microbatches,
                                                                              ParallelLayout.for_partition([1] * stages,
                                                                                                           microbatches,
                                                                                                           checkpoint=checkpoint,
                                                                                                           schedule=schedule), record=record))


def main() -> int:
    rows = []
    for stages, microbatches in [(8, 32), (128, 128)]:
        for system, checkpoint, schedule in [("ideal", "never", "gpipe"), ("h100-nvlink", "always", "gpipe"),
                                             ("h100-pcie", "except_last", "1f1b")]:
            seconds = simulate_case(stages, microbatches, system, checkpoint, schedule)
            rows.append({"case": f"simulate K={stages} M={microbatches}", "system": system,
                         "checkpoint": checkpoint, "schedule": schedule, "wall_s": seconds})
    transformer = get_workload("transformer", {"layers": 48, "d_model": 1024, "ff": 4096, "heads": 16,
                                               "seq": 512, "vocab": 32000})
    # batch 64: M values that split the batch alike are one candidate; batch 4096: all 64 M differ
    for system, batch in (("a100-nvlink", 64), ("tpu-v3", 64), ("a100-nvlink", 4096)):
        holder = {}

        def plan():
            holder["result"] = search(transformer, get_system(system), batch, [1, 2, 4, 8], list(range(1, 65)))

        seconds = best_of(3, plan)
        result = holder["result"]
        rows.append({"case": f"plan transformer-48 batch {batch}, K 1,2,4,8 x M 1..64 x 3 policies x 2 schedules",
                     "system": system, "wall_s": seconds, "candidates": result.candidates,
                     "simulated": result.simulated})
    # the scale-out goal: a 96-block transformer on 64 devices (8 nodes of 8 H100) over the whole
    # space gpipe plan searches by default: D x K <= 64, V in 1,2,4, M 1..64, 3 policies, 3 schedules,
    # both placements where they differ; the global batch 512
    big = get_workload("transformer", {"layers": 96, "d_model": 1024, "ff": 4096, "heads": 16, "seq": 512,
                                       "vocab": 32000})
    cluster = get_system("h100-nvlink", nodes=8)
    holder = {}

    def plan_scale_out():
        holder["result"] = search(big, cluster, 512, default_stage_options(cluster, big.num_layers),
                                  list(range(1, 65)), replica_options=default_replica_options(cluster),
                                  virtual_options=[1, 2, 4])

    seconds = best_of(3, plan_scale_out)
    result = holder["result"]
    best = result.best.candidate
    rows.append({"case": "plan transformer-96 batch 512 on 64 devices, D x K x V x M x policy x schedule x placement",
                 "system": "h100-nvlink x8", "wall_s": seconds, "candidates": result.candidates,
                 "simulated": result.simulated, "partitioned": result.partitioned,
                 "best": {"replicas": best.replicas, "stages": best.stages, "virtual_stages": best.virtual_stages,
                          "microbatches": best.microbatches, "schedule": best.schedule,
                          "placement": best.placement, "step_time_s": result.best.step_time_s}})
    # growth: time per simulated action over a grid of K x M (ideal links, gpipe, never)
    growth = []
    for stages in (4, 16, 64):
        for microbatches in (8, 32, 128):
            seconds = simulate_case(stages, microbatches, "h100-nvlink", "never", "gpipe")
            growth.append({"K": stages, "M": microbatches, "KxM": stages * microbatches, "wall_s": seconds})
    km = np.array([g["KxM"] for g in growth], dtype=float)
    wall = np.array([g["wall_s"] for g in growth])
    exponent, _ = np.polyfit(np.log(km), np.log(wall), 1)
    summary = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "rows": rows, "growth": growth, "growth_exponent_in_KxM": float(exponent),
        "microseconds_per_KxM": float(np.median(wall / km) * 1e6),
    }
    write_json_atomic(RESULTS, summary)
    for row in rows:
        extra = f" ({row['simulated']} of {row['candidates']} simulated)" if "candidates" in row else ""
        print(f"{row['case']:<86} {row['system']:<14} {row['wall_s'] * 1e3:9.1f} ms{extra}")
    print(f"cost grows as (K x M)^{exponent:.2f}; median {summary['microseconds_per_KxM']:.1f} us per K x M")
    print(f"results written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
