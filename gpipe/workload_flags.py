"""The command line's model: which workload and batch the flags of ``gpipe simulate`` and ``plan`` name.

Part of the composition root (the commands, :mod:`gpipe`): it wires the simulator's
torch-free resolution (:mod:`sim.workloads.resolve`) to calibration's meta-device analysis of torch models
(:mod:`calibrate.measure.meta_profile`), imported only when a ``package.module:factory`` model is asked
for, so built-in models never import torch; and a Hugging Face model (``hf:<type>``) to the reading of
its structure on the meta device (:mod:`executor.models.hf_shape`), which the simulator prices as the
transformer of that shape (:mod:`sim.workloads.decoder_shape`).

With ``--costs FILE`` and no ``--model``, the model, its options and the batch are the file's: the
costs describe exactly one model, so asking for it again would only invite a mismatch. So is the
precision without ``--precision``; without either, the precision is the device's default
(:func:`sim.workloads.precision.choose_precision`).
"""

from __future__ import annotations

import argparse
from typing import Any

from sim.catalog.hardware import Device, Link, System
from sim.errors import GpipeInputError, require_positive
from sim.formats.costs import measured_precision, read_costs
from sim.workloads import resolve
from sim.workloads.decoder_shape import ANALYSES, ANALYSIS_KEYS, HF_OPTIONS, ShapedWorkload
from sim.workloads.model_defaults import DEFAULT_BATCH
from sim.workloads.moe.workload import MoEWorkload, hf_moe_workload
from sim.workloads.precision import choose_precision
from sim.workloads.workload import Workload

DEFAULT_MODEL = "uniform"  # gpipe simulate and plan without --model or --costs


def analyse_torch_model(model: str, options: dict[str, Any]) -> Workload:
    """``model`` (``package.module:factory``) measured on PyTorch's meta device, as its own code runs:
    ``compile`` is priced for the built-in transformer's shape only."""
    if options.get("compile"):
        raise GpipeInputError(f"compile is modelled for the built-in transformer and the models planned by its "
                              f"shape, not {model!r} as measured on the meta device; drop compile")
    try:
        from calibrate.measure.meta_profile import torch_workload
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise GpipeInputError(f"model {model!r} needs torch; install it with pip install torch") from None
    return torch_workload(model, options)


def is_hf(model: str | None) -> bool:
    return bool(model) and model.startswith(("hf:", "hf-config:"))  # type: ignore[union-attr]


def resolve_workload(model: str | None, options: dict[str, Any], costs_path: str | None = None,
                     by_shape: bool = False) -> Workload:
    """:func:`sim.workloads.resolve.resolve_workload` with torch models measured on the meta device and
    Hugging Face models priced as the transformer of their structure's shape
    (:mod:`sim.workloads.decoder_shape`, read by :mod:`executor.models.hf_shape`), unless
    ``--option analysis=meta`` asks for them measured op by op as other torch models are (``by_shape``,
    for tensor or context parallelism, which only the shape splits, overrides that)."""
    if is_hf(model) and costs_path is None:
        analysis = options.get("analysis", HF_OPTIONS["analysis"])
        if analysis not in ANALYSES:
            raise GpipeInputError(f"--option analysis={analysis}: choose shape (the transformer of the model's "
                                  "structure) or meta (measured op by op on the meta device)")
        if analysis == "shape" or by_shape:
            moe = hf_moe_config(model, options)  # type: ignore[arg-type]
            if moe is not None:  # a mixture of experts: priced by its config's fields (sim.workloads.moe.config)
                return hf_moe_workload(model, options, moe)  # type: ignore[arg-type]
            try:
                from executor.models.hf_shape import decoder_shape
            except ModuleNotFoundError as exc:
                if exc.name != "torch":
                    raise
                raise GpipeInputError(f"model {model!r} needs torch; install it with pip install torch") from None
            return ShapedWorkload(model, options, decoder_shape(model, options))  # type: ignore[arg-type]
    return resolve.resolve_workload(model, options, costs_path, analyse_torch_model)


def hf_moe_config(model: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """The ``transformers`` config's fields of ``model`` (``hf:<type>`` or ``hf-config:PATH``) with
    ``options`` when its type is a mixture of experts the MoE shape reads
    (:data:`sim.workloads.moe.config.MOE_TYPES`), else None; one line if the config refuses them."""
    from sim.workloads.moe.config import MOE_TYPES
    from sim.workloads.moe.options import MOE_KNOBS

    try:
        from executor.models.hf import transformers_module, type_and_fields
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise GpipeInputError(f"model {model!r} needs torch; install it with pip install torch") from None
    fields = {k: v for k, v in options.items() if k not in (*HF_OPTIONS, *ANALYSIS_KEYS, *MOE_KNOBS)}
    model_type, data = type_and_fields(model, fields)
    if model_type not in MOE_TYPES:
        return None
    try:
        config = transformers_module().AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # TypeError, ValueError, or the config's own validation error
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1].strip()
        raise GpipeInputError(f"{model!r}: the config refuses the options {data} ({reason})") from None
    return config.to_dict()


