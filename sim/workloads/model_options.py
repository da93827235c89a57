"""A built-in model's options: its defaults filled in, every value converted from the command line's strings
and checked, with one line naming the value and the fix for anything invalid.
"""

from __future__ import annotations

from typing import Any

from sim.errors import GpipeInputError
from sim.workloads.decoder_features import FEATURE_DEFAULTS, check_feature
from sim.workloads.model_defaults import ACTIVATIONS, ATTENTIONS, DEFAULT_OPTIONS
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_SLOTS
from sim.workloads.precision import DEFAULT_PRECISION, check_precision, precision_of

# Options every analytic model accepts besides its own (DEFAULT_OPTIONS); uniform takes only the
# optimizer's. optimizer_slots: state tensors per parameter (sim.workloads.optimizers; set by --optimizer).
COMMON_DEFAULTS: dict[str, Any] = {"precision": DEFAULT_PRECISION,
                                   "optimizer_slots": OPTIMIZER_SLOTS[DEFAULT_OPTIMIZER]}


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
