"""Per-stage costs: a workload's layer costs summed over the layers a partition gives each stage.

Memory accounting, shared with the executor's measurement: a stage holds its static bytes
(parameters, gradients, optimizer state) all step long. For a micro-batch that is not re-materialized
it holds every tensor its layers save for backward from the forward until the backward; for one that
is, it holds only the stage's boundary input (the stash) until the recompute, then everything saved.
When the stage's first layer saves its own input for backward (true of Linear, Conv, LayerNorm and
Embedding in fp32), the stash is counted once, inside ``saved_bytes``; when it does not
(``LayerCost.saves_input`` false: under bf16 autocast a Linear saves a bf16 cast of an fp32 input,
and a pooling head saves nothing of it), the input is added to the stage's ``saved_bytes``, since the
stage holds it until the backward all the same. Transient working memory inside an op, gradients in
flight and allocator fragmentation are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from sim.catalog.hardware import Device
from sim.engine.host import NO_HOST_EFFECTS, HostEffects
from sim.schedules.schedule import recomputes_attention_core, recomputes_ops, recomputes_per_layer
from sim.workloads.workload import LayerCost, SharedParameter, Workload, shared_parameters


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
    step_overhead_s: float = 0.0  # once per step, fitted by calibration: what spans do not explain
    # the executor's own time after an action of each kind, in COMPUTE_KINDS order (F, R, B, I, W),
    # before the device's next action (its loop, freeing a backward's graph, posting receives,
    # unpacking the next message): neither busy nor waiting; measured by calibration from the
    # timeline's gaps, none (empty) in the analytic models
    gap_after_s: tuple[float, ...] = ()
    # what an action of each kind, in COMPUTE_KINDS order, adds when it starts cold
    # (sim.schedules.schedule.cold_starts: the first of a device's list, the step's first): busy time; fitted by
    # calibration, none (empty) in the analytic models
    cold_start_s: tuple[float, ...] = ()
    # what a CPU host adds to the stage's actions (sim.engine.host: the warm-up after waits); off
    # (NO_HOST_EFFECTS) unless a costs file measured on a CPU host turns it on
    host: HostEffects = NO_HOST_EFFECTS
    # the sender's own time in a send to another device, after a forward (its output) and after a
    # backward or I (its input's gradient): device time, not busy; measured by calibration, 0 in the
    # analytic models, whose sends are asynchronous
    activation_send_s: float = 0.0
    gradient_send_s: float = 0.0
    # --checkpoint full: every layer's input, held per micro-batch from forward to backward, and the most
    # one layer's recompute adds during the backward to what is still held (inputs of the layers not yet
    # done, the layer's own saved tensors); see per_layer_bytes
    layer_inputs_bytes: int = 0
    layer_transient_bytes: int = 0
    # --checkpoint selective: the attention cores' saved bytes, not held, and their recompute time
    core_saved_bytes: int = 0
    core_recompute_s: float = 0.0
    # --checkpoint selective_op: the blocks' bytes not kept, and their rerun inside the backward
    op_dropped_bytes: int = 0
    op_recompute_s: float = 0.0
    # split-backward schedules: the part of backward_s that is the weight gradients (W), and what
    # splitting adds to I + W beyond the whole backward (a second autograd call, the kept graph; measured
    # by calibration, 0 in the analytic models)
    weight_grad_s: float = 0.0
    split_overhead_s: float = 0.0
    # the first stage's split backward, whose I computes no gradient and whose W is the whole backward:
    # W's time where calibration measured it on a line of its own (None: the whole backward's time),
    # and I's (the executor's own work around it; 0 in the analytic models)
    first_weight_grad_s: float | None = None
    first_input_s: float = 0.0
    # --checkpoint full: a backward that recomputes each layer just before its own backward, with the
    # time per layer calibration measured beyond the backward's time plus the recompute's (None: that sum)
    full_backward_s: float | None = None
    # deviations of a device's compute in one step from its typical, as an equally weighted sample
    # (quantiles): how late the slowest of D replicas finishes (sim.engine.stragglers); measured by
    # calibration, none in the analytic models
    replica_spread: tuple[float, ...] = ()
    # ZeRO-2/3 (sim.engine.fsdp): the parameter gathers and gradient reductions an action leaves
    # exposed beyond the compute they overlap, paid as communication, not busy time: before it, every
    # forward's gathers (K = 1), the chunk's first forward's alone (K > 1: gathered once per step)
    # and a backward's (or W's) gathers (ZeRO-3, K = 1); after a backward (or W), its reduce-scatters
    # (gradient sync microbatch; the device's last backward's are the step's tail instead)
    fsdp_forward_gather_s: float = 0.0
    fsdp_first_forward_gather_s: float = 0.0
    fsdp_backward_gather_s: float = 0.0
    fsdp_backward_reduce_s: float = 0.0
    # expert parallelism: of forward_s and backward_s, the all-to-alls no compute hides (dispatch and combine,
    # shown as spans of their own inside the action; sim.workloads.moe.expert_parallel)
    ep_forward_s: float = 0.0
    ep_backward_s: float = 0.0


WEIGHT_GRAD_SHARE = 0.5  # of the backward of a layer with weights


def layer_weight_grad_s(backward_s: float, param_bytes: int) -> float:
    """The weight-gradient part (W) of a layer's backward (less its all-to-alls under expert
    parallelism, which the input gradient's I action runs), by the analytic rule: a layer with weights
    spends half its backward on them (a matmul's weight gradient costs as many FLOPs as its input
    gradient), a layer without weights none. Limits: a layer that also runs weightless work (an
    attention core inside a transformer block) has that work counted half in W too, so W is
    overestimated there; I and W are not profiled apart yet."""
    return WEIGHT_GRAD_SHARE * backward_s if param_bytes else 0.0


def input_grad_time_s(cost: StageCost, checkpoint: str, first: bool) -> float:
    """An I action's time: the backward less its weight gradients, plus what the split costs; on
    the first (virtual) stage, whose input needs no gradient, only the executor's work around it."""
    if first:
        return cost.first_input_s
    return max(0.0, backward_time_s(cost, checkpoint) - cost.weight_grad_s) + cost.split_overhead_s


