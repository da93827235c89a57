"""Training precision: one name (``fp32`` or ``bf16``) and what it means for bytes and FLOP/s.

``bf16`` is mixed precision as ``torch.autocast(device_type, dtype=torch.bfloat16)`` runs it: the
weights stay fp32 (the master copy the optimizer updates), so do their gradients and the optimizer
state; matmuls and convolutions read and write bf16 and run at the device's bf16 peak. Autocast
casts each weight a matmul uses to bf16 once per autocast region (a cached copy, 2 bytes per
element), and the matmul saves that copy for its backward, so every micro-batch whose graph is alive
holds its own copy (the executor enters autocast once per forward). Ops on autocast's fp32 list
(layer_norm, softmax, the losses, ...) run in fp32 and save fp32 tensors; a residual stream that
starts in fp32 stays fp32, since an add promotes. ``fp32`` casts nothing and runs at the fp32 peak.

The what-if default is the precision people train in on a device, the catalog's
``Device.default_precision``: bf16 where the device has bf16 units, fp32 elsewhere. A costs file
records the precision it was measured at, which then is the only one it can predict.

Torch-free, like the rest of the simulator's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.errors import GpipeInputError

FP32_BYTES = 4  # master weights, their gradients, optimizer state, and what autocast keeps in fp32


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a precision moves and keeps."""

    name: str
    compute_bytes: int  # what matmuls and convolutions read and write (the autocast dtype)
    cast_bytes: int  # moved by one autocast cast per element: read one dtype, write the other
    weight_copy_bytes: int  # autocast's cached low-precision copy of a matmul weight, per element

    @property
    def casts(self) -> bool:
        return self.cast_bytes > 0


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", compute_bytes=4, cast_bytes=0, weight_copy_bytes=0),
    "bf16": Precision("bf16", compute_bytes=2, cast_bytes=2 + 4, weight_copy_bytes=2),
}
DEFAULT_PRECISION = "fp32"  # where nothing else decides: the executor, an old plan or costs file


def check_precision(value: Any) -> str:
    """``value`` if it names a precision, else a one-line error listing the choices."""
    if value not in PRECISIONS:
        raise GpipeInputError(f"unknown precision {value!r}; choose one of {', '.join(PRECISIONS)}")
    return value


def precision_of(name: str) -> Precision:
    return PRECISIONS[check_precision(name)]


def choose_precision(given: str | None, device: Any, measured: str | None = None) -> str:
    """The precision a prediction uses: ``given`` (``--precision``), else the one the costs file was
    ``measured`` at, else the ``device``'s default (``sim.hardware.Device.default_precision``).

    A ``given`` precision that contradicts the costs file, or that the device has no peak for
    (analytic costs only), is a one-line error.
    """
    if given is not None:
        check_precision(given)
        if measured is not None and given != measured:
            raise GpipeInputError(f"--precision {given} contradicts the costs file, which was measured at "
                                  f"{measured}; drop --precision or run gpipe calibrate --precision {given}")
    chosen = given or measured or device.default_precision
    if measured is None and chosen not in device.peak_flops:
        raise GpipeInputError(
            f"device {device.name} has no {chosen} units in the catalog; use --precision "
            f"{device.default_precision}, or measure it with gpipe calibrate --precision {chosen}")
    return chosen
