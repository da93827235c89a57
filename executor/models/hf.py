"""Hugging Face decoder-only language models as pipeline layers: ``--model hf:llama``, ``hf-config:PATH``.

The model is built from a ``transformers`` config (no download: ``hf:<model_type>`` with
``--option key=value`` for the config's fields, or ``hf-config:PATH`` for a ``config.json`` or a
folder holding one) on the meta device, then cut into the layers a pipeline partitions:

    0          embedding: token ids (rows, seq) -> {hidden states, position ids, rotary cos and sin}
    1 .. L     one decoder layer each: the same dict, hidden states updated
    L + 1      head: final norm, then -> logits (rows, seq, vocab); its weight is the embedding's when the
               config ties them

The dict crosses stage boundaries as several tensors (:mod:`executor.runtime.boundary`): the hidden states
per row, the position ids and rotary tables at a fixed shape. Attention runs as ``sdpa`` with no
mask tensor: without padding the model itself builds none and lets ``is_causal`` mask the future,
and nothing of (seq x seq) has to be sent between stages. The layers are those of the built-in
transformer (embedding, blocks, head with its norm), so a plan of the model's shape
(:mod:`sim.workloads.decoder_shape`, any decoder-only type) partitions them alike. Trained families:
GPT-2 and Llama (Mistral and Qwen2 share Llama's layout; so do Mixtral and Qwen3-MoE, whose routers'
loss crosses the stages as :mod:`executor.models.hf_moe` says); the others are planned, not trained. Data: random token ids of ``seq`` tokens (an option of ours, default 64),
targets the next token with the last position ignored (-100), so the mean cross entropy equals the
loss ``transformers`` computes from ``labels=ids``.

Every layer's ``reset_parameters()`` applies the model's own ``_init_weights`` to its modules,
children before parents as ``PreTrainedModel`` does, so a layer initialised on its own gets the
distributions the family specifies. Checkpoint names map to the model's own
(``model.layers.3.self_attn.q_proj.weight``), so ``--init-from`` takes a ``save_pretrained`` folder.

Limits: no padding masks, no key-value cache, no sliding-window or other per-layer attention
patterns; attention is always ``sdpa`` (the config's ``attn_implementation`` is set to it).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch
from torch import nn

from executor.models import hf_moe
from sim.errors import GpipeInputError
from sim.workloads.decoder_shape import HF_OPTIONS

# Mixtral and Qwen3-MoE share Llama's layout; their routers' loss: executor.models.hf_moe
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "mixtral": "llama",
            "qwen3_moe": "llama"}
OUR_OPTIONS = HF_OPTIONS  # options that describe the data and the pricing, not the config


def is_hf(name: str) -> bool:
    return name.startswith(("hf:", "hf-config:"))


def transformers_module():
    """The transformers package, or one line saying how to install it."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise GpipeInputError("Hugging Face models (hf:, hf-config:) need the transformers package; install it with "
                              "pip install -e '.[hf]'") from None
    return transformers


