"""The torch models the executor trains: built-ins ``mlp``, ``transformer``, ``cnn`` and user factories.

Every builder returns an ``nn.Sequential`` whose top-level children are the pipeline's layers (the
partition counts them). :func:`build_model` is the model a user would train without a pipeline: the
builder called once after ``torch.manual_seed(seed)``; where a run's stages take their first values
from is :mod:`executor.models.initial_weights`. The layer lists mirror the simulator's analytic models
(``sim.workloads.transformer``, ``sim.workloads.mlp_and_cnn``) and read their defaults from :mod:`sim.workloads.model_defaults`.

A user model is named ``package.module:function``; the function is called with the model options as
keyword arguments (none by default) and must return an ``nn.Sequential``. Its data comes from
``example_batch(batch_size)`` in the same module, or from ``--data package.module:function``
(see :mod:`executor.runtime.data`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from executor.models import hf, hf_moe
from executor.models.materialize import build_meta
from executor.models.moe import MixtureOfExperts
from executor.runtime.selective import AttentionCore, attention_core, recomputing_attention_core
from sim.errors import GpipeInputError, did_you_mean
from sim.formats.plan import ModelRef
from sim.workloads import model_options
from sim.workloads.model_defaults import DEFAULT_OPTIONS
from sim.workloads.moe.builtin import MOE_OPTION_DEFAULTS, check_moe_options

BUILTIN_MODELS = ("mlp", "transformer", "cnn")
DEFAULT_LOSS = {"mlp": "mse", "transformer": "cross_entropy", "cnn": "cross_entropy"}
LOSSES = ("mse", "cross_entropy")


def is_builtin(name: str) -> bool:
    return name in BUILTIN_MODELS


def resolve_options(name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A built-in model's defaults overlaid with ``options``; user models get ``options`` as given."""
    if hf.is_hf(name):
        hf.config_of(name, dict(options or {}))  # an unknown type or option fails here, in one line
        return dict(options or {})
    if not is_builtin(name):
        if ":" not in name:
            from sim.workloads.named_models import named_models

            known = [*BUILTIN_MODELS, *named_models()]
            raise GpipeInputError(f"unknown model {name!r}{did_you_mean(name, known)}; choose one of "
                                  f"{', '.join(known)} or name a factory as package.module:function")
        return dict(options or {})
    given = dict(options or {})
    moe = check_moe_options(given) if name == "transformer" else {}  # absent unless given (sim.workloads.moe.builtin)
    merged: dict[str, Any] = dict(DEFAULT_OPTIONS[name])
    for key, value in given.items():
        if key in moe:
            continue
        if key not in merged:
            raise GpipeInputError(f"model {name!r} has no option {key!r}; its options are "
                                  f"{', '.join(merged)}")
        try:
            merged[key] = type(merged[key])(value)
        except (TypeError, ValueError):
            raise GpipeInputError(f"model option {key}={value!r} is not a "
                                  f"{type(merged[key]).__name__}") from None
    # every value checked as gpipe simulate checks it (a positive width, heads dividing d_model, ...),
    # in one line here rather than as torch's error from inside the build
    checked = model_options.resolve_options(name, merged)
    return {**{key: checked[key] for key in merged}, **moe}


# ----------------------------------------------------------------------------- transformer pieces


