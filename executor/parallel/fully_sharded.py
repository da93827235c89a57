"""ZeRO-2, ZeRO-3 and HSDP: each stage's parameters, gradients and optimizer state sharded over its
data-parallel ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``), under our own pipeline.

Units, as torchtitan wraps a model: every layer of a stage's ``nn.Sequential`` chunk that holds
parameters (a transformer block, the embedding, the head) is one ``fully_shard`` unit, and the chunk
itself is the root unit, holding what no layer holds alone (parameters two layers of the chunk
share: a tied embedding and head on one stage). Each unit is sharded over the stage's ``dp`` ranks of
the run's :class:`~torch.distributed.device_mesh.DeviceMesh` (:mod:`executor.parallel.replicas`); with
tensor parallelism the parameters are DTensors on the mesh's ``tp`` dimension first and FSDP shards
them over ``dp`` of the same mesh. With ``--shard-group N`` below D (HSDP) the dp ranks form a 2-D
mesh (replicate, shard): shards within groups of N consecutive replicas, all-reduced across groups.

With expert parallelism (``--expert-parallel E``, :mod:`executor.parallel.expert_parallel`), as
torchtitan composes FSDP2 with it (``apply_fsdp`` with ``ep_degree``): each block's routed experts,
the rank's n/E of them (:class:`~executor.parallel.expert_exchange.LocalExperts`), are a unit of
their own nested in the block's, sharded over the mesh's ``edp`` dimension (the D/E replicas holding
the same experts; with E = D a mesh of one, so each rank's experts stay whole); the rest of the block
and the root over ``dp`` as above. An expert's gradient already holds its group's weighted sum (the
exchange scales what it sends back), so its reduce-scatter over ``edp`` has weight 1, the rest's
``rows_d / B``: the same sums as the all-reduces without sharding. Which gradients are absent is
agreed over the ranks each unit reduces over. Under ZeRO-3 on one stage a unit's experts are
prefetched with the unit (the simulator's unit holds its experts).

What is done when (the contract with the simulator, ``sim/``):

* ``--zero 2``: a unit's parameters are gathered before its first forward of a step and kept until
  the step's gradients are reduced (``reshard_after_forward=False``).
* ``--zero 3`` with one pipeline stage (K = 1): gathered before each forward and again before each
  backward, freed after each (``reshard_after_forward=True``), the next unit's gather issued with
  the current one's (forward and backward prefetch of one unit).
* with K > 1 (torchtitan's policy for pipelines): no reshard after forward, so ``--zero 3`` runs as
  ``--zero 2`` in time and memory; each stage gathers once per step.
* ``--gradient-sync step`` (the default with K > 1): gradients of a stage's M micro-batches
  accumulate unsharded (``set_requires_gradient_sync(False)``) and are reduce-scattered once per
  step, right after the chunk's last backward (as torch's own pipeline schedules reduce after the
  last micro-batch, ``perform_reduce_grad``), replacing the all-reduce of whole replicas.
* ``--gradient-sync microbatch`` (the default with K = 1, as FSDP2's and DeepSpeed's gradient
  accumulation run): the same reduce-scatter after every micro-batch's backward, FSDP2 adding each
  into the sharded gradient and freeing the unsharded one, so no unsharded gradient outlasts a
  backward; ZeRO-2's units stay gathered until the step's last backward reshards them.
* Each rank multiplies its gradients by its replica's share of the global batch ``rows_d / B``
  before a summing reduce-scatter, so uneven splits train what one process trains, exactly as the
  all-reduce of :mod:`executor.parallel.replicas` does; the weighting is linear, so weighting each
  micro-batch's gradients before their reduction sums to the same as weighting the accumulated ones.

The optimizer is the configured torch.optim class over the sharded (DTensor) parameters; clipping
takes each gradient's norm over its shards (a DTensor's norm made whole: each element counted once,
tensor-parallel replicas once, :func:`executor.runtime.optim.squared_norm`). Under ``--precision
bf16`` the layers run under autocast with fp32 parameters as without sharding
(:mod:`executor.runtime.precision`): FSDP gathers fp32 and reduces in fp32. FSDP's own
``MixedPrecisionPolicy(param_dtype=bf16)`` is not used: it would make every op on a parameter
(an embedding lookup, a bias add outside autocast's lists) run in bf16 where one process runs it in
fp32, so the run would no longer be one process's bf16 run, and the boundary dtypes would change.

Refused, one line, before any worker starts (:mod:`executor.parallel.sharding_checks`): the split-backward
schedules (zb-h1, zbv, dualpipev: their weight pass adds gradients to the parameters autograd.grad
is given, which under FSDP are the sharded ones, not the gathered ones the forward used);
``--checkpoint full`` when a chunk ties parameters between its own layers (the layer-by-layer
recompute calls the layers directly, so the root unit that holds the tied parameter is never
gathered); a parameter with no dimension to shard.

Where the shard group's ranks share a host, each with a core, the gathers and the reduce-scatters go
through shared memory (:mod:`executor.transport.shm_allgather`,
:class:`executor.transport.shm_allreduce.SharedSum`, as the whole replicas' all-reduce does: gloo
over loopback took about twice as long); HSDP's all-reduce across groups goes through the process
group's backend.

Limits: the gathers and reduce-scatters run synchronously (a prefetched gather is issued early but
not overlapped with compute on the host) and are timed as spans of their own
(:data:`~sim.formats.timeline.DP_ALL_GATHER`, :data:`~sim.formats.timeline.DP_REDUCE_SCATTER`);
a backward's reduce-scatters run unit by unit after the chunk's backward, not inside it as FSDP2's
hooks would issue them; the gradient norm takes one small all-reduce per parameter; the peak of
gathered parameters is sampled at each unit's forward (after its gather and prefetch) and after
every action, and the unsharded gradients held after every action's reduction, so a peak inside a
backward alone is not seen. The driving of FSDP's post-backward (:meth:`ShardedChunk.reduce`)
and the gathered-bytes probe read FSDP2's private state, as torch's own pipeline schedules do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # FSDP2's comm hooks

from executor.models.loaded_types import is_dtensor
from executor.models.moe import MixtureOfExperts
from executor.parallel.expert_exchange import LocalExperts
from executor.parallel.sharding_checks import units_of
from executor.transport.shm_allgather import SharedGather
from executor.transport.shm_allreduce import SharedSum
from executor.transport.shm_transport import HostLinks
from sim.formats.timeline import DP_ALL_GATHER, DP_REDUCE_SCATTER
from sim.schedules.schedule import Action, Kind


@dataclass(frozen=True)
class Sharding:
    """How a rank's chunks are sharded: over ``mesh`` (1-D dp, or 2-D (replicate, shard) for HSDP)."""

    mesh: DeviceMesh
    reshard_after_forward: bool  # ZeRO-3 on one stage; False for ZeRO-2 and under a pipeline
    weight: float  # rows_d / B: this replica's share of the global batch
    reduce_every_microbatch: bool = False  # --gradient-sync microbatch; else once per step, after the last backward
    expert_mesh: DeviceMesh | None = None  # E > 1: the edp replicas each block's routed experts are sharded over


