"""Expert parallelism: each MoE layer's routed experts split over E ranks, tokens exchanged by all-to-alls.

Megatron-Core folds the expert grid (ETP x E x expert-DP) over the ranks that run one pipeline stage,
T x C x D of them (:class:`sim.formats.layout.ParallelLayout`), rank order ``tp-cp-ep-dp-pp`` (pipeline
outermost): the E ranks of one expert-parallel group are E x ETP consecutive GPUs, one every ETP. On a
system of ``devices_per_node`` GPUs per scale-up domain (8 on NVLink, 72 on a GB200 NVL72 rack) the group
therefore spans N = ceil(E x ETP / devices_per_node) domains with g = E / N members on each.

Per MoE layer and micro-batch, each rank's tokens (its s / T of the sequence under sequence parallelism,
which Megatron-Core requires for MoE with T > 1) are sent to the ranks holding their top-k experts and
the outputs brought back: two all-to-alls in the forward (dispatch, combine) and two in the backward
(their gradients), again in a recompute that reruns the MoE MLP. Each moves, per rank,

    bytes = tokens x top_k x d_model x compute dtype bytes x (E - 1) / E

(assignments x capacity factor where one is set), of which (g - 1) / E of the payload stays in the domain
and (E - g) / E crosses it on the rank's own NIC (one rail per GPU). NCCL posts every peer's send and
receive at once, so the two parts run together (:func:`all_to_all_s`):

    max((g - 1)/E x n / B_intra, (E - g)/E x n / B_inter) + L_intra (+ L_inter across domains)

With ETP > 1 each expert is also split ETP ways: the tokens an expert rank receives are all-gathered over
its ETP group after the dispatch and its output reduce-scattered before the combine (ring, on the
tensor-parallel link), as Megatron-Core's all-to-all dispatcher runs it; with ETP = 1 and T > 1 each
expert is whole on one rank and the expert MLP issues no tensor-parallel collective: a MoE block without
a shared expert drops the dense MLP's (the shared expert, split by T, keeps them).

The slowest expert rank sets the grouped matmul's time: the routed experts' compute is scaled by the
expected most loaded rank's assignments over the mean (:func:`sim.workloads.moe.layers.expected_max_load`,
E ranks as the bins, the E ranks' tokens as the balls) or by ``expert_imbalance`` where given; with a
``capacity_factor`` every expert computes its padded capacity, and no rank more than another.

A schedule that overlaps one micro-batch's all-to-all with another micro-batch's compute (``dualpipev``,
DeepSeek-V3's DualPipe; or any schedule run with Megatron-Core's ``overlap_moe_expert_parallel_comm``, which
merges one micro-batch's forward with an adjacent one's backward, a replayed run's ``moe_a2a_overlap``) hides it: per MoE layer, exposed = max(0, all-to-alls of a forward and a backward
- that layer's forward and backward compute), split between the two in proportion. Every other schedule
shows it whole. The exposed part is counted in the F and B actions' time and shown as ``dispatch_ep`` and
``combine_ep`` spans inside them.

Limits: all-to-alls are not contended by the pipeline's sends, the data-parallel reduction or each other;
a DualPipe warm-up or cool-down action without a partner is priced as overlapped all the same; the
imbalance estimate is a router balanced in expectation (real routers, and DeepSeek's node-limited routing,
differ); the placement of the expert group is Megatron-Core's rank order whatever the pipeline's
``--placement``. A measured workload (``--costs``) is split by :mod:`sim.formats.measured_experts`
instead: its profiled blocks, the fitted all-to-all (the costs file's ``expert_parallel`` entry,
:func:`sim.formats.costs_links.expert_parallel_link`), whole stages only (T = 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sim.catalog.hardware import Link, System
from sim.engine.allreduce import ring_allreduce_s
from sim.errors import GpipeInputError

# schedules that run one micro-batch's forward beside another's backward, hiding the all-to-all
OVERLAPPING_SCHEDULES = ("dualpipev",)


def _wire_s(nbytes: float, link: Link) -> float:
    bandwidth = link.collective_bytes_per_s(2)
    return 0.0 if math.isinf(bandwidth) or nbytes <= 0 else nbytes / bandwidth


def all_to_all_s(nbytes: float, members: int, per_domain: int, intra: Link, inter: Link,
                 across_bytes: float | None = None) -> float:
    """One all-to-all among ``members`` ranks, ``per_domain`` of them in each scale-up domain, each rank
    holding ``nbytes`` of payload for the group (its own share included): see the module docstring.
    ``across_bytes``: what crosses the domain's network per rank where a deduplicating dispatcher sends
    less than the payload's share for other domains; the rest is then carried inside the domain."""
    if members < 2 or nbytes <= 0:
        return 0.0
    if across_bytes is None:
        inside = _wire_s(nbytes * (per_domain - 1) / members, intra)
        across_bytes = nbytes * (members - per_domain) / members
    else:  # every other rank's share crosses the domain's links once, the fan-out to the experts' ranks
        inside = _wire_s(nbytes * (members - 1) / members, intra) if per_domain > 1 else 0.0
    across = _wire_s(across_bytes, inter) if members > per_domain else 0.0
    latency = (intra.latency_s if per_domain > 1 else 0.0) + (inter.latency_s if members > per_domain else 0.0)
    return max(inside, across) + latency


