"""Mixture-of-experts decoder layers: routed experts with top-k routing, shared experts, dense layers first or
interleaved, multi-head latent attention and multi-token prediction, as the simulator's layer specs.

A MoE block is the transformer block of :func:`sim.workloads.transformer.transformer_layers` with its MLP
of width 0 (the attention, the norms, the residual stream and the MLP's d-wide input and output as
they are) plus :func:`moe_ffn_delta`, what the router, the routed experts and the shared experts add.
Per token on one of T devices, with d the stream's width, E experts of width f (gated: fc1 projects
to 2f), top-k routing, a shared MLP of width fs, c the compute dtype's bytes:

- router: a d x E matmul (2dE FLOPs), its scores in fp32 (written, normalised by a softmax or a
  sigmoid, read by the top-k: 4 passes over E), the chosen k indices and weights kept.
- routed experts: the tokens permuted into expert order (a = k assignments per token; with a capacity
  factor C each expert padded to its capacity, a = C k, as GShard and Switch Transformer run them:
  Lepikhin et al. 2021; Fedus et al. 2022, "expert capacity = tokens / experts x capacity factor"),
  two grouped matmuls over the assignments (2a x 3df FLOPs gated), the activation, and the combine
  (each output weighted by its router score and summed back into the token's row). The grouped
  matmuls are timed as a kernel kind of their own (``grouped_matmul_flops_per_row``,
  :mod:`sim.catalog.kernel_model`), many small matmuls that run further from peak than one dense one.
- shared experts: a dense MLP of width fs on every token, added to the routed output.

Saved for the backward: the permuted input, fc1's output, the activation's saved tensors and fc2's
output (the combine's weights need it) per assignment; the router's fp32 probabilities and the
chosen indices per token; the shared MLP's as a dense MLP's. Parameters: every expert of the layer
(E x 3df gated, / T), the router (dE, replicated) and the shared MLP (3dfs / T): without expert
parallelism every stage holds all its layers' experts.

Tensor parallelism splits every expert as the dense MLP is split (expert tensor parallelism equal to
T, Megatron-Core's default), with the same collectives; the router is replicated. Without expert
parallelism load imbalance does not change a step: one device runs every expert of its layers, and
the grouped matmul's time follows the assignments it is given, not how they spread. Expert
parallelism (:mod:`sim.workloads.moe.expert_parallel`) splits the experts over E ranks: there the most
loaded rank sets the layer's time (:func:`expected_max_load`).

Limits: no token dropping is modelled beyond the capacity's padding (dropped tokens still cost their
share of the padded matmuls); the router's auxiliary loss, its z-loss and DeepSeek's group-limited
routing are free; the permutation is one gather and one scatter (no fused permute kernels); a MoE
layer's dispatch under tensor parallelism is priced as the dense MLP's collectives.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from sim.workloads.moe.latent_attention import is_latent, latent_attention_delta, qk_head_dim
from sim.workloads.moe.options import MOE_DEFAULTS
from sim.workloads.layer_spec import INDEX_BYTES, STAT_BYTES, LayerSpec, weights_read
from sim.workloads.precision import FP32_BYTES, Precision, precision_of
from sim.workloads.transformer import transformer_layers

ROUTER_FP32_PASSES = 4  # the scores written, normalised (read and written), read by the top-k


def moe_layer_set(o: dict[str, Any]) -> frozenset[int]:
    text = str(o.get("moe_layers", "none"))
    return frozenset() if text == "none" else frozenset(int(i) for i in text.split(","))


def assignments_per_token(o: dict[str, Any]) -> float:
    """Expert assignments a token costs: top-k dropless, capacity factor x top-k padded to capacity."""
    capacity = float(o.get("capacity_factor") or 0.0)
    return o["top_k"] * (capacity if capacity > 0 else 1.0)


def expected_max_load(tokens: int, experts: int, top_k: int, imbalance: float = 0.0) -> float:
    """The most loaded expert's assignments over the mean's, for ``tokens`` tokens routed top-k among
    ``experts``: ``imbalance`` when given (> 0), else a router balanced in expectation, the expected
    maximum of m = tokens x top_k balls in E bins, mean + sqrt(2 mean ln E) (Raab and Steger 1998,
    "Balls into Bins: A Simple and Tight Analysis", for m >= E ln E); real routers are less even."""
    if imbalance > 0:
        return imbalance
    mean = tokens * top_k / experts
    if mean <= 0:
        return 1.0
    return 1.0 + math.sqrt(2.0 * mean * math.log(max(experts, 2))) / mean


def expert_parameters(o: dict[str, Any], t: int, ep: int = 1, etp: int | None = None) -> int:
    """One rank's routed experts' weights and biases of one MoE layer: E / ``ep`` experts, each split
    over ``etp`` ranks (default ``t``, the experts split as the dense MLP is)."""
    d, E, f, g = o["d_model"], o["experts"], o["expert_ff"], 2
    split = t if etp is None else etp
    held = E // ep
    return held * (g + 1) * d * f // split + o.get("expert_biases", False) * held * (g * f // split + d)


def moe_ffn_delta(o: dict[str, Any], s: int, t: int, p: Precision, ep: int = 1, etp: int | None = None) -> LayerSpec:
    """What a MoE MLP adds to the block whose MLP has width 0, for ``s`` tokens per row on one of
    ``t`` devices (see the module docstring); with expert parallelism (``ep`` > 1, or ``etp`` given) one
    rank holds E / ``ep`` experts split ``etp`` ways (:mod:`sim.workloads.moe.expert_parallel`); the
    mean work per rank is the same, every rank's tokens spread over the group's experts."""
    d, E, f, fs = o["d_model"], o["experts"], o["expert_ff"], o.get("shared_ff", 0)
    c, g = p.compute_bytes, 2  # gated (SwiGLU) experts: fc1 writes the gate and the value
    a = s * assignments_per_token(o)  # assignments per row
    router_weights = d * E
    split = t if etp is None else etp
    expert_weights = (E // ep) * (g + 1) * d * f // split
    shared_weights = (g + 1) * d * fs // t
    # with expert biases the shared MLP has its own too: fc1's split over t, fc2's whole (the block's MLP
    # output bias is the shared MLP's, or none without shared experts: the transformer's fc2 bias is off)
    biases = (o.get("router_bias", False) * E
              + o.get("expert_biases", False) * ((E // ep) * (g * f // split + d) + ((g * fs // t + d) if fs else 0)))
    matmul_weights = router_weights + expert_weights + shared_weights
    # traffic: router (reads its input, scores in fp32), permute (gather a rows), experts (fc1 in and out,
    # the SwiGLU's 8 elements per f as the dense block counts them, fc2 in and out), combine (reads the
    # outputs and their weights, writes the row), shared MLP as a dense one, its sum with the routed output
    router_traffic = s * d * c + ROUTER_FP32_PASSES * s * E * FP32_BYTES + s * o["top_k"] * (INDEX_BYTES + FP32_BYTES)
    expert_traffic = (2 * a * d * c + a * d * c + 4 * g * a * f * c / t + a * d * c + 3 * a * d * c + s * d * c)
    shared_traffic = (s * d * c + 4 * g * s * fs * c / t + s * d * c + 3 * s * d * c) if fs else 0.0
    matmul_operands = (s * d * c + s * E * FP32_BYTES + a * d * c + a * (g * f + f) * c / t + a * d * c
                       + ((2 * s * d * c + s * (g + 1) * fs * c / t) if fs else 0.0))
    saved_per_f = 2 * g  # gated: fc1's output (2f), silu's output and the product (f each)
    saved = (a * d * c + saved_per_f * a * f * c / t + a * d * c + s * E * FP32_BYTES + s * o["top_k"] * INDEX_BYTES
             + saved_per_f * s * fs * c / t)
    return LayerSpec(
        "moe", params=matmul_weights + biases,
        flops_per_row=2.0 * (s * router_weights + a * (g + 1) * d * f / t + s * shared_weights),
        traffic_bytes_per_row=router_traffic + expert_traffic + shared_traffic,
        fixed_traffic_bytes=weights_read(p, matmul_weights + biases, 0),
        saved_bytes_per_row=saved, input_bytes_per_row=0.0, output_bytes_per_row=0.0,
        fixed_saved_bytes=p.weight_copy_bytes * matmul_weights,
        matmul_traffic_bytes_per_row=matmul_operands, matmuls=1 + 2 + (2 if fs else 0),
        grouped_matmul_flops_per_row=2.0 * a * (g + 1) * d * f / t,
    )


def add_specs(a: LayerSpec, b: LayerSpec, name: str | None = None) -> LayerSpec:
    """``a`` with ``b``'s counts added: a block and what a MoE MLP, MLA or an MTP module adds to it.
    Collectives: counted in all-reduces of the larger tensor of the two."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(LayerSpec):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "name":
            values["name"] = name or a.name
        elif field.name in ("saves_input", "fp8_matmuls"):
            values[field.name] = x
        elif field.name == "op_checkpointed":  # selective_op is not priced for a mixture (checkpoints_ops)
            values[field.name] = False
        elif field.name == "cp_steps":
            values[field.name] = max(x, y)
        elif field.name.startswith("tp_allreduces"):
            continue
        else:
            values[field.name] = x + y
    size = max(a.tp_allreduce_bytes_per_row, b.tp_allreduce_bytes_per_row)
    values["tp_allreduce_bytes_per_row"] = size
    for key in ("tp_allreduces_forward", "tp_allreduces_backward", "tp_allreduces_backward_waited"):
        scaled = (getattr(spec, key) * spec.tp_allreduce_bytes_per_row / size for spec in (a, b)) if size else ()
        values[key] = sum(scaled, 0.0)
    return LayerSpec(**values)


