"""Tensor parallelism inside a pipeline stage, Megatron-style, on torch's DTensor.

Each stage's T ranks hold one shard of every attention and MLP projection: the QKV projection and
the MLP's first linear column-parallel (each rank computes its own heads and its own FFN units),
the attention's output projection and the MLP's second linear row-parallel (a partial sum per rank
that DTensor all-reduces), as Shoeybi et al. (2019) split them. torch's ``parallelize_module`` with
``ColwiseParallel`` and ``RowwiseParallel`` shards the weights and runs the collectives; a stage's
layers still take and return ordinary tensors, the same on its T ranks, so the pipeline's sends,
receives and schedules do not change: tensor-parallel rank t of stage k talks to rank t of stage
k + 1.

Fused projections: the built-in transformer's QKV projection is one linear whose rows are
[q | k | v], and the SwiGLU MLP's first linear's are [gate | value]. A plain row split would give
rank 0 all of q; so before sharding the rows are put in rank order ([q_0 k_0 v_0 | q_1 k_1 v_1 |
...]) and the split gives each rank its own heads of each. :func:`full_state_dict` undoes the order,
so checkpoints hold the model's own layout (and resume under any T that divides the heads).

Replicated on every rank of a stage: the embedding, the head (its logits feed the loss whole:
vocabulary-parallel cross entropy is not used, so those two layers' memory and FLOPs are not split,
where the simulator splits them), the layer norms and the row-parallel biases. Their gradients are
equal on every rank (DTensor sums the column-parallel inputs' gradients), and the gradient norm
counts them once (:func:`executor.runtime.optim.squared_norm`).

A layer of a user's ``nn.Sequential`` takes part by defining ``tensor_parallel_plan(parts)``: it
returns ``parallelize_module``'s plan for the layer (submodule name -> ``ParallelStyle``), ``{}`` to
be replicated, and adapts the layer's own view of its shapes (heads per rank, say). A layer with
parameters and no such method is refused in one line when T > 1.

Hugging Face llama, mistral and qwen2 layers split the same way (:class:`executor.models.hf.DecoderLayer`
says how), and GPT-2's: its projections are transformers' ``Conv1D`` (weight stored (in, out), used as x
@ W + b), which torch's styles do not know, so :class:`executor.parallel.tp_styles.Conv1DColwise` and
:class:`executor.parallel.tp_styles.Conv1DRowwise` split a Conv1D's weight along its columns or rows with
torch's own input and output handling; the fused attention projection's columns [q | k | v] are put in
rank order as the built-in QKV's rows are.

Sequence parallelism (``--sequence-parallel``, the built-in transformer, as Korthikanti et al.
2022): inside a stage's run of blocks the residual stream and the norms hold 1/T of the tokens per
rank (all-gathered before each column-parallel projection, reduce-scattered after each row-parallel
one); the run takes its input whole and gives its output whole, so stage boundaries carry the
whole activation (Megatron's scatter-gather of the send is not done).

Experts (the built-in transformer's ``experts`` option, :mod:`executor.models.moe`): every expert and the
shared MLP split as the dense MLP is, the router replicated (:func:`moe_plan`).

ZeRO-2/3 composes with it: FSDP shards the DTensor parameters over the dp dimension of the same mesh
(:mod:`executor.parallel.fully_sharded`), and checkpoints gather over both.

Limits (refused in one line until they are built): ZeRO-1, sequence parallelism for other models, with
dropout or with experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from executor.models import hf
from executor.models.build import Block, Embedding, Head
from executor.models.moe import MixtureOfExperts
from executor.parallel.tp_styles import ORDER_DIMS, ROW_ORDER, features_in_rank_order
from sim.errors import GpipeInputError

TP = "tp"  # the mesh's tensor-parallel dimension
HOOK = "tensor_parallel_plan"  # a user layer's own plan: tensor_parallel_plan(parts) -> {name: ParallelStyle}


def check_model(model: nn.Sequential, parts: int, sequence_parallel: bool = False) -> None:
    """Every layer of ``model`` (on the meta device) has a plan for ``parts`` ranks: the built-in
    transformer's heads, key/value heads and FFN width divide by it; a layer with parameters and no
    plan is named. Sequence parallelism: the built-in transformer only, its sequence dividing by T,
    without dropout (a rank's share of the tokens would draw other masks than one process)."""
    if parts == 1:
        return
    if sequence_parallel:
        embedding = next((layer for layer in model if isinstance(layer, Embedding)), None)
        if embedding is None or any(not isinstance(layer, (Embedding, Block, Head)) for layer in model):
            raise GpipeInputError("--sequence-parallel splits the built-in transformer's blocks; drop it for other "
                                  "models (tensor parallelism alone runs them)")
        seq = embedding.position.num_embeddings
        if seq % parts:
            raise GpipeInputError(f"--sequence-parallel with --tensor-parallel {parts} does not divide seq={seq}; "
                                  f"use a T that divides {seq}")
        if embedding.drop.p:
            raise GpipeInputError(f"--sequence-parallel with dropout={embedding.drop.p}: each rank's share of the "
                                  "tokens would draw other masks than one process; set dropout=0")
    for index, layer in enumerate(model):
        if isinstance(layer, Block):
            if sequence_parallel and isinstance(layer.mlp, MixtureOfExperts):
                raise GpipeInputError("--sequence-parallel with experts: the router needs every token on every rank "
                                      "here; drop --sequence-parallel (tensor parallelism alone splits the experts)")
            attn, ff = layer.attn, _mlp_widths(layer.mlp)
            for name, value in (("heads", attn.heads), ("kv_heads", attn.kv_heads), *ff):
                if value % parts:
                    raise GpipeInputError(f"--tensor-parallel {parts} does not divide {name}={value}: each rank holds "
                                          f"whole heads, key/value heads and FFN units; use a T that divides "
                                          f"heads={attn.heads}, kv_heads={attn.kv_heads} and "
                                          f"{' and '.join(f'{n}={v}' for n, v in ff)}")
        elif isinstance(layer, hf.DecoderLayer):
            hf.check_tensor_parallel(layer.family, layer.config, parts)
        elif not isinstance(layer, (Embedding, Head)) and not hasattr(layer, HOOK) \
                and any(True for _ in layer.parameters()):
            raise GpipeInputError(f"layer {index} ({type(layer).__name__}) has no tensor-parallel plan: give it a "
                                  f"{HOOK}(parts) method (executor/parallel/tensor_parallel.py says how) or use "
                                  "--tensor-parallel 1")


def _mlp_widths(mlp: nn.Module) -> list[tuple[str, int]]:
    """The FFN widths a rank's share must divide: the dense MLP's, or each expert's and the shared MLP's."""
    if not isinstance(mlp, MixtureOfExperts):
        return [("ff", mlp[2].in_features)]
    widths = [("expert_ff", mlp.named_experts()[0][1][2].in_features)]
    return widths + ([("shared_experts x expert_ff", mlp.shared[2].in_features)] if mlp.shared is not None else [])


def _mlp_plan(mlp: nn.Sequential, prefix: str, parts: int) -> dict[str, Any]:
    """An MLP (fc1, activation, fc2[, dropout]) split Megatron-style; a gated fc1's rows in rank order."""
    fc1, fc2 = mlp[0], mlp[2]
    if fc1.out_features == 2 * fc2.in_features:  # gated: [gate | value]
        features_in_rank_order(fc1, [fc2.in_features, fc2.in_features], parts)
    return {f"{prefix}.0": ColwiseParallel(), f"{prefix}.2": RowwiseParallel()}


def moe_plan(moe: MixtureOfExperts, parts: int) -> dict[str, Any]:
    """Every expert and the shared MLP split as the dense MLP is (column- then row-parallel, expert
    tensor parallelism equal to T); the router replicated, so every rank routes the same tokens."""
    plan: dict[str, Any] = {}
    for index, expert in moe.named_experts():  # this rank's, under expert parallelism
        plan.update(_mlp_plan(expert, f"mlp.experts.{index}", parts))
    if moe.shared is not None:
        plan.update(_mlp_plan(moe.shared, "mlp.shared", parts))
    return plan


def block_plan(block: Block, parts: int, sequence_parallel: bool = False) -> dict[str, Any]:
    """The built-in block's plan; its fused rows put in rank order and its attention left with
    1/T of the heads. With ``sequence_parallel`` the residual stream between the projections is
    split along the sequence (Korthikanti et al. 2022): the norms run on each rank's share of the
    tokens, the column-parallel inputs are all-gathered and the row-parallel outputs
    reduce-scattered (DTensor's ``SequenceParallel`` and the styles' layouts)."""
    attn = block.attn
    features_in_rank_order(attn.qkv, [attn.heads * attn.head_dim, attn.kv_width, attn.kv_width], parts)
    if isinstance(block.mlp, MixtureOfExperts):
        attn.split_heads(parts)
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(), **moe_plan(block.mlp, parts)}
    fc1, fc2 = block.mlp[0], block.mlp[2]
    if fc1.out_features == 2 * fc2.in_features:  # gated: [gate | value]
        features_in_rank_order(fc1, [fc2.in_features, fc2.in_features], parts)
    attn.split_heads(parts)
    if not sequence_parallel:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    tokens = Shard(1)
    return {"ln1": SequenceParallel(), "attn.qkv": ColwiseParallel(input_layouts=tokens),
            "attn.proj": RowwiseParallel(output_layouts=tokens), "ln2": SequenceParallel(),
            "mlp.0": ColwiseParallel(input_layouts=tokens), "mlp.2": RowwiseParallel(output_layouts=tokens)}


