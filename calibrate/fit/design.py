"""The runs calibration learns from: a run's layout (:class:`RunSpec`), the design, their executor configs.

The design (:func:`calibration_design`) is a handful of runs chosen to make every fitted term
identifiable: several micro-batch sizes (so per-action scale and overhead separate), both stage
counts the machine has room for, a balanced and a skewed partition (different sums of layers per
action and different boundary tensors), every checkpoint policy and both schedules. The held-out set
of :mod:`calibrate.validate.held_out_design` is disjoint from it by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from sim.errors import require_at_least
from sim.formats.layout import ParallelLayout
from sim.planner.partition import even_partition
from sim.workloads.optimizers import DEFAULT_OPTIMIZER


@dataclass(frozen=True)
class RunSpec:
    """One executor run: (D, K, T, V, M, partition, checkpoint, schedule) at a global batch size.

    The layout's D copies of the pipeline train on ``torch.chunk`` of the batch each and average
    their gradients; each stage runs on T ranks (D x K x T processes in all); under a multi-chunk
    schedule each process runs V chunks (the partition lists V x K); the calibration design keeps
    D = T = V = 1.
    """

    partition: tuple[int, ...]
    batch_size: int
    layout: ParallelLayout  # its K: the partition's length over V

    @classmethod
    def of(cls, partition: Sequence[int], microbatches: int, checkpoint: str, schedule: str, batch_size: int,
           replicas: int = 1, tensor_parallel: int = 1, virtual_stages: int = 1, **degrees: Any) -> RunSpec:
        """The run of ``partition`` at ``batch_size`` with the layout these degrees name
        (:class:`sim.formats.layout.ParallelLayout`'s keys)."""
        layout = ParallelLayout.for_partition(tuple(partition), microbatches, checkpoint, schedule, replicas=replicas,
                                              tensor_parallel=tensor_parallel, virtual_stages=virtual_stages, **degrees)
        return cls(tuple(partition), batch_size, layout)

    @property
    def stages(self) -> int:
        return self.layout.stages

    @property
    def processes(self) -> int:
        """D x K x T: one process per (replica, stage, tensor-parallel rank)."""
        return self.layout.processes * self.layout.tensor_parallel

    def label(self) -> str:
        layout, parts = self.layout, ",".join(map(str, self.partition))
        replicas = f"D={layout.replicas} " if layout.replicas > 1 else ""
        replicas += f"ZeRO-{layout.zero} " if layout.zero else ""
        replicas += f"E={layout.expert_parallel} " if layout.expert_parallel > 1 else ""
        split = f" T={layout.tensor_parallel}" if layout.tensor_parallel > 1 else ""
        chunks = f" V={layout.virtual_stages}" if layout.virtual_stages > 1 else ""
        return (f"{replicas}K={self.stages}{split}{chunks} M={layout.microbatches} [{parts}] {layout.checkpoint} "
                f"{layout.schedule}")


def skewed(num_layers: int, stages: int) -> tuple[int, ...]:
    """A deliberately unbalanced split: the first stage gets about a quarter of the layers."""
    if stages == 1:
        return (num_layers,)
    first = max(1, num_layers // 4)
    return (first,) + even_partition(num_layers - first, stages - 1)


def calibration_design(num_layers: int, batch_size: int, max_stages: int = 2,
                       tensor_parallel: Sequence[int] = (), split_backward: bool = False,
                       row_span: bool = True, per_layer_recompute: bool = True) -> list[RunSpec]:
    """The runs the fit learns from (few and small: they are most of a calibration's time); for each T in
    ``tensor_parallel`` (the splits the profile measured) two one-stage runs split over T ranks,
    whose actions fit the split stages' in-pipeline factor (:func:`calibrate.fit.design_fit.fit_tensor_parallel`). With
    ``split_backward`` (a profile that timed I and W apart) a zb-h1 run, whose I and W actions get
    in-pipeline factors of their own: a backward split in two pays its dispatch twice and keeps
    its graph between the halves, which the whole backward's factor does not see. It keeps every
    forward's graph (``never``) at 5-6 rows, where the other runs that do have 8 or 16.

    ``row_span`` (a full calibration) adds runs at the ends of the rows a plan can use: the whole
    batch in one micro-batch (K = 1 and 2, every kind of action at the batch's rows) and K = 1 with
    16 micro-batches keeping their graphs (the fewest rows a forward that keeps its graph has).
    Without them the lines rest on 4 to 16 rows at K = 1 and 2 to 16 at K = 2, and the held-out
    runs with the whole batch in one micro-batch came out low in every calibration
    (docs/notes/2026-11-26-fit-variants.md, docs/notes/2026-11-27-figures-behind-the-code.md).

    ``per_layer_recompute`` (a full calibration) adds a ``--checkpoint full`` run at K = 1 and at K = 2
    (4 rows), whose backwards, each layer recomputed just before its own, measure the time each layer
    after a stage's first adds beyond the backward's and the recompute's lines
    (:func:`calibrate.fit.pipeline_fit.fit_full_backward`)."""
    single = even_partition(num_layers, 1)
    specs = [RunSpec.of(single, 2, "never", "gpipe", batch_size),
             RunSpec.of(single, 8, "always", "gpipe", batch_size)]
    if row_span:
        specs += [RunSpec.of(single, 1, "always", "gpipe", batch_size),
                  RunSpec.of(single, 16, "never", "gpipe", batch_size)]
    if per_layer_recompute:
        specs.append(RunSpec.of(single, 8, "full", "gpipe", batch_size))
    if max_stages >= 2 and num_layers >= 2:
        specs += [RunSpec.of(even_partition(num_layers, 2), 4, "except_last", "gpipe", batch_size),
                  RunSpec.of(skewed(num_layers, 2), 8, "always", "1f1b", batch_size),
                  RunSpec.of(even_partition(num_layers, 2), 2, "never", "1f1b", batch_size),
                  RunSpec.of(even_partition(num_layers, 2), 16, "always", "gpipe", batch_size)]
        if row_span:
            specs.append(RunSpec.of(even_partition(num_layers, 2), 1, "always", "gpipe", batch_size))
        if split_backward:
            specs.append(RunSpec.of(even_partition(num_layers, 2), 6, "never", "zb-h1", batch_size))
        if per_layer_recompute:
            specs.append(RunSpec.of(even_partition(num_layers, 2), 8, "full", "gpipe", batch_size))
    for parts in tensor_parallel:
        specs += [RunSpec.of(even_partition(num_layers, 1), 2, "never", "gpipe", batch_size, 1, parts),
                  RunSpec.of(even_partition(num_layers, 1), 4, "except_last", "gpipe", batch_size, 1, parts)]
    return specs


WARMUP_STEPS = 1  # each run's first steps, left out of its timing (the report's measured steps)


def check_timed_steps(steps: int) -> int:
    """``--steps`` of a command whose runs are timed: more than the warm-up, which the timing leaves
    out (with no step left, a report times every step, the warm-up included)."""
    return require_at_least("steps", steps, WARMUP_STEPS + 1, "the first step is a warm-up, left out of "
                            f"the timing; use --steps {WARMUP_STEPS + 1} or more")


def run_config(model: str, options: dict[str, Any], spec: RunSpec, steps: int, device: str = "cpu",
               optimizer: str = DEFAULT_OPTIMIZER, precision: str = "fp32") -> Any:
    from executor.config import RunConfig

    return RunConfig(model=model, options=dict(options), partition=spec.partition, layout=spec.layout,
                     batch_size=spec.batch_size, steps=steps, warmup_steps=WARMUP_STEPS, device=device, timeout_s=120.0,
                     optimizer=optimizer, precision=precision).validate()
