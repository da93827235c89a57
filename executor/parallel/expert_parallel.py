"""Expert parallelism (``--expert-parallel E``): each stage's routed experts sharded over E of its replicas.

The D replicas of a stage (the ``dp`` dimension of the run's mesh, :mod:`executor.parallel.replicas`)
form D/E expert-parallel groups of E consecutive replicas (``ep``, replicas ``g x E .. g x E + E-1``);
replica d holds experts ``(d mod E) x n/E`` to ``(d mod E + 1) x n/E - 1`` of every block of its
stage, whole (each split over the stage's T ranks as tensor parallelism splits it: expert tensor
parallelism equal to T), and runs them for every token its group routes to them
(:mod:`executor.parallel.expert_exchange`). Everything else (attention, norms, the router, shared
experts, embedding and head) is whole on every replica, as without experts. Megatron-Core folds its
expert grid the same way, with the expert-data-parallel replicas (``edp``: the D/E replicas that hold
the same experts, d mod E equal) beside it.

Gradients: the non-expert parameters' are summed over all D replicas with weights ``rows_d / B`` as
without experts; each expert's already holds its group's weighted sum (the exchange scales what it sends back),
so it is summed over its ``edp`` replicas with weight 1, in the same step phase. The global norm for
clipping counts each expert once: its squares are summed over the group. With D > E an expert's
gradient absent on a replica (no row reached it this step) is taken as zero where another replica
has one, and stays absent where none has (:class:`executor.parallel.gradient_average.GradientAverage`), so
the optimizer skips it as one process would.

With ``--zero 1`` the non-expert parameters' optimizer state is sharded over ``dp``, the experts'
over ``edp`` (:mod:`executor.parallel.expert_zero`). With ``--zero 2|3`` each block's experts are a FSDP unit of their own over the ``edp`` replicas and
FSDP reduce-scatters their gradients there, with weight 1 as above
(:mod:`executor.parallel.fully_sharded`); the norm counts each expert once in the same way, its
shards' squares whole over ``edp`` first.

Checkpoints hold the whole stage (every expert, their optimizer state in the unsharded model's order):
the E ranks of replica 0's group gather their parts before replica 0 writes
(:func:`full_stage_state`), so a run resumes at any E, or without expert parallelism, and one saved
without it resumes under it (each rank takes its experts by name,
:func:`executor.state.checkpoint.repartitioned_state`).

Hugging Face MoE blocks (``hf:mixtral``, ``hf:qwen3_moe``) keep their experts as 3-D tensors: each
rank keeps its rows of them under transformers' names and routes through the same exchange
(:mod:`executor.parallel.hf_experts`).

Limits: the built-in transformer's and those Hugging Face blocks' experts only
(:mod:`executor.parallel.expert_checks` refuses the rest in one line); the
gather for a checkpoint moves the group's experts through one process (``all_gather_object``); the
experts run in a Python loop, once per (source rank, expert), correct rather than fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from executor.models.loaded_types import is_dtensor
from executor.models.moe import MixtureOfExperts
from executor.parallel import hf_experts
from executor.parallel.expert_exchange import Exchange, LocalExperts
from executor.parallel.expert_zero import held_states
from executor.runtime.optim import gradients, squared_norm
from sim.schedules.schedule import Action

EXPERT_NAME = re.compile(r"^(.*\.experts\.)(\d+)\.(.*)$")  # a routed expert's tensor: (block prefix, index, rest)


@dataclass
class ExpertSharding:
    """This rank's place in its stage's expert grid and the groups it talks over."""

    group: dist.ProcessGroup  # ep: the E replicas that hold the stage's experts between them
    rank: int  # this replica's place in it
    size: int  # E
    data_group: dist.ProcessGroup | None  # edp: the D/E replicas holding the same experts (None: D = E)
    weight: float  # this replica's share of the global batch, rows_d / B


def moe_blocks(module: nn.Module) -> list[MixtureOfExperts]:
    return [m for m in module.modules() if isinstance(m, MixtureOfExperts)]


def is_expert(name: str) -> bool:
    """Whether a parameter or state-dict name is a routed expert's (not the router's or a shared one's):
    one of the built-in's experts, or a Hugging Face block's 3-D experts' tensor."""
    return EXPERT_NAME.match(name) is not None or hf_experts.is_fused_expert(name)


def keep_local_experts(module: nn.Module, sharding: ExpertSharding) -> None:
    """Drop the experts other ranks hold from every block of ``module``, in place, and route the
    blocks' tokens through ``sharding``'s group."""
    for block in moe_blocks(module):
        per_rank = block.num_experts // sharding.size
        first = sharding.rank * per_rank
        block.experts = LocalExperts({str(e): block.experts[e] for e in range(first, first + per_rank)})
        block.exchange = Exchange(sharding.group, sharding.rank, sharding.size, sharding.weight)
    hf_experts.keep_local(module, lambda block: Exchange(sharding.group, sharding.rank, sharding.size, sharding.weight))


def exchanges_of(module: nn.Module) -> list[Exchange]:
    """The exchanges of ``module``'s blocks (none without expert parallelism)."""
    return ([block.exchange for block in moe_blocks(module) if block.exchange is not None]
            + [block.exchange for block in hf_experts.sharded_blocks(module)])


