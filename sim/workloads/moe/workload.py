"""A mixture-of-experts decoder as a workload: its layers (:mod:`sim.workloads.moe.layers`), its total and
active parameters, and the model FLOPs per token that MFU counts.

Built from a config's fields (:mod:`sim.workloads.moe.config`) for a named model
(``--model deepseek-v3``) or a Hugging Face type (``--model hf:mixtral``). ``describe()`` names the
model and the options it was given, as a plan file records them, with the priced options as
``shape`` (as :class:`sim.workloads.decoder_shape.ShapedWorkload` does).

Active parameters are those one token's forward uses: every dense weight, the router, the shared
experts and top-k routed experts of each MoE layer, and the head; not the input embedding (a
gather, no matmul). Model FLOPs per token (for MFU and model TFLOP/s) are PaLM's 6N + attention
(:mod:`sim.planner.training_cost`) with N the active matmul parameters, multi-token prediction
modules included (they run every step); the attention term counts each layer's scores and values
at their own widths (MLA: qk and v per head). Published parameter counts leave the MTP modules out
(DeepSeek-V3's 671B), so :meth:`MoEWorkload.parameter_counts` gives them apart.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from sim.catalog.hardware import Device, Link
from sim.workloads.layer_spec import LayerSpec
from sim.workloads.moe.expert_parallel import ExpertSplit, remote_domains_per_token
from sim.workloads.moe.latent_attention import is_latent, qk_head_dim
from sim.workloads.models import AnalyticWorkload
from sim.workloads.moe.layers import (assignments_per_token, expected_max_load, expert_parameters, moe_layer_set,
                                      moe_transformer_layers)
from sim.workloads.moe.options import resolve_moe_options

# A MoE layer's fixed time per forward (twice per backward) beside its kernels' work, where the trainer
# launches its kernels from the host (no CUDA graphs): the router's and the token permutation's many small
# kernels, and the host waiting on the device for the routed token counts its grouped matmuls are sized
# by (Megatron-Core's dropless dispatchers). Fitted on the development set's three mixtures of experts
# (DeepSeek-V3 on H100, Llama 4 Maverick on GB200, Qwen3-30B-A3B on H100, none graphed; benchmarks/README.md).
MOE_LAYER_FIXED_S = 0.0013
from sim.workloads.precision import FP32_BYTES, precision_of
from sim.workloads.workload import LayerCost

MOE_SPECS = ("moe_block", "mtp")  # the layers whose MLP is the mixture


class MoEWorkload(AnalyticWorkload):
    """A MoE decoder ``name`` with ``given`` options (config fields, ``seq``), priced by ``priced``."""

    def __init__(self, name: str, given: dict[str, Any], priced: dict[str, Any], assumed: list[str] | None = None,
                 planned_from: str | None = None) -> None:
        options = resolve_moe_options(priced, name)
        super().__init__(name, options, moe_transformer_layers(options))
        self.given = dict(given)
        self.is_transformer = True
        self.has_attention_core = True
        self.planned_from = planned_from or name
        self.assumed = list(assumed or [])
        self.shape_line = shape_line(name, options)
        self.has_experts = True
        self.experts_split: ExpertSplit | None = None  # expert parallelism (sim.workloads.moe.expert_parallel)

    @property
    def parameter_count(self) -> int:
        return self.parameter_counts()["total"]

    def parameter_counts(self) -> dict[str, int]:
        """Parameters of the whole model (one device's share is ``layers``): ``total`` (the MTP modules
        included), ``main`` (without them, as published), ``active`` (one token's, without the MTP
        modules and the input embedding, as published), ``embedding`` and ``mtp``."""
        o = self.options
        layers = moe_transformer_layers(o)
        tied = o["vocab"] * o["d_model"] if o.get("tied") else 0
        total = sum(spec.params for spec in layers) - tied
        mtp = sum(spec.params for spec in layers if spec.name == "mtp")
        embedding = layers[0].params
        E, k, f, d = o["experts"], o["top_k"], o["expert_ff"], o["d_model"]
        idle_per_layer = (E - k) * (3 * d * f + o["expert_biases"] * (2 * f + d))  # routed experts a token skips
        idle = idle_per_layer * len(moe_layer_set(o))
        active = total - mtp - idle - embedding + tied
        return {"total": total, "main": total - mtp, "active": active, "embedding": embedding, "mtp": mtp}

    def model_flops_per_token(self) -> float:
        """PaLM's 6N + 6 x (scores and values per token) over all layers, N the active matmul parameters
        with the MTP modules' (see the module docstring)."""
        o = self.options
        counts = self.parameter_counts()
        E, k, f, d = o["experts"], o["top_k"], o["expert_ff"], o["d_model"]
        mtp_active = counts["mtp"] - int(o.get("mtp_layers", 0)) * (E - k) * 3 * d * f
        h, s = o["heads"], o["seq"]
        if is_latent(o):
            width = h * (qk_head_dim(o) + o["v_head_dim"])
        else:
            width = 2 * h * (o.get("head_dim") or d // h)
        attention = 6.0 * s * width * (o["layers"] + int(o.get("mtp_layers", 0)))
        return 6.0 * (counts["active"] + mtp_active) + attention

    def expected_max_load(self, tokens: int) -> float:
        """The most loaded expert's assignments over the mean for ``tokens`` routed tokens."""
        o = self.options
        return expected_max_load(tokens, o["experts"], o["top_k"], o["expert_imbalance"])

    def rank_load(self, tokens: float) -> float:
        """The most loaded expert rank's assignments over the mean, each of E ranks routing ``tokens``: the
        balls-into-bins estimate (or ``expert_imbalance``) dropless; 1 with a capacity factor, every expert
        then computing exactly its capacity (tokens above it dropped, those below it padded, as Megatron-Core
        runs ``moe_expert_capacity_factor`` with ``moe_pad_expert_input_to_capacity``), which the assignments
        per token (capacity factor x top-k) already count; 1 without expert parallelism."""
        ep = self.experts_split
        o = self.options
        if ep is None or ep.expert_parallel < 2 or o.get("capacity_factor"):
            return 1.0
        return expected_max_load(round(tokens * ep.expert_parallel), ep.expert_parallel, o["top_k"],
                                 o["expert_imbalance"])

    def split_over(self, tensor_parallel: int, sequence_parallel: bool, tp_link: Link | None,
                   context_parallel: int = 1, cp_link: Link | None = None,
                   cp_ranks_per_node: int | None = None) -> "MoEWorkload":
        """As :meth:`sim.workloads.models.AnalyticWorkload.split_over`, the MoE blocks split too."""
        split = copy.copy(self)
        split.tensor_parallel, split.sequence_parallel = tensor_parallel, sequence_parallel
        split.tp_link, split.context_parallel = tp_link, context_parallel
        split.cp_link = cp_link
        split.cp_ranks_per_node = context_parallel if cp_ranks_per_node is None else cp_ranks_per_node
        split.layers = split._split_layers()
        return split

    def _split_layers(self) -> tuple[LayerSpec, ...]:
        ep = self.experts_split
        return tuple(moe_transformer_layers(self.options, self.tensor_parallel, self.sequence_parallel,
                                            self.context_parallel, ep.expert_parallel if ep else 1,
                                            ep.expert_tensor_parallel if ep else None))

    @property
    def expert_parallel(self) -> int:
        """E: the ranks each MoE layer's routed experts are split over (1 without expert parallelism)."""
        return self.experts_split.expert_parallel if self.experts_split else 1

    def split_experts(self, split: ExpertSplit) -> "MoEWorkload":
        """This workload (split over T x C already) with its experts split as ``split`` says
        (:func:`sim.workloads.moe.expert_parallel.with_expert_parallel`)."""
        out = copy.copy(self)
        out.experts_split = split
        out.layers = out._split_layers()
        return out

    def expert_tokens_per_row(self) -> float:
        """Tokens one rank routes per row of a micro-batch: its s / C of the sequence, / T under tensor
        parallelism (sequence-parallel, as Megatron-Core runs MoE with T > 1)."""
        return self.options["seq"] / self.context_parallel / self.tensor_parallel

    def _cost(self, spec: LayerSpec, rows: int, flops_s: float, bytes_s: float, device: Device) -> LayerCost:
        ep = self.experts_split
        if ep is None or spec.name not in MOE_SPECS:
            return super()._cost(spec, rows, flops_s, bytes_s, device)
        o = self.options
        tokens = rows * self.expert_tokens_per_row()
        load = self.rank_load(tokens)
        grouped = spec.grouped_matmul_flops_per_row
        spec = dataclasses.replace(spec, flops_per_row=spec.flops_per_row + (load - 1) * grouped,
                                   grouped_matmul_flops_per_row=load * grouped)
        cost = super()._cost(spec, rows, flops_s, bytes_s, device)
        token_bytes = o["d_model"] * precision_of(self.precision).compute_bytes
        payload = tokens * assignments_per_token(o) * token_bytes
        across = None
        if o.get("dispatcher", "alltoall") != "alltoall":  # one copy per destination domain (DeepEP, HybridEP)
            copies = assignments_per_token(o) / o["top_k"]  # padded to capacity: as many more copies
            domains = remote_domains_per_token(o["experts"], o["top_k"], ep.domains, o["expert_groups"],
                                               o["routed_groups"])
            across = tokens * token_bytes * copies * domains
        exchange_s = 2 * ep.exchange_s(payload, across)  # dispatch and combine
        forward_s, backward_s = ep.exposed_s(exchange_s, exchange_s, cost.forward_s, cost.backward_s)
        experts = expert_parameters(o, self.tensor_parallel, ep.expert_parallel, ep.expert_tensor_parallel)
        fixed_s = 0.0 if o.get("cuda_graphs") else MOE_LAYER_FIXED_S  # the constant's comment
        return dataclasses.replace(cost, forward_s=cost.forward_s + forward_s + fixed_s,
                                   backward_s=cost.backward_s + backward_s + 2 * fixed_s,
                                   recompute_s=cost.recompute_s + forward_s + fixed_s, ep_forward_s=forward_s,
                                   ep_backward_s=backward_s, expert_grad_bytes=experts * FP32_BYTES)

    def describe(self) -> dict:
        counts = self.parameter_counts()
        return {"name": self.name, "options": dict(self.given), "num_layers": self.num_layers,
                "parameter_count": counts["total"], "active_parameter_count": counts["active"],
                "model_flops_per_token": self.model_flops_per_token(), "shape": dict(self.options)}


def shape_line(name: str, o: dict[str, Any]) -> str:
    """One line saying how ``name`` is priced."""
    moe = len(moe_layer_set(o))
    shared = f" + a shared MLP of {o['shared_ff']}" if o.get("shared_ff") else ""
    attention = (f"latent attention (q rank {o['q_lora_rank']}, kv rank {o['kv_lora_rank']}, heads of "
                 f"{qk_head_dim(o)}/{o['v_head_dim']})" if is_latent(o) else
                 f"{o['heads']} heads, {o.get('kv_heads') or o['heads']} key/value heads")
    mtp = f", {o['mtp_layers']} multi-token prediction module(s)" if o.get("mtp_layers") else ""
    capacity = f"capacity factor {o['capacity_factor']}" if o.get("capacity_factor") else "dropless"
    return (f"{name} priced as a mixture of experts: {o['layers']} layers ({moe} MoE, {o['layers'] - moe} dense of "
            f"ff {o['ff']}), d_model {o['d_model']}, {o['experts']} experts of {o['expert_ff']} top-{o['top_k']}"
            f"{shared}, {capacity}, {attention}, vocab {o['vocab']}{mtp}; {o['attention']} attention")


def builtin_workload(name: str, options: dict[str, Any] | None = None) -> AnalyticWorkload:
    """:func:`sim.workloads.models.get_workload`, the built-in transformer with ``experts`` > 0 priced as
    a MoE workload (:mod:`sim.workloads.moe.builtin`): every layer MoE, gated experts with biases."""
    from sim.workloads.model_options import resolve_options
    from sim.workloads.models import get_workload
    from sim.workloads.moe.builtin import check_moe_options, is_moe, priced_moe_options

    given = dict(options or {})
    moe = check_moe_options(given) if name == "transformer" else {}
    if not is_moe(moe):
        return get_workload(name, given)  # type: ignore[return-value]
    merged = resolve_options(name, {k: v for k, v in given.items() if k not in moe})
    return MoEWorkload(name, given, priced_moe_options({**merged, **moe}))


def named_moe_workload(name: str, options: dict[str, Any]) -> MoEWorkload:
    """Named MoE model ``name`` (:mod:`sim.workloads.named_models`) with ``options``: config fields, ``seq``,
    the analysis' (``precision``, ``optimizer_slots``, ``attention``, ``compile``) and the MoE pricing's
    (``capacity_factor``, ``expert_imbalance``); one line for anything else."""
    from sim.errors import GpipeInputError
    from sim.workloads.moe.config import assumed_lines, moe_options
    from sim.workloads.moe.options import MOE_KNOBS
    from sim.workloads.named_models import ANALYSIS_KEYS, config_of, named_models

    config = config_of(name)
    ours = ("seq", *ANALYSIS_KEYS, *MOE_KNOBS)
    unknown = sorted(set(options) - set(config) - set(ours))
    if unknown:
        raise GpipeInputError(f"--model {name}: {', '.join(unknown)} is not a field of its config; give one of "
                              f"{', '.join(sorted(k for k in config if isinstance(config[k], int)))}, seq, "
                              f"{', '.join(MOE_KNOBS)}")
    config.update({k: v for k, v in options.items() if k not in ours})
    priced = moe_options(config, int(options.get("seq", named_models()[name].seq)), name)
    priced.update({k: options[k] for k in (*ANALYSIS_KEYS, *MOE_KNOBS) if k in options})
    return MoEWorkload(name, options, priced, assumed_lines(config), planned_from=name)


def hf_moe_workload(name: str, options: dict[str, Any], config: dict[str, Any]) -> MoEWorkload:
    """A Hugging Face MoE model (``hf:mixtral``) from its ``transformers`` config's fields ``config``
    (``to_dict()``), with ``options`` as given (config fields, ``seq``, the analysis' and the MoE
    pricing's)."""
    from sim.workloads.decoder_shape import ANALYSIS_KEYS, HF_OPTIONS
    from sim.workloads.moe.config import assumed_lines, moe_options
    from sim.workloads.moe.options import MOE_KNOBS

    priced = moe_options(config, int(options.get("seq", HF_OPTIONS["seq"])), name)
    priced["attention"] = options.get("attention", HF_OPTIONS["attention"])
    priced.update({k: options[k] for k in (*ANALYSIS_KEYS, *MOE_KNOBS) if k in options})
    return MoEWorkload(name, options, priced, assumed_lines(config), planned_from=name)
