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

    ``replicas`` D copies of the pipeline train on ``torch.chunk`` of the batch each and average
    their gradients; each stage runs on ``tensor_parallel`` T ranks (D x K x T processes in all);
    under a multi-chunk schedule each process runs ``virtual_stages`` V chunks (the partition lists
    V x K); the calibration design keeps D = T = V = 1.
    """

    partition: tuple[int, ...]
    microbatches: int
    checkpoint: str
    schedule: str
    batch_size: int
    replicas: int = 1
    tensor_parallel: int = 1
    virtual_stages: int = 1
    zero: int = 0  # 3: parameters, gradients and optimizer state sharded over the D replicas (FSDP2)
    gradient_sync: str | None = None  # ZeRO-2/3: "step" or "microbatch" reduce-scatter; None: the trainers' default
    expert_parallel: int = 1  # E: each stage's routed experts sharded over E of its D replicas
    expert_tensor_parallel: int | None = None  # each expert's T; None: T (the only value the executor trains)

    @property
    def stages(self) -> int:
        return len(self.partition) // self.virtual_stages

    @property
    def layout(self) -> ParallelLayout:
        """The run's parallel layout, as the simulator takes it (the partition beside it)."""
        return ParallelLayout(self.stages, self.microbatches, self.checkpoint, self.schedule, self.replicas,
                              self.virtual_stages, self.zero, tensor_parallel=self.tensor_parallel,
                              gradient_sync=self.gradient_sync, expert_parallel=self.expert_parallel,
                              expert_tensor_parallel=self.expert_tensor_parallel)

    @property
    def processes(self) -> int:
        """D x K x T: one process per (replica, stage, tensor-parallel rank)."""
        return self.replicas * self.stages * self.tensor_parallel

    def label(self) -> str:
        parts = ",".join(map(str, self.partition))
        replicas = f"D={self.replicas} " if self.replicas > 1 else ""
        replicas += f"ZeRO-{self.zero} " if self.zero else ""
        replicas += f"E={self.expert_parallel} " if self.expert_parallel > 1 else ""
        split = f" T={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        chunks = f" V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"{replicas}K={self.stages}{split}{chunks} M={self.microbatches} [{parts}] {self.checkpoint} "
                f"{self.schedule}")


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
    specs = [RunSpec(single, 2, "never", "gpipe", batch_size),
             RunSpec(single, 8, "always", "gpipe", batch_size)]
    if row_span:
        specs += [RunSpec(single, 1, "always", "gpipe", batch_size),
                  RunSpec(single, 16, "never", "gpipe", batch_size)]
    if per_layer_recompute:
        specs.append(RunSpec(single, 8, "full", "gpipe", batch_size))
    if max_stages >= 2 and num_layers >= 2:
        specs += [RunSpec(even_partition(num_layers, 2), 4, "except_last", "gpipe", batch_size),
                  RunSpec(skewed(num_layers, 2), 8, "always", "1f1b", batch_size),
                  RunSpec(even_partition(num_layers, 2), 2, "never", "1f1b", batch_size),
                  RunSpec(even_partition(num_layers, 2), 16, "always", "gpipe", batch_size)]
        if row_span:
            specs.append(RunSpec(even_partition(num_layers, 2), 1, "always", "gpipe", batch_size))
        if split_backward:
            specs.append(RunSpec(even_partition(num_layers, 2), 6, "never", "zb-h1", batch_size))
        if per_layer_recompute:
            specs.append(RunSpec(even_partition(num_layers, 2), 8, "full", "gpipe", batch_size))
    for parts in tensor_parallel:
        specs += [RunSpec(even_partition(num_layers, 1), 2, "never", "gpipe", batch_size, 1, parts),
                  RunSpec(even_partition(num_layers, 1), 4, "except_last", "gpipe", batch_size, 1, parts)]
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

    return RunConfig(model=model, options=dict(options), partition=spec.partition,
                     batch_size=spec.batch_size, microbatches=spec.microbatches,
                     schedule=spec.schedule, checkpoint=spec.checkpoint, steps=steps,
                     warmup_steps=WARMUP_STEPS, device=device, timeout_s=120.0, optimizer=optimizer,
                     precision=precision, replicas=spec.replicas,
                     tensor_parallel=spec.tensor_parallel, virtual_stages=spec.virtual_stages,
                     zero=spec.zero, gradient_sync=spec.gradient_sync, expert_parallel=spec.expert_parallel,
                     expert_tensor_parallel=spec.expert_tensor_parallel).validate()