class Embedding(nn.Module):
    """Token plus learned position embeddings: ids (rows, seq) -> (rows, seq, d_model)."""

    def __init__(self, vocab: int, seq: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.token(ids) + self.position(positions))


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention; with ``kv_heads`` < ``heads``, grouped-query attention (each
    key/value head serves heads / kv_heads query heads, repeated to them before the matmuls).
    ``attention`` eager materialises the scores; flash runs ``scaled_dot_product_attention``
    (causal), whose kernels keep no (heads, seq, seq) tensor."""

    def __init__(self, d_model: int, heads: int, dropout: float, kv_heads: int = 0, attention: str = "eager") -> None:
        super().__init__()
        if attention == "fused":
            raise GpipeInputError("attention=fused is Megatron-LM's fused softmax kernel, a planning option: the "
                                  "executor trains attention=eager (the same arithmetic) or attention=flash")
        if attention not in ("eager", "flash"):
            raise GpipeInputError(f"attention={attention!r}; choose one of eager, flash")
        self.flash = attention == "flash"
        if d_model % heads:
            raise GpipeInputError(f"d_model={d_model} is not divisible by heads={heads}; "
                                  "pick heads that divide d_model")
        kv_heads = kv_heads or heads
        if heads % kv_heads:
            raise GpipeInputError(f"kv_heads={kv_heads} does not divide heads={heads}; choose a divisor of heads "
                                  "(0: one per head)")
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = d_model // heads
        self.kv_width = kv_heads * self.head_dim
        self.qkv = nn.Linear(d_model, d_model + 2 * self.kv_width)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def split_heads(self, parts: int) -> None:
        """Hold 1/``parts`` of the heads and key/value heads: this module's share under tensor
        parallelism, whose QKV rows are in rank order (:mod:`executor.parallel.tensor_parallel`)."""
        self.heads, self.kv_heads, self.kv_width = self.heads // parts, self.kv_heads // parts, self.kv_width // parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, seq, _ = x.shape
        head_dim, q_width = self.head_dim, self.heads * self.head_dim
        q, k, v = self.qkv(x).split([q_width, self.kv_width, self.kv_width], dim=2)
        # (rows, heads, seq, head_dim)
        q = q.view(rows, seq, self.heads, head_dim).transpose(1, 2)
        k, v = (t.view(rows, seq, self.kv_heads, head_dim).transpose(1, 2) for t in (k, v))
        groups = self.heads // self.kv_heads
        if self.flash:  # a fused kernel: no (heads, seq, seq) tensor kept, nothing for selective to drop
            if groups > 1:
                k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif recomputing_attention_core():  # --checkpoint selective: keep q, k, v only (executor.runtime.selective)
            out = AttentionCore.apply(q, k, v, groups)
        else:
            out = attention_core(q, k, v, groups)
        return self.drop(self.proj(out.transpose(1, 2).reshape(rows, seq, q_width)))


class SquaredReLU(nn.Module):
    """relu(x)^2, Nemotron-4's MLP activation (So et al. 2021, "Primer")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(torch.relu(x))


