"""What a published run leaves unsaid, searched as its trainer would have tuned it.

A runs file states the layout, D, K, T and C; ``null`` in ``checkpoint``, ``sequence_parallel``,
``virtual_stages``, ``microbatch_size`` or ``zero`` means the source does not say. Whoever ran it
tuned those for speed within the memory they had, so the replay takes the fastest plan that fits
memory among the values each unsaid field can take, the stated fields fixed, through the planner's
own search (:func:`sim.planner.search.search`), and names every value it chose.

The values searched: the policies trainers offer (``never``, ``selective``, ``full``: Megatron-LM's
none, selective and full recompute; GPipe's stage re-materialization is no trainer's), sequence
parallelism off and on where T > 1, 1, 2 or 4 virtual stages per device where K > 1 (the schedule
following: gpipe or 1f1b with one, interleaved with more), every micro-batch size that divides a
replica's share of the batch, and ZeRO 0 or 1 where D > 1 (a distributed optimizer as ZeRO-1), then
2 and 3 in turn for the plans that fit neither (2 and 3 where a ``shard_group`` is given). Trainers
shard gradients and parameters where memory needs it: ZeRO-2 and 3 add collectives the model takes as
perfectly overlapped and step the optimizer on the shard, where ZeRO-1's shard step is taken to cancel
its gather, so ranked by time alone they would win where a trainer would not have used them.
ZeRO-2/3's gradients are reduce-scattered as the run's ``gradient_sync`` says, null meaning the
trainers' default (after every micro-batch with one stage, once per step with a pipeline:
:attr:`sim.formats.layout.ParallelLayout.resolved_gradient_sync`), or for a run stating
Megatron-FSDP what it runs (after every micro-batch: :mod:`sim.evidence.megatron_fsdp`); it is never
searched.

Limits: a run whose trainer did not tune is predicted as if it had (too fast, where its choices
were slower); a plan that fits nowhere is timed all the same, at the values that hold least memory
(the last of each list above, the most micro-batches), and the replay says it does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.catalog.hardware import System
from sim.engine.engine import SimResult, simulate
from sim.errors import GpipeInputError
from sim.evidence.megatron_fsdp import gradient_sync_of
from sim.formats.layout import ZERO_STAGES, ParallelLayout, check_sharding
from sim.planner.search import Candidate, default_partition, search
from sim.schedules.microbatch import split_rows
from sim.schedules.schedule import CHECKPOINT_POLICIES, PRICED_ONLY_POLICIES
from sim.workloads.moe.expert_parallel import with_expert_parallel
from sim.workloads.tensor_parallel import with_tensor_parallel
from sim.workloads.workload import Workload, check_checkpoint_for

TRAINER_POLICIES = ("never", "selective", "full")  # what a null checkpoint searches, least memory last
VIRTUAL_OPTIONS = (2, 4)  # the interleaved schedule's V a null virtual_stages searches beside 1


@dataclass(frozen=True)
class Space:
    """The values each field of a run may take: the stated one alone, or what a null searches."""

    checkpoints: tuple[str, ...]
    sequence_parallel: tuple[bool, ...]
    schedules: tuple[str, ...]
    virtual_options: tuple[int, ...]
    microbatch_options: tuple[int, ...]  # M per replica
    zero_options: tuple[int, ...]
    shard_group: int | None = None  # HSDP's groups of replicas (zero 2 or 3); None: all of them
    zero_escalates: bool = False  # a plan that fits at no ZeRO stage listed is tried at the next (2, then 3)
    gradient_sync: str | None = None  # ZeRO-2/3: "step" or "microbatch" reduce-scatter; None: the trainers' default
    pipeline_split: Any = None  # the run's stated split (sim.evidence.pipeline_split); None: balanced
    a2a_overlap: bool = False  # the trainer overlaps one micro-batch's all-to-alls with another's compute


@dataclass
class Found:
    """The plan the replay times: the fastest that fits, or the one holding least if none fits."""

    candidate: Candidate
    partition: list[int]
    result: SimResult
    sequence_parallel: bool
    fits: bool
    experts: tuple[int, int | None] = (1, None)  # (E, ETP) taken


def expert_options(run: dict[str, Any], workload: Workload, tensor: int, context: int,
                   replicas: int) -> list[tuple[int, int | None]]:
    """The (E, ETP) pairs a run's ``expert_parallel`` and ``expert_tensor_parallel`` leave: the stated
    value alone, a null searched (E the divisors of the experts whose E x ETP divides T x C x D, ETP 1 or
    T); (1, None) for a model without experts. One line for a stated value the layout refuses."""
    from sim.formats.layout import check_expert_grid
    from sim.workloads.moe.expert_parallel import check_expert_parallel, expert_count

    stated_e = count_of(run, "expert_parallel") if "expert_parallel" in run else 1
    stated_etp = count_of(run, "expert_tensor_parallel") if "expert_tensor_parallel" in run else None
    experts = expert_count(workload)
    if not experts:
        check_expert_parallel(workload, stated_e or 1, stated_etp, tensor)
        if run.get("moe_a2a_overlap"):
            raise GpipeInputError("moe_a2a_overlap true for a model without experts; leave it out (or null)")
        return [(1, None)]
    group = tensor * context * replicas
    etps = [stated_etp] if stated_etp is not None else sorted({1, tensor})
    es = [stated_e] if stated_e is not None else [e for e in range(1, experts + 1) if experts % e == 0]
    pairs = []
    for e in es:
        for etp in etps:
            if group % (e * etp) == 0:
                pairs.append((e, etp))
    if stated_e is not None and stated_etp is not None:
        check_expert_grid(stated_e, stated_etp, tensor, context, replicas)
        check_expert_parallel(workload, stated_e, stated_etp, tensor)
    if not pairs:
        raise GpipeInputError(f"expert_parallel {stated_e} with expert_tensor_parallel {etps}: no E x ETP divides "
                              f"T x C x D = {group}; give values that do")
    return pairs


def modelled_experts(space: Space, experts: list[tuple[int, int | None]],
                     replicas: int) -> list[tuple[int, int | None]]:
    """The (E, ETP) pairs of ``experts`` whose layout is modelled with the sharding of ``space``: with a
    shard group (HSDP) E = 1 alone (:func:`sim.formats.layout.check_expert_sharding`); one line if none
    is left, so a run the layout refuses is reported not modelled, never priced."""
    from sim.formats.layout import check_expert_sharding

    if space.shard_group is None or space.shard_group == replicas:
        return experts
    kept = [(e, etp) for e, etp in experts if e == 1]
    if not kept:
        check_expert_sharding(max(space.zero_options), experts[0][0], space.shard_group, replicas)
    return kept


def expert_lines(run: dict[str, Any], workload: Workload, found: Found) -> list[str]:
    """What a null ``expert_parallel`` or ``expert_tensor_parallel`` took, one line each."""
    if not workload.has_experts:
        return []
    e, etp = found.experts
    lines = []
    if "expert_parallel" not in run or run["expert_parallel"] is None:
        lines.append(f"expert_parallel null: {e}, the fastest of the divisors of the experts that fits")
    if "expert_tensor_parallel" not in run or run["expert_tensor_parallel"] is None:
        lines.append(f"expert_tensor_parallel null: {etp}, the fastest of 1 and T that fits")
    if e > 1 and run.get("moe_a2a_overlap") is None:
        lines.append("moe_a2a_overlap null: off, every all-to-all exposed (Megatron-Core's default)")
    return lines


def space_of(run: dict[str, Any], workload: Workload, stages: int, replicas: int, tensor: int) -> Space:
    """The search space of ``run``; one line naming a stated value the replay cannot take."""
    checkpoint = run["checkpoint"]
    if checkpoint is None:
        checkpoints = TRAINER_POLICIES
    elif checkpoint in CHECKPOINT_POLICIES + PRICED_ONLY_POLICIES:
        checkpoints = (check_checkpoint_for(workload, checkpoint),)
    else:
        raise GpipeInputError(f"checkpoint {checkpoint!r}; give one of "
                              f"{', '.join(CHECKPOINT_POLICIES + PRICED_ONLY_POLICIES)}, or null where the source "
                              "does not say")
    sequence = run["sequence_parallel"]
    sequence_options = (False, True) if sequence is None and tensor > 1 else (bool(sequence),)
    virtual = count_of(run, "virtual_stages")
    if virtual is not None and virtual > 1:
        schedules, virtual_options = ("interleaved",), (virtual,)
    elif virtual == 1 or stages == 1:
        schedules, virtual_options = ("gpipe", "1f1b"), VIRTUAL_OPTIONS
    else:
        schedules, virtual_options = ("gpipe", "1f1b", "interleaved"), VIRTUAL_OPTIONS
    per_replica = int(run["global_batch"]) // replicas
    size = count_of(run, "microbatch_size")
    if size is not None:
        microbatches: tuple[int, ...] = (max(1, per_replica // size),)
    else:
        microbatches = tuple(m for m in range(1, per_replica + 1) if per_replica % m == 0)
    zero = run.get("zero")
    if zero is not None and (isinstance(zero, bool) or zero not in ZERO_STAGES):
        raise GpipeInputError(f"zero {zero!r}; give 0, 1 (a distributed optimizer), 2 (and gradients sharded), 3 "
                              "(and parameters: FSDP), or null where the source does not say")
    group = run.get("shard_group")
    if group is not None:
        if zero is not None and zero < 2:
            raise GpipeInputError(f"shard_group {group!r} with zero {zero}: a shard group (HSDP) shards parameters "
                                  "or gradients, zero 2 or 3; give one of them, or null")
        check_sharding(zero if zero is not None else 2, replicas, group)
    if replicas == 1:
        zeros: tuple[int, ...] = (0,)
    elif zero is not None:
        zeros = (zero,)
    else:
        zeros = (2, 3) if group is not None else (0, 1)
    escalates = zero is None and group is None and replicas > 1  # 2, then 3, where neither 0 nor 1 fits
    sync = gradient_sync_of(run, zero)
    return Space(checkpoints, sequence_options, schedules, virtual_options, microbatches, zeros, group, escalates,
                 sync, run.get("pipeline_split"), _a2a_overlap(run))


def _a2a_overlap(run: dict[str, Any]) -> bool:
    """A run's ``moe_a2a_overlap``: true, false, or null (off, Megatron-Core's default); one line otherwise."""
    value = run.get("moe_a2a_overlap")
    if value is not None and not isinstance(value, bool):
        raise GpipeInputError(f"moe_a2a_overlap {value!r}; give true, false, or null where the source does not say")
    return bool(value)


def count_of(run: dict[str, Any], key: str) -> int | None:
    """``run[key]``, a positive integer or None (null); one line if it is neither."""
    value = run[key]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GpipeInputError(f"{key} {value!r}; give a positive integer, or null where the source does not say")
    return value


def fastest_fitting(workload: Workload, system: System, batch: int, stages: int, replicas: int, tensor: int,
                    context: int, space: Space, experts: list[tuple[int, int | None]] | None = None) -> Found:
    """The fastest plan of ``space`` that fits memory, each value of sequence parallelism (and each (E, ETP)
    of ``experts``) searched on its own split workload as ``gpipe plan`` searches them; else the one
    holding least, timed."""
    best: Found | None = None
    for sequence in space.sequence_parallel:
        tp_split, groups = with_tensor_parallel(workload, system, tensor, sequence, context)
        for e, etp in experts or [(1, None)]:
            split = with_expert_parallel(tp_split, system, e, etp, "1f1b", space.a2a_overlap)
            found = None
            for virtual, schedules, given in _split_options(space, stages, split):
                option = search(split, groups, batch, [stages], list(space.microbatch_options),
                                list(space.checkpoints), schedules, top=1, replica_options=[replicas],
                                virtual_options=[virtual] if virtual > 1 else list(space.virtual_options),
                                zero_options=list(space.zero_options), dp_overlap=True, shard_group=space.shard_group,
                                escalate_zero=space.zero_escalates, gradient_sync_options=(space.gradient_sync,),
                                partition=given).best
                if option is not None and (found is None or option.step_time_s < found.step_time_s):
                    found = option
            if found is not None and (best is None or found.step_time_s < best.result.step_time_s):
                assert found.result is not None and found.partition is not None
                best = Found(found.candidate, found.partition, found.result, sequence, True, (e, etp))
    return best if best is not None else _holding_least(workload, system, batch, stages, replicas, tensor,
                                                          context, space, (experts or [(1, None)])[-1])


def _holding_least(workload: Workload, system: System, batch: int, stages: int, replicas: int, tensor: int,
                   context: int, space: Space, experts: tuple[int, int | None] = (1, None)) -> Found:
    sequence = space.sequence_parallel[-1]
    split, groups = with_tensor_parallel(workload, system, tensor, sequence, context)
    split = with_expert_parallel(split, system, experts[0], experts[1], "1f1b", space.a2a_overlap)
    schedule = "1f1b" if "1f1b" in space.schedules else space.schedules[0]  # the fewest micro-batches in flight
    zero = 3 if space.zero_escalates else space.zero_options[-1]
    candidate = Candidate(stages, space.microbatch_options[-1], space.checkpoints[-1], schedule, replicas,
                          space.virtual_options[0] if schedule == "interleaved" else 1, zero,
                          shard_group=space.shard_group if zero >= 2 else None,
                          gradient_sync=space.gradient_sync if zero >= 2 else None)
    given = {v: part for v, _, part in _split_options(space, stages, split)}.get(candidate.virtual_stages)
    partition = given or default_partition(split, groups, batch, candidate)
    result = simulate(split, groups, partition, batch,
                      ParallelLayout.for_partition(partition, candidate.microbatches,
                                                   checkpoint=candidate.checkpoint, schedule=schedule,
                                                   virtual_stages=candidate.virtual_stages, replicas=replicas,
                                                   zero=candidate.zero, shard_group=candidate.shard_group,
                                                   gradient_sync=candidate.gradient_sync),
                      record=False, dp_overlap=True)
    return Found(candidate, partition, result, sequence, all(s.fits for s in result.stages), experts)


def _split_options(space: Space, stages: int, workload: Workload) -> list[tuple[int, list[str], list[int] | None]]:
    """The (V, schedules, partition) searches of ``space``: one over all of them with the balanced split, or
    with a stated pipeline split (whose partition depends on V) one per V the schedules take (V = 1 for
    gpipe and 1f1b) and the split allows; one line if it allows none."""
    if space.pipeline_split is None or stages == 1:
        return [(1, list(space.schedules), _given_partition(space, workload, stages))]
    virtuals = []
    flat = [s for s in space.schedules if s != "interleaved"]
    if flat:
        virtuals.append((1, flat))
    if "interleaved" in space.schedules:
        virtuals += [(v, ["interleaved"]) for v in space.virtual_options]
    options, refusal = [], None
    for virtual, schedules in virtuals:
        try:
            options.append((virtual, schedules, _given_partition(space, workload, stages * virtual)))
        except GpipeInputError as exc:
            refusal = refusal or exc
    if not options and refusal is not None:
        raise refusal
    return options


def _given_partition(space: Space, workload: Workload, chunks: int) -> list[int] | None:
    """The partition of the run's stated pipeline split over ``chunks`` virtual stages, or None (balanced)."""
    from sim.evidence.pipeline_split import stated_partition

    if space.pipeline_split is None:
        return None
    return stated_partition({"pipeline_split": space.pipeline_split}, [spec.name for spec in workload.layers], chunks)


