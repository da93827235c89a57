"""The built-in transformer layer by layer: embedding, blocks and head, and how tensor, sequence and context
parallelism split them.

The layers mirror the torch model the executor builds (:mod:`executor.models.build`), and every decoder a
Hugging Face structure describes (:mod:`sim.workloads.decoder_shape`) is priced as this transformer with
its features (:mod:`sim.workloads.decoder_features`). How a layer's FLOPs, bytes and memory are counted,
and what is left out: :mod:`sim.workloads.layer_spec`.
"""

from __future__ import annotations

from typing import Any

from sim.workloads.decoder_features import Features
from sim.workloads.layer_spec import INDEX_BYTES, MASK_BYTES, STAT_BYTES, LayerSpec, weights_read
from sim.workloads.precision import FP8_CAST_BYTES, FP32_BYTES, precision_of

LOSS_FP32_PASSES = 4  # the loss's fp32 passes over the logits: cast, row maximum, sum of exponentials, output


def transformer_layers(o: dict[str, Any], tp: int = 1, sp: bool = False, cp: int = 1) -> list[LayerSpec]:
    """[Embedding, ``layers`` x pre-LayerNorm Block, Head], GPT-style with learned positions.

    With s = seq, d = d_model, f = ff, h = heads, V = vocab; c the compute bytes (4 in fp32, 2 in
    bf16), F = 4 the fp32 bytes, x the bytes of one cast (0 in fp32, 6 in bf16), per row (sequence):

    - Embedding (token + position), fp32 in both precisions: params V*d + s*d; F = 0;
      saved = 8s (int64 ids) [+ sd mask]; output F*sd.
    - Block: params 4d^2 + 2df + 9d + f (LN 2d, QKV 3d^2+3d, proj d^2+d, LN 2d, fc1 df+f,
      fc2 fd+d). F = 2s(3d^2 + d^2 + 2df) + 4s^2*d (q.k^T and p.v, each 2*s*s*d over all heads).
      saved = sd(2F + 6c) + 2c*sf + h*s^2(F + [bf16] c) + 16s: LN1 in and LN2 in (the fp32
      residual stream), QKV's and fc1's inputs (LN outputs, cast to bf16 in bf16), q/k/v (3sd),
      attention out (proj's input), fc1 out (GELU's input), GELU out (fc2's input), the softmax
      probabilities (fp32; in bf16 p.v also saves their bf16 cast), 4 fp32 LN statistics per
      token; in bf16 plus the weight copies of QKV, proj, fc1 and fc2, 2(4d^2 + 2df) bytes per
      micro-batch. Input and output are the fp32 residual stream (F*sd): autocast adds the bf16
      branches into it, which promotes. Dropout p > 0 sits where the executor puts it: after the
      embedding sum, the attention projection and the MLP (not on the attention probabilities);
      each adds a mask of sd bytes.
    - Head: LayerNorm + Linear(d, V): params 2d + dV + V; F = 2s*d*V; saved = F*sd (LN in) +
      c*sd (Linear's input) + 8s [+ 2dV weight copy in bf16]; output c*sV logits, which the
      cross entropy reads and passes over four times in fp32 (cast, row maximum, sum of
      exponentials, log-probabilities): (c + 16)sV bytes of traffic more.

    ``attention`` ``flash`` (a fused kernel, ``scaled_dot_product_attention``, as GPU trainers run
    attention): no (heads, s, s) tensor is written, read or saved; the kernel keeps a fp32
    log-sum-exp per head and token (4hs; its output is the storage proj saves), with grouped keys
    and values their repeats (2se*c more than without); its backward recomputes QK^T (2s^2*d FLOPs
    more). Selective recompute then has nothing left to drop.

    ``attention`` ``fused`` (Megatron-LM's scale-mask-softmax kernel, for planning: the executor
    trains eager, the same arithmetic): the scores are materialised, but scaled, masked and
    normalised in one pass in the compute dtype (read and written once), and the probabilities are
    kept in the compute dtype; with dropout, Megatron's dropout on them adds its mask and output (the
    5as^2 of Korthikanti's count, which ``precision`` ``bf16-model`` then matches exactly, plus the
    layer norms' statistics their count leaves out).

    ``activation`` ``squared_relu`` (ReLU then its square, Nemotron-4's MLP) in place of GELU saves
    the same two (s, f) tensors (ReLU's output, which the square saves as its input, and the square's
    output, fc2's input) and moves the same bytes, so nothing above changes. ``swiglu`` (the gated
    MLP of Llama, Mistral and Qwen: fc1 projects to 2f, silu of one half times the other) has fc1 of
    2df weights and 2f biases, 6sdf FLOPs in the MLP, and saves 4f per token in place of 2f (fc1's
    output, which silu and the product keep, silu's output and the product, fc2's input); per sf it
    moves 8 elements (fc1 writes 2, silu reads and writes 1 each, the product reads 2 and writes 1,
    fc2 reads 1) in place of 4.

    ``compile`` (torch.compile of the whole model, as torchtitan's ``--compile`` compiles its blocks
    and loss; for planning: the executor trains eager kernels): TorchInductor fuses the elementwise
    ops between two matmuls into one kernel, so each region's traffic is counted once: what enters it
    is read once and what leaves it (including what autograd saves) written once, in place of every
    op reading and writing its own input and output. The regions: the embedding's gather, position
    add and dropout; LN1 with its cast; the attention's dropout, residual add and LN2 with its cast;
    the MLP's activation (swiglu's silu and product together: 3 elements per sf in place of 5; a GELU
    or squared ReLU moves what it did); the MLP's dropout and residual add; under eager attention the
    scale, mask and softmax with their casts (the scores read once, the probabilities written once,
    in fp32 too under autocast, which the softmax's backward reads); the head's norm with its cast,
    and the loss's reductions over the logits (read twice, no fp32 copy or log-probabilities
    written). Per sd, forward, 5 fp32 and 4 compute-dtype elements in place of 8, 2 casts and 2;
    the dropouts' masks alone. Limits: the backward is priced at twice the forward's bytes as
    without compiling, the memory saved for it is eager autograd's (Inductor's partitioner may
    recompute cheap elementwise ops and save less), a region reads its inputs once (a looped
    reduction over a wide row may read them twice), a block's last residual add is not fused with
    the next block's LN1 (per-block compilation), matmuls, flash and fused attention, Transformer
    Engine's fp8 casts and the collectives are unchanged, and the launches saved are not counted
    (one fixed overhead per layer).

    Grouped-query attention (``kv_heads`` < ``heads``; 0 means one key/value head per head): QKV
    projects to d + 2e, e = kv_heads * d / heads, so the block has 2d(d - e) fewer QKV weights and
    2s*2d(d - e) fewer FLOPs; keys and values are repeated to their query heads before the
    attention matmuls (as the executor runs it), which then save as much as without grouping.

    How other decoders differ (:mod:`sim.workloads.decoder_features`, options for planning that a
    Hugging Face model's structure sets): ``head_dim`` makes the attention dq = heads x head_dim wide
    in place of d (QKV d(dq + 2e) weights, proj dq*d, every split attention term above dq wide);
    ``norm``, ``norm_weights`` and ``norms`` the norms' statistics, parameters and count;
    ``parallel_block``, ``qk_norm``, ``embedding_norm``, ``biases``, ``positions`` (a learned table,
    rotary, ALiBi or none), ``tied`` and ``window`` (a flash kernel's keys per query) what their
    names say; ``relu`` as the activation saves one (s, f) tensor where GELU saves two.

    Selective recompute (Korthikanti et al. 2022) drops the attention core's saved tensors (the
    probabilities, fp32, and in bf16 their cast; with grouped keys and values their repeats, the
    core keeping q, k and v as QKV wrote them) and reruns the core (QK^T, softmax, attention over V:
    4s^2*d FLOPs and its h*s^2 traffic) inside the backward.

    Context parallelism over ``cp`` = C devices (Megatron-LM's, ring attention on flash kernels:
    Liu et al. 2023, "Ring Attention with Blockwise Transformers"): each device holds s/C tokens of
    every sequence, so every token-proportional count above is divided by C, while its queries
    attend to all s keys (the attention's FLOPs s/C x s) and the position table stays whole. The
    keys and values go round the ring: C-1 sends of the device's own (s/C, 2e) block forward, beside
    the attention over the blocks already received; backward the blocks again and their gradients.

    Tensor parallelism over ``tp`` = T devices, as Megatron-LM splits a GPT (Shoeybi et al. 2019;
    Korthikanti et al. 2022 for ``sp``, sequence parallelism): one device's share. QKV and fc1 are
    column-parallel (heads and the FFN's hidden units split), proj and fc2 row-parallel (their
    biases, the layer norms and the position table replicated), the token embedding and the head
    vocabulary-parallel (ceil(V/T) rows each). Every matmul FLOP and the attention's are split; of
    the saved tensors q/k/v, the attention's input to proj, fc1's and GELU's outputs and the
    probabilities are split, while the residual stream, the LN outputs feeding QKV and fc1, the LN
    statistics and the dropout masks are replicated unless ``sp``, which splits them along the
    sequence (the LN outputs kept split and gathered again for backward), so with ``sp`` every saved
    tensor is divided by T (Korthikanti's sbh(34 + 5as/h)/t). Collectives, in all-reduces of the
    layer's activation (an all-gather or reduce-scatter is half of one): a block, two forward
    (after proj and fc2) and two backward (the input gradients of QKV and fc1), in the compute
    dtype, with ``sp`` as all-gather/reduce-scatter pairs of the same volume, and in its backward
    one more (the all-gathers of proj's and fc2's output gradients, and of QKV's and fc1's inputs
    saved split, against the reduce-scatters of their input gradients: three, of which the first
    pair, one all-reduce's volume, is waited for by proj's and fc2's input-gradient matmuls, while
    the rest can run beside other matmuls as Megatron-LM issues them); the embedding one
    forward (the partial lookups summed, fp32; a reduce-scatter with ``sp``), none backward (half,
    an all-gather, with ``sp``); the head one backward (its input gradient) and, with ``sp``, half
    forward (the all-gather of its input). The cross entropy's statistics over the vocabulary
    slices (three all-reduces of s floats) are left out. Without ``sp`` a stage boundary carries the
    full residual stream on every device (no scatter-gather of the send); with ``sp``, 1/T of it.
    """
    L, seq, d, f, h, V = (o[k] for k in ("layers", "seq", "d_model", "ff", "heads", "vocab"))
    s = seq // cp  # the tokens of each sequence one device holds; its queries attend to all seq keys
    p, drop = precision_of(o["precision"]), o["dropout"] > 0
    # F: the residual stream's, the norms' and the embedding's bytes (fp32 under autocast, the compute dtype
    # for a bf16 model); the eager softmax runs in fp32 either way
    c, F, x = p.compute_bytes, p.activation_bytes, p.cast_bytes
    t = tp
    z = Features.of(o)  # how the decoder differs from GPT's layout (sim.workloads.decoder_features); none by default
    hd = z.head_dim or d // h
    dq = h * hd  # the queries' (and the attention output's) width: d unless head_dim says otherwise
    kv = o.get("kv_heads") or h
    e = kv * hd  # the key (and the value) width: dq with one key/value head per head
    grouped = kv != h
    # QKV writes dq + 2e per token; grouped keys and values are repeated to every head of their group
    # (read 2e, write 2dq); the attention matmuls save q and the (repeated) k and v, 3dq per token as
    # without grouping: grouping saves weights and QKV FLOPs, not activations, in this eager form
    qkv_written = dq + 2 * e + grouped * (2 * e + 2 * dq)
    split_seq = t if sp else 1  # what sequence parallelism splits: the residual stream and the norms
    vocab = -(-V // t)  # vocabulary rows per device
    compiled = bool(o.get("compile"))  # torch.compile's fused elementwise regions (see the docstring)
    learned = z.positions == "learned"
    rows = (z.position_rows or seq) if learned else 0  # the position table's
    # a norm right after the embedding (embedding_norm): reads and writes the stream, saves its input and statistics
    norm_weights = z.norm_weights * d
    embedding_norm_traffic = z.embedding_norm * (2 * s * d * F / split_seq + z.stats * STAT_BYTES * s / split_seq)
    embed = LayerSpec(
        "embedding", params=vocab * d + rows * d + z.embedding_norm * norm_weights + z.extra_params,
        flops_per_row=0.0,
        # read ids; gather reads/writes sd; add reads sd (+ position table once), writes sd; compiled, the
        # gather, the add and the dropout are one region: the rows read once, the sum written once
        traffic_bytes_per_row=(INDEX_BYTES * s + (2 * s * d * F + drop * MASK_BYTES * s * d if compiled else
                                                  (4 if learned else 2) * s * d * F + drop * (2 * s * d * F + s * d))
                               + embedding_norm_traffic),
        fixed_traffic_bytes=s * d * F * learned + z.embedding_norm * norm_weights * FP32_BYTES,
        saved_bytes_per_row=(INDEX_BYTES * s + drop * MASK_BYTES * s * d / split_seq
                             + z.embedding_norm * (s * d * F + z.stats * STAT_BYTES * s) / split_seq),
        input_bytes_per_row=INDEX_BYTES * s, output_bytes_per_row=s * d * F / split_seq,
        tp_allreduce_bytes_per_row=s * d * F, tp_allreduces_forward=0.5 if sp else 1.0,
        tp_allreduces_backward=0.5 if sp else 0.0,
    )
    # a gated MLP (swiglu) projects to 2f, the gate and the value, before fc2 brings f back to d; relu
    # saves its output (fc2's input) only, where GELU and the squared ReLU save their input besides
    g = 2 if o.get("activation") == "swiglu" else 1
    mlp_saved = 2 * g - (o.get("activation") == "relu")  # (s, f) tensors the MLP saves
    split_weights = d * (dq + 2 * e) + dq * d + (g + 1) * d * f  # QKV, proj, fc1, fc2 weights: split over T
    matmul_weights = split_weights // t  # T divides heads and kv heads, so dq and e, and ff (sim.workloads.tensor_parallel)
    b = z.biases
    norms_params = z.norms * norm_weights
    # QKV and fc1 biases split; norms, proj/fc2 biases and what has no term here not
    block_params = ((split_weights + ("qkv" in b) * (dq + 2 * e) + ("fc1" in b) * g * f) // t + norms_params
                    + ("proj" in b) * d + ("fc2" in b) * d + z.extra_block_params)
    # Forward traffic per sd: 8 fp32 elements (LN 2+2, residual adds read x and write 2+2) and 16 in
    # the compute dtype (QKV 1+3, q.k^T 2, p.v 1+1, transpose 2, proj 1+1, adds read the branch 1+1,
    # fc1 1, fc2 1), plus 2 casts (LN outputs); per sf 4 (fc1 out, GELU 2, fc2 in); per h*s^2 6 in the
    # compute dtype (scores written, scale 2, mask 2, read by p.v), 2 in fp32 (softmax) and 2 casts
    # (to fp32 and back); each dropout reads and writes sd plus its mask. Over T devices: of the 16,
    # QKV's and fc1's inputs and proj's and fc2's outputs are whole tensors on each, the adds' 2 follow
    # the residual stream, the other 10 are split; the sf and h*s^2 terms are split. With head_dim, the
    # split attention terms are dq wide.
    kernel = o.get("attention", "eager")
    flash, fused = kernel == "flash", kernel == "fused"
    # eager keeps the probabilities; flash keeps one fp32 log-sum-exp per head and token (its output, laid
    # out as the projection reads it, is the storage proj saves anyway) and with grouped keys and values
    # their repeats beside QKV's whole output; fused (Megatron's scale-mask-softmax kernel) writes and
    # keeps the probabilities in the compute dtype, and with dropout its mask and output (the
    # probabilities' dropout of Korthikanti's count, which only this kernel has)
    if flash:
        scores_traffic = h * s * 2 * STAT_BYTES
        scores_saved = h * s * STAT_BYTES + grouped * 2 * s * e * c
    elif fused:
        scores_traffic = h * s * s * (4 * c + drop * (2 * c + MASK_BYTES))
        scores_saved = h * s * s * (c + drop * (MASK_BYTES + c))
    else:  # compiled, scale, mask, softmax and their casts are one region: the scores read once, the
        # probabilities written once in the dtype p.v reads (under autocast in fp32 too, for the softmax's backward)
        scores_traffic = h * s * s * ((4 * c + (FP32_BYTES if p.casts else 0)) if compiled
                                      else (6 * c + 2 * FP32_BYTES + 2 * x))
        scores_saved = h * s * s * (FP32_BYTES + (c if p.casts else 0))
    scores_matmul_traffic = 0.0 if flash else 2 * c * h * s * s  # QK^T writes the scores, attention over V reads them
    # compiled: per sd 5 fp32 elements and 4 in the compute dtype (LN1 with its cast reads x, writes its
    # output; the first dropout, residual add and LN2 read the branch and x, write x' and LN2's output; the
    # second dropout and add read the branch and x', write the output), the dropouts' masks alone; per sf
    # swiglu's silu and product one region (reads 2, writes 1)
    stream = 5 * F + 4 * c if compiled else 8 * F + 2 * x + 2 * c
    dropouts = drop * (MASK_BYTES if compiled else 2 * c + MASK_BYTES) * 2 * s * d / split_seq
    # norms beyond the block's two each read and write the stream and save their input (fewer: one norm
    # and its output, which QKV and fc1 then share, gone); a parallel block's MLP norm reads the block
    # input, so the stream after attention is never saved; rotary positions read and write q and k once
    # more; norms over q and k read and write them and save their inputs (eager, compiled or not)
    more = z.norms - 2
    norms_traffic = (2 * F if more > 0 else 2 * F + x) * more * s * d / split_seq
    norms_saved = ((F if more > 0 else F + c) * more - z.parallel_block * (more >= 0) * F) * s * d / split_seq
    qk_traffic = (2 * z.qk_norm + 2 * (z.positions == "rotary") * z.rotary_fraction) * c * s * (dq + e) / t
    block_traffic = (s * d * (stream / split_seq + 4 * c) + s * (7 * dq + qkv_written) * c / t
                     + (2 + 2 * g if compiled else 4 * g) * s * f * c / t
                     + scores_traffic / t + z.norms * z.stats * STAT_BYTES * s / split_seq
                     + dropouts + norms_traffic + qk_traffic)
    if p.fp8_casts:  # the four projections' inputs cast to fp8 (the output gradients' casts: the backward's share)
        block_traffic += FP8_CAST_BYTES * (2 * s * d + s * dq / t + g * s * f / t)
    block_saved = (s * d * (2 * F + 2 * c) / split_seq + s * dq * 4 * c / t + mlp_saved * s * f * c / t
                   + scores_saved / t
                   + z.norms * z.stats * STAT_BYTES * s / split_seq + drop * MASK_BYTES * 2 * s * d / split_seq
                   + norms_saved + z.qk_norm * c * s * (dq + e) / t)
    norm_params = norms_params + z.extra_block_params  # read in fp32 where the matmul weights are cast
    # selective_op (torchtitan's op-level policy, flash attention only): the matmuls counted in a Llama block's
    # order q, k, v, o, the MLP's first projection (w1), its second (w3 gated, fc2 otherwise), w2; the even
    # ones (k, o and the MLP's second: d*e, dq*d and d*f wide) are rerun, or every one where they are fp8
    # scaled matmuls, which the save list (aten.mm) does not name; the block keeps its input, the odd
    # matmuls' outputs (q, v, w1, and gated w2, whose output is whole on each device before its reduction),
    # the flash kernel's output and log-sum-exp, and with sequence parallelism the reduce-scatters' outputs
    projection_flops = 2.0 * s * (d * (dq + 2 * e) + dq * d + (g + 1) * d * f) / t
    op_recompute_flops = projection_flops if p.fp8_casts else 2.0 * s * (d * e + dq * d + d * f) / t
    kept_matmuls = 0.0 if p.fp8_casts else (s * (dq + e + f) * c / t + (g == 2) * s * d * c)
    op_kept = (s * d * F / split_seq + kept_matmuls + s * dq * c / t + h * s * STAT_BYTES / t
               + sp * 2 * s * d * c / t)

    def block(keys: int) -> LayerSpec:
        """The block whose queries attend to ``keys`` keys each (a flash kernel's sliding window)."""
        return LayerSpec(
            "block", params=block_params,
            flops_per_row=(2.0 * s * (d * (dq + 2 * e) + dq * d + (g + 1) * d * f) + 4.0 * s * keys * dq) / t,
            traffic_bytes_per_row=block_traffic,
            fixed_traffic_bytes=weights_read(p, block_params - norm_params, norm_params),
            saved_bytes_per_row=block_saved, input_bytes_per_row=s * d * F / split_seq,
            output_bytes_per_row=s * d * F / split_seq,
            fixed_saved_bytes=p.weight_copy_bytes * matmul_weights,
            tp_allreduce_bytes_per_row=s * d * c, tp_allreduces_forward=2.0, tp_allreduces_backward=3.0 if sp else 2.0,
            tp_allreduces_backward_waited=1.0 if sp else 0.0,
            core_saved_bytes_per_row=0.0 if flash else (scores_saved + grouped * 2 * s * (dq - e) * c) / t,
            core_flops_per_row=0.0 if flash else 4.0 * s * s * dq / t,
            core_traffic_bytes_per_row=0.0 if flash else (scores_traffic + grouped * s * (2 * e + 2 * dq) * c) / t,
            backward_extra_flops_per_row=2.0 * s * keys * dq / t if flash else 0.0,  # flash recomputes QK^T
            attention_flops_per_row=4.0 * s * keys * dq / t,
            cp_exchange_bytes_per_row=2.0 * s * e * c / t if cp > 1 else 0.0, cp_steps=cp - 1,
            # whole on each device (QKV's and fc1's inputs, proj's and fc2's outputs), split (QKV's output, q, k,
            # v and the attention's output read and written, proj's input, fc1's output, fc2's input), the scores
            matmul_traffic_bytes_per_row=(c * (4 * s * d + s * (6 * dq + 2 * e) / t + (g + 1) * s * f / t)
                                          + scores_matmul_traffic / t),
            matmuls=4 + (1 if flash else 2), fp8_matmuls=p.fp8_casts,
            core_matmul_traffic_bytes_per_row=scores_matmul_traffic / t,
            op_checkpointed=flash, op_recompute_flops_per_row=op_recompute_flops if flash else 0.0,
            op_kept_bytes_per_row=op_kept if flash else 0.0,
        )

    # a flash kernel skips the blocks outside a sliding window; with context parallelism the ring passes
    # every block, and eager and fused attention compute every score
    windowed = flash and cp == 1
    blocks = {keys: block(keys) for keys in {min(z.window(i), seq) if windowed and z.window(i) else seq
                                             for i in range(L)}}
    block_of = [blocks[min(z.window(i), seq) if windowed and z.window(i) else seq] for i in range(L)]
    head_weights = vocab * d + ("head" in b) * vocab
    head_params = norm_weights + head_weights
    head = LayerSpec(
        "head", params=head_params, flops_per_row=2.0 * s * d * vocab,
        # LN reads and writes sd in fp32; cast; Linear reads sd, writes sV; the loss (cross entropy in fp32, as
        # autocast and Megatron's vocabulary-parallel one run it) reads the logits and writes them in fp32, reads
        # those twice (the row maximum, the sum of exponentials) and writes the log-probabilities
        # compiled: LN with its cast one region, and the loss's reductions read the logits twice (row maximum,
        # sum of exponentials with the target's gather), no fp32 copy or log-probabilities written
        traffic_bytes_per_row=(s * d * (((F + c) if compiled else (2 * F + x)) / split_seq + c) + c * s * vocab
                               + z.stats * STAT_BYTES * s / split_seq
                               + (2 * c if compiled else c + LOSS_FP32_PASSES * FP32_BYTES) * s * vocab),
        fixed_traffic_bytes=weights_read(p, head_weights, norm_weights),
        saved_bytes_per_row=s * d * (F + c) / split_seq + z.stats * STAT_BYTES * s / split_seq,
        input_bytes_per_row=s * d * F / split_seq, output_bytes_per_row=s * vocab * c,
        fixed_saved_bytes=p.weight_copy_bytes * d * vocab,
        tp_allreduce_bytes_per_row=s * d * c, tp_allreduces_forward=0.5 if sp else 0.0, tp_allreduces_backward=1.0,
        matmul_traffic_bytes_per_row=c * (s * d + s * vocab), matmuls=1,
    )
    return [embed] + block_of + [head]
