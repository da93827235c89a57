"""Meta-device analysis of large transformers: wall time and peak RSS, one fresh process per size.

Writes results/meta_analysis.json. Sizes: GPT-style, ff = 4 d_model, seq 2048, vocab 50304.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

SIZES = {"1.1B": (24, 1792, 14), "81B": (100, 8192, 64)}


def measure(layers: int, d_model: int, heads: int) -> dict:
    from calibrate.measure.meta_profile import torch_workload

    started = time.perf_counter()
    w = torch_workload("transformer", {"layers": layers, "d_model": d_model, "ff": 4 * d_model,
                                       "heads": heads, "seq": 2048, "vocab": 50304})
    w.layer_costs(8, __import__("sim.catalog.hardware", fromlist=["get_system"]).get_system("h100-nvlink").device)
    return {"parameters": w.parameter_count, "analysis_s": time.perf_counter() - started,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    if len(sys.argv) == 4:
        print(json.dumps(measure(*map(int, sys.argv[1:]))))
        return
    results = {}
    for name, size in SIZES.items():
        out = subprocess.run([sys.executable, __file__, *map(str, size)], capture_output=True, text=True,
                             check=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(name, results[name])
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "meta_analysis.json")
    from sim.formats.timeline import write_json_atomic

    write_json_atomic(path, results)


if __name__ == "__main__":
    main()