class SwiGLU(nn.Module):
    """The gated MLP's activation (Shazeer 2020, as Llama runs it): silu of one half times the other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = x.chunk(2, dim=-1)
        return F.silu(gate) * value


ACTIVATION_MODULES = {"gelu": nn.GELU, "squared_relu": SquaredReLU, "swiglu": SwiGLU}
GATED = {"swiglu"}  # activations that take fc1's 2 x ff outputs


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(LN(x)); x + MLP(LN(x)). With ``moe`` (the options
    ``experts`` > 0, ``top_k``, ``shared_experts``, ``expert_ff``, ``aux_loss_coef``) the MLP is a
    mixture of such MLPs (:mod:`executor.models.moe`)."""

    def __init__(self, d_model: int, ff: int, heads: int, dropout: float, kv_heads: int = 0,
                 activation: str = "gelu", attention: str = "eager", moe: dict[str, Any] | None = None) -> None:
        super().__init__()
        if activation not in ACTIVATION_MODULES:
            raise GpipeInputError(f"activation={activation!r}; choose one of {', '.join(ACTIVATION_MODULES)}")
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, dropout, kv_heads, attention)
        self.ln2 = nn.LayerNorm(d_model)

        def make_mlp(ff: int) -> nn.Sequential:
            width = 2 * ff if activation in GATED else ff
            return nn.Sequential(nn.Linear(d_model, width), ACTIVATION_MODULES[activation](), nn.Linear(ff, d_model),
                                 nn.Dropout(dropout))

        if moe and moe.get("experts"):
            o = {**MOE_OPTION_DEFAULTS, **moe}
            self.mlp: nn.Module = MixtureOfExperts(d_model, o["experts"], o["top_k"], o["expert_ff"] or ff,
                                                   o["shared_experts"], make_mlp, o["aux_loss_coef"])
        else:
            self.mlp = make_mlp(ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """LayerNorm then the vocabulary projection: (rows, seq, d_model) -> logits (rows, seq, vocab)."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


# ----------------------------------------------------------------------------- builders


def _mlp(o: dict[str, Any]) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(o["width"], o["width"]), nn.ReLU())
                           for _ in range(o["layers"])])


def _transformer(o: dict[str, Any]) -> nn.Sequential:
    moe = {k: o[k] for k in MOE_OPTION_DEFAULTS if k in o}
    blocks = [Block(o["d_model"], o["ff"], o["heads"], o["dropout"], o["kv_heads"], o["activation"], o["attention"],
                    moe) for _ in range(o["layers"])]
    return nn.Sequential(Embedding(o["vocab"], o["seq"], o["d_model"], o["dropout"]), *blocks,
                         Head(o["d_model"], o["vocab"]))


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


def _cnn(o: dict[str, Any]) -> nn.Sequential:
    c = o["channels"]
    body = [_conv_bn_relu(c, c) for _ in range(o["layers"])]
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, o["classes"]))
    return nn.Sequential(_conv_bn_relu(3, c), *body, head)


_BUILDERS: dict[str, Callable[[dict[str, Any]], nn.Sequential]] = {
    "mlp": _mlp, "transformer": _transformer, "cnn": _cnn,
}


def load_object(spec: str, what: str) -> Any:
    """Import ``package.module:attribute`` with a one-line error naming what failed."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise GpipeInputError(f"bad {what} {spec!r}; expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise GpipeInputError(f"cannot import {module_name!r} for {what} {spec!r} ({exc}); "
                              "check the name and PYTHONPATH") from None
    if not hasattr(module, attr):
        raise GpipeInputError(f"{module_name!r} has no {attr!r} for {what} {spec!r}")
    return getattr(module, attr)


def _builder(name: str, options: dict[str, Any] | None) -> Callable[[], nn.Sequential]:
    """The call that builds the model (a user factory is imported here, one line if it cannot be)."""
    opts = resolve_options(name, options)
    if hf.is_hf(name):
        return lambda: hf.build(name, opts)
    if is_builtin(name):
        return lambda: _BUILDERS[name](opts)
    factory = load_object(name, "model factory")

    def build() -> nn.Sequential:
        model = factory(**opts)
        if not isinstance(model, nn.Sequential):
            raise GpipeInputError(f"model factory {name!r} returned {type(model).__name__}; "
                                  "it must return an nn.Sequential whose children are the pipeline layers")
        return model

    return build


def build_meta_model(name: str, options: dict[str, Any] | None = None) -> nn.Sequential:
    """The model's structure on the meta device (no storage)."""
    return build_meta(_builder(name, options))


def checkpoint_names(name: str, options: dict[str, Any] | None = None) -> Callable[[str], str] | None:
    """How the model's state-dict names map to a saved checkpoint's (None: the same names)."""
    if hf.is_hf(name):
        return hf.checkpoint_names(name, dict(options or {}))
    return None


def build_model(name: str, options: dict[str, Any] | None = None, seed: int = 0) -> nn.Sequential:
    """The whole model as the user builds it: ``torch.manual_seed(seed)``, then the factory (the
    caller's random state is left as it was). What ``--init factory`` runs start from."""
    build = _builder(name, options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def example_batch(name: str, options: dict[str, Any] | None, rows: int,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic (inputs, targets) mini-batch of ``rows`` samples, a pure function of ``seed``."""
    opts = resolve_options(name, options)
    if hf.is_hf(name):
        return hf.example_batch(name, opts, rows, seed)
    if not is_builtin(name):
        module_name = name.partition(":")[0]
        fn = load_object(f"{module_name}:example_batch", "example data")
        torch.manual_seed(seed)
        return fn(rows)
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        w = opts["width"]
        return torch.randn(rows, w, generator=gen), torch.randn(rows, w, generator=gen)
    if name == "transformer":
        shape = (rows, opts["seq"])
        return (torch.randint(0, opts["vocab"], shape, generator=gen),
                torch.randint(0, opts["vocab"], shape, generator=gen))
    size = opts["image"]
    return (torch.randn(rows, 3, size, size, generator=gen),
            torch.randint(0, opts["classes"], (rows,), generator=gen))


def default_loss(name: str) -> str:
    """The loss a built-in model trains with; ``mse`` for user models unless ``--loss`` says else."""
    return "cross_entropy" if hf.is_hf(name) else DEFAULT_LOSS.get(name, "mse")


def has_router_loss(name: str, options: dict[str, Any] | None = None) -> bool:
    """The model has routers whose load-balancing loss it trains (:mod:`executor.models.moe_aux_loss`):
    the built-in transformer with experts, a Hugging Face MoE config with ``output_router_logits``."""
    if hf.is_hf(name):
        return hf_moe.trains_router_loss(hf.config_of(name, dict(options or {})))
    return name == "transformer" and bool((options or {}).get("experts"))


def check_loss(loss: str) -> str:
    if loss not in LOSSES:
        raise GpipeInputError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    return loss


def loss_function(loss: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean loss of one (micro-)batch; cross entropy flattens (rows, seq, classes) logits."""
    check_loss(loss)
    if loss == "mse":
        return F.mse_loss

    def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    return cross_entropy


def model_ref(name: str, options: dict[str, Any] | None = None, seed: int = 0) -> ModelRef:
    """The plan's description of a model: resolved options, pipeline layers and parameter count."""
    opts = resolve_options(name, options)
    model = build_meta_model(name, opts)
    params = sum(p.numel() for p in model.parameters())
    return ModelRef(name=name, options=opts, num_layers=len(model), parameter_count=params)
