"""How long ``gpipe plan --model deepseek-v3 --hardware h100-nvlink --nodes 256`` takes (goal: under 60 s
on one core).

The command as a user types it, on one core (pinned with ``taskset`` where the machine has it): every T,
K, D, E and ETP (the divisors of the 256 routed experts dividing T x D, ETP 1 and T), V, M, checkpoint
policy, schedule, placement and ZeRO (auto) by default, at the default batch; then at a batch of 4,096
sequences (16.8M tokens), where the best plan splits the experts. Writes
benchmarks/results/plan_deepseek_v3.json with the wall time of the whole command, the search's own time,
the command's CPU time and the best plan.

    .venv/bin/python benchmarks/plan_deepseek_v3.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.plan_timing import one_core, timed_plan, write_results  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "plan_deepseek_v3.json")
COMMAND = ["plan", "--model", "deepseek-v3", "--hardware", "h100-nvlink", "--nodes", "256", "--quiet", "--json"]


def main() -> int:
    pin = one_core()
    experts = {"expert_parallel": 1, "expert_tensor_parallel": None}  # left out of a plan where default
    rows = [timed_plan(COMMAND, top, pin, experts) for top in (1, 10)]
    rows.append(timed_plan([*COMMAND, "--batch", "4096"], 10, pin, experts))  # a batch at which expert parallelism wins
    write_results(RESULTS, rows, pin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
