"""Analytic workloads for the built-in models: per-layer FLOPs, bytes and memory against a roofline.

Each model's layer list mirrors the torch model the executor builds, layer for layer, so a partition
(``balance``) means the same thing to the simulator and to the executor. Torch-free: ``gpipe
simulate`` must not import torch.

Time of one layer pass on ``device`` (the roofline, Williams et al., CACM 2009; a GPU with fractions
fitted on published runs is timed kernel by kind instead, :mod:`sim.catalog.kernel_model`)::

    forward_s  = max(F / achieved_flops(precision), B / achieved_bandwidth) + LAYER_OVERHEAD_S
    backward_s = max(2F / achieved_flops(precision), 2B / achieved_bandwidth) + 2 * LAYER_OVERHEAD_S
    recompute_s = forward_s

F counts matmul FLOPs as 2*m*n*k (convolutions as the matmul they are, attention scores q.k^T and
values p.v included); backward costs twice the forward (one matmul for the input gradient, one for
the weight gradient: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1).
Ignored in F: bias adds, activations, normalisation, softmax, pooling, residual adds and the
embedding gather; they are memory-bound and enter through B. B counts bytes each op reads and
writes (weights read once per pass, activations read and written per op, no fusion).

Precision (:mod:`sim.workloads.precision`): ``fp32`` runs everything in fp32. ``bf16`` is autocast as
torch runs it on CUDA: matmuls and convolutions (and the elementwise ops after them: GELU, ReLU,
batch norm, pooling, the attention scale and mask) read and write bf16 (``c`` = 2 bytes below);
the embedding, layer norms, softmax and the residual stream stay fp32 (``f`` = 4 bytes); an fp32
tensor entering a matmul is cast (read 4, write 2 bytes: ``x`` = 6 below, 0 in fp32), and so is
every weight and bias a matmul uses, once per forward (8 bytes per such parameter moved instead of
4). Weights, gradients and optimizer state stay fp32 (4 bytes per parameter each) in both.

Memory per layer and micro-batch (``saved_bytes``) counts what PyTorch autograd keeps for these
modules: Linear and Conv2d save their input (in bf16, the bf16 cast of an fp32 input, not the input)
and, when their input needs a gradient, their weight (a parameter in fp32, not counted; in bf16
autocast's 2-byte copy, counted per micro-batch as ``fixed_saved_bytes``), ReLU its output, GELU its
input, LayerNorm its input plus fp32 mean and rstd per token, BatchNorm2d its input (plus
per-channel statistics, ignored), softmax its output (fp32 in bf16, and p.v saves the bf16 cast of
it too), the attention matmuls q, k, v and the probabilities, dropout a one-byte mask per element
(only when dropout > 0; CUDA's fused kernel; on CPU PyTorch keeps a mask in the input's dtype),
Embedding its int64 indices. Tensors that do not grow with the micro-batch (position ids, the causal
mask, BatchNorm's per-channel statistics) are left out. Each tensor is counted once: a ReLU's
output is the next layer's input and is counted there (the next layer's first op saves it), so
summing a stage's layers counts every tensor once, except the last layer's saved output in the mlp
and cnn (ReLU), which equals that stage's ``output_bytes``. A layer that does not keep its input's
own storage says so (``saves_input``), and a stage starting there holds the input besides. The fp32
transformer block's count matches Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", eq. 1, with every tensor at 4 bytes: at 16 bits with dropout their
s*b*h*(34 + 5*a*s/h) bytes, less their dropout on the attention probabilities (3*a*s^2*b), which the
executor's model does not have.

Limits: no kernel fusion beyond the transformer's attention kernels (``attention`` eager, fused or
flash) and, with ``compile``, its elementwise regions (:func:`transformer_layers`), the causal mask saves no FLOPs, the transformer's loss is counted as traffic (its fp32
passes over the logits) but not as memory (its fp32 log-probabilities kept for backward; the other
models' losses not at all), one fixed launch overhead per layer, transient workspace not counted.
bf16 follows CUDA's autocast op lists; CPU autocast runs softmax in bf16 and saves only its bf16
output (the block saves 4 bytes per attention score less there), and TPUs (XLA) keep lists of
their own. Casts of biases and of fp32 inputs are counted as traffic, not as saved memory, except
where a matmul saves the cast.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sim.catalog.hardware import Device, Link
from sim.catalog.kernel_model import layer_times, ring_exposed_s
from sim.engine.allreduce import ring_allreduce_s
from sim.errors import GpipeInputError, did_you_mean
from sim.workloads.decoder_features import FEATURE_DEFAULTS, Features, check_feature
from sim.workloads.model_defaults import ACTIVATIONS, ATTENTIONS, DEFAULT_OPTIONS
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_SLOTS
from sim.workloads.precision import (DEFAULT_PRECISION, FP8_CAST_BYTES, FP32_BYTES, Precision, check_precision,
                                     precision_of)
from sim.workloads.workload import LayerCost, SharedParameter, UniformWorkload, Workload, WorkloadCapabilities

BUILTIN_MODELS = ("uniform", "mlp", "transformer", "cnn")

# Assumption: a layer's pass costs a few eager-mode kernel launches that do not overlap with the
# device's work, ~5 us of CPU dispatch each (PyTorch eager, CUDA launch latency); 10 us in all.
LAYER_OVERHEAD_S = 10e-6

STAT_BYTES = 4  # LayerNorm's saved mean and rstd are fp32 whatever the input dtype
INDEX_BYTES = 8  # token ids are int64
MASK_BYTES = 1  # dropout's saved mask is a bool per element

# Options every analytic model accepts besides its own (DEFAULT_OPTIONS); uniform takes only the
# optimizer's. optimizer_slots: state tensors per parameter (sim.workloads.optimizers; set by --optimizer).
COMMON_DEFAULTS: dict[str, Any] = {"precision": DEFAULT_PRECISION,
                                   "optimizer_slots": OPTIMIZER_SLOTS[DEFAULT_OPTIMIZER]}

LOSS_FP32_PASSES = 4  # the loss's fp32 passes over the logits: cast, row maximum, sum of exponentials, output
_HAS_OPTIMIZER_S = "optimizer_s" in {f.name for f in dataclasses.fields(LayerCost)}


@dataclass(frozen=True)
class LayerSpec:
    """One layer's costs per sample (row); fixed terms do not scale with the micro-batch."""

    name: str
    params: int
    flops_per_row: float  # forward matmul FLOPs
    traffic_bytes_per_row: float  # activation bytes read + written in forward
    fixed_traffic_bytes: float  # weights (or the rows of them) read once per forward
    saved_bytes_per_row: float
    input_bytes_per_row: float
    output_bytes_per_row: float
    fixed_saved_bytes: float = 0.0  # per micro-batch whatever its rows: bf16 weight copies
    saves_input: bool = True  # whether the saved bytes hold the input's own storage
    # tensor parallelism (sim.workloads.tensor_parallel): collectives over the layer's T devices, counted in
    # all-reduces of one tensor of this many bytes per row (an all-gather or reduce-scatter is half)
    tp_allreduce_bytes_per_row: float = 0.0
    tp_allreduces_forward: float = 0.0
    tp_allreduces_backward: float = 0.0
    # of the backward's, those on its critical path (the next kernel waits for them), which no weight
    # gradient can hide (sim.catalog.kernel_model)
    tp_allreduces_backward_waited: float = 0.0
    # fp8 (sim.workloads.precision): the layer's matmuls other than the attention core run at the fp8 peak
    fp8_matmuls: bool = False
    # the attention core (QK^T, softmax, attention over V): what selective recompute drops and reruns
    core_saved_bytes_per_row: float = 0.0
    core_flops_per_row: float = 0.0
    core_traffic_bytes_per_row: float = 0.0
    backward_extra_flops_per_row: float = 0.0  # beyond twice the forward's: flash attention's recompute
    # what the GPU kernel model (sim.catalog.kernel_model) times apart: of flops_per_row, the attention core's
    # QK^T and attention over V; of traffic_bytes_per_row, what the matrix multiplications themselves
    # read and write (their operands and results, which move while they compute); matrix-multiply
    # kernels per forward
    attention_flops_per_row: float = 0.0
    matmul_traffic_bytes_per_row: float = 0.0
    matmuls: int = 0
    core_matmul_traffic_bytes_per_row: float = 0.0  # of core_traffic_bytes_per_row: the scores written and read
    # context parallelism (sim.workloads.tensor_parallel): ring attention passes each device's keys and values
    # (this many bytes per row) to its neighbour cp_steps times a forward, beside the attention
    cp_exchange_bytes_per_row: float = 0.0
    cp_steps: int = 0


