"""Tiny scenarios the simulator's tests share: the ideal system, a timeline as literal spans,
uniform layers with the executor's gaps between actions, and layers of given forward times."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sim.catalog.hardware import Device, get_system
from sim.engine.host import HostEffects
from sim.workloads.workload import LayerCost, UniformWorkload, WorkloadCapabilities

IDEAL = get_system("ideal")


def spans(result, kinds=("F", "R", "B")):
    """The result's actions of ``kinds`` as (stage, "F0", start ms, end ms), by stage then start."""
    return [(r.stage, f"{r.kind}{r.microbatch}", round(r.start_s * 1e3, 9), round(r.end_s * 1e3, 9))
            for r in sorted(result.timeline.records, key=lambda r: (r.stage, r.start_s)) if r.kind in kinds]


class GappedWorkload(UniformWorkload):
    """Uniform layers whose stages carry the executor's time between two actions (as measured costs do)."""

    def __init__(self, layers: int, gap_s: float, send_s: float = 0.0, backward_gap_s: float | None = None,
                 cold_s: tuple[float, ...] = (), warm_s: float = 0.0) -> None:
        super().__init__(layers)
        self.warm_s = warm_s  # what a device loses after a long wait (sim.engine.host)
        self.send_s = send_s
        after_backward = gap_s if backward_gap_s is None else backward_gap_s
        self.gaps = (gap_s, gap_s, after_backward, gap_s, gap_s)  # after F, R, B, I, W
        self.cold = cold_s  # what F, R, B, I, W add when they start cold

    def stage_cost(self, rows, first, end, device):
        from dataclasses import replace

        from sim.engine.stage_costs import sum_stage

        return replace(sum_stage(self.layer_costs(rows, device)[first:end]), gap_after_s=self.gaps,
                       cold_start_s=self.cold, host=HostEffects(self.warm_s), activation_send_s=self.send_s if end < self.num_layers else 0.0,
                       gradient_send_s=self.send_s if first > 0 else 0.0)


@dataclass(frozen=True)
class ListWorkload(WorkloadCapabilities):
    """Layers with the given forward times; backward twice forward; memory per layer from args."""

    forward_s: Sequence[float]
    saved_bytes: int = 10
    input_bytes: int = 1
    param_bytes: int = 100
    name: str = "list"

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    def layer_costs(self, rows: int, device: Device) -> list[LayerCost]:
        return [LayerCost(name=f"layer{i}", forward_s=f * rows, backward_s=2 * f * rows, recompute_s=f * rows,
                          saved_bytes=self.saved_bytes * rows, output_bytes=self.input_bytes * rows,
                          input_bytes=self.input_bytes * rows, param_bytes=self.param_bytes,
                          grad_bytes=self.param_bytes, optimizer_bytes=0)
                for i, f in enumerate(self.forward_s)]

    def describe(self) -> dict:
        return {"name": self.name, "options": {}, "num_layers": self.num_layers, "parameter_count": 0}