def weight_grad_time_s(cost: StageCost, checkpoint: str, first: bool) -> float:
    """A W action's time: the weight gradients; the whole backward on the first (virtual) stage, at
    the time calibration measured for it there where it did."""
    if not first:
        return cost.weight_grad_s
    if cost.first_weight_grad_s is None:
        return backward_time_s(cost, checkpoint)
    return backward_time_s(cost, checkpoint) - cost.backward_s + cost.first_weight_grad_s


def stage_bounds(partition: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first_layer, end_layer), ...]`` for layers per stage ``partition``."""
    bounds, start = [], 0
    for count in partition:
        bounds.append((start, start + count))
        start += count
    return bounds


def held_input_bytes(first: LayerCost) -> int:
    """Bytes of the stage's input held until the backward besides what its layers save."""
    return 0 if first.saves_input else first.input_bytes


def stage_of_layers(partition: Sequence[int]) -> list[int]:
    """The stage of every layer, in layer order, for layers per stage ``partition``."""
    return [k for k, count in enumerate(partition) for _ in range(count)]


def per_layer_bytes(inputs: Sequence[int], alone: Sequence[int]) -> tuple[int, int]:
    """(held, transient) of ``--checkpoint full`` over a stage's layers, from each layer's input bytes
    and what it saves as a stage of its own (``alone``, its input included). Every layer's input is
    kept until the micro-batch's backward, which runs the layers last to first, recomputing each just
    before its own backward: then the inputs of it and the layers before it are still held and its
    saved tensors are alive; each input is freed after its layer's backward. So the backward's peak is
    max_i(sum_{j<=i} in_j + alone_i - in_i), the transient being that less all the inputs."""
    running, peak = 0, 0
    for held, saved in zip(inputs, alone):
        running += held
        peak = max(peak, running + saved - held)
    return running, max(0, peak - running)


def layer_alone_bytes(cost: LayerCost) -> int:
    """What one layer holds as a stage of its own: its saved tensors, and its input if it does not save it."""
    return cost.saved_bytes + held_input_bytes(cost)


def rerun_in_backward_s(cost: StageCost | LayerCost, checkpoint: str) -> float:
    """What ``checkpoint`` reruns inside a backward of ``cost`` (a stage's or one layer's): every layer
    (``full``), the attention cores (``selective``), what ``selective_op`` dropped; 0 otherwise."""
    if recomputes_per_layer(checkpoint):
        return cost.recompute_s
    if recomputes_attention_core(checkpoint):
        return cost.core_recompute_s
    if recomputes_ops(checkpoint):
        return cost.op_recompute_s
    return 0.0


