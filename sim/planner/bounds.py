"""Lower bounds on a candidate's simulated step time, for the planner's best-first search.

Both must never exceed what :func:`sim.engine.engine.simulate` returns (property tests check it): the
planner simulates candidates in order of their bound and stops once the next bound exceeds the
``top``-th best step, so an unsound bound would drop a plan from the ranking.

:func:`lower_bound_s`, for a partitioned candidate. Take replica 0 (any one replica bounds the
step, since every data-parallel all-reduce waits for all replicas) and device k:

- before its first action, the forwards of micro-batch 0 on virtual stages 0..k-1 (``fill``);
- all its own work on its chunks (``compute``), ending with its last backward, which is on its
  chunk 0 whatever the schedule;
- then either its own tail (data-parallel all-reduce, optimizer, fitted overhead) or that last
  backward's gradient flowing back through virtual stages k-1..0 (``drain``, one backward each)
  followed by device 0's tail: whichever is longer. Split-backward schedules (``zb-h1``) take its own
  tail alone: a device's last actions are W's, which nothing after them waits for.

Communication between stages and the shared-parameter reduction are left out, so it only gets
smaller; so are ZeRO-2/3's gathers and reduce-scatters, with the optimizer step on the shard.
The all-reduce is the engine's own closed form, which depends on bytes and links alone.

:func:`balanced_bound_s`, before any partition: the K devices share the whole model's work and,
with D > 1, each device's all-reduce; the busiest device does at least the average. The all-reduce
of stage k is affine in its bytes (a_k x bytes + b_k), the devices together hold at least the
model's gradient bytes, so the sum over k is at least min(a) x bytes + K x min(b). Without
interleaving it also takes the pipeline's fill and drain at their least over all partitions
(:meth:`BalancedBounds.bubble_s`), which rules out deep pipelines of few micro-batches unpartitioned.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Sequence

from sim.catalog.hardware import Link, System
from sim.engine.allreduce import data_parallel_group, group_allreduce_s
from sim.engine.stage_costs import CostTable, StageCost, backward_time_s, stage_bounds
from sim.schedules.microbatch import split_rows
from sim.schedules.schedule import SPLIT_BACKWARD_SCHEDULES, recomputes, virtual_stages_of_device
from sim.workloads.moe.expert_parallel import expert_data_ranks


def replica_rows(batch_size: int, replicas: int, microbatches: int) -> list[int]:
    """Replica 0's micro-batch rows (the largest replica: torch.chunk puts the remainder last)."""
    return list(_replica_rows(batch_size, replicas, microbatches))


@lru_cache(maxsize=1 << 14)
def _replica_rows(batch_size: int, replicas: int, microbatches: int) -> tuple[int, ...]:
    """:func:`replica_rows`, kept for the planner's many candidates of one D and M."""
    return tuple(split_rows(split_rows(batch_size, replicas)[0], microbatches))


def stage_allreduce_s(table: CostTable, rows: int, partition: Sequence[int], stages: int, replicas: int,
                      placement: str, system: System, allreduce_link: Link | None,
                      schedule: str = "gpipe") -> list[float]:
    """Each device's data-parallel all-reduce, as :mod:`sim.engine.engine` times it."""
    if replicas == 1:
        return [0.0] * stages
    bounds = stage_bounds(partition)
    virtual = len(bounds) // stages
    out = []
    for k in range(stages):
        nbytes = sum(table.gradient_and_optimizer_bytes(rows, *bounds[s])[0]
                     for s in virtual_stages_of_device(k, stages, virtual, schedule))
        out.append(group_allreduce_s(nbytes, data_parallel_group(k, replicas, stages, placement), system,
                                     allreduce_link))
    return out


def shard_share(table: CostTable, candidate) -> float:
    """The least share of a device's optimizer step ZeRO-2/3 leaves it: 1 over the larger of its shard
    group and (experts split) the routed experts' expert-data-parallel ranks, so a bound whatever the split."""
    return 1 / max(candidate.shard_ranks, expert_data_ranks(table.workload, candidate.replicas))


def lower_bound_s(table: CostTable, batch_size: int, candidate, partition: Sequence[int],
                  system: System | None = None, allreduce_link: Link | None = None) -> float:
    """A bound on ``candidate``'s step with ``partition`` (module docstring); without ``system``
    the all-reduce is left out (still a bound)."""
    c = candidate
    rows = replica_rows(batch_size, c.replicas, c.microbatches)
    K = len(partition) // c.virtual_stages
    bounds = stage_bounds(partition)
    by_rows: dict[int, list[StageCost]] = {r: [table.stage(r, a, b) for a, b in bounds] for r in set(rows)}
    first = by_rows[rows[0]]
    sharded = c.zero >= 2 and c.replicas > 1  # ZeRO-2/3: reduce-scatters, bounded below by nothing
    allreduce = (stage_allreduce_s(table, rows[0], partition, K, c.replicas, c.placement, system, allreduce_link,
                                   c.schedule) if system is not None and not sharded else [0.0] * K)
    optimizer_share = shard_share(table, c) if sharded else 1.0  # the optimizer steps the shard
    tails, computes = [], []
    # micro-batches by rows (at most two sizes), and those of them recomputed: a device's work is their
    # counts times each size's costs, summed without walking every micro-batch
    count = Counter(rows)
    again = Counter(r for m, r in enumerate(rows) if recomputes(c.checkpoint, m, len(rows)))
    for k in range(K):
        chunks = virtual_stages_of_device(k, K, c.virtual_stages, c.schedule)
        compute = 0.0
        for s in chunks:
            for r, n in count.items():
                cost = by_rows[r][s]
                compute += n * (cost.forward_s + backward_time_s(cost, c.checkpoint))
            for r, n in again.items():
                compute += n * by_rows[r][s].recompute_s
        computes.append(compute)
        tails.append(allreduce[k] + optimizer_share * sum(first[s].optimizer_s for s in chunks)
                     + max(first[s].step_overhead_s for s in chunks))
    best = fill = drain = 0.0
    split = c.schedule in SPLIT_BACKWARD_SCHEDULES  # device k's last W may run beside the others' drain
    for k in range(K):
        best = max(best, fill + computes[k] + (tails[k] if split else max(tails[k], drain + tails[0])))
        fill += first[k].forward_s
        if not split:
            drain += min(by_rows[r][k].backward_s for r in by_rows)
    return best