def expert_units(module: nn.Module) -> list[nn.Module]:
    """The routed experts a rank holds under expert parallelism, one :class:`LocalExperts` per block
    (none without it): units of their own, sharded over :attr:`Sharding.expert_mesh`."""
    return [m for m in module.modules() if isinstance(m, LocalExperts)]


def shard_module(module: nn.Sequential, sharding: Sharding) -> nn.Sequential:
    """Apply ``fully_shard`` to each unit of ``module`` and then to ``module`` itself (the root), in
    place; every rank passes the same full values. With expert parallelism each block's routed
    experts are a unit of their own, sharded over the expert mesh first (so the block's unit leaves
    them out), as torchtitan shards them. Under ZeRO-3 each unit prefetches its own experts and the
    next unit with its experts in forward, the previous one with its experts in backward."""
    reshard = sharding.reshard_after_forward
    units = units_of(module)
    inner = {id(unit): expert_units(unit) for unit in units}
    for unit in units:
        for experts in inner[id(unit)]:
            fully_shard(experts, mesh=sharding.expert_mesh, reshard_after_forward=reshard)
        fully_shard(unit, mesh=sharding.mesh, reshard_after_forward=reshard)
    fully_shard(module, mesh=sharding.mesh, reshard_after_forward=reshard)
    fully_shard.state(module)._lazy_init()  # the chunk is the root, whichever layer runs first (--checkpoint full)
    if reshard and units:
        for before, after in zip(units, units[1:]):
            before.set_modules_to_forward_prefetch([*inner[id(before)], after, *inner[id(after)]])  # type: ignore[operator]
            after.set_modules_to_backward_prefetch([before, *inner[id(before)]])  # type: ignore[operator]
        if len(units) == 1 and inner[id(units[0])]:
            units[0].set_modules_to_forward_prefetch(inner[id(units[0])])  # type: ignore[operator]
        # not FSDP's default for the first unit, which takes the unit before it in the order of the
        # step's forwards: with M forwards before a backward, the last unit of another micro-batch
        units[0].set_modules_to_backward_prefetch([module])  # type: ignore[operator]
    return module


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class _PlainBuffers:
    """FSDP's communication hooks' buffers (the ``allocate`` of torch's ``Comm``) as plain empty
    tensors: both hooks below copy through the group's backend or shared memory of their own, which
    need no memory pool."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _TimedAllGather(_PlainBuffers, AllGather):
    """FSDP's all-gather, synchronous and timed as a span of its own; through shared memory where
    the group's ranks share a host, each with a core (:class:`executor.transport.shm_allgather.SharedGather`),
    else through the group's backend."""

    def __init__(self, recorder: Callable[[], Any], links: HostLinks | None) -> None:
        self.recorder = recorder
        self.links = links
        self._shared: SharedGather | None = None  # made at the first call, when the group is known

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        with self.recorder().span(DP_ALL_GATHER):
            ranks = _covered(self.links, input_tensor, group)
            if ranks is None:
                dist.all_gather_single(output_tensor, input_tensor, group=group)
                return
            if self._shared is None or self._shared.numel != input_tensor.numel():
                self._shared = SharedGather(self.links, ranks, [tuple(input_tensor.shape)],  # type: ignore[arg-type]
                                            input_tensor.dtype, "fsdp-gather")
            self._shared.gather(input_tensor, output_tensor)


