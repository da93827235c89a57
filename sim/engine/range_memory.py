"""What every contiguous range of layers holds as one chunk, for all ranges at once (numpy).

The planner's memory-constrained partition asks, for each first layer, how far a chunk may reach and
still fit a device: thousands of times for a large search. Each answer is static bytes plus a peak of
activation counts times the chunk's (stash, saved, transient) sizes (:func:`sim.engine.stage_costs.held_sizes`),
and all of them are sums or range maxima over the layers. Here they are computed for every range
[first, end) in one pass from per-layer figures, exactly as :class:`sim.engine.stage_costs.CostTable` sums
them (integers throughout), so the planner's answers do not change, only their cost.

Not for workloads that know their stages better than a sum of layers (measured costs, which supply
``stage_cost``): the planner checks those range by range.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sim.engine.memory import Sharding, sharded_static_bytes
from sim.engine.stage_costs import dropped_bytes, held_input_bytes, layer_alone_bytes
from sim.schedules.schedule import recomputes_per_layer
from sim.workloads.workload import LayerCost, SharedParameter


def _prefix(values: Sequence[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(np.asarray(values, dtype=np.int64))))


def _range(prefix: np.ndarray) -> np.ndarray:
    """[first, end] -> prefix[end] - prefix[first], an (L, L + 1) matrix."""
    return prefix[None, :] - prefix[:-1, None]


def _gathered(params: Sequence[int]) -> np.ndarray:
    """ZeRO-3 with K = 1, per range [first, end): the most two consecutive units (layers with
    parameters) hold gathered at once, as :func:`sim.engine.fsdp.gathered_in_flight_bytes` counts them."""
    n = len(params)
    out = np.zeros((n, n + 1), dtype=np.int64)
    firsts = np.arange(n)
    previous_unit = -1
    for end in range(1, n + 1):
        layer = end - 1
        column = np.maximum(out[:, end - 1], params[layer])
        if params[layer] and previous_unit >= 0:  # the pair (previous unit, this one), in ranges holding both
            pair = np.where(firsts <= previous_unit, params[previous_unit] + params[layer], 0)
            column = np.maximum(column, pair)
        out[:, end] = column
        if params[layer]:
            previous_unit = layer
    return out


class RangeMemory:
    """Per range [first, end) of ``layers``: static bytes (weights, gradients, optimizer state, a
    shared parameter once, ZeRO's shards and gathered units under ``sharding``) and the (stash,
    saved, transient) sizes of ``checkpoint``."""

    def __init__(self, layers: Sequence[LayerCost], shared: Sequence[SharedParameter], checkpoint: str,
                 sharding: Sharding = Sharding(), expert_stride: int = 1) -> None:
        n = len(layers)
        static = _range(_prefix([c.param_bytes + c.grad_bytes + c.optimizer_bytes for c in layers]))
        optimizer = _range(_prefix([c.optimizer_bytes for c in layers]))
        gradient = _range(_prefix([c.grad_bytes for c in layers]))
        for parameter in shared:
            uses = np.zeros(n, dtype=np.int64)
            uses[list(parameter.layers)] = 1
            extra = np.maximum(_range(_prefix(uses)) - 1, 0)
            static = static - extra * parameter.static_bytes
            optimizer = optimizer - extra * max(0, parameter.static_bytes - 2 * parameter.param_bytes)
            gradient = gradient - extra * parameter.param_bytes
        optimizer = np.maximum(optimizer, 0)
        gradient = np.maximum(gradient, 0)
        experts = _range(_prefix([c.expert_grad_bytes for c in layers]))
        if sharding.zero == 1 and experts.any():  # sim.engine.memory.expert_static_bytes
            expert_state = optimizer * experts // np.maximum(gradient, 1)
            rest = optimizer - expert_state
            static = (static - optimizer + (-(-rest // sharding.ranks))
                      + (-(-expert_state // max(1, sharding.ranks // expert_stride))))
        elif sharding.zero == 1:  # sim.engine.memory.static_bytes
            static = static - optimizer + (-(-optimizer // sharding.ranks))
        elif sharding.zero >= 2:  # every range at once: sharded_static_bytes takes arrays as it takes ints
            params = np.maximum(static - gradient - optimizer, 0)
            gathered = params if sharding.holds_all else _gathered([c.param_bytes for c in layers])
            static = sharded_static_bytes(params, gradient, optimizer, gathered, sharding, experts)
        inputs = np.array([c.input_bytes for c in layers], dtype=np.int64)
        zeros = np.zeros((n, n + 1), dtype=np.int64)
        if recomputes_per_layer(checkpoint):  # sim.engine.stage_costs.per_layer_bytes, for all ranges
            running = _prefix(inputs)
            alone = np.array([layer_alone_bytes(c) for c in layers], dtype=np.int64)
            peaks = running[1:] + alone - inputs  # Q[l]: the backward's peak at layer l, less running[first]
            tops = np.full((n, n + 1), np.iinfo(np.int64).min, dtype=np.int64)
            for first in range(n):
                tops[first, first + 1:] = np.maximum.accumulate(peaks[first:])
            self.stash = zeros
            self.saved = _range(running)
            self.transient = np.maximum(tops - running[None, :], 0)
        else:
            held = np.array([held_input_bytes(c) for c in layers], dtype=np.int64)
            saved = _range(_prefix([c.saved_bytes for c in layers])) + held[:, None]
            dropped = [dropped_bytes(c, checkpoint) for c in layers]  # selective's and selective_op's
            if any(dropped):
                saved = saved - _range(_prefix(dropped))
            self.stash = np.broadcast_to(inputs[:, None], (n, n + 1))
            self.saved = saved
            self.transient = zeros
        self.static = static
        self.layers = n
        self._upper = np.arange(n + 1)[None, :] >= np.arange(n)[:, None]  # [first, e] with e >= first

    def furthest_ends(self, counts: Sequence[tuple[int, int, int]], capacity: float) -> list[int]:
        """For each first layer, the furthest end whose chunk fits ``capacity`` holding the largest of
        ``counts`` (stash, saved, transient) micro-batches; the two-pointer sweep of
        :func:`sim.planner.partition._memory_ends` over the precomputed answers."""
        peak = None
        for a, b, t in counts:
            held = b * self.saved
            if a:
                held = held + a * self.stash
            if t:
                held = held + t * self.transient
            peak = held if peak is None else np.maximum(peak, held)
        n = self.layers
        fits = (self.static + peak) <= capacity  # fits[first, end]
        # stop[first, e]: a sweep along the row stops at end e (e = n, or [first, e + 1) does not fit)
        stop = np.ones((n, n + 1), dtype=bool)
        np.logical_not(fits[:, 1:], out=stop[:, :n])
        stop &= self._upper  # from e = first on
        first_stop = stop.argmax(axis=1).tolist()
        ends, j = [], 0
        for i in range(n):
            j = max(j, i)
            # the previous row's end is past this row's first stop only where fitting is not monotone
            j = first_stop[i] if j <= first_stop[i] else j + int(stop[i, j:].argmax())
            ends.append(j)
        return ends
