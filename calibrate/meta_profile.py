"""Any ``nn.Sequential`` measured layer by layer on PyTorch's meta device, without allocating it.

A model (a built-in name, or a user's ``package.module:factory``) is built under
``torch.device("meta")``: tensors carry shapes and dtypes but no storage, so an 80-billion-parameter
model costs only its Python objects. For ``precision`` bf16 its parameters, buffers and tensor
attributes are then re-homed as fake CPU tensors (``FakeTensorMode``: still meta storage, but a
CPU device, so that ``torch.autocast`` applies; it ignores meta tensors; fp32 keeps the plain meta
tensors, which analyse about twice as fast). Each top-level child (a pipeline layer) then runs one
forward and one backward on a meta (fake) input, each forward under CPU autocast for bf16
(:mod:`executor.precision`, as the executor trains), and we record

- FLOPs, forward and backward, from PyTorch's own ``torch.utils.flop_counter.FlopCounterMode``
  (matmuls, convolutions and attention as 2*m*n*k; elementwise ops count zero);
- memory traffic: bytes of every tensor each non-view aten op reads and writes (no fusion);
- bytes saved for backward: storages packed by ``saved_tensors_hooks``, each storage once,
  parameters and buffers excluded (they are counted as static memory; autocast's bf16 copies of
  them are saved per micro-batch and counted), and whether the layer's input storage is among them;
- parameter bytes, input bytes (what a stage starting here stashes) and output bytes (what crosses
  a stage boundary).

Rows: every quantity is affine in the micro-batch rows for layers that treat samples
independently (and for BatchNorm, whose statistics add a fixed term). Each layer is measured at 2
and 3 rows and the line through them gives any larger row count; a test checks this against direct
measurements. One row is measured on its own: with a batch dimension of 1 some reshapes stay views
where more rows need a copy, so one row is not on the line. Layers with the same structure,
options and input shape (a transformer's blocks) are measured once.

The measurements become a :class:`sim.meta_workload.MetaWorkload`, which the simulator costs on
any device's roofline without torch. This module lives beside the profiler because analysing a torch
model is measuring it; the simulator only reads the numbers.

Limits: what the meta kernels do is what is counted, which is eager PyTorch (no fusion, no flash
attention unless the model calls ``scaled_dot_product_attention``); data-dependent control flow and
ops without meta kernels cannot be analysed (the error names the layer). bf16 is analysed under
CPU autocast, the only one that runs without a GPU: CUDA's runs a few more ops in fp32 (softmax,
layer_norm on a bf16 input, sum, exp, ...), which save 4-byte tensors there where 2-byte ones are
counted here (an explicit attention's probabilities: 6 bytes per score on CUDA, 2 here). The
analytic models (:mod:`sim.models`) follow CUDA's lists; the tests state the difference.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from executor.precision import autocast
from sim.errors import GpipeInputError
from sim.meta_workload import MEASURED_ROWS, LayerMeasure, LayerProfile, MetaWorkload
from sim.precision import DEFAULT_PRECISION, check_precision

ANALYSIS_DEFAULTS: dict[str, Any] = {"precision": DEFAULT_PRECISION, "optimizer_slots": 2}


class _TrafficMode(TorchDispatchMode):
    """Adds up the bytes of every tensor each op reads and writes; views move nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.namespace != "prim":  # prim: fake tensors asking for a device
            self.bytes += sum(t.nbytes for t in tree_leaves((args, kwargs, out))
                              if isinstance(t, torch.Tensor))
        return out


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _measure(layer: nn.Module, x: torch.Tensor, index: int,
             precision: str = DEFAULT_PRECISION) -> tuple[LayerMeasure, torch.Tensor]:
    """Run ``layer`` forward (under CPU autocast for bf16, one region per forward as the executor
    runs it, so weights are cast afresh) and backward on the meta or fake input ``x``; returns its
    measure and output."""
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
            with FlopCounterMode(display=False) as flops, _TrafficMode() as traffic, autocast(precision, "cpu"):
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
    input_saved = x.untyped_storage().nbytes() if _storage_key(x) in saved else 0
    measure = LayerMeasure(float(forward_flops), float(backward_flops), float(forward_bytes),
                           float(backward_bytes), float(saved_bytes), float(x.nbytes), float(y.nbytes),
                           float(input_saved))
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


def profile_layers(model: nn.Sequential, sample_shape: Sequence[int], sample_dtype: torch.dtype,
                   precision: str = DEFAULT_PRECISION) -> list[LayerProfile]:
    """Measure every top-level layer of a meta ``model`` (or a fake one, inside :func:`fake_mode`)
    at ``MEASURED_ROWS`` rows and ``precision`` (bf16 needs the fake model: autocast ignores meta
    tensors).

    ``sample_shape`` is one sample's shape (no row dimension).
    """
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("meta"))
    cache: dict[tuple, tuple[LayerMeasure, torch.Tensor]] = {}
    per_rows = []
    for rows in MEASURED_ROWS:
        x = torch.empty((rows, *sample_shape), dtype=sample_dtype, device=device)
        measures = []
        for index, layer in enumerate(model):
            key = _signature(layer, x) + (index == 0,)
            if key not in cache:
                cache[key] = _measure(layer, x, index, precision)
            measure, x = cache[key]
            measures.append(measure)
        per_rows.append(measures)
    return [LayerProfile(f"{i}:{type(layer).__name__}", sum(p.numel() for p in layer.parameters()),
                         tuple(measures))
            for i, (layer, *measures) in enumerate(zip(model, *per_rows))]


def fake_cpu(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """``model`` (built on the meta device) with every parameter, buffer and tensor attribute
    replaced by a fake CPU tensor of ``mode``: no storage, but a device autocast acts on."""
    with mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[name] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype), param.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and not name.startswith("_"):
                    setattr(module, name, torch.empty(value.shape, dtype=value.dtype))
    return model


@contextlib.contextmanager
def fake_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` re-homed as fake CPU tensors, inside the fake mode it is measured in."""
    mode = FakeTensorMode()
    fake = fake_cpu(model, mode)
    with mode:
        yield fake


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
    ``precision`` (fp32 or bf16, see :mod:`sim.precision`), ``optimizer_slots`` (optimizer state per
    parameter) and
    ``input_shape`` (one sample's shape, see :func:`parse_sample_shape`; default: the model's
    ``example_batch``).
    """
    from executor.models import build_model

    options = dict(options or {})
    input_shape = options.pop("input_shape", None)
    analysis = {k: options.pop(k, v) for k, v in ANALYSIS_DEFAULTS.items()}
    precision = check_precision(analysis["precision"])
    started = time.perf_counter()
    with torch.device("meta"):
        module = build_model(model, options)
    shape, dtype = _sample(model, options, input_shape)
    if precision == DEFAULT_PRECISION:  # nothing to autocast: the faster plain meta tensors
        profiles = profile_layers(module, shape, dtype)
    else:
        with fake_mode(module) as fake:
            profiles = profile_layers(fake, shape, dtype, precision)
    described = {**options, **analysis, **({"input_shape": input_shape} if input_shape else {})}
    return MetaWorkload(model, described, profiles, precision, int(analysis["optimizer_slots"]),
                        analysis_s=time.perf_counter() - started)

