"""Multi-head latent attention (DeepSeek-V2/V3's MLA) priced as what it computes.

MLA (DeepSeek-AI 2024, "DeepSeek-V2", section 2.1; the V3 report keeps it) projects the stream down
to a query latent of ``q_lora_rank`` (qr) and a key/value latent of ``kv_lora_rank`` (kvr) plus one
rotary key of ``qk_rope_head_dim`` (rope) shared by all heads, normalises each latent (RMSNorm), and
projects them up: queries to h heads of qk = ``qk_nope_head_dim`` + rope, keys' non-rotary part and
values to h x (nope + ``v_head_dim``). Attention runs over qk-wide scores and v-wide values; the
output projection reads h x v. With d the stream's width, per token:

    weights  d*qr + qr*h*qk + d*(kvr + rope) + kvr*h*(nope + v) + h*v*d   (no q latent: d*h*qk)
    FLOPs    twice the weights, plus the attention: 2*keys*h*qk (scores) + 2*keys*h*v (values)

This module prices MLA as a correction of the transformer block with h heads of qk width and one
key/value head per head (:func:`sim.workloads.transformer.transformer_layers`, whose block then has
QKV and output weights 4*d*h*qk and attention 4*keys*h*qk): :func:`latent_attention_delta` is what
to add to that block. Under tensor parallelism the down projections are replicated and the up and
output projections split, as Megatron-Core's MLA layer splits them.

Limits: the latents' norms and the rotary key's broadcast are counted as traffic in the compute
dtype; the keys are assembled from their two parts as the Hugging Face model does (a copy per
head), not absorbed into the queries as inference kernels do; context parallelism's ring passes the
assembled keys and values.
"""

from __future__ import annotations

from typing import Any

from sim.workloads.layer_spec import STAT_BYTES, LayerSpec, weights_read
from sim.workloads.precision import FP32_BYTES, Precision

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def is_latent(o: dict[str, Any]) -> bool:
    return bool(o.get("kv_lora_rank"))


def qk_head_dim(o: dict[str, Any]) -> int:
    return int(o["qk_nope_head_dim"]) + int(o["qk_rope_head_dim"])


def latent_weights(o: dict[str, Any], t: int = 1) -> tuple[int, int, int]:
    """(down-projection weights, up and output weights on one of T devices, norm weights) of one layer."""
    d, h = o["d_model"], o["heads"]
    qr, kvr, nope, rope, v = (int(o.get(k) or 0) for k in MLA_KEYS)
    qk = nope + rope
    down = d * qr + d * (kvr + rope)
    up = (qr * h * qk if qr else d * h * qk) + kvr * h * (nope + v) + h * v * d
    return down, up // t, qr + kvr


def latent_attention_delta(o: dict[str, Any], s: int, keys: int, t: int, p: Precision, flash: bool) -> LayerSpec:
    """What MLA adds to (or, negative, takes from) the block of h heads of qk width, for ``s`` tokens
    per row on one of ``t`` devices whose queries attend to ``keys`` keys each."""
    d, h = o["d_model"], o["heads"]
    qr, kvr, nope, rope, v = (int(o.get(k) or 0) for k in MLA_KEYS)
    qk = nope + rope
    c = p.compute_bytes
    down, up, norms = latent_weights(o, t)
    base = 4 * d * h * qk // t  # the plain block's QKV and output weights
    matmul_delta = down + up - base
    attention_delta = -2.0 * s * keys * h * (qk - v) / t  # values and the output are v wide, not qk
    # the latents: written by their down projection, read and written by their norm, read by the up
    # projection; the rotary key broadcast to every head; the keys assembled from their two parts
    latent_traffic = c * s * (4 * (qr + kvr) + rope * (2 + 1)) + 2 * STAT_BYTES * s * (qr > 0) + 2 * STAT_BYTES * s
    head_traffic = c * s * h * ((nope + v) + (nope + rope) + qk - 3 * qk + 4 * (v - qk)) / t
    saved = c * s * 2 * (qr + kvr) + STAT_BYTES * s * (1 + (qr > 0)) + c * s * 2 * h * (v - qk) / t
    # the matmuls' own operands: the stream read by both down projections, the latents written and read,
    # the up projections' outputs, the output projection's v-wide input
    mla_operands = c * s * (2 * d + 2 * (qr + kvr + rope) + (h * qk + h * (nope + v) + h * v) / t + d)
    base_operands = c * s * (2 * d + (3 * h * qk + h * qk) / t)
    core = 0.0 if flash else attention_delta
    return LayerSpec(
        "mla", params=matmul_delta + norms,
        flops_per_row=2.0 * s * matmul_delta + attention_delta,
        traffic_bytes_per_row=latent_traffic + head_traffic + (mla_operands - base_operands),
        fixed_traffic_bytes=weights_read(p, matmul_delta, 0) + norms * FP32_BYTES,
        saved_bytes_per_row=saved, input_bytes_per_row=0.0, output_bytes_per_row=0.0,
        fixed_saved_bytes=p.weight_copy_bytes * matmul_delta,
        attention_flops_per_row=attention_delta, core_flops_per_row=core,
        matmul_traffic_bytes_per_row=mla_operands - base_operands, matmuls=3,
        cp_exchange_bytes_per_row=c * s * h * (v - qk) / t,
    )
