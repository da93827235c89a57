"""The planner's search of a :class:`sim.planner.space.SearchSpace`: every system and every T, ranked together.

:func:`search_plans` runs the exact best-first search (:func:`sim.planner.search.search`, over D, K,
V, M, policy, schedule, placement and partition) once per hardware system and tensor-parallel degree
T, each T on its split workload and its system of T x C-device groups; a measured workload
(:class:`sim.planner.space.MeasuredCosts`) once per K and D as well, since its fits are those of D x K
processes. A mixture of experts is searched once more per (E, ETP) inside each T
(:func:`sim.planner.space.expert_values`), on its workload with the experts split
(:mod:`sim.workloads.moe.expert_parallel`), with D restricted to those E x ETP divides T x C x D (ZeRO-2/3
sharding the routed experts over their expert-data-parallel group, :mod:`sim.engine.fsdp`; no HSDP shard
groups with E > 1), and an overlapping schedule (``dualpipev``) apart from the others. The searches of one
system, every T and (E, ETP), share the ``top``-th best score found so far as a ceiling, so one ends as soon
as none of its bounds can beat it; each part's ranking is exact above it, so the system's top is exact too.
Each system keeps its own ranking (the output gives every system's best); the second search for the
fastest or the cheapest plan of all (:func:`fastest_and_cheapest`) shares its best so far across systems.

With days and dollars (:class:`sim.planner.training_cost.Costing`) every ranked plan is priced;
ranked by cost, each candidate's step is weighed by its devices and their price inside the search,
and limits on days and dollars drop candidates there. Where nothing fits, or nothing is within the
limits, the error says why in one line, told on the leanest candidate or on what the limits exclude.

Limits: measured costs are searched by step time alone (their fits are of this machine); the
fastest and the cheapest plan under the other objective come from a second search of its best only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from sim.catalog.hardware import System
from sim.errors import GpipeInputError
from sim.planner.search import PlanOption, Progress, SearchResult, search
from sim.planner.space import (MeasuredCosts, SearchSpace, SystemSpace, Target, check_fits, expert_values, on_system,
                               policies_for, stage_values, tensor_parallel_values)
from sim.planner.training_cost import Costing, dollars, format_token_count, plan_cost, price_of
from sim.schedules.microbatch import split_rows
from sim.schedules.schedule import MULTI_CHUNK_SCHEDULES
from sim.workloads.moe.expert_parallel import OVERLAPPING_SCHEDULES, with_expert_parallel
from sim.workloads.tensor_parallel import check_context_parallel, default_sequence_parallel, with_tensor_parallel
from sim.workloads.workload import Workload


@dataclass
class Planned:
    """One system's search and what its output needs."""

    system: System
    workload: Workload
    batch: int
    precision: str
    result: SearchResult  # its ranked plans, each with its hardware and, with days and dollars, its cost
    stage_options: list[int]
    microbatch_options: list[int]
    schedules: list[str]


@dataclass
class PlanSearch:
    """Every system's search (``planned``, in the space's order) and their plans ranked together."""

    planned: list[Planned]
    ranked: list[PlanOption]  # best first: by score, then peak memory, then fewer stages

    @property
    def best(self) -> PlanOption:
        return self.ranked[0]

    def totals(self, ranked: list[PlanOption]) -> SearchResult:
        """The searches' counts summed, with ``ranked`` as their ranking."""
        parts = [p.result for p in self.planned]
        return SearchResult(ranked=ranked, candidates=sum(p.candidates for p in parts),
                            simulated=sum(p.simulated for p in parts), not_fitting=sum(p.not_fitting for p in parts),
                            elapsed_s=sum(p.elapsed_s for p in parts), over_limit=sum(p.over_limit for p in parts))


def layout_text(option: PlanOption) -> str:
    c = option.candidate
    experts = f" E={c.expert_parallel}" if c.expert_parallel > 1 else ""
    return f"T={c.tensor_parallel} D={c.replicas}{experts} K={c.stages} V={c.virtual_stages} M={c.microbatches}"


def ranking_key(option: PlanOption) -> tuple:
    return (option.score, option.max_peak_memory_bytes, option.candidate.stages)


