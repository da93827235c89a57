"""Per-stage costs: a workload's layer costs summed over the layers a partition gives each stage.

Memory accounting, shared with the executor's measurement: a stage holds its static bytes
(parameters, gradients, optimizer state) all step long. For a micro-batch that is not re-materialized
it holds every tensor its layers save for backward from the forward until the backward; for one that
is, it holds only the stage's boundary input (the stash) until the recompute, then everything saved.
This assumes the stage's first layer saves its own input for backward (true of Linear, Conv,
LayerNorm and Embedding), so the stash is counted once, inside ``saved_bytes``. Transient working
memory inside an op, gradients in flight and allocator fragmentation are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sim.hardware import Device
from sim.workload import LayerCost, Workload


@dataclass(frozen=True)
class StageCost:
    """One stage's costs for a micro-batch of a given size."""

    forward_s: float
    backward_s: float
    recompute_s: float
    saved_bytes: int  # held per micro-batch from forward (or recompute) to backward
    stash_bytes: int  # held per micro-batch from forward to recompute under re-materialization
    output_bytes: int  # sent to the next stage per micro-batch; its gradient comes back
    static_bytes: int  # parameters + gradients + optimizer state
    optimizer_s: float  # once per step


def stage_bounds(partition: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first_layer, end_layer), ...]`` for layers per stage ``partition``."""
    bounds, start = [], 0
    for count in partition:
        bounds.append((start, start + count))
        start += count
    return bounds


def sum_stage(layers: Sequence[LayerCost]) -> StageCost:
    return StageCost(
        forward_s=sum(c.forward_s for c in layers),
        backward_s=sum(c.backward_s for c in layers),
        recompute_s=sum(c.recompute_s for c in layers),
        saved_bytes=sum(c.saved_bytes for c in layers),
        stash_bytes=layers[0].input_bytes,
        output_bytes=layers[-1].output_bytes,
        static_bytes=sum(c.param_bytes + c.grad_bytes + c.optimizer_bytes for c in layers),
        optimizer_s=sum(c.optimizer_s for c in layers),
    )


class CostTable:
    """Caches ``workload.layer_costs(rows, device)`` and stage sums.

    The planner asks for the same micro-batch sizes over and over; this keeps that cheap.
    """

    def __init__(self, workload: Workload, device: Device) -> None:
        self.workload = workload
        self.device = device
        self._layers: dict[int, tuple[LayerCost, ...]] = {}
        self._stages: dict[tuple[int, int, int], StageCost] = {}

    def layers(self, rows: int) -> tuple[LayerCost, ...]:
        if rows not in self._layers:
            self._layers[rows] = tuple(self.workload.layer_costs(rows, self.device))
        return self._layers[rows]

    def stage(self, rows: int, first: int, end: int) -> StageCost:
        key = (rows, first, end)
        if key not in self._stages:
            # A workload may know its stages better than a sum of layers (measured costs hold the
            # exact union of saved storages and per-action constants): calibrate.costs uses this.
            exact = getattr(self.workload, "stage_cost", None)
            self._stages[key] = (exact(rows, first, end, self.device) if exact is not None
                                 else sum_stage(self.layers(rows)[first:end]))
        return self._stages[key]

    def stages(self, rows: int, partition: Sequence[int]) -> list[StageCost]:
        return [self.stage(rows, first, end) for first, end in stage_bounds(partition)]