class AnalyticWorkload(WorkloadCapabilities):
    """A built-in model as a list of :class:`LayerSpec`, costed on any device by the roofline."""

    def __init__(self, name: str, options: dict[str, Any], layers: Sequence[LayerSpec],
                 tensor_parallel: int = 1, sequence_parallel: bool = False, tp_link: Link | None = None,
                 context_parallel: int = 1) -> None:
        self.name = name
        self.options = dict(options)
        self.layers = tuple(layers)
        self.num_layers = len(self.layers)
        self.precision: str = options["precision"]
        self.optimizer_slots: int = options["optimizer_slots"]
        # layers split over T devices of one node (sim.workloads.tensor_parallel); costs are one device's
        self.tensor_parallel = tensor_parallel
        self.sequence_parallel = sequence_parallel
        self.tp_link = tp_link
        self.context_parallel = context_parallel  # C devices share each sequence; weights replicated over them
        self.planned_from: str | None = None  # a Hugging Face model planned by its shape (gpipe.workload_flags)
        # its layers are transformer_layers(options), which tensor and context parallelism split
        self.is_transformer = name == "transformer"
        self.has_attention_core = self.is_transformer  # what --checkpoint selective recomputes

    @property
    def parameter_count(self) -> int:
        """The whole model's parameters (a tensor-parallel layer's whole, not one device's share; a
        tied embedding and head's weight once)."""
        if self.tensor_parallel > 1 or self.sequence_parallel or self.context_parallel > 1:
            layers = (transformer_layers if self.is_transformer else _BUILDERS[self.name])(self.options)
        else:
            layers = list(self.layers)
        tied = self.options["vocab"] * self.options["d_model"] if self._tied else 0  # the head's, counted twice
        return sum(spec.params for spec in layers) - tied

    @property
    def _tied(self) -> bool:
        return self.is_transformer and bool(self.options.get("tied"))

    @property
    def shared_parameters(self) -> tuple[SharedParameter, ...]:
        """A tied embedding and head (``tied``): one token table, on the first and last layer."""
        if not self._tied:
            return ()
        numel = -(-self.options["vocab"] // self.tensor_parallel) * self.options["d_model"]
        p = precision_of(self.precision)
        static = numel * (p.weight_bytes + FP32_BYTES + (self.optimizer_slots + p.master_copy) * FP32_BYTES)
        return (SharedParameter("embedding.weight", (0, self.num_layers - 1), numel * p.weight_bytes, static),)

    def split_over(self, tensor_parallel: int, sequence_parallel: bool, tp_link: Link | None,
                   context_parallel: int = 1) -> "AnalyticWorkload":
        """The transformer split over T x C devices (:mod:`sim.workloads.tensor_parallel`): one
        member's layers, the same model otherwise."""
        split = copy.copy(self)
        split.layers = tuple(transformer_layers(self.options, tensor_parallel, sequence_parallel, context_parallel))
        split.tensor_parallel, split.sequence_parallel = tensor_parallel, sequence_parallel
        split.tp_link, split.context_parallel = tp_link, context_parallel
        return split

    def layer_costs(self, rows: int, device: Device) -> Sequence[LayerCost]:
        if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows <= 0:
            raise GpipeInputError(f"micro-batch rows must be a positive integer, got {rows!r}")
        flops_s = device.achieved_flops(self.precision)
        bytes_s = device.achieved_bandwidth()
        return [self._cost(spec, rows, flops_s, bytes_s, device) for spec in self.layers]

    def _cost(self, spec: LayerSpec, rows: int, flops_s: float, bytes_s: float, device: Device) -> LayerCost:
        collective_s = 0.0
        if self.tp_link is not None and self.tensor_parallel > 1:
            collective_s = ring_allreduce_s(spec.tp_allreduce_bytes_per_row * rows, self.tensor_parallel,
                                            self.tp_link)
        ring_send_s = 0.0
        if self.tp_link is not None and spec.cp_steps:
            ring_send_s = self.tp_link.transfer_s(spec.cp_exchange_bytes_per_row * rows)
        core_s = None
        precision = precision_of(self.precision)
        # fp8: the projections at the fp8 peak, the attention core at the precision's own
        matmul_peak = precision.matmul_peak if spec.fp8_matmuls else precision.peak
        if device.kernels is not None:  # a GPU with fitted fractions: kernels by kind (sim.catalog.kernel_model)
            times = layer_times(spec, rows, device.peak_flops[precision.peak],
                                device.memory_bandwidth_bytes_per_s, device.kernels, collective_s, LAYER_OVERHEAD_S,
                                ring_send_s, projection_peak_flops=device.peak_flops[matmul_peak])
            forward_s, backward_s, core_s = times.forward_s, times.backward_s, times.core_recompute_s
            bytes_s = device.memory_bandwidth_bytes_per_s * device.kernels.memory
        else:  # the roofline; the matmuls wait for the collectives: no overlap
            attention = spec.attention_flops_per_row * rows
            projections_s = (spec.flops_per_row * rows - attention) / device.achieved_flops(matmul_peak)
            compute_s = projections_s + attention / flops_s
            extra_s = spec.backward_extra_flops_per_row * rows / flops_s
            moved = spec.traffic_bytes_per_row * rows + spec.fixed_traffic_bytes
            forward_s = max(compute_s, moved / bytes_s) + LAYER_OVERHEAD_S
            backward_s = max(2 * compute_s + extra_s, 2 * moved / bytes_s) + 2 * LAYER_OVERHEAD_S
            forward_s += spec.tp_allreduces_forward * collective_s
            backward_s += spec.tp_allreduces_backward * collective_s
            attention_s = spec.attention_flops_per_row * rows / flops_s
            ring_forward_s, ring_backward_s = ring_exposed_s(spec.cp_steps, ring_send_s, attention_s, 2 * attention_s)
            forward_s += ring_forward_s
            backward_s += ring_backward_s
        param_bytes = spec.params * precision.weight_bytes  # fp32 weights (the master copy) unless a bf16 model
        grad_bytes = spec.params * FP32_BYTES  # fp32 gradients (a bf16 model's main gradients too)
        optimizer_bytes = (self.optimizer_slots + precision.master_copy) * spec.params * FP32_BYTES
        extra = {}
        if _HAS_OPTIMIZER_S:
            # Elementwise update: read weight, grad and slots, write weight and slots; a bf16 model's trainer
            # also zeroes its fp32 main gradients, reads them for the global norm and copies the master
            # weights to the bf16 ones (read 4, write 2) every step
            megatron = precision.master_copy * (2 * FP32_BYTES + FP32_BYTES + precision.weight_bytes)
            extra["optimizer_s"] = (((3 + 2 * self.optimizer_slots) * FP32_BYTES + megatron) * spec.params
                                    / device.optimizer_bandwidth())
            if self.context_parallel > 1 and self.tp_link is not None:
                # the C devices of a sequence hold the same weights: their gradients are summed on the
                # node's link after the last backward, before the data-parallel reduction
                extra["optimizer_s"] += ring_allreduce_s(grad_bytes, self.context_parallel, self.tp_link)
        if spec.core_flops_per_row and core_s is not None:
            extra["core_recompute_s"] = core_s
            extra["core_saved_bytes"] = round(spec.core_saved_bytes_per_row * rows)
        elif spec.core_flops_per_row:
            extra["core_recompute_s"] = max(spec.core_flops_per_row * rows / flops_s,
                                            spec.core_traffic_bytes_per_row * rows / bytes_s)
            extra["core_saved_bytes"] = round(spec.core_saved_bytes_per_row * rows)
        return LayerCost(
            name=spec.name, forward_s=forward_s, backward_s=backward_s, recompute_s=forward_s,
            saved_bytes=round(spec.saved_bytes_per_row * rows + spec.fixed_saved_bytes),
            output_bytes=round(spec.output_bytes_per_row * rows),
            input_bytes=round(spec.input_bytes_per_row * rows),
            param_bytes=param_bytes, grad_bytes=grad_bytes,
            optimizer_bytes=optimizer_bytes, saves_input=spec.saves_input, **extra,
        )

    def describe(self) -> dict:
        return {"name": self.name, "options": dict(self.options), "num_layers": self.num_layers,
                "parameter_count": self.parameter_count}


def _weights_read(p: Precision, matmul_params: int, other_params: int) -> float:
    """Bytes one forward moves for weights: matmul weights and biases in the compute dtype (cast
    from fp32 first under autocast), the rest (norms) in fp32."""
    return matmul_params * (p.compute_bytes + p.cast_bytes) + other_params * FP32_BYTES


# --- mlp -----------------------------------------------------------------------------------------
def mlp_layers(o: dict[str, Any]) -> list[LayerSpec]:
    """``layers`` x [Linear(w, w) + ReLU] on rows of ``width`` fp32 features.

    Per row, with c the compute bytes: F = 2w^2; B = 4w*c (Linear reads w, writes w; ReLU reads w,
    writes w) + weights once; saved = w*c (Linear's input; ReLU's output is counted as the next
    layer's input). Under bf16 the first layer's fp32 input is cast (6w bytes moved) and the cast
    saved instead of the input (``saves_input`` false); every later layer's input needs a gradient,
    so its Linear also saves autocast's copy of the weight, 2w^2 bytes per micro-batch.
    """
    w, p = o["width"], precision_of(o["precision"])
    c = p.compute_bytes
    params = w * w + w
    later = LayerSpec(
        "linear_relu", params, flops_per_row=2.0 * w * w, traffic_bytes_per_row=4.0 * w * c,
        fixed_traffic_bytes=_weights_read(p, params, 0), saved_bytes_per_row=w * c,
        input_bytes_per_row=w * c, output_bytes_per_row=w * c,
        fixed_saved_bytes=p.weight_copy_bytes * w * w,
    )
    # the model's input needs no gradient: its Linear saves no weight copy
    first = dataclasses.replace(later, traffic_bytes_per_row=later.traffic_bytes_per_row + p.cast_bytes * w,
                                input_bytes_per_row=w * FP32_BYTES, fixed_saved_bytes=0.0,
                                saves_input=not p.casts)
    return [first] + [later] * (o["layers"] - 1)


# --- transformer ---------------------------------------------------------------------------------
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

    def block(keys: int) -> LayerSpec:
        """The block whose queries attend to ``keys`` keys each (a flash kernel's sliding window)."""
        return LayerSpec(
            "block", params=block_params,
            flops_per_row=(2.0 * s * (d * (dq + 2 * e) + dq * d + (g + 1) * d * f) + 4.0 * s * keys * dq) / t,
            traffic_bytes_per_row=block_traffic,
            fixed_traffic_bytes=_weights_read(p, block_params - norm_params, norm_params),
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
        fixed_traffic_bytes=_weights_read(p, head_weights, norm_weights),
        saved_bytes_per_row=s * d * (F + c) / split_seq + z.stats * STAT_BYTES * s / split_seq,
        input_bytes_per_row=s * d * F / split_seq, output_bytes_per_row=s * vocab * c,
        fixed_saved_bytes=p.weight_copy_bytes * d * vocab,
        tp_allreduce_bytes_per_row=s * d * c, tp_allreduces_forward=0.5 if sp else 0.0, tp_allreduces_backward=1.0,
        matmul_traffic_bytes_per_row=c * (s * d + s * vocab), matmuls=1,
    )
    return [embed] + block_of + [head]


# --- cnn -----------------------------------------------------------------------------------------
def cnn_layers(o: dict[str, Any]) -> list[LayerSpec]:
    """[Stem, ``layers`` x Conv-BN-ReLU, Head] on 3 x n x n fp32 images, C channels, k classes.

    Per row (image), with c the compute bytes and x the bytes of one cast (see the module):

    - Stem Conv2d(3, C, 3, pad 1) + BN + ReLU: params 27C + C + 2C; F = 2*n^2*C*27;
      saved = c(3n^2 + Cn^2) (conv input, BN input; ReLU output counted by the next layer). In
      bf16 the conv saves the bf16 cast of the fp32 image, not the image (``saves_input`` false),
      and the copy of its weight, 54C bytes (a convolution keeps its weight even when its input
      needs no gradient; a Linear does not).
    - Block Conv2d(C, C, 3, pad 1) + BN + ReLU: params 9C^2 + C + 2C; F = 2*n^2*C*9C;
      saved = 2Cn^2*c [+ 18C^2 weight copy in bf16].
    - Head AdaptiveAvgPool2d(1) + Flatten + Linear(C, k): params Ck + k; F = 2Ck;
      saved = C*c (Linear's input; pooling to 1x1 runs as a mean, which saves only shapes, so the
      head keeps nothing of its own input) [+ 2Ck weight copy in bf16].
    Traffic per row: conv reads its input, writes Cn^2; BN reads twice (statistics, normalise)
    and writes once; ReLU reads and writes once; bf16 casts the image once. BN statistics per
    channel are not counted.
    """
    L, C, n, k = (o[key] for key in ("layers", "channels", "image", "classes"))
    p, area = precision_of(o["precision"]), o["image"] ** 2
    c = p.compute_bytes
    stem_params = 27 * C + C + 2 * C
    stem = LayerSpec(
        "stem", params=stem_params, flops_per_row=2.0 * area * C * 27,
        traffic_bytes_per_row=c * (3 * area + 6 * C * area) + p.cast_bytes * 3 * area,
        fixed_traffic_bytes=_weights_read(p, 28 * C, 2 * C),
        saved_bytes_per_row=c * (3 * area + C * area),
        input_bytes_per_row=3 * area * FP32_BYTES, output_bytes_per_row=C * area * c,
        fixed_saved_bytes=p.weight_copy_bytes * 27 * C,  # a convolution saves its weight regardless
        saves_input=not p.casts,
    )
    block_params = 9 * C * C + C + 2 * C
    block = LayerSpec(
        "conv_bn_relu", params=block_params, flops_per_row=2.0 * area * C * 9 * C,
        traffic_bytes_per_row=7 * C * area * c, fixed_traffic_bytes=_weights_read(p, 9 * C * C + C, 2 * C),
        saved_bytes_per_row=2 * C * area * c,
        input_bytes_per_row=C * area * c, output_bytes_per_row=C * area * c,
        fixed_saved_bytes=p.weight_copy_bytes * 9 * C * C,
    )
    head_params = C * k + k
    head = LayerSpec(
        "head", params=head_params, flops_per_row=2.0 * C * k,
        traffic_bytes_per_row=c * (C * area + 2 * C + k), fixed_traffic_bytes=_weights_read(p, head_params, 0),
        saved_bytes_per_row=C * c,
        input_bytes_per_row=C * area * c, output_bytes_per_row=k * c,
        fixed_saved_bytes=p.weight_copy_bytes * C * k, saves_input=False,
    )
    return [stem] + [block] * L + [head]


# --- registry ------------------------------------------------------------------------------------
_BUILDERS: dict[str, Callable[[dict[str, Any]], list[LayerSpec]]] = {
    "mlp": mlp_layers, "transformer": transformer_layers, "cnn": cnn_layers,
}


def get_workload(name: str, options: dict[str, Any] | None = None) -> Workload:
    """The built-in model ``name`` with ``options`` over its defaults (``DEFAULT_OPTIONS``).

    Values may be strings (as typed on the command line); they are converted and checked.
    Raises GpipeInputError, one line naming the value and the fix, for anything invalid.
    """
    if name not in BUILTIN_MODELS:
        raise GpipeInputError(f"unknown model {name!r}{did_you_mean(name, BUILTIN_MODELS)}; choose one of "
                              f"{', '.join(BUILTIN_MODELS)}")
    merged = resolve_options(name, options or {})
    if name == "uniform":
        return UniformWorkload(num_layers=merged["layers"], optimizer_slots=merged["optimizer_slots"])
    return AnalyticWorkload(name, merged, _BUILDERS[name](merged))


def resolve_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Defaults filled in and every value checked; the full option dict ``describe()`` reports."""
    defaults = dict(DEFAULT_OPTIONS[name])
    if name != "uniform":
        defaults.update(COMMON_DEFAULTS)
    else:
        defaults["optimizer_slots"] = COMMON_DEFAULTS["optimizer_slots"]
    # the transformer's planning features (sim.workloads.decoder_features): taken when given, else absent
    features = FEATURE_DEFAULTS if name == "transformer" else {}
    unknown = sorted(set(options) - set(defaults) - set(features))
    if unknown:
        raise GpipeInputError(
            f"unknown option(s) {', '.join(unknown)} for model {name}; "
            f"choose from {', '.join(defaults)}")
    merged = {**defaults, **options}
    for key, value in merged.items():
        merged[key] = _check_option(name, key, value)
    if name != "transformer" and precision_of(merged.get("precision", DEFAULT_PRECISION)).planning_only:
        raise GpipeInputError(f"precision {merged['precision']} ({precision_of(merged['precision']).about}) is "
                              f"modelled for the built-in transformer only, not {name}; use bf16-autocast")
    if name == "transformer" and merged["d_model"] % merged["heads"] and not merged.get("head_dim"):
        raise GpipeInputError(
            f"heads={merged['heads']} does not divide d_model={merged['d_model']}; "
            "choose heads that divide d_model")
    if name == "transformer" and merged["kv_heads"] and merged["heads"] % merged["kv_heads"]:
        raise GpipeInputError(
            f"kv_heads={merged['kv_heads']} does not divide heads={merged['heads']}; each key/value head serves "
            "a whole group of query heads: choose a divisor of heads (0: one per head)")
    return merged


def _check_option(model: str, key: str, value: Any) -> Any:
    if key in FEATURE_DEFAULTS:
        return check_feature(key, value, model)
    if key == "precision":
        return check_precision(value)
    if key == "compile":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise GpipeInputError(f"compile={value!r} for model {model}; use true (torch.compile's fused elementwise "
                                  "regions) or false")
        return value
    if key in ("activation", "attention"):
        choices = ACTIVATIONS if key == "activation" else ATTENTIONS
        if value not in choices:
            raise GpipeInputError(f"{key}={value!r} for model {model}; choose one of {', '.join(choices)}")
        return value
    if key == "dropout":
        try:
            p = float(value)
        except (TypeError, ValueError):
            p = -1.0
        if isinstance(value, bool) or not 0.0 <= p < 1.0:
            raise GpipeInputError(f"dropout={value!r} for model {model}; use a number in [0, 1)")
        return p
    least = 0 if key in ("optimizer_slots", "kv_heads") else 1
    number = value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        number = int(value)
    if isinstance(number, bool) or not isinstance(number, int) or number < least:
        kind = "a non-negative" if least == 0 else "a positive"
        raise GpipeInputError(f"{key}={value!r} for model {model}; use {kind} integer")
    return number