def dropped_bytes(cost: StageCost | LayerCost, checkpoint: str) -> int:
    """Of ``cost``'s saved bytes, those ``selective`` (the attention cores') or ``selective_op`` does not
    keep until the backward; 0 for the other policies, whose held bytes are counted apart."""
    if recomputes_attention_core(checkpoint):
        return cost.core_saved_bytes
    if recomputes_ops(checkpoint):
        return cost.op_dropped_bytes
    return 0


def backward_time_s(cost: StageCost, checkpoint: str) -> float:
    """A backward action's time: with what its policy reruns inside it (:func:`rerun_in_backward_s`), under
    ``--checkpoint full`` the time per layer calibration measured for it, where it did."""
    if recomputes_per_layer(checkpoint) and cost.full_backward_s is not None:
        return cost.full_backward_s
    return cost.backward_s + rerun_in_backward_s(cost, checkpoint)


def held_sizes(cost: StageCost, checkpoint: str) -> tuple[int, int, int]:
    """(stash, saved, transient) bytes for the counts of :func:`sim.engine.memory.peak_coefficients`: what a
    micro-batch holds until its recompute, from then (or its forward) until its backward, and what a
    backward adds while it runs (``full`` only)."""
    if recomputes_per_layer(checkpoint):
        return 0, cost.layer_inputs_bytes, cost.layer_transient_bytes
    return cost.stash_bytes, cost.saved_bytes - dropped_bytes(cost, checkpoint), 0


def sum_stage(layers: Sequence[LayerCost]) -> StageCost:
    inputs, transient = per_layer_bytes([c.input_bytes for c in layers], [layer_alone_bytes(c) for c in layers])
    return StageCost(
        forward_s=sum(c.forward_s for c in layers),
        backward_s=sum(c.backward_s for c in layers),
        recompute_s=sum(c.recompute_s for c in layers),
        saved_bytes=sum(c.saved_bytes for c in layers) + held_input_bytes(layers[0]),
        stash_bytes=layers[0].input_bytes,
        output_bytes=layers[-1].output_bytes,
        static_bytes=sum(c.param_bytes + c.grad_bytes + c.optimizer_bytes for c in layers),
        optimizer_s=sum(c.optimizer_s for c in layers),
        layer_inputs_bytes=inputs, layer_transient_bytes=transient,
        core_saved_bytes=sum(c.core_saved_bytes for c in layers), core_recompute_s=sum(c.core_recompute_s for c in layers),
        op_dropped_bytes=sum(c.op_dropped_bytes for c in layers), op_recompute_s=sum(c.op_recompute_s for c in layers),
        weight_grad_s=sum(layer_weight_grad_s(c.backward_s - c.ep_backward_s, c.param_bytes) for c in layers),
        ep_forward_s=sum(c.ep_forward_s for c in layers), ep_backward_s=sum(c.ep_backward_s for c in layers),
    )


def duplicate_static_bytes(shared: Sequence[SharedParameter], first: int, end: int) -> int:
    """Static bytes the layers [first, end) count more than once: a parameter two of them share is
    held once by the stage, but summed once per layer."""
    total = 0
    for parameter in shared:
        inside = sum(first <= layer < end for layer in parameter.layers)
        if inside > 1:
            total += (inside - 1) * parameter.static_bytes
    return total