def search_plans(space: SearchSpace, costing: Costing = Costing(), top: int = 10,
                 progress: Progress | None = None) -> PlanSearch:
    """The ``top`` best plans of each system of ``space``, ranked together; one line (GpipeInputError)
    where none fits or none is within ``costing``'s limits."""
    planned = [plan_on(target, space, costing, top, progress) for target in space.hardware]
    fitting = [p for p in planned if p.result.best is not None]
    if not fitting and costing.limited and any(p.result.over_limit for p in planned):
        raise GpipeInputError(nothing_within_limits(space, costing))
    if not fitting:
        raise GpipeInputError(nothing_fits(planned[0], space))
    return PlanSearch(planned, sorted((o for p in fitting for o in p.result.ranked), key=ranking_key))


def plan_on(target: Target, space: SearchSpace, costing: Costing, top: int, progress: Progress | None,
            ceiling: float = float("inf")) -> Planned:
    """The search on one system, its ranked plans costed (:mod:`sim.planner.training_cost`); ``ceiling``:
    a score other systems' searches reached (none of this one's above it is ranked: for a search of the
    best plan of all, not of each system's)."""
    system, workload = target.system, target.workload
    degrees = on_system(space, system)
    checkpoints = policies_for(space, workload)
    stage_options = stage_values(space, system, workload.num_layers)
    microbatch_options = list(space.microbatches)
    check_fits(degrees, stage_options, microbatch_options, system, workload.num_layers)
    measured = workload.measured_costs  # measured costs hold one fit per stage count
    if measured:
        if costing.active:
            raise GpipeInputError("--train-tokens, --rank-by cost, --max-devices and several --hardware plan the "
                                  "analytic models; drop --costs (use --efficiency-from COSTS for its fit)")
        check_context_parallel(space.context_parallel, workload, system)
    result = _search_each_tensor_parallel(target, space, degrees, tensor_parallel_values(space, workload, system),
                                          stage_options, checkpoints, top, progress, None if measured else costing,
                                          ceiling)
    for option in result.ranked:
        option.hardware = system.name
        option.cost = (plan_cost(option, workload, system, target.batch, target.precision, costing)
                       if costing.active else None)
    return Planned(system, workload, target.batch, target.precision, result, stage_options, microbatch_options,
                   list(degrees.schedules))


def _search_each_tensor_parallel(target: Target, space: SearchSpace, degrees: SystemSpace, tensor_options: list[int],
                                 stage_options: list[int], checkpoints: list[str], top: int,
                                 progress: Progress | None, costing: Costing | None,
                                 ceiling: float = float("inf")) -> SearchResult:
    """Search T by T, each on its split workload and its system of T-device groups, then merge the
    rankings. Ranked by cost, each candidate's step is weighed by its devices and their price;
    ``--max-devices`` bounds D x K x T x C. Measured costs are searched K by K and D by D inside each T."""
    workload, system, batch = target.workload, target.system, target.batch
    parts: list[SearchResult] = []
    price = price_of(system, costing) if costing is not None else None
    for t in tensor_options:
        devices_per_group = t * space.context_parallel
        weight = None
        if costing is not None and costing.rank_by == "cost":
            weight = (lambda c, g=devices_per_group: c.stages * c.replicas * g * price)
        max_groups = costing.max_devices // devices_per_group if costing and costing.max_devices else None
        if max_groups == 0:
            continue
        step_limit = (costing.step_limit(batch * workload.options["seq"], devices_per_group, price)
                      if costing is not None and costing.limited else None)
        sequence_parallel = default_sequence_parallel(t, space.sequence_parallel, workload) and t > 1
        split, groups = with_tensor_parallel(workload, system, t, sequence_parallel, space.context_parallel,
                                             target.tensor_parallel_link(sequence_parallel))
        stages = [k for k in stage_options if k <= groups.total_devices]
        if not stages:
            continue
        if split.measured_costs:  # each E on the profiled experts (sim.formats.measured_experts), whole at T = 1
            for e, _etp in expert_values(space, workload, t):
                experts = with_expert_parallel(split, system, e, None, list(degrees.schedules)[0]) if e > 1 else split
                replicas = [d for d in degrees.replicas if (t * space.context_parallel * d) % e == 0]
                if not replicas:
                    continue
                part = _search_each_stage_count(experts, groups, batch, stages, checkpoints,
                                                replace(degrees, replicas=tuple(replicas)), space, top, progress)
                _label(part, t, sequence_parallel, space.context_parallel, e)
                parts.append(part)
            continue
        for e, etp in _near_a_domain_first(expert_values(space, workload, t), t, system.devices_per_node):
            replicas = [d for d in degrees.replicas if (t * space.context_parallel * d) % (e * (etp or t)) == 0]
            for schedules in _by_overlap(list(degrees.schedules), e):
                if not replicas:
                    continue
                experts = with_expert_parallel(split, system, e, etp, schedules[0])
                part = search(experts, groups, batch, stages, list(space.microbatches), checkpoints, schedules,
                              space.partitioner, top, progress, replicas, list(degrees.virtual_stages),
                              list(degrees.zero), list(space.placements), dp_overlap=space.dp_overlap,
                              weight=weight, max_groups=max_groups, step_limit_s=step_limit,
                              escalate_zero=space.zero_escalates,
                              shard_group_options=space.shard_groups if e == 1 else (),  # HSDP of experts: not modelled
                              gradient_sync_options=space.gradient_syncs,
                              ceiling_score=min(ceiling, _ceiling(parts, top)))
                _label(part, t, sequence_parallel, space.context_parallel, e, etp)
                parts.append(part)
    return _merged(parts, top)


