"""Any ``nn.Sequential`` measured layer by layer on PyTorch's meta device, without allocating it.

A model (a built-in name, or a user's ``package.module:factory``) is built under
``torch.device("meta")``: tensors carry shapes and dtypes but no storage, so an 80-billion-parameter
model costs only its Python objects. For ``precision`` bf16 its parameters, buffers and tensor
attributes are then re-homed as fake CPU tensors (``FakeTensorMode``: still meta storage, but a
CPU device, so that ``torch.autocast`` applies; it ignores meta tensors; fp32 keeps the plain meta
tensors, which analyse about twice as fast). Each top-level child (a pipeline layer) then runs one
forward and one backward on a meta (fake) input, each forward under CPU autocast for bf16
(:mod:`executor.runtime.precision`, as the executor trains), and we record

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

The measurements become a :class:`sim.workloads.meta_workload.MetaWorkload`, which the simulator costs on
any device's roofline without torch. This module lives beside the profiler because analysing a torch
model is measuring it; the simulator only reads the numbers.

Limits: what the meta kernels do is what is counted, which is eager PyTorch (no fusion, no flash
attention unless the model calls ``scaled_dot_product_attention``); data-dependent control flow and
ops without meta kernels cannot be analysed (the error names the layer). bf16 is analysed under
CPU autocast, the only one that runs without a GPU: CUDA's runs a few more ops in fp32 (softmax,
layer_norm on a bf16 input, sum, exp, ...), which save 4-byte tensors there where 2-byte ones are
counted here (an explicit attention's probabilities: 6 bytes per score on CUDA, 2 here). The
analytic models (:mod:`sim.workloads.models`) follow CUDA's lists; the tests state the difference.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_structure
from torch.utils.flop_counter import FlopCounterMode

from executor.models.fake import fake_mode
from executor.parallel.sharing import shared_tensors
from executor.runtime.boundary import map_tensors, tensors
from executor.runtime.precision import autocast
from sim.errors import GpipeInputError
from sim.workloads.meta_workload import MEASURED_ROWS, LayerMeasure, LayerProfile, MetaWorkload, SharedTensor
from sim.workloads.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_SLOTS
from sim.workloads.precision import DEFAULT_PRECISION, check_precision

ANALYSIS_DEFAULTS: dict[str, Any] = {"precision": DEFAULT_PRECISION,
                                     "optimizer_slots": OPTIMIZER_SLOTS[DEFAULT_OPTIMIZER]}


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


def _measure(layer: nn.Module, x: Any, index: int, precision: str = DEFAULT_PRECISION) -> tuple[LayerMeasure, Any]:
    """Run ``layer`` forward (under CPU autocast for bf16, one region per forward as the executor
    runs it, so weights are cast afresh) and backward on the meta or fake input ``x`` (a tensor, or a
    tuple or dict of them); returns its measure and output. Bytes in and out count every tensor."""
    static = {_storage_key(t) for t in [*layer.parameters(), *layer.buffers()]}
    saved: dict[int, torch.Tensor] = {}  # storage -> one tensor on it, kept alive while counting

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in static:
            saved.setdefault(key, t)
        return t

    def leaf(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if t.is_floating_point() and index > 0 else t

    x = map_tensors(leaf, x)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with FlopCounterMode(display=False) as flops, _TrafficMode() as traffic, autocast(precision, "cpu"):
                y = layer(x)
        forward_flops, forward_bytes = flops.get_total_flops(), traffic.bytes
        backward_flops = backward_bytes = 0
        wrt = [t for t in [*tensors(x), *layer.parameters()] if t.requires_grad]
        roots = [t for t in tensors(y) if t.requires_grad]
        if roots and wrt:
            with FlopCounterMode(display=False) as flops, _TrafficMode() as traffic:
                torch.autograd.grad(roots, wrt, [torch.ones_like(t) for t in roots], allow_unused=True)
            backward_flops, backward_bytes = flops.get_total_flops(), traffic.bytes
    except Exception as exc:  # a meta kernel missing, or data-dependent control flow
        raise GpipeInputError(f"layer {index} ({type(layer).__name__}) cannot run on the meta device: "
                              f"{str(exc).splitlines()[0]}; give it shape-only code paths") from None
    saved_bytes = sum(t.untyped_storage().nbytes() for t in saved.values())
    inputs = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors(x)}
    input_saved = sum(nbytes for key, nbytes in inputs.items() if key in saved)
    measure = LayerMeasure(float(forward_flops), float(backward_flops), float(forward_bytes),
                           float(backward_bytes), float(saved_bytes), float(_nbytes(x)), float(_nbytes(y)),
                           float(input_saved))
    return measure, map_tensors(torch.Tensor.detach, y)


def _nbytes(value: Any) -> int:
    """Bytes of ``value``'s tensors, each counted: at a boundary each is sent, and received into a
    buffer of its own, even when two are views of one storage here."""
    return sum(t.nbytes for t in tensors(value))


def _signature(layer: nn.Module, x: Any) -> tuple:
    """What determines a layer's measure: its modules' types, plain attributes, tensor shapes, input."""
    parts: list[Any] = [str(tree_structure(x)), tuple((tuple(t.shape), t.dtype) for t in tensors(x))]
    for name, module in layer.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(module).items()
                             if not k.startswith("_") and isinstance(v, (int, float, str, bool, tuple))))
        params = tuple((n, tuple(t.shape), t.dtype) for n, t in
                       [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])
        parts.append((name, type(module).__qualname__, type(module).__module__, plain, params))
    return tuple(parts)


def sample_of(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A one-row meta input of one sample's ``shape`` and ``dtype``."""
    return torch.empty((1, *shape), dtype=dtype, device="meta")


