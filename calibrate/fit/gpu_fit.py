"""Fit each GPU's kernel fractions (:mod:`sim.catalog.kernel_model`) on the development set of published runs.

The development set (``benchmarks/published_runs/dev.json``) is the only GPU truth a fit may see:
whole-step times of runs (``runs``, replayed as ``gpipe replay`` does) and one transformer layer's
forward and backward times (``layer_times``). Every other published run is kept for validation, and
this module reads no file but the one it is given.

A row's device is its catalog system's, or a named variant over it (a hardware object's own ``name``,
:func:`sim.catalog.user_systems.fitted_name`: the same silicon under another power limit), fitted
apart. Per device, the fractions a development row constrains are fitted by least squares on the log of
predicted over measured (a relative error, symmetric in over- and under-prediction), within bounds
that keep each a physical fraction. A fraction no row of a device constrains is tied, and the file
says to what:

- the A100 rows (Korthikanti et al. 2022, Narayanan et al. 2021) fit its matmul, memory-bound,
  collective and optimizer fractions and the per-matmul launch time (the per-layer times constrain
  the first four terms, the step times what lies outside the layers, chiefly the optimizer step);
  they run no flash attention, so its attention fraction is tied to its matmul fraction;
- every other device (the H100's Nemotron-4 15B row, the 500 W H100's torchtitan Llama 3.1 70B
  row, the B200's Llama 3 8B fp8 row, the GB200's Llama 3.1 405B row) fits its matmul fraction alone,
  which a single step time determines exactly; its
  flash attention is tied to that fraction and its memory-bound, collective, optimizer and launch
  terms to the A100's fit. A device with one row has a development error of zero by construction; only
  the validation set says how well it is modelled.

The development set's mixtures of experts (:func:`is_mixture_of_experts`) are predicted and
listed beside the others but fit no kernel fraction: the fractions are those of dense runs, and the
MoE rows test what expert parallelism adds (:mod:`sim.workloads.moe.expert_parallel`) on top of them,
so adding them moves no dense run's prediction.

Limits: a few configurations of four devices, one row for each but the A100; the fractions absorb
whatever the kernel model leaves out (concurrent streams, wave quantisation, Megatron's bf16 residual
stream, which the simulator keeps in fp32 as torch autocast does; CUDA graphs, which the B200 row
ran).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
from scipy.optimize import least_squares

from sim.catalog.hardware import SYSTEMS, get_system
from sim.catalog.user_systems import fitted_name, resolve_system
from sim.catalog.kernel_model import KernelEfficiency
from sim.errors import GpipeInputError
from sim.engine.stage_costs import rerun_in_backward_s
from sim.evidence.replay import Resolve, replay
from sim.formats.timeline import read_json
from sim.workloads.tensor_parallel import with_tensor_parallel

# Starting point and bounds of each fitted term (fractions of peak; seconds per matmul kernel)
START = {"matmul": 0.7, "memory": 0.7, "collective": 0.7, "optimizer": 0.7, "matmul_launch_s": 10e-6}
BOUNDS = {"matmul": (0.05, 1.0), "memory": (0.05, 1.0), "collective": (0.05, 1.0), "optimizer": (0.05, 1.0),
          "matmul_launch_s": (0.0, 100e-6)}
LAYER_KEYS = ("id", "hardware", "model", "options", "tensor_parallel", "sequence_parallel", "microbatch_size",
              "precision", "checkpoint", "forward_ms", "backward_ms")


@dataclass
class Target:
    """One measured figure of the development set and how to predict it from a device's fractions."""

    id: str
    hardware: str
    measured_s: float
    predict: Callable[[KernelEfficiency], float]
    fitted: bool = True  # False: predicted and listed, not fitted on (a mixture of experts' run)