def exchanges(parts: Sequence[Any]) -> list[Exchange]:
    return [exchange for part in parts for exchange in exchanges_of(part.module)]


def split_params(part: Any) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """A stage's trained parameters as (not routed experts', routed experts'), each in the stage's order."""
    experts = {id(p) for name, p in part.module.named_parameters() if is_expert(name)}
    return [p for p in part.params if id(p) not in experts], [p for p in part.params if id(p) in experts]


def attach(stage: Any, parts: Sequence[Any], sharding: ExpertSharding, traced: bool) -> list[nn.Parameter]:
    """The stage's norm counting each expert once over the group and, in ``traced`` runs, the exchanges'
    all-to-alls recorded as spans of the action running (told its micro-batch); returns the expert
    parameters, whose gradients the caller sums over ``sharding.data_group``."""
    expert_params: list[nn.Parameter] = []
    for part in parts:
        _, local = split_params(part)
        expert_ids = {id(p) for p in local}
        part.norm_params = [p for p in part.norm_params if id(p) not in expert_ids]
        part.grad_sq_norm = _norm_with_experts(part, part.grad_sq_norm, local, sharding.group)
        expert_params += local
    if traced and exchanges(parts):
        run, microbatch = stage.run, [-1]
        for part in parts:  # a chunk's recorder tags its spans with the chunk's virtual stage
            for exchange in exchanges_of(part.module):
                exchange.recorder, exchange.microbatch = part.recorder, microbatch

        def run_telling_microbatch(action: Action) -> None:
            microbatch[0] = action.microbatch
            run(action)

        stage.run = run_telling_microbatch
    return expert_params


def _norm_with_experts(part: Any, own: Any, experts: list[nn.Parameter], group: dist.ProcessGroup) -> Any:
    def grad_sq_norm() -> torch.Tensor:
        local = own()
        total = squared_norm(gradients(experts), part.device)
        dist.all_reduce(total, group=group)
        return local + total

    return grad_sq_norm


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if is_dtensor(tensor) else tensor  # a tensor-parallel shard: this rank's part
    return local.numel() * local.element_size()


def memory_bytes(parts: Sequence[Any]) -> dict[str, int]:
    """This rank's bytes as the contract with the simulator counts them (as ZeRO-2/3's,
    :func:`executor.parallel.fully_sharded.memory_bytes`): its parameters and a gradient of each
    trained one's size (the non-expert ones whole, n/E experts; a tensor-parallel shard's local part),
    and optimizer state tensors of a parameter's shape it holds (AdamW: 2 per parameter; with ZeRO-1
    its shards' only; the scalar step counters left out)."""
    parameter = gradient = optimizer = 0
    for part in parts:
        parameter += sum(_local_bytes(p) for p in part.module.parameters())
        gradient += sum(_local_bytes(p) for p in part.params)
        optimizer += sum(_local_bytes(value) for state in held_states(part.optimizer)
                         for value in state.values() if torch.is_tensor(value) and value.dim())
    return {"parameter_bytes": parameter, "gradient_bytes": gradient, "optimizer_state_bytes": optimizer}


def _template(name: str) -> str:
    match = EXPERT_NAME.match(name)
    return name if match is None else f"{match.group(1)}*.{match.group(3)}"


def full_stage_state(module: nn.Module, module_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None,
                     names: list[list[str]]) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, list[list[str]]]:
    """The stage's state with every expert, gathered from its expert-parallel group, the optimizer's
    indexed in the unsharded model's parameter order (and ``names``, each index's names, to match);
    unchanged without expert parallelism. Collective over the group."""
    found = exchanges_of(module)
    if not found:
        return module_state, optimizer_state, names
    group = found[0].group
    mine = (module_state, optimizer_state["state"] if optimizer_state is not None else None, names)
    parts: list[Any] = [None] * found[0].size
    dist.all_gather_object(parts, mine, group=group)
    full_module = {key: value for state, _, _ in parts for key, value in state.items()}
    fused_module, fused_optimizer = hf_experts.gathered(parts)  # Hugging Face blocks: slices joined in rank order
    full_module.update(fused_module)
    if optimizer_state is None:
        return full_module, None, names
    position = {_template(n[0]): i for i, n in enumerate(names)}
    block_start: dict[str, int] = {}
    for i, n in enumerate(names):
        match = EXPERT_NAME.match(n[0])
        if match is not None:
            block_start.setdefault(match.group(1), i)

    def order(name: str) -> tuple[int, int, int]:  # the unsharded model's: a block's experts in index order
        match = EXPERT_NAME.match(name)
        if match is None:
            return position[name], -1, 0
        return block_start[match.group(1)], int(match.group(2)), position[_template(name)]

    entries: dict[str, tuple[list[str], Any]] = {}
    for n in parts[0][2]:
        if n[0] in fused_optimizer:
            entries[n[0]] = (n, fused_optimizer[n[0]])
    for _, state, part_names in parts:
        for index, n in enumerate(part_names):
            entries.setdefault(n[0], (n, state.get(index)))
    full_names = sorted(entries, key=order)
    state = {i: entries[name][1] for i, name in enumerate(full_names) if entries[name][1] is not None}
    groups = [dict(group, params=list(range(len(full_names)))) for group in optimizer_state["param_groups"]]
    return full_module, {"state": state, "param_groups": groups}, [entries[name][0] for name in full_names]