@dataclass(frozen=True)
class ExpertSplit:
    """How one MoE model's experts are split: E ranks, each expert over ETP ranks, the domains the group
    spans, the links it crosses, and whether the schedule overlaps its all-to-alls."""

    expert_parallel: int
    expert_tensor_parallel: int
    per_domain: int  # g: members of one expert-parallel group in one scale-up domain
    intra: Link
    inter: Link
    overlapped: bool = False

    @property
    def domains(self) -> int:
        """The scale-up domains the expert-parallel group spans."""
        return max(1, self.expert_parallel // max(1, self.per_domain))

    def exchange_s(self, nbytes: float, across_bytes: float | None = None) -> float:
        """One dispatch (or combine): the all-to-all of ``nbytes`` per rank (``across_bytes`` of it over the
        network where a dispatcher deduplicates, :func:`all_to_all_s`), and with ETP > 1 the gather (or
        reduce-scatter) of what the rank received over its ETP group."""
        seconds = all_to_all_s(nbytes, self.expert_parallel, self.per_domain, self.intra, self.inter, across_bytes)
        if self.expert_tensor_parallel > 1:
            seconds += ring_allreduce_s(nbytes * self.expert_tensor_parallel, self.expert_tensor_parallel,
                                        self.intra) / 2
        return seconds

    def exposed_s(self, forward_a2a_s: float, backward_a2a_s: float, forward_s: float,
                  backward_s: float) -> tuple[float, float]:
        """(forward, backward) all-to-all seconds shown beside a layer's ``forward_s`` and ``backward_s``
        of compute: all of it, or with an overlapping schedule what the other micro-batch's compute
        does not hide."""
        if not self.overlapped:
            return forward_a2a_s, backward_a2a_s
        total = forward_a2a_s + backward_a2a_s
        shown = max(0.0, total - forward_s - backward_s)
        if total <= 0 or shown <= 0:
            return 0.0, 0.0
        return shown * forward_a2a_s / total, shown * backward_a2a_s / total


def remote_domains_per_token(experts: int, top_k: int, domains: int, groups: int = 0,
                             routed_groups: int = 0) -> float:
    """Expected scale-up domains other than its own a token's top-k experts fall in, experts spread evenly
    over ``domains`` and a router balanced in expectation (k distinct experts drawn uniformly): each other
    domain is reached unless all k experts are elsewhere, C(n - n/N, k) / C(n, k). DeepEP and HybridEP
    send a token once to each such domain and fan it out to the experts' ranks inside it (DeepSeek-V3
    technical report, Section 3.2.2; Megatron-Core's ``flex`` dispatcher); an all-to-all sends one copy
    per assignment. With group-limited routing (``groups`` of experts, a token's top-k drawn from its best
    ``routed_groups``: DeepSeek-V3's 8 and 4) and the groups laid whole on the domains (``groups`` a
    multiple of them), a domain is reached when one of its groups is chosen, each group taken to receive at
    least one of the token's experts: C(G - G/N, g) / C(G, g) missed."""
    if domains < 2:
        return 0.0
    if groups and routed_groups and groups % domains == 0:
        missed = math.comb(groups - groups // domains, routed_groups) / math.comb(groups, routed_groups)
        return (domains - 1) * (1.0 - missed)
    per_domain = experts / domains
    missed = math.comb(experts - round(per_domain), top_k) / math.comb(experts, top_k)
    return (domains - 1) * (1.0 - missed)


def expert_replica_stride(workload: Any) -> int:
    """How many replicas' stage groups one expert-parallel group spans (E x ETP / (T x C), at least 1): the
    replicas holding the same expert shard, its expert-data-parallel group, are every this-many-th."""
    split = workload.experts_split
    if split is None:
        return 1
    per_stage = workload.tensor_parallel * workload.context_parallel
    return max(1, split.expert_parallel * split.expert_tensor_parallel // per_stage)


def expert_data_ranks(workload: Any, replicas: int) -> int:
    """The ranks holding the same expert shard, T x C x D / (E x ETP) (the layout's
    :attr:`sim.formats.layout.ParallelLayout.expert_data_parallel`), for a workload split by E; 0 without
    expert parallelism. ZeRO-2/3 shards the routed experts' state over them."""
    split = workload.experts_split
    if split is None:
        return 0
    group = workload.tensor_parallel * workload.context_parallel * replicas
    return max(1, group // (split.expert_parallel * split.expert_tensor_parallel))


def expert_count(workload: Any) -> int:
    """The routed experts of a MoE workload's layers; 0 for a model without experts."""
    return int(workload.options.get("experts", 0)) if workload.has_experts else 0


def check_expert_parallel(workload: Any, expert_parallel: int, expert_tensor_parallel: int | None = None,
                          tensor_parallel: int = 1) -> None:
    """E > 1 (or an ETP other than T) only for a model with experts, E dividing them (a measured one: its
    routed experts profiled apart, whole stages); one line each."""
    if expert_parallel == 1 and expert_tensor_parallel in (None, tensor_parallel):
        return
    experts = expert_count(workload)
    name = workload.name
    if not experts:
        flag = "--expert-parallel" if expert_parallel > 1 else "--expert-tensor-parallel"
        raise GpipeInputError(f"{flag} splits a mixture of experts' routed experts, and {name} has none; "
                              "leave it out (or give a model with experts)")
    if experts % expert_parallel:
        raise GpipeInputError(f"--expert-parallel {expert_parallel} does not divide {name}'s {experts} routed "
                              "experts; give a divisor of the experts")
    if workload.measured_costs and not workload.experts_profiled:
        raise GpipeInputError("--expert-parallel with --costs: the costs file has no profile of its routed experts "
                              "apart (calibrated before they were timed apart); re-run gpipe calibrate --force, or "
                              "drop --costs to plan expert parallelism on the analytic model")
    if workload.measured_costs and tensor_parallel > 1:
        raise GpipeInputError("--expert-parallel with --costs prices whole experts on whole stages; drop "
                              "--tensor-parallel (or --costs, to plan it on the analytic model)")


def expert_split(system: System, expert_parallel: int, expert_tensor_parallel: int, schedule: str,
                 tp_link: Link | None = None, overlap: bool = False) -> ExpertSplit:
    """The :class:`ExpertSplit` of E x ETP consecutive GPUs of ``system`` (module docstring); its all-to-alls
    overlapped under an overlapping schedule or where ``overlap`` says the trainer overlaps them."""
    span = expert_parallel * expert_tensor_parallel
    domains = max(1, -(-span // system.devices_per_node))
    return ExpertSplit(expert_parallel, expert_tensor_parallel, max(1, expert_parallel // domains),
                       tp_link or system.intra_link, system.inter_link, overlap or schedule in OVERLAPPING_SCHEDULES)


def with_expert_parallel(workload: Any, system: System, expert_parallel: int, expert_tensor_parallel: int | None,
                         schedule: str, overlap: bool = False) -> Any:
    """``workload`` (already split over T x C by :func:`sim.workloads.tensor_parallel.with_tensor_parallel`)
    with its experts split over E ranks of ETP each on ``system`` (the physical system, before T x C
    groups); itself where E = 1 and ETP is T's default. ``overlap``: the trainer overlaps one micro-batch's
    all-to-alls with another's compute whatever the schedule (Megatron-Core's
    ``overlap_moe_expert_parallel_comm``, which merges adjacent micro-batches' forward and backward)."""
    tensor_parallel = workload.tensor_parallel
    etp = tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
    check_expert_parallel(workload, expert_parallel, expert_tensor_parallel, tensor_parallel)
    if expert_parallel == 1 and etp == tensor_parallel:
        return workload
    return workload.split_experts(expert_split(system, expert_parallel, etp, schedule,
                                               workload.tp_link, overlap))
