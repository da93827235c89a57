"""From a model name, its options and an optional costs file to a :class:`sim.workload.Workload`.

Built-in analytic models need no torch. Measured costs (``--costs``) and a user's torch model
(``package.module:factory``) import torch lazily, only when asked for.
"""

from __future__ import annotations

from typing import Any

from sim.errors import GpipeInputError
from sim.workload import Workload


def resolve_workload(model: str, options: dict[str, Any], costs_path: str | None = None) -> Workload:
    if costs_path is not None:
        from calibrate.costs import load_costs_workload

        return load_costs_workload(costs_path, model, options)
    from sim.models import BUILTIN_MODELS, get_workload

    if model in BUILTIN_MODELS:
        return get_workload(model, options)
    if ":" in model:
        try:
            from sim.meta_workload import torch_workload
        except ModuleNotFoundError:
            raise GpipeInputError(f"model {model!r} needs torch; install it with pip install torch") from None
        return torch_workload(model, options)
    raise GpipeInputError(
        f"unknown model {model!r}; choose one of {', '.join(BUILTIN_MODELS)} or give package.module:factory")