def _base_options(o: dict[str, Any]) -> dict[str, Any]:
    """The transformer's options of the MoE model's attention and dense MLP (MLA: h heads of qk width)."""
    base = {k: v for k, v in o.items() if k not in MOE_DEFAULTS}
    if is_latent(o):
        base.update({"head_dim": qk_head_dim(o), "kv_heads": 0})
    return base


def _mtp_module(block: LayerSpec, head: LayerSpec, o: dict[str, Any], s: int, t: int, sp: bool,
                p: Precision) -> LayerSpec:
    """One multi-token prediction module (DeepSeek-V3 report, section 2.2): the next token's embedding and
    the stream, each normalised, concatenated and projected 2d -> d, one MoE block, the shared head's
    norm and matmul over the vocabulary and a loss. The embedding and the head's weight are the main
    model's (counted once); the module's own weights are its block, the projection and three norms."""
    d, F, c = o["d_model"], p.activation_bytes, p.compute_bytes
    split = t if sp else 1
    projection = 2 * d * d // t
    extra = LayerSpec(
        "mtp", params=projection + 2 * d, flops_per_row=2.0 * s * 2 * d * d / t,
        # the gather of the next tokens' rows, two norms, the concatenation, the projection in and out
        traffic_bytes_per_row=INDEX_BYTES * s + s * d * (2 * F + 4 * F + 4 * c) / split + 2 * STAT_BYTES * s / split,
        fixed_traffic_bytes=weights_read(p, projection, 2 * d), saved_bytes_per_row=(2 * s * d * (F + c)) / split
        + 2 * STAT_BYTES * s / split + INDEX_BYTES * s, input_bytes_per_row=0.0, output_bytes_per_row=0.0,
        fixed_saved_bytes=p.weight_copy_bytes * projection, matmul_traffic_bytes_per_row=c * s * 3 * d / split,
        matmuls=1, fp8_matmuls=block.fp8_matmuls)
    shared_head = dataclasses.replace(head, params=d, input_bytes_per_row=0.0, output_bytes_per_row=0.0)
    module = add_specs(add_specs(block, extra), shared_head, name="mtp")
    return dataclasses.replace(module, input_bytes_per_row=block.input_bytes_per_row,
                               output_bytes_per_row=block.output_bytes_per_row)


