"""One layer's costs per sample, as the built-in models count them: FLOPs, bytes moved and memory kept.

The layer lists (:mod:`sim.workloads.transformer`, :mod:`sim.workloads.mlp_and_cnn`) fill these in;
:class:`sim.workloads.models.AnalyticWorkload` times them on a device. How they are counted:

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
flash) and, with ``compile``, its elementwise regions (:func:`sim.workloads.transformer.transformer_layers`),
the causal mask saves no FLOPs, the transformer's loss is counted as traffic (its fp32
passes over the logits) but not as memory (its fp32 log-probabilities kept for backward; the other
models' losses not at all), one fixed launch overhead per layer, transient workspace not counted.
bf16 follows CUDA's autocast op lists; CPU autocast runs softmax in bf16 and saves only its bf16
output (the block saves 4 bytes per attention score less there), and TPUs (XLA) keep lists of
their own. Casts of biases and of fp32 inputs are counted as traffic, not as saved memory, except
where a matmul saves the cast.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.workloads.precision import FP32_BYTES, Precision

STAT_BYTES = 4  # LayerNorm's saved mean and rstd are fp32 whatever the input dtype
INDEX_BYTES = 8  # token ids are int64
MASK_BYTES = 1  # dropout's saved mask is a bool per element


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
    # torchtitan's op-level selective checkpointing (selective_op) of a block: what the backward reruns (every
    # second matmul's FLOPs, or all of them where they are fp8 scaled matmuls, which its save list leaves out;
    # every elementwise op besides) and what the block keeps for its backward; a layer not checkpointed
    # (op_checkpointed False: the embedding, the head) keeps all it saves
    op_checkpointed: bool = False
    op_recompute_flops_per_row: float = 0.0
    op_kept_bytes_per_row: float = 0.0
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
    # of flops_per_row, the routed experts' grouped matmuls (sim.workloads.moe.layers), timed further from peak
    # than a dense matmul (sim.catalog.kernel_model.GROUPED_MATMUL_RELATIVE)
    grouped_matmul_flops_per_row: float = 0.0


def weights_read(p: Precision, matmul_params: int, other_params: int) -> float:
    """Bytes one forward moves for weights: matmul weights and biases in the compute dtype (cast
    from fp32 first under autocast), the rest (norms) in fp32."""
    return matmul_params * (p.compute_bytes + p.cast_bytes) + other_params * FP32_BYTES
