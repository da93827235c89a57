"""Any ``nn.Sequential`` measured layer by layer on PyTorch's meta device, without allocating it.

A model (a built-in name, or a user's ``package.module:factory``) is built under
``torch.device("meta")``: tensors carry shapes and dtypes but no storage, so an 80-billion-parameter
model costs only its Python objects. Each top-level child (a pipeline layer) then runs one forward
and one backward on a meta input, and we record

- FLOPs, forward and backward, from PyTorch's own ``torch.utils.flop_counter.FlopCounterMode``
  (matmuls, convolutions and attention as 2*m*n*k; elementwise ops count zero);
- memory traffic: bytes of every tensor each non-view aten op reads and writes (no fusion);
- bytes saved for backward: storages packed by ``saved_tensors_hooks``, each storage once,
  parameters and buffers excluded (they are counted as static memory);
- parameter bytes, input bytes (what a stage starting here stashes) and output bytes (what crosses
  a stage boundary).

Rows: every quantity is affine in the micro-batch rows for layers that treat samples
independently (and for BatchNorm, whose statistics add a fixed term). Each layer is measured at 2
and 3 rows and the line through them gives any larger row count; a test checks this against direct
measurements. One row is measured on its own: with a batch dimension of 1 some reshapes stay views
where more rows need a copy, so one row is not on the line. Layers with the same structure, options and input shape (a transformer's blocks) are
measured once.

Times come from the roofline of :mod:`sim.models`: ``max(F / achieved FLOP/s, B / achieved
bandwidth) + LAYER_OVERHEAD_S`` per pass, the device's ``efficiency`` being the calibrated one when
the caller supplies it (``--efficiency`` or a costs file), else ``sim.hardware.DEFAULT_EFFICIENCY``.

Limits: what the meta kernels do is what is counted, which is eager PyTorch (no fusion, no flash
attention unless the model calls ``scaled_dot_product_attention``); transient workspace, the
loss after the last layer and allocator fragmentation are not counted; data-dependent control flow
and ops without meta kernels cannot be analysed (the error names the layer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from sim.errors import GpipeInputError
from sim.hardware import Device
from sim.models import DTYPE_BYTES, LAYER_OVERHEAD_S
from sim.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_SLOTS
from sim.workload import LayerCost

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ANALYSIS_DEFAULTS: dict[str, Any] = {"dtype": "fp32", "optimizer_slots": OPTIMIZER_SLOTS[DEFAULT_OPTIMIZER]}
MEASURED_ROWS = (1, 2, 3)  # measured directly; rows above the last lie on the line of the last two


@dataclass(frozen=True)
class LayerMeasure:
    """One layer's pass at one row count: FLOPs, bytes moved and bytes held."""

    forward_flops: float
    backward_flops: float
    forward_bytes: float  # read + written by the forward's ops
    backward_bytes: float
    saved_bytes: float  # held for backward, the layer's input included when an op saves it
    input_bytes: float
    output_bytes: float

    def along(self, other: "LayerMeasure", t: float) -> "LayerMeasure":
        """The point ``t`` of the way from ``self`` to ``other`` (t may exceed 1)."""
        values = {k: v + t * (getattr(other, k) - v) for k, v in vars(self).items()}
        return LayerMeasure(**values)


@dataclass(frozen=True)
class LayerProfile:
    """One layer's measures at each of ``MEASURED_ROWS`` and its parameter count."""

    name: str
    parameters: int
    measures: tuple[LayerMeasure, ...]  # one per MEASURED_ROWS

    def at(self, rows: int) -> LayerMeasure:
        if rows in MEASURED_ROWS:
            return self.measures[MEASURED_ROWS.index(rows)]
        a, b = MEASURED_ROWS[-2:]
        return self.measures[-2].along(self.measures[-1], (rows - a) / (b - a))


