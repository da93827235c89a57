"""The built-in transformer's mixture-of-experts options, shared by ``gpipe simulate`` and ``gpipe train``.

``experts`` (0: the dense MLP, the default), ``top_k`` (experts each token is routed to),
``shared_experts`` (experts every token goes through, one MLP of ``shared_experts x expert_ff`` as
DeepSeek runs them), ``expert_ff`` (each expert's width; 0: ``ff``) and ``aux_loss_coef`` (the
load-balancing loss's weight, 0.01 by default). They are absent from a model's options unless given,
so a dense transformer's options, plans and reports are as they were.

With ``experts`` > 0 every block's MLP is the mixture: the simulator prices it with
:class:`sim.workloads.moe.workload.MoEWorkload` (the routed experts gated as its pricing assumes,
with the built-in MLP's biases), the executor trains :mod:`executor.models.moe`. Torch-free.
"""

from __future__ import annotations

from typing import Any

from sim.errors import GpipeInputError
from sim.workloads.decoder_features import BIASES

MOE_OPTION_DEFAULTS: dict[str, Any] = {"experts": 0, "top_k": 0, "shared_experts": 0, "expert_ff": 0,
                                       "aux_loss_coef": 0.01}


def _integer(key: str, value: Any) -> int:
    number = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise GpipeInputError(f"{key}={value!r} for model transformer; use a non-negative integer")
    return number


def check_moe_options(options: dict[str, Any]) -> dict[str, Any]:
    """The MoE options among ``options`` converted and checked together (one line for anything wrong);
    the others are left out. Empty when none is given."""
    given = {k: v for k, v in options.items() if k in MOE_OPTION_DEFAULTS}
    checked: dict[str, Any] = {}
    for key, value in given.items():
        if key == "aux_loss_coef":
            try:
                coef = float(value)
            except (TypeError, ValueError):
                coef = -1.0
            if isinstance(value, bool) or coef < 0:
                raise GpipeInputError(f"aux_loss_coef={value!r} for model transformer; use a number from 0 up")
            checked[key] = coef
        else:
            checked[key] = _integer(key, value)
    experts, top_k = checked.get("experts", 0), checked.get("top_k", 0)
    if not experts:
        extra = sorted(k for k in checked if k != "experts" and checked[k] != MOE_OPTION_DEFAULTS[k])
        if extra:
            raise GpipeInputError(f"{', '.join(extra)} given without experts for model transformer; set experts "
                                  "(routed experts per block, e.g. experts=4 top_k=2) or drop them")
        return checked
    if not top_k:
        raise GpipeInputError(f"experts={experts} without top_k for model transformer; set top_k, the experts "
                              f"each token is routed to (1 to {experts})")
    if top_k > experts:
        raise GpipeInputError(f"top_k={top_k} is above experts={experts} for model transformer; each token is "
                              f"routed to at most every expert: choose top_k from 1 to {experts}")
    return checked


def is_moe(options: dict[str, Any]) -> bool:
    return bool(options.get("experts"))


def priced_moe_options(options: dict[str, Any]) -> dict[str, Any]:
    """The MoE workload's options (:mod:`sim.workloads.moe.options`) for the built-in transformer's
    ``options`` (the dense ones resolved, the MoE ones checked, ``experts`` > 0): every layer a MoE
    layer, gated experts with biases, the shared MLP's biases its own (a non-gated ``activation``'s experts
    are priced as gated ones: the MoE pricing knows gated experts only)."""
    dense = {k: v for k, v in options.items() if k not in MOE_OPTION_DEFAULTS}
    expert_ff = options.get("expert_ff") or dense["ff"]
    # the block's MLP output bias belongs to the experts and the shared MLP (expert_biases), not the block
    biases = [b for b in str(dense.get("biases", ",".join(BIASES))).split(",") if b in BIASES and b != "fc2"]
    dense["biases"] = ",".join(biases) or "none"
    moe = {"experts": options["experts"], "top_k": options["top_k"], "expert_ff": expert_ff,
           "shared_ff": options.get("shared_experts", 0) * expert_ff,
           "moe_layers": ",".join(str(i) for i in range(dense["layers"])), "expert_biases": True}
    return {**dense, **moe}
