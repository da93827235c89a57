"""From a model name, its options and an optional costs file to a :class:`sim.workloads.workload.Workload`.

Torch-free. Built-in analytic models and measured costs (:mod:`sim.formats.costs`) are resolved here. A
user's torch model (``package.module:factory``) has to be measured first, which takes torch: the
caller passes the function that measures it (``analyse``). The command line wires in
:func:`calibrate.measure.meta_profile.torch_workload` (see :mod:`gpipe.workload_flags`); the simulator itself
never imports it.
"""

from __future__ import annotations

from typing import Any, Callable

from sim.errors import GpipeInputError, did_you_mean
from sim.formats.costs import load_costs_workload
from sim.workloads.models import BUILTIN_MODELS, get_workload
from sim.workloads.named_models import is_named, named_models, named_options
from sim.workloads.workload import Workload

# (model, options) -> the model measured layer by layer, e.g. on PyTorch's meta device
Analyse = Callable[[str, dict[str, Any]], Workload]


def resolve_workload(model: str | None, options: dict[str, Any], costs_path: str | None = None,
                     analyse: Analyse | None = None) -> Workload:
    """The workload of ``model``; with ``costs_path``, measured costs (``model`` None: the file's)."""
    if costs_path is not None:
        return load_costs_workload(costs_path, model, options)
    if model is None:
        raise GpipeInputError("no model; give --model NAME or --costs FILE")
    if model in BUILTIN_MODELS:
        return get_workload(model, options)
    if is_named(model) and named_models()[model].moe:  # a mixture of experts, by its config's fields
        from sim.workloads.moe.workload import named_moe_workload

        return named_moe_workload(model, options)
    if is_named(model):  # a well-known model: the built-in transformer of its config's shape
        workload = get_workload("transformer", named_options(model, options))
        workload.planned_from = model  # type: ignore[attr-defined]
        return workload
    if ":" in model:
        if analyse is None:
            raise GpipeInputError(f"model {model!r} is a torch model and needs measuring first; "
                                  "run it through gpipe simulate or gpipe plan")
        return analyse(model, options)
    raise GpipeInputError(
        f"unknown model {model!r}{did_you_mean(model, [*BUILTIN_MODELS, *named_models()])}; choose one of "
        f"{', '.join(BUILTIN_MODELS)}, a named model "
        f"({', '.join(named_models())}: gpipe plan --list-models) or give package.module:factory")