def _near_a_domain_first(pairs: list[tuple[int, int | None]], t: int, per_domain: int) -> list[tuple[int, int | None]]:
    """(E, ETP) in the order likely fastest first: groups filling about one scale-up domain (all-to-alls on
    NVLink, the fewest experts per rank), so the shared ceiling (:func:`_ceiling`) prunes the rest early.
    The order changes how much is simulated, never the ranking."""
    return sorted(pairs, key=lambda p: abs(math.log2(p[0] * (p[1] or t)) - math.log2(per_domain)))


def _ceiling(parts: list[SearchResult], top: int) -> float:
    """The ``top``-th best score of the searches so far: no plan above it enters the merged ranking."""
    scores = sorted(o.score for part in parts for o in part.ranked)
    return scores[top - 1] if len(scores) >= top else float("inf")


def _by_overlap(schedules: list[str], expert_parallel: int) -> list[list[str]]:
    """The schedules in groups priced alike: with E > 1 those that overlap the all-to-alls apart from the
    others (:mod:`sim.workloads.moe.expert_parallel`); all together otherwise."""
    if expert_parallel == 1:
        return [schedules]
    hiding = [s for s in schedules if s in OVERLAPPING_SCHEDULES]
    showing = [s for s in schedules if s not in OVERLAPPING_SCHEDULES]
    return [g for g in (showing, hiding) if g]


def _label(part: SearchResult, t: int, sequence_parallel: bool, context_parallel: int, e: int = 1,
           etp: int | None = None) -> None:
    """Each option of ``part`` with the degrees its workload was split by."""
    for option in part.ranked + part.unfit_examples:
        option.candidate = replace(option.candidate, tensor_parallel=t, sequence_parallel=sequence_parallel,
                                   context_parallel=context_parallel, expert_parallel=e,
                                   expert_tensor_parallel=etp)


def _search_each_stage_count(workload: MeasuredCosts, system: System, batch: int, stage_options: list[int],
                             checkpoints: list[str], degrees: SystemSpace, space: SearchSpace, top: int,
                             progress: Progress | None) -> SearchResult:
    """Search K by K and D by D with the measured workload bound to each (its fits and threads are
    those of D x K processes), then merge the rankings. With its experts split (E > 1) HSDP is not
    searched (not modelled for the routed experts)."""
    parts = []
    for k in stage_options:
        for d in degrees.replicas:
            bound, bound_system = workload.bind(system, k, replicas=d)
            parts.append(search(bound, bound_system, batch, [k], list(space.microbatches), checkpoints,
                                list(degrees.schedules), space.partitioner, top, progress, [d],
                                list(degrees.virtual_stages), list(degrees.zero), list(space.placements),
                                bound.allreduce_link(bound_system),  # type: ignore[attr-defined]
                                escalate_zero=space.zero_escalates,
                                shard_group_options=space.shard_groups if workload.expert_parallel == 1 else (),
                                gradient_sync_options=space.gradient_syncs))
    return _merged(parts, top)


def _merged(parts: list[SearchResult], top: int) -> SearchResult:
    ranked = sorted((o for part in parts for o in part.ranked), key=ranking_key)[:top]
    return SearchResult(ranked=ranked, candidates=sum(p.candidates for p in parts),
                        simulated=sum(p.simulated for p in parts), not_fitting=sum(p.not_fitting for p in parts),
                        elapsed_s=sum(p.elapsed_s for p in parts),
                        unfit_examples=[o for p in parts for o in p.unfit_examples][:5],
                        over_limit=sum(p.over_limit for p in parts))