def _without_mlp_collectives(block: LayerSpec) -> LayerSpec:
    """A block whose MLP issues no tensor-parallel collective (experts whole on a rank, ETP = 1 < T, no
    shared expert): the attention's half of the block's collectives kept."""
    return dataclasses.replace(block, tp_allreduces_forward=block.tp_allreduces_forward / 2,
                               tp_allreduces_backward=block.tp_allreduces_backward / 2,
                               tp_allreduces_backward_waited=block.tp_allreduces_backward_waited / 2)


def moe_transformer_layers(o: dict[str, Any], tp: int = 1, sp: bool = False, cp: int = 1, ep: int = 1,
                           etp: int | None = None) -> list[LayerSpec]:
    """[Embedding, ``layers`` blocks (dense or MoE), ``mtp_layers`` MTP modules, Head] for the MoE
    transformer's options ``o`` (:mod:`sim.workloads.moe.options`), one of T x C devices' share, the
    routed experts split over ``ep`` ranks of ``etp`` each (:mod:`sim.workloads.moe.expert_parallel`)."""
    base = _base_options(o)
    dense = transformer_layers(base, tp, sp, cp)
    sparse = transformer_layers({**base, "ff": 0}, tp, sp, cp)
    if etp is not None and etp < tp and not o.get("shared_ff"):
        sparse = [_without_mlp_collectives(spec) if spec.name == "block" else spec for spec in sparse]
    p = precision_of(o["precision"])
    s, moe = o["seq"] // cp, moe_layer_set(o)
    flash = o.get("attention") == "flash"
    ffn = moe_ffn_delta(o, s, tp, p, ep, etp)
    mla = latent_attention_delta(o, s, o["seq"], tp, p, flash) if is_latent(o) else None
    blocks = []
    for i in range(o["layers"]):
        block = sparse[1 + i] if i in moe else dense[1 + i]
        if mla is not None:
            block = add_specs(block, mla)
        blocks.append(add_specs(block, ffn, name="moe_block") if i in moe else block)
    mtp_block = add_specs(add_specs(sparse[1], mla) if mla is not None else sparse[1], ffn, name="moe_block")
    mtp = [_mtp_module(mtp_block, dense[-1], o, s, tp, sp, p) for _ in range(int(o.get("mtp_layers", 0)))]
    return [dense[0], *blocks, *mtp, dense[-1]]
