"""Training precision: one name (``fp32``, ``bf16``, ``fp8``) and what it means for bytes and FLOP/s.

``bf16`` means what the people who train on a device mean by it, so it has two meanings:

- **The trainers' mixed precision** (internal name ``bf16-model``, kept as a synonym): as Megatron-LM's
  ``--bf16``, NeMo and torchtitan train on GPUs. The model's weights (a bf16 copy) and every activation (the
  residual stream and the norms' inputs included) are bf16 and the matmuls run at the bf16 peak, so
  nothing is cast per step; gradients are accumulated and reduced in fp32 (4 bytes per parameter) and
  the optimizer keeps an fp32 master copy of the weights beside its state (4 more). This is what
  ``bf16`` means in a runs file (``gpipe replay``, :mod:`sim.evidence.replay`) and when ``gpipe simulate``
  and ``gpipe plan`` price a GPU trainers run on (:func:`trainers_gpu`) for a model this is modelled for
  (:func:`prices_trainers_precision`: the built-in transformer and the named models planned by its shape).
- **torch's autocast** (internal name ``bf16``; ``bf16-autocast`` names it everywhere): what ``gpipe
  train --precision bf16`` runs, ``torch.autocast(device_type, dtype=torch.bfloat16)``. The weights stay
  fp32 (the master copy the optimizer updates), so do their gradients and the optimizer state; matmuls
  and convolutions read and write bf16 and run at the device's bf16 peak. Autocast casts each weight a
  matmul uses to bf16 once per autocast region (a cached copy, 2 bytes per element), and the matmul
  saves that copy for its backward, so every micro-batch whose graph is alive holds its own copy (the
  executor enters autocast once per forward). Ops on autocast's fp32 list (layer_norm, softmax, the
  losses, ...) run in fp32 and save fp32 tensors; a residual stream that starts in fp32 stays fp32,
  since an add promotes. ``bf16`` means this on a CPU, on TPUs and older GPUs, for the mlp, the cnn
  and models measured on the meta device (the only bf16 modelled for them), and for a costs file
  measured at bf16. Plan what ``gpipe train`` would run on a GPU with ``--precision bf16-autocast``.

The two differ in memory and traffic, not in FLOPs: autocast keeps 16 bytes a parameter with Adam (fp32
weights, gradients, two moments) plus a 2-byte weight copy per micro-batch in flight, moves the
residual stream, the norms and the softmax in fp32 and pays a cast before every matmul; the trainers'
scheme keeps 18 bytes a parameter (bf16 weights, fp32 gradients, master weights and moments) and
moves every activation in bf16.

``fp8`` is Transformer Engine's fp8 training as NeMo runs it on Hopper and Blackwell, on devices with
fp8 units: the trainers' mixed precision with each transformer layer's four projection matmuls (QKV,
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
                            about="the trainers' mixed precision: the model in bf16 with fp32 master weights and "
                                  "gradients, as Megatron-LM trains"),
    "fp8": Precision("fp8", compute_bytes=2, cast_bytes=0, weight_copy_bytes=0, activation_bytes=2, weight_bytes=2,
                     peak_dtype="bf16", planning_only=True, matmul_peak_dtype="fp8",
                     about="Transformer Engine's fp8 matmuls in a bf16 model, a what-if"),
}
# Other names a user may give, and the precision each always means
SYNONYMS = {"bf16-autocast": "bf16"}
TRAINERS_BF16 = "bf16-model"  # what bf16 means where the trainers' meaning applies
FP8_CAST_BYTES = 3  # a cast to fp8 reads 2 bytes (bf16) and writes 1 per element
DEFAULT_PRECISION = "fp32"  # where nothing else decides: the executor, an old plan or costs file


def check_precision(value: Any, trained: bool = False) -> str:
    """The precision ``value`` names (a synonym as the precision it stands for), if one the executor
    trains when ``trained``; else a one-line error listing the choices."""
    name = SYNONYMS.get(value, value) if isinstance(value, str) else value
    choices = [name for name, p in PRECISIONS.items() if not (trained and p.planning_only)]
    if name not in choices:
        if name in PRECISIONS:
            raise GpipeInputError(f"precision {value} is a planning option ({PRECISIONS[name].about}); the executor "
                                  f"trains {' and '.join(choices)} (torch's autocast): plan with --precision "
                                  "bf16-autocast to price what it runs")
        named = choices if trained else [choices[0], choices[1], *SYNONYMS, *choices[2:]]
        raise GpipeInputError(f"unknown precision {value!r}; choose one of {', '.join(named)}")
    return name


def precision_of(name: str) -> Precision:
    return PRECISIONS[check_precision(name)]


def trainers_gpu(device: Any) -> bool:
    """Whether ``device`` is a GPU that Megatron-LM, NeMo and torchtitan train on in their mixed
    precision: those the catalog marks as running flash attention (``Device.flash_attention``: NVIDIA
    Ampere and later, AMD CDNA3). TPUs, older GPUs and the CPU are not."""
    return bool(getattr(device, "flash_attention", False))


def prices_trainers_precision(model: str | None) -> bool:
    """Whether ``model`` is priced in the trainers' mixed precision: the built-in transformer, the
    named models planned as it (:mod:`sim.workloads.named_models`) and Hugging Face models priced by
    their structure (:mod:`sim.workloads.decoder_shape`). The mlp, the cnn and models measured on the
    meta device are priced under autocast only."""
    from sim.workloads.named_models import is_named

    return model == "transformer" or is_named(model) or bool(model) and model.startswith(("hf:", "hf-config:"))


def trainers_precision(name: Any) -> str:
    """The precision ``name`` means in a runs file of published runs: ``bf16`` is the trainers' mixed
    precision (``bf16-model``), ``bf16-autocast`` torch's autocast; one line if it names none."""
    return TRAINERS_BF16 if name == "bf16" else check_precision(name)


