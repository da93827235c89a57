"""What expert parallelism (:mod:`executor.parallel.expert_parallel`) cannot run, refused in one line
before any worker starts; kept apart so that checking a run's settings imports no process groups."""

from __future__ import annotations

from typing import Protocol

from torch import nn

from sim.errors import GpipeInputError
from sim.schedules.microbatch import split_rows


class ExpertSettings(Protocol):
    """What this module reads of a run's settings (an :class:`executor.config.RunConfig`)."""

    expert_parallel: int
    expert_tensor_parallel: int | None
    replicas: int
    tensor_parallel: int
    zero: int
    schedule: str
    batch_size: int
    microbatches: int


def check_expert_parallel(config: ExpertSettings) -> None:
    """The settings E needs, one line each: E dividing D, expert tensor parallelism equal to T (ZeRO-1
    shards the experts' optimizer state and ZeRO-2/3 the experts over their own replicas; HSDP is
    refused where the layout is built), the same number of micro-batches on every replica (the replicas of a group run their
    all-to-alls together, action by action).

    Every schedule runs, the split-backward ones (zb-h1, zbv, dualpipev) included: the exchange's
    reverse all-to-alls are on the input-gradient path, so I runs them (W starts below them, at the
    experts' own nodes, and reaches only weights); on the first stage, whose inputs need no gradient,
    W is the whole backward and runs them instead. Either way a rank issues them in the action its
    replicas issue them in, since they walk one action list."""
    parts, etp = config.layout.expert_parallel, config.layout.expert_tensor_parallel
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise GpipeInputError(f"--expert-parallel {parts!r} is not a positive integer; use 1 (none) or more")
    if etp is not None and etp != config.layout.tensor_parallel:
        raise GpipeInputError(f"--expert-tensor-parallel {etp} differs from --tensor-parallel "
                              f"{config.layout.tensor_parallel}: gpipe train splits each expert as tensor parallelism splits the dense layers; drop "
                              f"--expert-tensor-parallel or use {config.layout.tensor_parallel}")
    if parts == 1:
        return
    if config.layout.replicas % parts:
        raise GpipeInputError(f"--expert-parallel {parts} does not divide --replicas {config.layout.replicas}: the experts "
                              "are sharded over E of each stage's replicas; use an E that divides D")
    executed = {len(split_rows(rows, config.layout.microbatches)) for rows in split_rows(config.batch_size, config.layout.replicas)}
    if len(executed) > 1:
        raise GpipeInputError(f"--batch {config.batch_size} gives the replicas {sorted(executed)} micro-batches, not "
                              f"the same number, and the replicas of an expert-parallel group exchange tokens "
                              f"micro-batch by micro-batch; use a batch that is a multiple of --replicas "
                              f"{config.layout.replicas} x --microbatches {config.layout.microbatches}")


def check_model_experts(model: nn.Sequential, parts: int, zero: int = 0) -> None:
    """The model (on the meta device) has mixture-of-experts blocks gpipe train shards (the built-in
    transformer's, or a Hugging Face Mixtral or Qwen3-MoE's) whose experts E divides; the Hugging Face
    ones without ZeRO (their slices of 3-D expert tensors are neither FSDP units of their own nor
    consolidated by the sharded optimizer's checkpoint path, which no test covers)."""
    if parts == 1:
        return
    from executor.models.moe import MixtureOfExperts
    from executor.parallel.hf_experts import SUPPORTED, experts_in, hf_blocks, implementation

    counts = [m.num_experts for m in model.modules() if isinstance(m, MixtureOfExperts)]
    hf_counts = [experts_in(block) for block in hf_blocks(model)]
    if not counts and not hf_counts:
        raise GpipeInputError(f"--expert-parallel {parts} shards routed experts, but this model has none that gpipe "
                              "train shards (the built-in transformer's experts option, hf:mixtral, hf:qwen3_moe); "
                              "use --expert-parallel 1")
    if hf_counts and zero:
        raise GpipeInputError(f"--expert-parallel {parts} with --zero {zero} on a Hugging Face mixture of experts is not "
                              "supported: its experts are slices of 3-D tensors, which ZeRO would shard and "
                              "consolidate as whole parameters over all replicas; drop --zero")
    for block in hf_blocks(model):
        if implementation(block.experts) not in SUPPORTED:
            raise GpipeInputError(f"--expert-parallel {parts} runs a Hugging Face model's experts as "
                                  f"{' or '.join(SUPPORTED)} computes them, not {implementation(block.experts)!r}; "
                                  "use --expert-parallel 1")
    for experts in counts + hf_counts:
        if experts % parts:
            raise GpipeInputError(f"--expert-parallel {parts} does not divide experts={experts}: each rank "
                                  f"holds experts / E whole experts; use an E that divides {experts}")