def _covered(links: HostLinks | None, tensor: torch.Tensor, group: dist.ProcessGroup) -> list[int] | None:
    """The group's global ranks when shared memory reaches them all (host tensors), else None."""
    if links is None or tensor.device.type != "cpu":
        return None
    ranks = dist.get_process_group_ranks(group)
    return ranks if all(r == links.rank or links.covers(r) for r in ranks) else None


class _WeightedReduceScatter(_PlainBuffers, ReduceScatter):
    """FSDP's reduce-scatter as a weighted sum: this rank's gradients times ``weight`` (its replica's
    share of the global batch), summed over the shard group; timed as a span of its own. Where the
    group's ranks share a host, each with a core (``links`` covers them), the sum goes through shared
    memory (:class:`executor.transport.shm_allreduce.SharedSum`, as the whole replicas' all-reduce
    does) and each rank keeps its slice; else through the group's backend."""

    def __init__(self, weight: float, recorder: Callable[[], Any], links: HostLinks | None) -> None:
        self.weight = weight
        self.recorder = recorder
        self.links = links
        self._shared: SharedSum | None = None  # made at the first call, when the group is known

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        with self.recorder().span(DP_REDUCE_SCATTER):
            shared = self._through_shared_memory(input_tensor, group)
            if shared is None:
                input_tensor.mul_(self.weight)
                dist.reduce_scatter_single(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
                return
            shared.launch([input_tensor], self.weight)
            shared.finish([None])  # the whole sum sits in the shared output until this rank's next launch
            start = dist.get_group_rank(group, dist.get_rank()) * output_tensor.numel()
            output_tensor.copy_(shared.output[start:start + output_tensor.numel()])  # type: ignore[index]

    def _through_shared_memory(self, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> SharedSum | None:
        ranks = _covered(self.links, input_tensor, group)
        if ranks is None:
            return None
        if self._shared is None or self._shared.numel != input_tensor.numel():
            self._shared = SharedSum(self.links, ranks, [tuple(input_tensor.shape)],  # type: ignore[arg-type]
                                     input_tensor.dtype, "fsdp")
        return self._shared


def _unit_params(module: FSDPModule) -> list[Any]:
    """The FSDP parameters of ``module``'s own unit (not its children's)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


def _unsharded_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded gradient an FSDP parameter holds (accumulated or just computed), or None."""
    if not hasattr(fsdp_param, "_unsharded_param"):
        return None
    if fsdp_param.unsharded_accumulated_grad is not None:
        return fsdp_param.unsharded_accumulated_grad
    return fsdp_param._unsharded_param.grad


def _groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


def _agree_on_presence(params: Sequence[Any], groups: Sequence[dist.ProcessGroup]) -> None:
    """A gradient of ``params`` absent here but present on another rank of ``groups`` taken as zero."""
    present = torch.tensor([float(_unsharded_grad(p) is not None) for p in params])
    for group in groups:
        dist.all_reduce(present, op=dist.ReduceOp.SUM, group=group)
    for fsdp_param, count in zip(params, present.tolist()):
        if count > 0 and _unsharded_grad(fsdp_param) is None:
            fsdp_param._unsharded_param.grad = torch.zeros_like(fsdp_param._unsharded_param)


class ShardedChunk:
    """One chunk's FSDP units at run time: gradients accumulated over the step's micro-batches and
    reduce-scattered after its last backward (:meth:`reduce`), or after each (:meth:`reduce_microbatch`)."""

    def __init__(self, part: Any, sharding: Sharding) -> None:
        self.part = part  # the PipelineStage: its recorder is looked up at each call (a device may swap it)
        self.root = part.module
        self.reshard_each_backward = sharding.reshard_after_forward
        # routed experts: a replica's rows may reach none of an expert, whose gradient it then lacks;
        # units agree on which are present over the ranks they reduce over (experts: their edp ranks)
        routed = any(isinstance(m, MixtureOfExperts) for m in self.root.modules())
        self.presence_groups = _groups(sharding.mesh) if routed else []
        self.expert_presence_groups = _groups(sharding.expert_mesh) if sharding.expert_mesh is not None else []
        recorder = lambda: self.part.recorder  # noqa: E731
        links = getattr(part.transport, "links", None)  # ranks of this host reached through shared memory
        for module in fsdp_modules(self.root):
            # an expert's gradient holds its group's weighted sum already (executor.parallel.expert_exchange)
            weight = 1.0 if isinstance(module, LocalExperts) else sharding.weight
            module.set_custom_all_gather(_TimedAllGather(recorder, links))
            module.set_custom_reduce_scatter(_WeightedReduceScatter(weight, recorder, links))
            module.set_gradient_divide_factor(1.0)  # the weights are applied before the sum
            module.set_force_sum_reduction_for_comms(True)
        self.accumulate()

    def accumulate(self) -> None:
        """Backwards from here on add to the unsharded gradients without reducing them."""
        self.root.set_is_last_backward(False)
        self.root.set_requires_gradient_sync(False)
        self.root.set_reshard_after_backward(self.reshard_each_backward)

    def reduce(self) -> None:
        """The step's gradients reduce-scattered (and all-reduced across HSDP groups) and the
        parameters resharded: FSDP's post-backward of every unit, run once, as torch's pipeline
        schedules run it after their last micro-batch."""
        root = self.root
        root.set_is_last_backward(True)
        root.set_requires_gradient_sync(True)
        root.set_reshard_after_backward(True)
        self.post_backward()

    def reduce_microbatch(self) -> None:
        """One micro-batch's gradients reduce-scattered (and all-reduced across HSDP groups) into the
        sharded gradients, the unsharded ones freed; not the step's last backward, so nothing is
        finalized and ZeRO-2's units stay gathered for the next micro-batch."""
        self.root.set_requires_gradient_sync(True)
        self.post_backward()

    def post_backward(self) -> None:
        """FSDP's post-backward of every unit, run here rather than by autograd: the gradients
        reduce-scattered as the root's settings say, then accumulation on again for what follows."""
        state = fully_shard.state(self.root)
        self.agree_on_absent_gradients()
        for unit_state in state._state_ctx.all_states:
            for group in unit_state._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        self.accumulate()

    def agree_on_absent_gradients(self) -> None:
        """Every rank reduce-scatters the same gradients (FSDP2 reduces those present, and ranks that
        disagree would wait on each other for ever): one absent here but present on another rank is
        taken as zero; one absent on every rank stays absent, so the optimizer skips it as one process
        would (a routed expert no row of the batch reached). Only for chunks with routed experts."""
        if not self.presence_groups:
            return
        experts = [isinstance(module, LocalExperts) for module in fsdp_modules(self.root)]
        for groups, of_experts in ((self.presence_groups, False), (self.expert_presence_groups, True)):
            params = [p for module, is_experts in zip(fsdp_modules(self.root), experts) if is_experts == of_experts
                      for p in _unit_params(module)]
            if params:
                _agree_on_presence(params, groups)

    def unsharded_gradient_bytes(self) -> int:
        """Bytes of unsharded gradients this chunk's units hold now (this rank's part of a DTensor's)."""
        nbytes = 0
        for module in fsdp_modules(self.root):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else []:
                if not hasattr(fsdp_param, "_unsharded_param"):
                    continue
                grad = fsdp_param.unsharded_accumulated_grad
                if grad is None:
                    grad = fsdp_param._unsharded_param.grad
                if grad is not None:
                    local = grad.to_local() if is_dtensor(grad) else grad
                    nbytes += local.numel() * local.element_size()
        return nbytes

    def gathered(self) -> tuple[int, list[torch.Tensor]]:
        """Bytes of the unit parameters this chunk holds gathered now (a prefetched unit's all-gather
        issued counts), and the gathered tensors, this rank's part of each."""
        nbytes, held = 0, []
        for module in fsdp_modules(self.root):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None or not (group.is_unsharded or group._all_gather_result is not None):
                continue
            for fsdp_param in group.fsdp_params:
                nbytes += math.prod(fsdp_param._orig_size) * fsdp_param.sharded_param.element_size()
                if group.is_unsharded:
                    tensor = fsdp_param.unsharded_param
                    held.append(tensor.to_local() if is_dtensor(tensor) else tensor)
        return nbytes, held


class GatheredPeak:
    """The largest sum of gathered parameters a rank's chunks hold at once, sampled at each unit's
    forward (after its gather and prefetch) and after every action; the gathered tensors are kept
    out of the activation count (``counter``), as the parameters they stand for are. Beside it, the
    most unsharded gradients held after an action and its reduction (:meth:`sample_gradients`):
    those accumulated across micro-batches, none where each backward reduces its own."""

    def __init__(self, chunks: Sequence[ShardedChunk], counter: Any) -> None:
        self.chunks = list(chunks)
        self.counter = counter
        self.peak_bytes = 0
        self.gradient_peak_bytes = 0
        for chunk in self.chunks:
            for unit in fsdp_modules(chunk.root):
                unit.register_forward_pre_hook(lambda module, args: self.sample())  # after FSDP's own

    def sample(self) -> None:
        total = 0
        for chunk in self.chunks:
            nbytes, held = chunk.gathered()
            total += nbytes
            if held:
                self.counter.exclude(held)
        self.peak_bytes = max(self.peak_bytes, total)

    def sample_gradients(self) -> None:
        total = sum(chunk.unsharded_gradient_bytes() for chunk in self.chunks)
        self.gradient_peak_bytes = max(self.gradient_peak_bytes, total)


def attach(stage: Any, parts: Sequence[Any], sharding: Sharding) -> tuple[GatheredPeak, Callable[[int, Action], None]]:
    """What drives the FSDP units of ``stage`` (a PipelineStage, or a device of chunks ``parts``)
    through each step: the probe of gathered bytes, and the hook to run after each action (the
    caller chains it), which reduces each chunk after its last backward of the step, and with
    ``--gradient-sync microbatch`` after each of its backwards before that too."""
    chunks = {part.config.stage: ShardedChunk(part, sharding) for part in parts}
    peak = GatheredPeak(list(chunks.values()), stage.counter)
    gradients = (Kind.BACKWARD, Kind.INPUT, Kind.WEIGHT)
    last = {action.stage: index for index, action in enumerate(stage.actions) if action.kind in gradients}

    def after(index: int, action: Action) -> None:
        peak.sample()
        if last.get(action.stage) == index:
            chunks[action.stage].reduce()
        elif sharding.reduce_every_microbatch and action.kind in (Kind.BACKWARD, Kind.WEIGHT):
            chunks[action.stage].reduce_microbatch()
        peak.sample_gradients()

    return peak, after


def memory_bytes(parts: Sequence[Any], peak: GatheredPeak) -> dict[str, int]:
    """This rank's bytes as the contract with the simulator counts them: parameter and gradient
    shards padded as FSDP pads them (dim 0 rounded up to a multiple of the shard ranks), optimizer
    state tensors of a parameter's shape at that size (AdamW: 2 per parameter; the scalar step
    counters left out), the largest sum of gathered unit parameters seen at once, and the most
    unsharded gradients held after an action (accumulated across micro-batches)."""
    parameter = gradient = optimizer = 0
    for part in parts:
        padded = {}
        for module in fsdp_modules(part.module):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else []:
                sharded = fsdp_param.sharded_param
                nbytes = math.prod(fsdp_param.padded_sharded_param_size) * sharded.element_size()
                padded[id(sharded)] = nbytes
                parameter += nbytes
                if sharded.requires_grad:
                    gradient += nbytes
        if part.optimizer is not None:
            for param, state in part.optimizer.state.items():
                optimizer += sum(padded.get(id(param), 0) for value in state.values()
                                 if torch.is_tensor(value) and value.dim())
    return {"parameter_bytes": parameter, "gradient_bytes": gradient, "optimizer_state_bytes": optimizer,
            "gathered_parameter_bytes_peak": peak.peak_bytes, "accumulated_gradient_bytes": peak.gradient_peak_bytes}