def planned_precision(name: str, device: Any, model: str | None) -> str:
    """The precision ``name`` means when ``model`` is planned on ``device``: ``bf16`` is the trainers'
    mixed precision on a GPU they train on (:func:`trainers_gpu`) for a model priced so
    (:func:`prices_trainers_precision`), autocast elsewhere."""
    if name == "bf16" and trainers_gpu(device) and prices_trainers_precision(model):
        return TRAINERS_BF16
    return check_precision(name)


def choose_precision(given: str | None, device: Any, measured: str | None = None, model: str | None = None) -> str:
    """The precision a prediction uses: ``given`` (``--precision``), else the one the costs file was
    ``measured`` at, else the ``device``'s default (``sim.catalog.hardware.Device.default_precision``);
    with ``model``, ``bf16`` in the meaning it has for that model on that device
    (:func:`planned_precision`; a costs file's is the precision it measured).

    A ``given`` precision that contradicts the costs file, or that the device has no peak for
    (analytic costs only), is a one-line error.
    """
    if given is not None:
        if measured is not None and check_precision(given) != measured:
            raise GpipeInputError(f"--precision {given} contradicts the costs file, which was measured at "
                                  f"{measured}; drop --precision or run gpipe calibrate --precision {given}")
    chosen = given or measured or device.default_precision
    chosen = planned_precision(chosen, device, model) if measured is None and model is not None \
        else check_precision(chosen)
    precision = precision_of(chosen)
    if measured is None and precision.fp8_casts and "fp8" not in device.peak_flops:
        raise GpipeInputError(f"device {device.name} has no fp8 units in the catalog (Hopper, Blackwell and "
                              f"MI300-class GPUs do); use --precision {device.default_precision} there")
    if measured is None and precision.peak not in device.peak_flops:
        raise GpipeInputError(
            f"device {device.name} has no {chosen} units in the catalog; use --precision "
            f"{device.default_precision}, or measure it with gpipe calibrate --precision {chosen}")
    return chosen