def layer_plan(layer: nn.Module, parts: int, sequence_parallel: bool = False) -> dict[str, Any]:
    if hasattr(layer, HOOK):
        return getattr(layer, HOOK)(parts)
    if isinstance(layer, Block):
        return block_plan(layer, parts, sequence_parallel)
    return {}  # the embedding, the head and layers without parameters: replicated


def parallelize_stage(module: nn.Sequential, mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Sequential:
    """Shard ``module``'s layers over the ranks of the one-dimensional ``mesh`` (a stage's T ranks),
    in place; every rank passes the same full values. With ``sequence_parallel`` the stage's run of
    blocks takes its input whole (every rank keeps its share of the tokens) and gives its output
    whole (an all-gather), so what crosses a stage boundary is the same as without it."""
    parts = mesh.size()
    if parts == 1:
        return module
    for layer in module:
        plan = layer_plan(layer, parts, sequence_parallel)
        if plan:
            parallelize_module(layer, mesh, plan)
    blocks = [layer for layer in module if isinstance(layer, Block)]
    if sequence_parallel and blocks:
        whole, tokens = Replicate(), Shard(1)
        parallelize_module(blocks[0], mesh, PrepareModuleInput(input_layouts=(whole,), desired_input_layouts=(tokens,),
                                                               use_local_output=True))
        parallelize_module(blocks[-1], mesh, PrepareModuleOutput(output_layouts=(tokens,),
                                                                 desired_output_layouts=(whole,),
                                                                 use_local_output=True))
    return module


Order = tuple[torch.Tensor, int]  # a rank order and the dimension it indexes


def _row_orders(module: nn.Module) -> dict[str, Order]:
    """State-dict name -> rank order and its dimension, for the tensors put in rank order."""
    orders = {}
    for name, sub in module.named_modules():
        order = getattr(sub, ROW_ORDER, None)
        if order is not None:
            dims = getattr(sub, ORDER_DIMS, {})
            for tensor in ("weight", "bias"):
                if getattr(sub, tensor, None) is not None:
                    orders[f"{name}.{tensor}" if name else tensor] = (order, dims.get(tensor, 0))
    return orders


def _full(value: torch.Tensor, order: Order | None) -> torch.Tensor:
    full = value.full_tensor() if isinstance(value, DTensor) else value
    if order is None:
        return full
    index, dim = order
    return torch.empty_like(full).index_copy_(dim, index.to(full.device), full)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict gathered from its T ranks, in the model's own row order. Collective
    over the stage's tensor-parallel ranks."""
    orders = _row_orders(module)
    return {name: _full(value, orders.get(name)) for name, value in module.state_dict().items()}


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each parameter's state gathered and in the model's row order
    (as :func:`full_state_dict`). Collective over the stage's tensor-parallel ranks."""
    state = optimizer.state_dict()
    orders = _param_orders(module, optimizer)
    state["state"] = {index: {key: _full(value, orders.get(index) if value.dim() else None)
                              if torch.is_tensor(value) else value for key, value in entry.items()}
                      for index, entry in state["state"].items()}
    return state


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what :func:`full_optimizer_state` gave (under any T) into this rank's optimizer."""
    params = _indexed_params(optimizer)
    orders = _param_orders(module, optimizer)
    for index, entry in state["state"].items():
        param = params[int(index)]
        for key, value in list(entry.items()):
            if torch.is_tensor(value) and value.dim() and isinstance(param, DTensor):
                entry[key] = _shard_like(value, param, orders.get(int(index)))
    optimizer.load_state_dict(state)


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (the model's own row order) into ``module``'s shards."""
    orders = _row_orders(module)
    own = module.state_dict()
    with torch.no_grad():
        for name, target in own.items():
            value = state[name]
            if isinstance(target, DTensor):
                target.to_local().copy_(_shard_like(value, target, orders.get(name)).to_local())
            else:
                target.copy_(value)


def _shard_like(full: torch.Tensor, like: DTensor, order: Order | None) -> DTensor:
    if order is not None:
        index, dim = order
        full = full.index_select(dim, index.to(full.device))
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements)


def _indexed_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _param_orders(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, Order]:
    """Optimizer state index -> rank order, for the parameters whose rows were put in rank order."""
    by_name = _row_orders(module)
    ids = {id(p): name for name, p in module.named_parameters()}
    return {index: by_name[ids[id(p)]] for index, p in enumerate(_indexed_params(optimizer))
            if ids.get(id(p)) in by_name}