def with_rows(sample: Any, rows: int, device: torch.device | str = "meta") -> Any:
    """``sample`` (tensors with the rows first) as empty tensors of ``rows`` rows on ``device``."""
    return map_tensors(lambda t: torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=device), sample)


def profile_layers(model: nn.Sequential, sample: Any, precision: str = DEFAULT_PRECISION) -> list[LayerProfile]:
    """Measure every top-level layer of a meta ``model`` (or a fake one, inside :func:`fake_mode`)
    at ``MEASURED_ROWS`` rows and ``precision`` (bf16 needs the fake model: autocast ignores meta
    tensors).

    ``sample`` is the model's input for any number of rows: a tensor, or a tuple or dict of tensors,
    each with the rows first (see :func:`sample_of`); only shapes and dtypes are read.
    """
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("meta"))
    cache: dict[tuple, tuple[LayerMeasure, Any]] = {}
    per_rows = []
    for rows in MEASURED_ROWS:
        x = with_rows(sample, rows, device)
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


def _sample(name: str, options: dict[str, Any], input_shape: str | None) -> Any:
    """The model's input at one row: from ``--input-shape``, else from its ``example_batch``."""
    if input_shape is not None:
        return sample_of(*parse_sample_shape(input_shape))
    from executor.models.hf import is_hf
    from executor.models.build import example_batch, is_builtin

    if not is_builtin(name) and not is_hf(name):
        module_name = name.partition(":")[0]
        import importlib

        if not hasattr(importlib.import_module(module_name), "example_batch"):
            raise GpipeInputError(f"{module_name!r} has no example_batch(batch_size) beside {name!r}; "
                                  "add one or give --input-shape, e.g. 3,224,224 or 1024:int64")
    inputs, _ = example_batch(name, options, 1, 0)
    return map_tensors(lambda t: t.to("meta"), inputs)


def torch_workload(model: str, options: dict[str, Any] | None = None) -> MetaWorkload:
    """Measure ``model`` (built-in name or ``package.module:factory``) on the meta device.

    ``options`` go to the model (as ``gpipe train`` passes them), except the analysis options
    ``precision`` (fp32 or bf16, see :mod:`sim.workloads.precision`), ``optimizer_slots`` (optimizer state per
    parameter) and
    ``input_shape`` (one sample's shape, see :func:`parse_sample_shape`; default: the model's
    ``example_batch``).
    """
    from executor.models.build import build_meta_model

    options = dict(options or {})
    input_shape = options.pop("input_shape", None)
    analysis = {k: options.pop(k, v) for k, v in ANALYSIS_DEFAULTS.items()}
    precision = check_precision(analysis["precision"])
    started = time.perf_counter()
    module = build_meta_model(model, options)  # values do not matter here
    shared = [SharedTensor(f"{layers[0]}.{name}", layers, numel) for name, layers, numel in shared_tensors(module)]
    sample = _sample(model, options, input_shape)
    if precision == DEFAULT_PRECISION:  # nothing to autocast: the faster plain meta tensors
        profiles = profile_layers(module, sample)
    else:
        with fake_mode(module) as fake:
            profiles = profile_layers(fake, sample, precision)
    described = {**options, **analysis, **({"input_shape": input_shape} if input_shape else {})}
    return MetaWorkload(model, described, profiles, precision, int(analysis["optimizer_slots"]),
                        analysis_s=time.perf_counter() - started, shared=shared)