def chosen_lines(run: dict[str, Any], found: Found, batch: int, stages: int, replicas: int, tensor: int) -> list[str]:
    """One line per null field of ``run``: the value the replay took and among what."""
    c = found.candidate

    def chosen(field: str, value: Any, among: str) -> str:
        how = f"the fastest of {among} that fits" if found.fits else f"of {among} the one holding least (none fits)"
        return f"{field} null: {value}, {how}"

    lines = []
    if run["checkpoint"] is None:
        lines.append(chosen("checkpoint", c.checkpoint, "never, selective and full"))
    if run["sequence_parallel"] is None:
        lines.append(chosen("sequence_parallel", "on" if found.sequence_parallel else "off", "off and on")
                     if tensor > 1 else "sequence_parallel null: off (no tensor parallelism)")
    if run["virtual_stages"] is None:
        lines.append(chosen("virtual_stages", f"{c.virtual_stages} ({c.schedule})", "1, 2 and 4")
                     if stages > 1 else "virtual_stages null: 1 (one pipeline stage)")
    if run["microbatch_size"] is None:
        rows = split_rows(batch // replicas, c.microbatches)[0]
        lines.append(chosen("microbatch_size", rows, "the sizes dividing a replica's batch"))
    if run.get("zero") is None:
        if replicas == 1:
            lines.append("zero null: 0 (one replica)")
        elif run.get("shard_group") is not None:
            lines.append(chosen("zero", c.zero, "2 and 3"))
        elif c.zero >= 2 and found.fits:
            lines.append(f"zero null: {c.zero}, the least sharding that fits (0 and 1 do not)")
        else:
            lines.append(chosen("zero", c.zero, "0 and 1"))
    return lines