def type_and_fields(name: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The model type and config fields ``name`` (``hf:<type>`` or ``hf-config:PATH``) and
    ``options`` give, the options laid over a config file's fields."""
    given = {k: v for k, v in options.items() if k not in OUR_OPTIONS}
    if not name.startswith("hf-config:"):
        return name.partition(":")[2], given
    path = name.partition(":")[2]
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise GpipeInputError(f"{name!r}: {file!r} is not a readable config.json ({exc})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise GpipeInputError(f"{name!r}: {file!r} has no model_type; give a Hugging Face config.json")
    model_type = data.pop("model_type")
    data.update(given)
    return model_type, data


def config_of(name: str, options: dict[str, Any]) -> Any:
    """The ``transformers`` config ``name`` and ``options`` describe."""
    transformers = transformers_module()
    model_type, data = type_and_fields(name, options)
    if model_type not in FAMILIES:
        raise GpipeInputError(f"Hugging Face model type {model_type!r} is not supported; choose one of "
                              f"{', '.join(FAMILIES)} (decoder-only causal language models)")
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # TypeError, ValueError, or the config's own validation error
        reason = str(exc).strip().splitlines()[-1].strip()
        raise GpipeInputError(f"{name!r}: the config refuses the options {data} ({reason})") from None
    config._attn_implementation = "sdpa"
    return config


def rank_imports(name: str, options: dict[str, Any]) -> list[str]:
    """The modules a rank training ``name`` imports on top of the executor: this module and the family's
    modeling code, which ``AutoModelForCausalLM`` loads at the first build (seconds of a core for GPT-2
    beyond what the fork server imports anyway, docs/notes/2026-11-26-launch-time.md; in every rank
    unless the fork server has it: :func:`executor.launch.agent.start_fork_server`). Empty for a model
    type not supported (the model check refuses it with its reason)."""
    model_type, _ = type_and_fields(name, options)
    if model_type not in FAMILIES:
        return []
    return [__name__, f"transformers.models.{model_type}.modeling_{model_type}"]


class _Initialiser:
    """The model's own ``_init_weights``, applied to a layer's modules children first.

    Holds the meta-device model only for its method and config; copying a layer shares it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __deepcopy__(self, memo: dict) -> "_Initialiser":
        return self

    def __call__(self, layer: nn.Module) -> None:
        def visit(module: nn.Module) -> None:
            for child in module.children():
                visit(child)
            self.model._init_weights(module)

        with torch.no_grad():
            visit(layer)


class _Layer(nn.Module):
    """A pipeline layer cut from a Hugging Face model, initialised by the model's own rules."""

    def __init__(self, initialiser: _Initialiser) -> None:
        super().__init__()
        self._initialiser = initialiser

    def reset_parameters(self) -> None:
        self._initialiser(self)

    def tensor_parallel_plan(self, parts: int) -> dict[str, Any]:
        """Replicated over a stage's tensor-parallel ranks (:mod:`executor.parallel.tensor_parallel`): the
        embeddings, the final norm and the head."""
        return {}


class Embedding(_Layer):
    """Token (and, for GPT-2, learned position) embeddings; rotary tables for Llama-style models."""

    def __init__(self, family: str, model: nn.Module, initialiser: _Initialiser) -> None:
        super().__init__(initialiser)
        self.family, self.config = family, model.config
        if family == "gpt2":
            self.wte, self.wpe, self.drop = model.transformer.wte, model.transformer.wpe, model.transformer.drop
        else:
            self.embed_tokens, self.rotary_emb = model.model.embed_tokens, model.model.rotary_emb

    def forward(self, ids: torch.Tensor) -> dict[str, Any]:
        position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # (1, seq)
        if self.family == "gpt2":
            hidden = self.drop(self.wte(ids) + self.wpe(position_ids))
            return {"hidden_states": hidden, "position_ids": position_ids}
        hidden = self.embed_tokens(ids)
        cos, sin = self.rotary_emb(hidden, position_ids=position_ids)
        value = {"hidden_states": hidden, "position_ids": position_ids, "cos": cos, "sin": sin}
        return hf_moe.start_sums(value, self.config, hidden) if hf_moe.trains_router_loss(self.config) else value


class DecoderLayer(_Layer):
    """One decoder layer, attention causal through ``scaled_dot_product_attention(is_causal=True)``."""

    def __init__(self, family: str, layer: nn.Module, config: Any, initialiser: _Initialiser) -> None:
        super().__init__(initialiser)
        self.family = family
        self.layer = layer
        self.config = config

    def tensor_parallel_plan(self, parts: int) -> dict[str, Any]:
        """Llama-style layers Megatron-style: q, k, v and the MLP's gate and up projections
        column-parallel (whole heads and FFN units per rank; the attention reshapes to -1 heads, so it
        runs on its share unchanged), the output and down projections row-parallel; norms replicated.
        GPT-2 the same way through its Conv1D projections: c_attn's columns [q | k | v] put in rank
        order and split, the attention told it holds 1/T of the heads, c_fc split by columns, both
        c_proj by rows."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        check_tensor_parallel(self.family, self.config, parts)
        if self.family == "gpt2":
            from executor.parallel.tp_styles import Conv1DColwise, Conv1DRowwise, features_in_rank_order

            attn = self.layer.attn
            features_in_rank_order(attn.c_attn, [attn.embed_dim] * 3, parts, weight_dim=1)
            attn.split_size, attn.num_heads = attn.embed_dim // parts, attn.num_heads // parts
            column, row = Conv1DColwise(), Conv1DRowwise()
            return {"layer.attn.c_attn": column, "layer.attn.c_proj": row, "layer.mlp.c_fc": column,
                    "layer.mlp.c_proj": row}
        column, row = ColwiseParallel(), RowwiseParallel()
        return {"layer.self_attn.q_proj": column, "layer.self_attn.k_proj": column, "layer.self_attn.v_proj": column,
                "layer.self_attn.o_proj": row, "layer.mlp.gate_proj": column, "layer.mlp.up_proj": column,
                "layer.mlp.down_proj": row}

    def forward(self, value: dict[str, Any]) -> dict[str, Any]:
        hidden, position_ids = value["hidden_states"], value["position_ids"]
        mask = None  # sdpa without padding: causal attention through is_causal, as the model runs it
        if self.family == "gpt2":
            out = self.layer(hidden, None, mask, position_ids=position_ids)
        else:
            def call() -> Any:
                return self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                                  position_embeddings=(value["cos"], value["sin"]))

            if hf_moe.COUNTS in value:
                out, sums = hf_moe.run_layer(self.layer, call, value, self.config)
                value = {**value, **sums}
            else:
                out = call()
        hidden = out[0] if isinstance(out, tuple) else out
        return {**value, "hidden_states": hidden}


class Head(_Layer):
    """The final norm and the head over the vocabulary, one layer as the built-in transformer's head."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, initialiser: _Initialiser, config: Any = None) -> None:
        super().__init__(initialiser)
        self.norm = norm
        self.lm_head = lm_head
        self.config = config

    def forward(self, value: dict[str, Any]) -> torch.Tensor:
        logits = self.lm_head(self.norm(value["hidden_states"]))
        return hf_moe.attach_router_loss(logits, value, self.config) if hf_moe.COUNTS in value else logits


def check_tensor_parallel(family: str, config: Any, parts: int) -> None:
    """What splitting a decoder layer over ``parts`` ranks needs; one line each."""
    if config.model_type in hf_moe.MOE_TYPES:
        raise GpipeInputError(f"--tensor-parallel {parts} with hf:{config.model_type}: its experts are 3-D tensors "
                              "the tensor-parallel styles do not split yet; use --tensor-parallel 1")
    if family == "gpt2":
        sizes = {"n_head": config.n_head, "n_inner": config.n_inner or 4 * config.n_embd}
        dropout = ("attn_pdrop", config.attn_pdrop)
    else:
        sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
                 "intermediate_size": config.intermediate_size}
        dropout = ("attention_dropout", getattr(config, "attention_dropout", 0.0))
    for field, value in sizes.items():
        if value % parts:
            raise GpipeInputError(f"--tensor-parallel {parts} does not divide {field}={value}: each rank holds whole "
                                  f"heads and FFN units; use a T that divides {', '.join(map(str, sizes.values()))}")
    if dropout[1]:
        raise GpipeInputError(f"--tensor-parallel {parts} with {dropout[0]}={dropout[1]}: the split heads would draw "
                              f"other masks than one process; set {dropout[0]}=0")


def build(name: str, options: dict[str, Any]) -> nn.Sequential:
    """The pipeline layers of the model (call under ``torch.device("meta")`` to allocate nothing)."""
    transformers = transformers_module()
    config = config_of(name, options)
    family = FAMILIES[config.model_type]
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # sizes the config accepts but the model cannot be built with
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1].strip()
        raise GpipeInputError(f"{name!r} cannot be built from its config ({type(exc).__name__}: {reason}); "
                              "check the --option sizes") from None
    initialiser = _Initialiser(model)
    decoder = model.transformer.h if family == "gpt2" else model.model.layers
    norm = model.transformer.ln_f if family == "gpt2" else model.model.norm
    return nn.Sequential(Embedding(family, model, initialiser),
                         *[DecoderLayer(family, layer, config, initialiser) for layer in decoder],
                         Head(norm, model.lm_head, initialiser, config))


