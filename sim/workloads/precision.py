"""Training precision: one name (``fp32`` or ``bf16``) and what it means for bytes and FLOP/s.

``bf16`` is mixed precision as ``torch.autocast(device_type, dtype=torch.bfloat16)`` runs it: the
weights stay fp32 (the master copy the optimizer updates), so do their gradients and the optimizer
state; matmuls and convolutions read and write bf16 and run at the device's bf16 peak. Autocast
casts each weight a matmul uses to bf16 once per autocast region (a cached copy, 2 bytes per
element), and the matmul saves that copy for its backward, so every micro-batch whose graph is alive
holds its own copy (the executor enters autocast once per forward). Ops on autocast's fp32 list
(layer_norm, softmax, the losses, ...) run in fp32 and save fp32 tensors; a residual stream that
starts in fp32 stays fp32, since an add promotes. ``fp32`` casts nothing and runs at the fp32 peak.

``bf16-model`` is mixed precision as Megatron-LM's ``--bf16`` and NeMo run it, which published
GPU runs use: the model's weights and every activation (the residual stream and the norms' inputs
included) are bf16, so nothing is cast per step; gradients are accumulated in fp32 (4 bytes per
parameter) and the optimizer keeps an fp32 master copy of the weights beside its state (4 more).
For the built-in transformer, in planning only: the executor trains ``fp32`` and ``bf16``.

``fp8`` is Transformer Engine's fp8 training as NeMo runs it on Hopper and Blackwell, a what-if on
devices with fp8 units: ``bf16-model`` with each transformer layer's four projection matmuls (QKV,
the attention's output, the MLP's two) at the device's fp8 peak, their inputs cast to fp8 forward
and their output gradients backward (read 2 bytes, write 1; the scaling factors' amax reduction is
fused into those casts, as Transformer Engine fuses it); flash attention, the norms, the embedding
and the head stay bf16. Memory is counted as ``bf16-model``'s (Transformer Engine's fp8 copies of
the saved inputs and of the weights are not counted apart). Planning only, for the built-in
transformer.

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
    activation_bytes: int = FP32_BYTES  # the residual stream, the norms' inputs and outputs, the embedding's
    weight_bytes: int = FP32_BYTES  # the model's own weights; below fp32 the optimizer keeps an fp32 master copy
    peak_dtype: str = ""  # the device peak it runs at; its own name if empty
    planning_only: bool = False  # the executor does not train it
    matmul_peak_dtype: str = ""  # the peak of a transformer layer's projection matmuls; ``peak`` if empty
    about: str = ""  # what it stands for, in the refusals of the parts that do not take it

    @property
    def casts(self) -> bool:
        return self.cast_bytes > 0

    @property
    def peak(self) -> str:
        return self.peak_dtype or self.name

    @property
    def matmul_peak(self) -> str:
        return self.matmul_peak_dtype or self.peak

    @property
    def fp8_casts(self) -> bool:
        """Whether a layer's projection matmuls cast their inputs and output gradients to fp8."""
        return self.matmul_peak == "fp8"

    @property
    def master_copy(self) -> int:
        """1 when the optimizer keeps an fp32 copy of weights the model holds in fewer bytes."""
        return int(self.weight_bytes < FP32_BYTES)


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", compute_bytes=4, cast_bytes=0, weight_copy_bytes=0),
    "bf16": Precision("bf16", compute_bytes=2, cast_bytes=2 + 4, weight_copy_bytes=2),
    "bf16-model": Precision("bf16-model", compute_bytes=2, cast_bytes=0, weight_copy_bytes=0, activation_bytes=2,
                            weight_bytes=2, peak_dtype="bf16", planning_only=True,
                            about="the model in bf16 with fp32 master weights, as Megatron-LM trains"),
    "fp8": Precision("fp8", compute_bytes=2, cast_bytes=0, weight_copy_bytes=0, activation_bytes=2, weight_bytes=2,
                     peak_dtype="bf16", planning_only=True, matmul_peak_dtype="fp8",
                     about="Transformer Engine's fp8 matmuls in a bf16 model, a what-if"),
}
FP8_CAST_BYTES = 3  # a cast to fp8 reads 2 bytes (bf16) and writes 1 per element
DEFAULT_PRECISION = "fp32"  # where nothing else decides: the executor, an old plan or costs file


def check_precision(value: Any, trained: bool = False) -> str:
    """``value`` if it names a precision (one the executor trains, if ``trained``), else a one-line
    error listing the choices."""
    choices = [name for name, p in PRECISIONS.items() if not (trained and p.planning_only)]
    if value not in choices:
        if value in PRECISIONS:
            raise GpipeInputError(f"precision {value} is a planning option ({PRECISIONS[value].about}); the executor "
                                  f"trains {', '.join(choices)}")
        raise GpipeInputError(f"unknown precision {value!r}; choose one of {', '.join(choices)}")
    return value


def precision_of(name: str) -> Precision:
    return PRECISIONS[check_precision(name)]


def choose_precision(given: str | None, device: Any, measured: str | None = None) -> str:
    """The precision a prediction uses: ``given`` (``--precision``), else the one the costs file was
    ``measured`` at, else the ``device``'s default (``sim.catalog.hardware.Device.default_precision``).

    A ``given`` precision that contradicts the costs file, or that the device has no peak for
    (analytic costs only), is a one-line error.
    """
    if given is not None:
        check_precision(given)
        if measured is not None and given != measured:
            raise GpipeInputError(f"--precision {given} contradicts the costs file, which was measured at "
                                  f"{measured}; drop --precision or run gpipe calibrate --precision {given}")
    chosen = given or measured or device.default_precision
    precision = precision_of(chosen)
    if measured is None and precision.fp8_casts and "fp8" not in device.peak_flops:
        raise GpipeInputError(f"device {device.name} has no fp8 units in the catalog (Hopper, Blackwell and "
                              f"MI300-class GPUs do); use --precision bf16-model there")
    if measured is None and precision.peak not in device.peak_flops:
        raise GpipeInputError(
            f"device {device.name} has no {chosen} units in the catalog; use --precision "
            f"{device.default_precision}, or measure it with gpipe calibrate --precision {chosen}")
    return chosen