class CostTable:
    """Caches ``workload.layer_costs(rows, device)`` and stage sums.

    The planner asks for the same micro-batch sizes over and over; this keeps that cheap.
    """

    def __init__(self, workload: Workload, device: Device) -> None:
        self.workload = workload
        self.device = device
        self._layers: dict[int, tuple[LayerCost, ...]] = {}
        self._stages: dict[tuple[int, int, int], StageCost] = {}
        self._prefix: dict[int, list[tuple[float, ...]]] = {}  # rows -> _prefix_sums
        self._exact = workload.stage_cost
        self._shared = shared_parameters(workload)
        self._state_bytes: dict[tuple[int, int], tuple[int, int]] = {}
        self._experts_split = workload.expert_parallel > 1

    def layers(self, rows: int) -> tuple[LayerCost, ...]:
        if rows not in self._layers:
            self._layers[rows] = tuple(self.workload.layer_costs(rows, self.device))
        return self._layers[rows]

    def _prefix_sums(self, rows: int) -> list[tuple[float, ...]]:
        """Running sums of (forward, backward, recompute, saved, static, optimizer, core saved, core
        recompute, weight gradients, selective_op's dropped bytes, its recompute) over layers."""
        if rows not in self._prefix:
            sums = [(0.0, 0.0, 0.0, 0, 0, 0.0, 0, 0.0, 0.0, 0, 0.0)]
            for c in self.layers(rows):
                f, b, r, saved, static, opt, core, core_s, weight, dropped, op_s = sums[-1]
                sums.append((f + c.forward_s, b + c.backward_s, r + c.recompute_s, saved + c.saved_bytes,
                             static + c.param_bytes + c.grad_bytes + c.optimizer_bytes, opt + c.optimizer_s,
                             core + c.core_saved_bytes, core_s + c.core_recompute_s,
                             weight + layer_weight_grad_s(c.backward_s - c.ep_backward_s, c.param_bytes),
                             dropped + c.op_dropped_bytes, op_s + c.op_recompute_s))
            self._prefix[rows] = sums
        return self._prefix[rows]

    def stage(self, rows: int, first: int, end: int) -> StageCost:
        key = (rows, first, end)
        cost = self._stages.get(key)
        if cost is None:
            if self._exact is not None:
                # A workload may know its stages better than a sum of layers (measured costs hold the
                # exact union of saved storages and per-action constants): sim.formats.costs uses this.
                cost = self._exact(rows, first, end, self.device)
            else:  # sum_stage, in O(1) from running sums
                sums, layers = self._prefix_sums(rows), self.layers(rows)
                low, high = sums[first], sums[end]
                saved = high[3] - low[3] + held_input_bytes(layers[first])
                inputs, transient = per_layer_bytes([c.input_bytes for c in layers[first:end]],
                                                    [layer_alone_bytes(c) for c in layers[first:end]])
                cost = StageCost(high[0] - low[0], high[1] - low[1], high[2] - low[2], saved,
                                 layers[first].input_bytes, layers[end - 1].output_bytes, high[4] - low[4],
                                 high[5] - low[5], layer_inputs_bytes=inputs, layer_transient_bytes=transient,
                                 core_saved_bytes=high[6] - low[6], core_recompute_s=high[7] - low[7],
                                 weight_grad_s=high[8] - low[8], op_dropped_bytes=high[9] - low[9],
                                 op_recompute_s=high[10] - low[10])
            if self._shared:
                cost = replace(cost, static_bytes=cost.static_bytes - duplicate_static_bytes(self._shared, first, end))
            if self._experts_split and self._exact is None:
                layers = self.layers(rows)[first:end]
                cost = replace(cost, ep_forward_s=sum(c.ep_forward_s for c in layers),
                               ep_backward_s=sum(c.ep_backward_s for c in layers))
            self._stages[key] = cost
        return cost

    def stages(self, rows: int, partition: Sequence[int]) -> list[StageCost]:
        return [self.stage(rows, first, end) for first, end in stage_bounds(partition)]

    def gradient_and_optimizer_bytes(self, rows: int, first: int, end: int) -> tuple[int, int]:
        """(weight-gradient bytes, optimizer-state bytes) the layers [first, end) hold, a shared
        parameter counted once: what a data-parallel all-reduce moves and what ZeRO-1 shards."""
        key = (first, end)
        found = self._state_bytes.get(key)
        if found is None:
            layers = self.layers(rows)[first:end]
            gradient = sum(c.grad_bytes for c in layers)
            optimizer = sum(c.optimizer_bytes for c in layers)
            for parameter in self._shared:
                extra = sum(first <= layer < end for layer in parameter.layers) - 1
                if extra > 0:
                    gradient -= extra * parameter.param_bytes
                    optimizer -= extra * max(0, parameter.static_bytes - 2 * parameter.param_bytes)
            found = self._state_bytes[key] = (max(0, gradient), max(0, optimizer))
        return found

    def expert_gradient_bytes(self, rows: int, first: int, end: int) -> int:
        """The routed experts' gradient bytes of the layers [first, end) (0 without expert parallelism):
        what is reduced over the expert-data-parallel group rather than all D replicas."""
        if not self._experts_split:
            return 0
        return sum(c.expert_grad_bytes for c in self.layers(rows)[first:end])