def checkpoint_names(name: str, options: dict[str, Any]) -> Callable[[str], str]:
    """Our state-dict names -> the model's (``1.layer.mlp.up_proj.weight`` -> ``model.layers.0.mlp...``)."""
    config = config_of(name, options)
    family = FAMILIES[config.model_type]
    layers = config.num_hidden_layers if family != "gpt2" else config.n_layer
    base = "transformer" if family == "gpt2" else "model"
    prefixes = {"0.": f"{base}.", f"{layers + 1}.norm.": f"{base}.{'ln_f' if family == 'gpt2' else 'norm'}.",
                f"{layers + 1}.lm_head.": "lm_head."}
    prefixes.update({f"{i + 1}.layer.": f"{base}.{'h' if family == 'gpt2' else 'layers'}.{i}." for i in range(layers)})

    def rename(ours: str) -> str:
        for prefix, theirs in prefixes.items():
            if ours.startswith(prefix):
                return theirs + ours[len(prefix):]
        return ours

    return rename


def example_batch(name: str, options: dict[str, Any], rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (rows, seq) and next-token targets, the last position ignored (-100)."""
    config = config_of(name, options)
    seq = int(options.get("seq", OUR_OPTIONS["seq"]))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (rows, seq), generator=generator)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    return ids, targets