def planned_from_note(workload: Workload) -> str | None:
    """One line saying a Hugging Face or named model was planned by its shape, then what that
    assumes, or None."""
    if isinstance(workload, (ShapedWorkload, MoEWorkload)):
        return "\n".join([workload.shape_line, *(f"assumed: {line}" for line in workload.assumed)])
    source = workload.planned_from
    if source is None:
        return None
    o = workload.describe()["options"]
    return (f"{source} planned by its shape as the built-in transformer ({o['layers']} layers, d_model {o['d_model']}, "
            f"ff {o['ff']} {o['activation']}, {o['heads']} heads, {o['kv_heads'] or o['heads']} key/value heads, "
            f"vocab {o['vocab']}, flash attention): its norms, biases, positions and any tied embedding are the "
            "built-in transformer's")


def compiled_note(workload: Workload) -> str | None:
    """One line saying the model is priced as torch.compile runs it, or None."""
    if not workload.options.get("compile"):
        return None
    return ("compile: torch.compile's fused elementwise regions, each region's memory traffic counted once "
            "(memory as eager autograd saves it)")


def model_name(args: argparse.Namespace) -> str | None:
    """The model the flags name: ``--model``, else the costs file's (None), else the default."""
    if args.model is not None:
        return args.model
    return None if getattr(args, "costs", None) else DEFAULT_MODEL


def chosen_precision(args: argparse.Namespace, device: Device, given: str | None = None) -> str:
    """``given`` (default ``--precision``), else the costs file's precision, else ``device``'s default;
    ``bf16`` in the meaning it has for the model on ``device`` (:func:`sim.workloads.precision.planned_precision`)."""
    costs = getattr(args, "costs", None)
    measured = measured_precision(read_costs(costs)) if costs else None
    model = model_name(args)
    if is_hf(model) and "analysis=meta" in [item.replace(" ", "") for item in getattr(args, "option", [])]:
        model = None  # measured op by op on the meta device: priced under autocast, as other torch models
    return choose_precision(given if given is not None else args.precision, device, measured, model)


def with_precision(model: str | None, options: dict[str, Any], precision: str,
                   costs: str | None = None) -> dict[str, Any]:
    """``options`` with the precision for models whose costs follow it: the analytic and torch
    models. Measured costs carry their own, and the uniform model's costs are nominal."""
    if costs or model in (None, "uniform"):
        return dict(options)
    return {**options, "precision": precision}


def with_attention_default(model: str | None, options: dict[str, Any], device: Device,
                           costs: str | None = None) -> tuple[dict[str, Any], str | None]:
    """``options`` with the built-in transformer's attention kernel defaulted to ``flash`` on GPUs
    trainers run flash attention on (``Device.flash_attention``), and the line that says so;
    ``--option attention=eager`` (or ``fused``) asks for another. Elsewhere, and for measured
    costs, the options unchanged and no line."""
    if costs or model != "transformer" or "attention" in options or not device.flash_attention:
        return dict(options), None
    return ({**options, "attention": "flash"},
            f"attention: flash, the default on {device.name} (--option attention=eager for the quadratic kernel)")


def workload_and_batch(args: argparse.Namespace, options: dict[str, Any],
                       precision: str, by_shape: bool = False) -> tuple[Workload, int]:
    """The workload at ``precision`` and the mini-batch rows the flags name (``--batch``, else the
    costs file's batch, else the model's default)."""
    if args.batch is not None:
        require_positive("batch size", args.batch, "use --batch 1 or more")
    costs = getattr(args, "costs", None)
    model = model_name(args)
    workload = resolve_workload(model, with_precision(model, options, precision, costs), costs, by_shape)
    batch = args.batch
    if batch is None:
        batch = workload.batch_size or DEFAULT_BATCH.get(workload.describe()["name"], 32)
    return workload, int(batch)


def calibrated_allreduce(workload: Workload, system: System) -> Link | None:
    """The all-reduce a costs file measured on ``system`` (:func:`sim.formats.costs.allreduce_link`), or None,
    in which case the simulator prices data-parallel groups on the catalog's links."""
    return workload.allreduce_link(system)
