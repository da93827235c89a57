"""How long ``gpipe plan`` takes for a 405B-parameter Llama-shaped model on 256 nodes of 8 H100.

Every T (1, 2, 4, 8), K, D, V, M, checkpoint policy, schedule, placement and ZeRO stage (0-3, each
ranked by time), on one core (pinned
with ``taskset`` where the machine has it), for ``hf:llama`` with Llama 3.1 405B's shape (126
layers, hidden 16384, FFN 53248, 128 heads, 8 key/value heads, vocabulary 128256, 8192 tokens),
a global batch of 2048 sequences (16M tokens), Megatron's bf16 model and overlapped reduction.
Writes benchmarks/results/plan_405b.json with the wall time of the whole command, the search's
own time, the command's CPU time (what it costs a core of its own where other jobs share the machine)
and the best plan.

    .venv/bin/python benchmarks/plan_405b.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.plan_timing import one_core, timed_plan, write_results  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "plan_405b.json")
SHAPE = {"num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
         "num_key_value_heads": 8, "vocab_size": 128256, "seq": 8192}
COMMAND = ["plan", "--model", "hf:llama", *[f"--option={k}={v}" for k, v in SHAPE.items()],
           "--precision", "bf16-model", "--hardware", "h100-nvlink", "--nodes", "256", "--batch", "2048",
           "--tensor-parallel-options", "1,2,4,8", "--zero-options", "0,1,2,3", "--dp-overlap", "--quiet", "--json"]


def main() -> int:
    pin = one_core()
    write_results(RESULTS, [timed_plan(COMMAND, top, pin) for top in (1, 10)], pin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
