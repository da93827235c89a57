"""A model measured layer by layer (FLOPs, bytes moved, bytes held), costed on any device's roofline.

The measurements come from running each pipeline layer on tensors without storage (fake CPU
tensors on PyTorch's meta device, under autocast for bf16: :mod:`calibrate.measure.meta_profile` does that;
this module never imports torch): FLOPs forward and backward, bytes every op reads and writes, bytes
saved for backward, and the layer's input, output and parameter sizes, at ``MEASURED_ROWS``
micro-batch rows. Every quantity is affine in the rows
for layers that treat samples independently, so rows beyond the last two measured lie on their line.

Times come from the roofline of :mod:`sim.workloads.models`: ``max(F / achieved FLOP/s, B / achieved
bandwidth) + LAYER_OVERHEAD_S`` per pass at the workload's precision, the device's ``efficiency``
being the calibrated one when the caller supplies it (``--efficiency`` or a costs file), else
``sim.catalog.hardware.DEFAULT_EFFICIENCY``. Weights, gradients and optimizer state are fp32 in either
precision (:mod:`sim.workloads.precision`).

Limits: what the meta kernels do is what is counted, which is eager PyTorch (no fusion, no flash
attention unless the model calls ``scaled_dot_product_attention``); transient workspace, the
loss after the last layer and allocator fragmentation are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from sim.catalog.hardware import Device
from sim.errors import GpipeInputError
from sim.workloads.models import LAYER_OVERHEAD_S
from sim.workloads.precision import DEFAULT_PRECISION, FP32_BYTES, precision_of
from sim.workloads.workload import LayerCost, SharedParameter, WorkloadCapabilities

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
    input_saved_bytes: float = 0.0  # the input's own storage, when an op saves it (else 0)

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


@dataclass(frozen=True)
class SharedTensor:
    """A parameter several layers use: its name in the first, the layers, its element count."""

    name: str
    layers: tuple[int, ...]
    numel: int


class MetaWorkload(WorkloadCapabilities):
    """A :class:`sim.workloads.workload.Workload` from meta-device measurements, costed by the roofline."""

    def __init__(self, name: str, options: dict[str, Any], profiles: Sequence[LayerProfile],
                 precision: str = DEFAULT_PRECISION, optimizer_slots: int = 2,
                 analysis_s: float = 0.0, shared: Sequence[SharedTensor] = ()) -> None:
        self.name = name
        self.options = dict(options)
        self.profiles = tuple(profiles)
        self.num_layers = len(self.profiles)
        if precision_of(precision).planning_only:
            raise GpipeInputError(f"precision {precision} is modelled for the built-in transformer only, not {name}; "
                                  "use bf16 (autocast)")
        self.precision = precision
        self.optimizer_slots = optimizer_slots
        self.analysis_s = analysis_s
        self.shared = tuple(shared)
        self._cache: dict[tuple[int, str, float, float, float], list[LayerCost]] = {}

    @property
    def parameter_count(self) -> int:
        """Parameters of the model, a shared one counted once."""
        duplicates = sum(t.numel * (len(t.layers) - 1) for t in self.shared)
        return sum(p.parameters for p in self.profiles) - duplicates

    @property
    def shared_parameters(self) -> tuple[SharedParameter, ...]:
        per_element = FP32_BYTES  # fp32 master weights in either precision
        return tuple(SharedParameter(t.name, t.layers, t.numel * per_element,
                                     t.numel * per_element * (2 + self.optimizer_slots)) for t in self.shared)

    def layer_costs(self, rows: int, device: Device) -> list[LayerCost]:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
            raise GpipeInputError(f"micro-batch rows must be a positive integer, got {rows!r}")
        key = (rows, device.name, device.efficiency, device.bandwidth_efficiency, device.optimizer_bandwidth(),
               device.peak_flops.get(self.precision, 0.0))
        if key not in self._cache:
            flops_s, bytes_s = device.achieved_flops(self.precision), device.achieved_bandwidth()
            self._cache[key] = [self._cost(p, p.at(rows), flops_s, bytes_s, device.optimizer_bandwidth())
                                for p in self.profiles]
        return list(self._cache[key])

    def _cost(self, profile: LayerProfile, m: LayerMeasure, flops_s: float, bytes_s: float,
              optimizer_bytes_s: float) -> LayerCost:
        forward_s = max(m.forward_flops / flops_s, m.forward_bytes / bytes_s) + LAYER_OVERHEAD_S
        backward_s = max(m.backward_flops / flops_s, m.backward_bytes / bytes_s) + 2 * LAYER_OVERHEAD_S
        param_bytes = profile.parameters * FP32_BYTES  # fp32 master weights in either precision
        return LayerCost(
            name=profile.name, forward_s=forward_s, backward_s=backward_s, recompute_s=forward_s,
            saved_bytes=round(m.saved_bytes), output_bytes=round(m.output_bytes),
            input_bytes=round(m.input_bytes), param_bytes=param_bytes, grad_bytes=param_bytes,
            optimizer_bytes=self.optimizer_slots * param_bytes,
            saves_input=m.input_saved_bytes > 0 or m.input_bytes == 0,
            # elementwise update: read weight, grad and slots, write weight and slots (as sim.workloads.models)
            optimizer_s=(3 + 2 * self.optimizer_slots) * param_bytes / optimizer_bytes_s,
        )

    def describe(self) -> dict:
        return {"name": self.name, "options": dict(self.options), "num_layers": self.num_layers,
                "parameter_count": self.parameter_count}