def fastest_and_cheapest(space: SearchSpace, costing: Costing,
                         ranked: list[PlanOption]) -> tuple[PlanOption | None, PlanOption | None]:
    """With train tokens, the fastest plan of all and the cheapest of the priced systems' (ranking by
    cost has them all priced): the ranking gives one, a second search (its best only) under the
    other objective the other. Without, the best plan is whichever the ranking is by."""
    priced = [target for target in space.hardware if price_of(target.system, costing) is not None]
    if costing.train_tokens is None or not priced:
        return (ranked[0], None) if costing.rank_by == "time" else (None, ranked[0])
    flipped = replace(costing, rank_by="cost" if costing.rank_by == "time" else "time")
    results: list[SearchResult] = []
    for target in priced if flipped.rank_by == "cost" else space.hardware:  # only a plan better than the best so far
        results.append(plan_on(target, space, flipped, 1, None, _ceiling(results, 1)).result)
    again = [o for result in results for o in result.ranked]
    other = min(again, key=lambda o: o.score) if again else None
    return (ranked[0], other) if costing.rank_by == "time" else (other, ranked[0])


def nothing_within_limits(space: SearchSpace, costing: Costing) -> str:
    """Why no plan is left, with what the limits exclude: the fastest and the cheapest without them."""
    free = replace(costing, max_cost=None, max_days=None)
    asked = " and ".join(text for text in (f"at most {costing.max_days:g} days" if costing.max_days else "",
                                           f"at most {dollars(costing.max_cost)}" if costing.max_cost else "") if text)
    best: dict[str, Any] = {}
    for rank_by in ("time", "cost") if costing.max_cost else ("time",):
        found = [o for target in space.hardware
                 for o in plan_on(target, space, replace(free, rank_by=rank_by), 1, None).result.ranked]
        if found:
            best[rank_by] = min(found, key=lambda o: o.score)
    said = []
    if "time" in best:
        said.append(f"the fastest, {layout_text(best['time'])} on {best['time'].hardware}, takes "
                    f"{best['time'].cost.days:.3g} days")
    if "cost" in best:
        said.append(f"the cheapest, {layout_text(best['cost'])} on {best['cost'].hardware}, costs "
                    f"{dollars(best['cost'].cost.cost)}")
    return (f"no plan trains {format_token_count(costing.train_tokens)} tokens in {asked}: "
            + "; ".join(said or ["none fits"]) + "; raise the limits, allow more devices (--max-devices) or try "
            "other --hardware")


def nothing_fits(first: Planned, space: SearchSpace) -> str:
    """Why nothing fits, told on the candidate that needs the least memory: most stages, most
    micro-batches, the most re-materialization searched."""
    from sim.engine.engine import simulate
    from sim.planner.search import Candidate, default_partition
    from sim.views.report import fit_advice

    result, workload, system, batch = first.result, first.workload, first.system, first.batch
    checkpoints, schedules, stage_options = list(space.policies), first.schedules, first.stage_options
    order = ["full", "always", "selective", "except_last", "never"]  # the leanest first, as large models run
    policy = min(checkpoints, key=order.index)
    stages = max(stage_options)
    microbatches = len(split_rows(batch, max(first.microbatch_options)))
    if result.candidates == 0:
        return (f"no candidate to search: --schedules {','.join(schedules)} cannot run any K of "
                f"{','.join(map(str, stage_options))} on {workload.num_layers} layers (zbv and dualpipev need 2K "
                f"layers and K > 1, dualpipev M >= 2K, interleaved V x K layers and M a multiple of K); "
                f"give other --stages-options or add gpipe or 1f1b to --schedules")
    schedule = next((s for s in schedules if s not in MULTI_CHUNK_SCHEDULES), None)  # one chunk per device
    if schedule is None:
        return (f"no plan among {result.candidates} candidates fits; try more stages or "
                f"--checkpoints always, or --schedules with gpipe or 1f1b")
    candidate = Candidate(stages, microbatches, policy, schedule)
    partition = default_partition(workload, system, batch, candidate)
    leanest = simulate(workload, system, partition, batch, candidate, record=False)
    return (f"no plan among {result.candidates} candidates fits; even K={stages} M={microbatches} {policy}: "
            + fit_advice(leanest, system))