def _allreduce_affine(stages: int, replicas: int, placement: str, system: System,
                      allreduce_link: Link | None) -> tuple[float, float]:
    """(min over k of a_k, min over k of b_k) of the stage all-reduces a_k x bytes + b_k."""
    return _affine(stages, replicas, placement, system.devices_per_node, system.intra_link, system.inter_link,
                   allreduce_link)


@lru_cache(maxsize=1 << 12)
def _affine(stages: int, replicas: int, placement: str, devices_per_node: int, intra: Link, inter: Link,
            allreduce_link: Link | None) -> tuple[float, float]:
    system = System("bound", None, devices_per_node, intra, inter, nodes=1)  # type: ignore[arg-type]
    probe = 1e9
    slopes, constants = [], []
    for k in range(stages):
        group = data_parallel_group(k, replicas, stages, placement)
        constant = group_allreduce_s(0, group, system, allreduce_link)
        slopes.append((group_allreduce_s(probe, group, system, allreduce_link) - constant) / probe)
        constants.append(constant)
    return min(slopes), min(constants)


class BalancedBounds:
    """:func:`balanced_bound_s` with the whole-model sums cached across candidates."""

    def __init__(self, table: CostTable, batch_size: int, system: System | None = None,
                 allreduce_link: Link | None = None) -> None:
        self.table, self.batch_size, self.system, self.allreduce_link = table, batch_size, system, allreduce_link
        self._work: dict[tuple, float] = {}

    def _whole_work_s(self, rows: tuple[int, ...], checkpoint: str, optimizer_share: float = 1.0) -> float:
        key = (rows, checkpoint, optimizer_share)
        if key not in self._work:
            layers = self.table.workload.num_layers
            whole_model = self.table.stage(rows[0], 0, layers)
            total = whole_model.optimizer_s * optimizer_share
            for m, r in enumerate(rows):
                whole = self.table.stage(r, 0, layers)
                total += whole.forward_s + backward_time_s(whole, checkpoint)
                if recomputes(checkpoint, m, len(rows)):
                    total += whole.recompute_s
            self._work[key] = total
        return self._work[key]

    def _chain_s(self, rows: tuple[int, ...]) -> float:
        """One micro-batch through every layer and back, at the cheapest rows: F_min + B_min."""
        key = (rows, "chain")
        if key not in self._work:
            layers = self.table.workload.num_layers
            wholes = [self.table.stage(r, 0, layers) for r in set(rows)]
            self._work[key] = min(w.forward_s for w in wholes) + min(w.backward_s for w in wholes)
        return self._work[key]

    def __call__(self, candidate) -> float:
        return max(self.balanced_s(candidate), self.bubble_s(candidate))

    def bubble_s(self, candidate) -> float:
        """The pipeline's fill and drain, without a partition (V = 1; 0 otherwise).

        With x_k the cost of one micro-batch's forward and backward on device k's layers (cheapest
        rows), device k cannot end before the chain through the devices before it plus its own M
        micro-batches: step >= x_0 + ... + x_{k-1} + M x_k for every k, the x_k summing to the
        whole chain C. The smallest such maximum over all partitions makes every term equal, a
        geometric series: T = C / (1 - (1 - 1/M)^K). It is C for M = 1 and tends to C M / K.
        """
        c = candidate
        if c.virtual_stages > 1 or c.schedule in SPLIT_BACKWARD_SCHEDULES:
            return 0.0  # the chain's backwards overlap other work (the interleaved chunks, the W's)
        rows = _replica_rows(self.batch_size, c.replicas, c.microbatches)
        m = len(rows)
        return self._chain_s(rows) / (1 - (1 - 1 / m) ** c.stages)

    def balanced_s(self, candidate) -> float:
        c = candidate
        rows = _replica_rows(self.batch_size, c.replicas, c.microbatches)
        layers = self.table.workload.num_layers
        sharded = c.zero >= 2 and c.replicas > 1  # ZeRO-2/3: the optimizer on the shard, no all-reduce
        total = (self._whole_work_s(rows, c.checkpoint, shard_share(self.table, c) if sharded else 1.0)
                 + self.table.stage(rows[0], 0, layers).step_overhead_s * c.stages)  # every device has it
        if c.replicas > 1 and self.system is not None and not sharded:
            slope, constant = _allreduce_affine(c.stages, c.replicas, c.placement, self.system, self.allreduce_link)
            gradient_bytes = self.table.gradient_and_optimizer_bytes(rows[0], 0, layers)[0]
            total += slope * gradient_bytes + constant * c.stages
        return total / c.stages


def balanced_bound_s(table: CostTable, batch_size: int, candidate, system: System | None = None,
                     allreduce_link: Link | None = None) -> float:
    """A lower bound that needs no partition (module docstring); :func:`lower_bound_s` is never below it."""
    return BalancedBounds(table, batch_size, system, allreduce_link)(candidate)
