"""Which runs are held out: configurations the calibration design never ran, over every layout it prices.

The held-out design covers: K in {1, 2} (and up to the stage count the
machine has room for), M from 1 to 16 including values that do not divide the batch, balanced and
skewed partitions, every checkpoint policy and both schedules, and D = 2 data-parallel replicas
with K = 1 and K = 2 (their gradients averaged by the all-reduce calibration measured, and the same
layouts under ZeRO-3: FSDP2's gathers and reduce-scatters, their sharded memory compared rank by
rank), and, where
the costs file profiled the layers split over T ranks, runs whose stages are split over T ranks
(tensor parallelism; a stage's measured figures are its rank 0's), and, for a mixture of experts whose
routed experts the costs file profiled apart, a run with its experts split over E = 2 of D = 2 replicas
(expert parallelism: the all-to-all calibration fitted, each rank's parameter, gradient and optimizer
bytes compared rank by rank). Any
configuration that is also in the calibration design is dropped, so no prediction is of a run the
fit learned from.

A run with more processes (D x K x T) than the machine has cores (CPU) or GPUs is still measured and its
error shown, marked ``oversubscribed``: the simulator predicts it as if each process had a core of
its own, so its error is what crowding cost (processes taking turns on the cores, and gloo sends
waiting while the cores are taken: docs/notes/2026-11-27-figures-behind-the-code.md), a CPU host's
effect the simulator does not model; it stays out of the summary.
"""

from __future__ import annotations

from typing import Sequence

from calibrate.fit.design import RunSpec, calibration_design, skewed
from sim.planner.partition import even_partition
from sim.schedules.schedule import default_virtual_stages


# (stages, microbatches, partition kind, checkpoint, schedule)
HELD_OUT = [
    (1, 1, "balanced", "never", "gpipe"),
    (1, 3, "balanced", "except_last", "gpipe"),
    (1, 5, "balanced", "never", "gpipe"),
    (1, 16, "balanced", "always", "gpipe"),
    (2, 1, "balanced", "except_last", "gpipe"),
    (2, 3, "skewed", "never", "gpipe"),
    (2, 4, "balanced", "always", "1f1b"),
    (2, 5, "balanced", "never", "gpipe"),
    (2, 6, "skewed", "except_last", "1f1b"),
    (2, 7, "balanced", "always", "gpipe"),
    (2, 12, "balanced", "except_last", "gpipe"),
    (2, 16, "skewed", "never", "1f1b"),
    (1, 4, "balanced", "full", "gpipe"),  # per-layer recompute: no calibration run has it
    (2, 4, "skewed", "full", "1f1b"),
    (2, 8, "balanced", "never", "zb-h1"),  # the split backward: no calibration run has it
    (2, 8, "balanced", "never", "zbv"),  # two chunks per process in a V, the backward split
    (2, 6, "balanced", "selective", "gpipe"),  # the attention core rerun in the backward (models with one)
]
# (replicas, stages, microbatches, partition kind, checkpoint, schedule): data-parallel runs
HELD_OUT_REPLICAS = [
    (2, 1, 3, "balanced", "except_last", "gpipe"),
    (2, 2, 4, "balanced", "never", "1f1b"),
]
# (replicas, stages, microbatches, partition kind, checkpoint, schedule, gradient sync): ZeRO-3 (FSDP2)
# runs, one stage (gathered per unit, again before each backward) and a pipeline (gathered once a step),
# both reduce-scattering once per step after the last micro-batch (the one-stage run states it: the
# trainers' default there is after every micro-batch), priced with the costs file's fitted all-gather
# and reduce-scatter and their sharded memory compared rank by rank
HELD_OUT_SHARDED = [
    (2, 1, 4, "balanced", "never", "gpipe", "step"),
    (2, 2, 4, "balanced", "never", "1f1b", None),
]
# (tensor-parallel ranks, stages, microbatches, partition kind, checkpoint, schedule): each stage
# split over T ranks, priced from the costs file's profile of the split layers (calibrate.measure.tp_profile)
HELD_OUT_TENSOR_PARALLEL = [
    (2, 1, 4, "balanced", "never", "gpipe"),
    (2, 1, 8, "balanced", "always", "gpipe"),
]
# (E, replicas, stages, microbatches, partition kind, checkpoint, schedule): each stage's routed experts
# split over E of its D replicas, tokens exchanged by all-to-alls (one launch of D x K processes)
HELD_OUT_EXPERT_PARALLEL = [
    (2, 2, 1, 4, "balanced", "never", "gpipe"),
]


def validation_design(num_layers: int, batch_size: int, max_stages: int = 2,
                      limit: int | None = None, max_replicas: int = 2,
                      attention_core: bool = False, tensor_parallel: Sequence[int] = (),
                      experts: bool = False) -> list[RunSpec]:
    """The held-out runs for a model of ``num_layers`` layers, none of them in the calibration design;
    ``--checkpoint selective`` among them only for a model with an ``attention_core`` to drop, runs
    with T ranks per stage only for the T in ``tensor_parallel`` (those the costs file profiled), runs
    with the routed experts split over E ranks only for a mixture of ``experts`` profiled apart.

    Data-parallel runs come after the single-pipeline ones and need every replica to get at least one row
    per micro-batch (batch >= D x M); they are kept even where D x K oversubscribes the machine (see the
    module). Tensor-parallel runs come next, expert-parallel runs last.
    """
    seen = set(calibration_design(num_layers, batch_size, max_stages, tensor_parallel, split_backward=True))
    wanted = ([(1, 1, *run, 0, None, 1) for run in HELD_OUT]
              + [(1, *run, 0, None, 1) for run in HELD_OUT_REPLICAS if run[0] <= max_replicas]
              + [(1, *run[:-1], 3, run[-1], 1) for run in HELD_OUT_SHARDED if run[0] <= max_replicas]
              + [(t, 1, *run[1:], 0, None, 1) for run in HELD_OUT_TENSOR_PARALLEL for t in [run[0]]
                 if t in tensor_parallel]
              + [(1, *run[1:], 0, None, run[0]) for run in HELD_OUT_EXPERT_PARALLEL
                 if experts and run[1] <= max_replicas])
    specs = []
    for parts, replicas, stages, m, kind, checkpoint, schedule, zero, sync, experts_over in wanted:
        if stages > min(max_stages, num_layers) or batch_size < replicas * m:
            continue
        if checkpoint == "selective" and not attention_core:
            continue
        split = even_partition if kind == "balanced" else skewed
        virtual = default_virtual_stages(schedule)
        if stages * virtual > num_layers:
            continue
        spec = RunSpec.of(split(num_layers, stages * virtual), m, checkpoint, schedule, batch_size, replicas, parts,
                          virtual, zero=zero, gradient_sync=sync, expert_parallel=experts_over)
        if spec not in seen and spec not in specs:
            specs.append(spec)
    return specs[:limit] if limit else specs


def machine_processes(device: str) -> int:
    """Processes this machine runs side by side without oversubscribing: cores, or GPUs on CUDA."""
    from executor.device import device_api

    return device_api(device).ranks_per_host()