class _TrafficMode(TorchDispatchMode):
    """Adds up the bytes of every tensor each op reads and writes; views move nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.bytes += sum(t.nbytes for t in tree_leaves((args, kwargs, out))
                              if isinstance(t, torch.Tensor))
        return out


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _measure(layer: nn.Module, x: torch.Tensor, index: int) -> tuple[LayerMeasure, torch.Tensor]:
    """Run ``layer`` forward and backward on the meta input ``x``; returns its measure and output."""
    static = {_storage_key(t) for t in [*layer.parameters(), *layer.buffers()]}
    saved: dict[int, torch.Tensor] = {}  # storage -> one tensor on it, kept alive while counting

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in static:
            saved.setdefault(key, t)
        return t

    x = x.detach()
    if x.is_floating_point() and index > 0:
        x.requires_grad_(True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with FlopCounterMode(display=False) as flops, _TrafficMode() as traffic:
                y = layer(x)
        forward_flops, forward_bytes = flops.get_total_flops(), traffic.bytes
        backward_flops = backward_bytes = 0
        wrt = [t for t in [x, *layer.parameters()] if t.requires_grad]
        if isinstance(y, torch.Tensor) and y.requires_grad and wrt:
            with FlopCounterMode(display=False) as flops, _TrafficMode() as traffic:
                torch.autograd.grad(y, wrt, torch.ones_like(y), allow_unused=True)
            backward_flops, backward_bytes = flops.get_total_flops(), traffic.bytes
    except Exception as exc:  # a meta kernel missing, or data-dependent control flow
        raise GpipeInputError(f"layer {index} ({type(layer).__name__}) cannot run on the meta device: "
                              f"{str(exc).splitlines()[0]}; give it shape-only code paths") from None
    if not isinstance(y, torch.Tensor):
        raise GpipeInputError(f"layer {index} ({type(layer).__name__}) returned {type(y).__name__}; "
                              "a pipeline layer must return one tensor")
    saved_bytes = sum(t.untyped_storage().nbytes() for t in saved.values())
    measure = LayerMeasure(float(forward_flops), float(backward_flops), float(forward_bytes),
                           float(backward_bytes), float(saved_bytes), float(x.nbytes), float(y.nbytes))
    return measure, y.detach()


def _signature(layer: nn.Module, x: torch.Tensor) -> tuple:
    """What determines a layer's measure: its modules' types, plain attributes, tensor shapes, input."""
    parts: list[Any] = [tuple(x.shape), x.dtype]
    for name, module in layer.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(module).items()
                             if not k.startswith("_") and isinstance(v, (int, float, str, bool, tuple))))
        tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in
                        [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])
        parts.append((name, type(module).__qualname__, type(module).__module__, plain, tensors))
    return tuple(parts)


def profile_layers(model: nn.Sequential, sample_shape: Sequence[int], sample_dtype: torch.dtype) -> list[LayerProfile]:
    """Measure every top-level layer of a meta ``model`` at ``MEASURED_ROWS`` rows.

    ``sample_shape`` is one sample's shape (no row dimension).
    """
    cache: dict[tuple, tuple[LayerMeasure, torch.Tensor]] = {}
    per_rows = []
    for rows in MEASURED_ROWS:
        x = torch.empty((rows, *sample_shape), dtype=sample_dtype, device="meta")
        measures = []
        for index, layer in enumerate(model):
            key = _signature(layer, x) + (index == 0,)
            if key not in cache:
                cache[key] = _measure(layer, x, index)
            measure, x = cache[key]
            measures.append(measure)
        per_rows.append(measures)
    return [LayerProfile(f"{i}:{type(layer).__name__}", sum(p.numel() for p in layer.parameters()),
                         tuple(measures))
            for i, (layer, *measures) in enumerate(zip(model, *per_rows))]


class MetaWorkload:
    """A :class:`sim.workload.Workload` from meta-device measurements, costed by the roofline."""

    def __init__(self, name: str, options: dict[str, Any], profiles: Sequence[LayerProfile],
                 dtype: str = "fp32", optimizer_slots: int = 2, analysis_s: float = 0.0) -> None:
        self.name = name
        self.options = dict(options)
        self.profiles = tuple(profiles)
        self.num_layers = len(self.profiles)
        self.dtype = dtype
        self.optimizer_slots = optimizer_slots
        self.analysis_s = analysis_s
        self._cache: dict[tuple[int, str, float, float, float], list[LayerCost]] = {}

    @property
    def parameter_count(self) -> int:
        return sum(p.parameters for p in self.profiles)

    def layer_costs(self, rows: int, device: Device) -> list[LayerCost]:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
            raise GpipeInputError(f"micro-batch rows must be a positive integer, got {rows!r}")
        key = (rows, device.name, device.efficiency, device.bandwidth_efficiency,
               device.peak_flops.get(self.dtype, 0.0))
        if key not in self._cache:
            flops_s, bytes_s = device.achieved_flops(self.dtype), device.achieved_bandwidth()
            self._cache[key] = [self._cost(p, p.at(rows), flops_s, bytes_s) for p in self.profiles]
        return list(self._cache[key])

    def _cost(self, profile: LayerProfile, m: LayerMeasure, flops_s: float, bytes_s: float) -> LayerCost:
        forward_s = max(m.forward_flops / flops_s, m.forward_bytes / bytes_s) + LAYER_OVERHEAD_S
        backward_s = max(m.backward_flops / flops_s, m.backward_bytes / bytes_s) + 2 * LAYER_OVERHEAD_S
        param_bytes = profile.parameters * DTYPE_BYTES[self.dtype]
        return LayerCost(
            name=profile.name, forward_s=forward_s, backward_s=backward_s, recompute_s=forward_s,
            saved_bytes=round(m.saved_bytes), output_bytes=round(m.output_bytes),
            input_bytes=round(m.input_bytes), param_bytes=param_bytes, grad_bytes=param_bytes,
            optimizer_bytes=self.optimizer_slots * param_bytes,
            # elementwise update: read weight, grad and slots, write weight and slots (as sim.models)
            optimizer_s=(3 + 2 * self.optimizer_slots) * param_bytes / bytes_s,
        )

    def describe(self) -> dict:
        return {"name": self.name, "options": dict(self.options), "num_layers": self.num_layers,
                "parameter_count": self.parameter_count}


def parse_sample_shape(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``"3,224,224"`` (float32 images) or ``"1024:int64"`` (token ids): one sample's shape and dtype."""
    shape_text, _, dtype_text = str(text).partition(":")
    dtype = getattr(torch, dtype_text or "float32", None)
    try:
        shape = tuple(int(v) for v in shape_text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(v <= 0 for v in shape) or not isinstance(dtype, torch.dtype):
        raise GpipeInputError(f"--input-shape {text!r} is not a sample shape; write e.g. 3,224,224 "
                              "or 1024:int64 (without the batch dimension)")
    return shape, dtype


def _sample(name: str, options: dict[str, Any], input_shape: str | None) -> tuple[tuple[int, ...], torch.dtype]:
    if input_shape is not None:
        return parse_sample_shape(input_shape)
    from executor.models import example_batch, is_builtin

    if not is_builtin(name):
        module_name = name.partition(":")[0]
        import importlib

        if not hasattr(importlib.import_module(module_name), "example_batch"):
            raise GpipeInputError(f"{module_name!r} has no example_batch(batch_size) beside {name!r}; "
                                  "add one or give --input-shape, e.g. 3,224,224 or 1024:int64")
    inputs, _ = example_batch(name, options, 1, 0)
    return tuple(inputs.shape[1:]), inputs.dtype


def torch_workload(model: str, options: dict[str, Any] | None = None) -> MetaWorkload:
    """Measure ``model`` (built-in name or ``package.module:factory``) on the meta device.

    ``options`` go to the model (as ``gpipe train`` passes them), except the analysis options
    ``dtype`` (fp32 or bf16), ``optimizer_slots`` (optimizer state per parameter) and
    ``input_shape`` (one sample's shape, see :func:`parse_sample_shape`; default: the model's
    ``example_batch``).
    """
    from executor.models import build_model

    options = dict(options or {})
    input_shape = options.pop("input_shape", None)
    analysis = {k: options.pop(k, v) for k, v in ANALYSIS_DEFAULTS.items()}
    if analysis["dtype"] not in TORCH_DTYPES:
        raise GpipeInputError(f"dtype={analysis['dtype']!r}; choose one of {', '.join(TORCH_DTYPES)}")
    started = time.perf_counter()
    with torch.device("meta"):
        module = build_model(model, options)
    module.to(TORCH_DTYPES[analysis["dtype"]])
    shape, dtype = _sample(model, options, input_shape)
    if dtype.is_floating_point:
        dtype = TORCH_DTYPES[analysis["dtype"]]
    profiles = profile_layers(module, shape, dtype)
    described = {**options, **analysis, **({"input_shape": input_shape} if input_shape else {})}
    return MetaWorkload(model, described, profiles, analysis["dtype"], int(analysis["optimizer_slots"]),
                        analysis_s=time.perf_counter() - started)

