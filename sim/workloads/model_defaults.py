"""Default options, batch sizes and command-line flags of the built-in models, shared by every part.

Torch-free on purpose: ``gpipe simulate`` reads these without importing torch. The analytic
workloads (:mod:`sim.workloads.models`) and the executor's torch models read the same numbers, so a model
named on the command line means the same layers in both.
"""

from __future__ import annotations

# Options per model; see sim.workloads.models for what each one means. Small by default so a CPU demo is quick.
DEFAULT_OPTIONS: dict[str, dict[str, int | float]] = {
    "uniform": {"layers": 16},
    "mlp": {"layers": 8, "width": 256},
    "transformer": {"layers": 4, "d_model": 64, "ff": 256, "heads": 4, "seq": 32, "vocab": 256,
                    "dropout": 0.0, "kv_heads": 0,  # kv_heads 0: one key/value head per head
                    "activation": "gelu",  # the MLP's: gelu, squared_relu (Nemotron-4's) or swiglu (Llama's gated MLP)
                    "attention": "eager",  # eager, fused (scores materialised) or flash (a kernel keeping none)
                    "compile": False},  # true: torch.compile's fused elementwise regions (planning only)
    "cnn": {"layers": 4, "channels": 16, "image": 16, "classes": 10},
}

# The transformer MLP's activations, by option value; relu (OPT's MLP, which saves one (seq, ff) tensor
# where GELU saves two) is for planning: the executor trains the others
ACTIVATIONS = ("gelu", "squared_relu", "swiglu", "relu")
# The transformer's attention kernels: eager materialises the (heads, seq, seq) scores as torch's
# unfused ops do, fused as Megatron-LM's scale-mask-softmax kernel does (planning only: the executor
# trains eager and flash), flash keeps none
ATTENTIONS = ("eager", "fused", "flash")

# Mini-batch size (samples per step, before splitting into micro-batches) per model.
DEFAULT_BATCH: dict[str, int] = {
    "uniform": 32,
    "mlp": 64,  # rows of width features
    "transformer": 16,  # sequences of seq tokens
    "cnn": 32,  # images of 3 x image x image
}

# The command line's flag of each model option: flag -> (option name in the model's options, type,
# help). Here, beside the options, so a note can spell out the command that asks for them.
MODEL_FLAGS = {
    "--layers": ("layers", int, "number of layers (transformer: blocks; cnn: conv blocks)"),
    "--width": ("width", int, "mlp: hidden width"),
    "--d-model": ("d_model", int, "transformer: model dimension"),
    "--ff": ("ff", int, "transformer: feed-forward dimension"),
    "--heads": ("heads", int, "transformer: attention heads"),
    "--seq": ("seq", int, "transformer: sequence length"),
    "--vocab": ("vocab", int, "transformer: vocabulary size"),
    "--dropout": ("dropout", float, "transformer: dropout probability"),
    "--channels": ("channels", int, "cnn: channels"),
    "--image": ("image", int, "cnn: image side in pixels"),
    "--classes": ("classes", int, "cnn: classes"),
}