def load_development_set(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runs and layer times of a development file; one line naming what is missing."""
    from sim.evidence.replay import load_runs

    runs = load_runs(path)
    data = read_json(path, "development set", "give benchmarks/published_runs/dev.json")
    layers = data.get("layer_times", [])
    for index, row in enumerate(layers):
        missing = [key for key in LAYER_KEYS if key not in row]
        if missing:
            raise GpipeInputError(f"layer_times[{index}] of {path!r} has no {', '.join(missing)}")
    return runs, layers


def layer_seconds(row: dict[str, Any], kernels: KernelEfficiency) -> tuple[float, float]:
    """One transformer block's forward and backward (with its policy's recompute) for ``row``."""
    from sim.workloads.models import get_workload

    system = resolve_system(row["hardware"], 1, kernels, where=f"layer_times row {row['id']!r}'s hardware")
    workload = get_workload(row["model"], {**row["options"], "precision": row["precision"]})
    workload, groups = with_tensor_parallel(workload, system, int(row["tensor_parallel"]),
                                            bool(row["sequence_parallel"]))
    block = workload.layer_costs(int(row["microbatch_size"]), groups.device)[1]
    return block.forward_s, block.backward_s + rerun_in_backward_s(block, row["checkpoint"])


def targets(runs: Sequence[dict[str, Any]], layers: Sequence[dict[str, Any]], resolve: Resolve) -> list[Target]:
    out = []
    for run in runs:
        def whole(kernels: KernelEfficiency, run=run) -> float:
            result = replay(run, resolve, {fitted_name(run["hardware"]): kernels})
            if not result.modelled:
                raise GpipeInputError(f"development run {run['id']!r} is not modelled: {result.reason}")
            return float(result.predicted_step_s)  # type: ignore[arg-type]
        out.append(Target(run["id"], fitted_name(run["hardware"]), float(run["measured_step_s"]), whole,
                          fitted=not is_mixture_of_experts(run)))
    for row in layers:
        out.append(Target(row["id"] + ":forward", fitted_name(row["hardware"]), row["forward_ms"] / 1e3,
                          lambda k, row=row: layer_seconds(row, k)[0]))
        out.append(Target(row["id"] + ":backward", fitted_name(row["hardware"]), row["backward_ms"] / 1e3,
                          lambda k, row=row: layer_seconds(row, k)[1]))
    return out


def is_mixture_of_experts(run: dict[str, Any]) -> bool:
    """Whether a development run trains a mixture of experts: a Hugging Face MoE type or a named MoE model."""
    from sim.workloads.moe.config import MOE_TYPES
    from sim.workloads.named_models import named_models

    model = str(run["model"])
    if model.startswith("hf:"):
        return model[3:] in MOE_TYPES
    named = named_models().get(model)
    return bool(named and named.moe) or bool(run.get("options", {}).get("experts"))


def fit_device(device_targets: Sequence[Target], free: Sequence[str], base: KernelEfficiency) -> KernelEfficiency:
    """``base`` with the ``free`` terms fitted on ``device_targets``; attention follows matmul."""
    def kernels_of(x: np.ndarray) -> KernelEfficiency:
        values = dict(zip(free, (float(v) for v in x)))
        kernels = replace(base, **values)
        return replace(kernels, attention=kernels.matmul)

    def residuals(x: np.ndarray) -> np.ndarray:
        kernels = kernels_of(x)
        return np.array([math.log(t.predict(kernels) / t.measured_s) for t in device_targets])

    x0 = np.array([getattr(base, key) for key in free])
    lower = np.array([BOUNDS[key][0] for key in free])
    upper = np.array([BOUNDS[key][1] for key in free])
    scale = np.array([1e-5 if key == "matmul_launch_s" else 0.1 for key in free])
    solution = least_squares(residuals, x0, bounds=(lower, upper), x_scale=scale, diff_step=1e-3)
    return kernels_of(solution.x)


def fit(path: str, resolve: Resolve) -> dict[str, Any]:
    """The efficiency file's content: per device its fractions, and every development row's error."""
    runs, layers = load_development_set(path)
    all_targets = targets(runs, layers, resolve)
    by_hardware: dict[str, list[Target]] = {}
    for t in all_targets:
        if t.fitted:
            by_hardware.setdefault(t.hardware, []).append(t)
    if "a100-nvlink" not in by_hardware:
        raise GpipeInputError(f"the development set {path!r} has no a100-nvlink row: the A100's fit gives every "
                              "other device the terms its rows do not determine")
    start = KernelEfficiency(attention=START["matmul"], **START)
    a100 = fit_device(by_hardware["a100-nvlink"], ("matmul", "memory", "collective", "optimizer", "matmul_launch_s"),
                      start)
    a100 = replace(a100, source=f"fitted on {_ids(by_hardware['a100-nvlink'])} of {path}",
                   tied=("attention = matmul (no flash attention among the A100 rows)",))
    fitted = {"a100-nvlink": a100}
    for name in sorted(set(by_hardware) - {"a100-nvlink"}):
        device = _device_name(name)
        one = fit_device(by_hardware[name], ("matmul",), replace(a100, matmul=START["matmul"]))
        fitted[name] = replace(
            one, source=f"fitted on {_ids(by_hardware[name])} of {path}",
            tied=("attention = matmul", f"memory, collective, optimizer and matmul_launch_s = the A100's fit (the "
                                        f"{device} rows determine one fraction)"))
    rows = [{"id": t.id, "hardware": t.hardware, "measured_s": t.measured_s,
             "predicted_s": t.predict(fitted[t.hardware]),
             "error": t.predict(fitted[t.hardware]) / t.measured_s - 1} for t in all_targets]
    devices = {_device_name(name): kernels.to_dict() for name, kernels in fitted.items()}
    return {"about": "Achieved fractions of peak by kind of kernel (sim/catalog/kernel_model.py), fitted by gpipe fit-gpu "
                     "on the development set alone; regenerate with: gpipe fit-gpu benchmarks/published_runs/dev.json "
                     "--out sim/catalog/gpu_efficiency.json",
            "devices": devices, "development_rows": rows}


def _device_name(name: str) -> str:
    """The device a fit is kept under: a catalog system's device, or a named variant itself
    (:func:`sim.catalog.user_systems.fitted_name`)."""
    return get_system(name).device.name if name in SYSTEMS else name


def _ids(device_targets: Sequence[Target]) -> str:
    seen: list[str] = []
    for t in device_targets:
        name = t.id.split(":")[0]
        if name not in seen:
            seen.append(name)
    return ", ".join(seen)
