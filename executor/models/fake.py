"""A meta-device model as fake CPU tensors: shapes and dtypes without storage, on a device autocast
acts on.

Autocast ignores meta tensors, so a bf16 forward on the meta device keeps fp32 everywhere. Under
``FakeTensorMode`` the same model's tensors claim to live on the CPU (still without storage), CPU
autocast applies to them, and the dtypes a real bf16 run produces come out. Used by the dry run
(:mod:`executor.runtime.shapes`) and by the meta-device analysis (:mod:`calibrate.measure.meta_profile`).

Limits: the CPU's autocast lists, not CUDA's (a few ops differ, see :mod:`executor.runtime.precision`);
each occurrence of a shared parameter becomes its own fake tensor (only shapes are read here).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


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
