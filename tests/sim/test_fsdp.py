"""ZeRO-2, ZeRO-3 and HSDP in the engine (:mod:`sim.engine.fsdp`): memory per rank against a hand
count, the gathers FSDP2 runs with and without a pipeline, HSDP's all-reduce across the groups, the
links a group crosses, and the planner proposing sharding where memory needs it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sim.catalog.hardware import Device, Link, System
from sim.engine.engine import simulate
from sim.engine.fsdp import Unit, backward_exposed_s, group_gather_s, ring_gather_s
from sim.engine.allreduce import group_allreduce_s
from sim.formats.layout import ParallelLayout
from sim.formats.timeline import DP_ALL_GATHER, DP_REDUCE_SCATTER
from sim.planner.search import search
from sim.workloads.workload import LayerCost, WorkloadCapabilities

PARAMS = (100, 300, 200, 50)  # bytes of each layer's weights: every layer is one unit
INTRA = Link("intra", 1e3, 1e-3)  # bytes/s and s: slow enough that gathers show beside the compute
INTER = Link("inter", 1e2, 1e-2)


@dataclass(frozen=True)
class Units(WorkloadCapabilities):
    """Layers of ``PARAMS`` weight bytes, fp32 gradients as large, Adam's two moments; 1 ms forward."""

    name: str = "units"
    num_layers: int = len(PARAMS)

    def layer_costs(self, rows, device):
        return [LayerCost(name=f"unit{i}", forward_s=1e-3 * rows, backward_s=2e-3 * rows, recompute_s=1e-3 * rows,
                          saved_bytes=10 * rows, output_bytes=rows, input_bytes=rows, param_bytes=p, grad_bytes=p,
                          optimizer_bytes=2 * p, optimizer_s=1e-3)
                for i, p in enumerate(PARAMS)]


def system(devices_per_node: int = 8, nodes: int = 1, memory_bytes: float = float("inf")) -> System:
    device = Device("test", {"fp32": 1e12}, memory_bytes, 1e12)
    return System("test", device, devices_per_node, INTRA, INTER, nodes=nodes)


def run(zero: int, stages: int = 1, microbatches: int = 1, replicas: int = 2, shard_group: int | None = None,
        where: System | None = None, batch: int = 4, gradient_sync: str | None = None):
    partition = [len(PARAMS)] if stages == 1 else [2, 2]
    layout = ParallelLayout.for_partition(partition, microbatches, checkpoint="never", replicas=replicas, zero=zero,
                                          shard_group=shard_group, gradient_sync=gradient_sync)
    return simulate(Units(), where or system(), partition, batch, layout)


def test_sharded_memory_per_rank_is_the_hand_count():
    total = sum(PARAMS)  # 650 bytes of weights, as many of gradients, twice as many of optimizer state
    for zero, gathered in ((2, total), (3, 300 + 200)):  # ZeRO-3, K = 1: a unit and the prefetched next at most
        device = run(zero).stages[0]
        s = device.sharded
        assert (s.parameter_bytes, s.gradient_bytes, s.optimizer_state_bytes) == (325, 325, 650)
        assert s.gathered_parameter_bytes_peak == gathered and s.accumulated_gradient_bytes == 0
        assert device.static_bytes == 325 + 325 + 650 + gathered
        assert device.peak_memory_bytes == device.static_bytes + device.peak_activation_bytes
    unsharded = run(0).stages[0]
    assert unsharded.sharded is None and unsharded.static_bytes == 4 * total
    # K > 1 with M > 1: all of a stage's units gathered once, its gradients accumulated unsharded
    first = run(3, stages=2, microbatches=2).stages[0].sharded
    assert first.gathered_parameter_bytes_peak == 400 and first.accumulated_gradient_bytes == 400
    # reduce-scattered after every micro-batch instead: no unsharded gradient outlasts a backward
    each = run(3, stages=2, microbatches=2, gradient_sync="microbatch").stages[0].sharded
    assert each.accumulated_gradient_bytes == 0


def reduce_tail_s(reduces_s, rows=2, gathers_s=None):
    """One stage's reduce-scatters left after its last backward: each unit's beside the backward of the
    unit before it (2 ms a row), by what it outlasts it, and the first unit's whole; with ZeRO-3's
    ``gathers_s`` in the same backward, what the two show together beyond what the gathers show alone."""
    units = [Unit(g, reduce_s, 1e-3 * rows, 2e-3 * rows) for g, reduce_s in zip(gathers_s or [0.0] * len(reduces_s),
                                                                              reduces_s)]
    if gathers_s is None:
        _gathers, shown, last = backward_exposed_s(units, False, True)
        return shown + last
    alone, _reduce, _last = backward_exposed_s(units, True, False)
    gathers, shown, last = backward_exposed_s(units, True, True)
    return gathers + shown + last - alone


def _kinds(result, kind):
    return [r for r in result.timeline.records if r.kind == kind and r.replica == 0 and r.stage == 0]


def test_zero3_gathers_again_before_each_backward_with_one_stage():
    two, three = run(2, microbatches=2, gradient_sync="step"), run(3, microbatches=2, gradient_sync="step")
    # ZeRO-2 gathers once a step; ZeRO-3 before each micro-batch's forward and again before its backward
    assert len(_kinds(two, DP_ALL_GATHER)) == 1 and len(_kinds(three, DP_ALL_GATHER)) == 4
    for result in (two, three):  # the micro-batches' gradients reduce-scattered once, after the last backward
        assert len(_kinds(result, DP_REDUCE_SCATTER)) == 1
        assert result.stages[0].sharded.accumulated_gradient_bytes == result.stages[0].sharded.gradient_bytes * 2
    assert three.step_time_s > two.step_time_s
    backward = min(r.start_s for r in three.timeline.records if r.kind == "B")
    assert any(r.start_s >= backward for r in _kinds(three, DP_ALL_GATHER))
    # the forward's exposed gathers: the first unit whole, each later one by what it exceeds the one before
    gather = [ring_gather_s(p, 2, INTRA) for p in PARAMS]
    shown = gather[0] + sum(max(0.0, g - 1e-3) for g in gather[1:])  # one row per micro-batch: 1 ms a unit
    assert _kinds(two, DP_ALL_GATHER)[0].end_s - _kinds(two, DP_ALL_GATHER)[0].start_s == pytest.approx(shown)


def test_gradient_sync_per_microbatch_reduces_after_every_backward_and_accumulates_sharded():
    for zero in (2, 3):
        step, each = run(zero, microbatches=2, gradient_sync="step"), run(zero, microbatches=2)  # K = 1: the default
        assert each.to_dict() == run(zero, microbatches=2, gradient_sync="microbatch").to_dict()
        assert each.to_dict()["gradient_sync"] == "microbatch" and step.to_dict()["gradient_sync"] == "step"
        spans = _kinds(each, DP_REDUCE_SCATTER)
        # after the first backward (before the second), and the second's as the step's tail
        first, second = sorted(_kinds(each, "B"), key=lambda r: r.start_s)
        assert [r.microbatch for r in spans] == [first.microbatch, -1]
        assert spans[0].start_s == pytest.approx(first.end_s) and spans[0].end_s <= second.start_s
        assert spans[0].end_s - spans[0].start_s == pytest.approx(spans[1].end_s - spans[1].start_s)
        if zero == 2:  # beside the backward as the last one's: the same exposure
            assert spans[1].end_s - spans[1].start_s == pytest.approx(reduce_tail_s([ring_gather_s(p, 2, INTRA)
                                                                                      for p in PARAMS], rows=1))
        assert each.step_time_s > step.step_time_s  # one more reduction for ...
        memory, held = each.stages[0].sharded, step.stages[0].sharded
        assert memory.accumulated_gradient_bytes == 0 and held.accumulated_gradient_bytes == sum(PARAMS)
        assert each.stages[0].static_bytes == step.stages[0].static_bytes - sum(PARAMS)  # ... no unsharded gradients
    # with a pipeline the default is once per step; per micro-batch, each backward's beside it as a whole
    piped = run(2, stages=2, microbatches=4, gradient_sync="microbatch", batch=8)
    assert run(2, stages=2, microbatches=4).to_dict()["gradient_sync"] == "step"
    spans = _kinds(piped, DP_REDUCE_SCATTER)
    assert len(spans) == 4 and spans[-1].microbatch == -1
    backward_s = 2 * 2e-3 * 1  # two units of 2 ms a row, one row per micro-batch
    assert spans[0].end_s - spans[0].start_s == pytest.approx(
        max(sum(ring_gather_s(p, 2, INTRA) for p in PARAMS[:2]) - backward_s, ring_gather_s(PARAMS[0], 2, INTRA)))
    assert piped.stages[0].sharded.accumulated_gradient_bytes == 0


def test_zero3_backward_gathers_and_reduce_scatters_share_the_links():
    # links far slower than the compute: each unit's gather and reduce-scatter outlast any unit's compute,
    # so a step shows at least every gather (forward and backward) and every reduction one after another
    gathers_s = [ring_gather_s(p, 2, INTRA) for p in PARAMS]
    communication_s = 2 * sum(gathers_s) + sum(gathers_s)  # gradients as large as the weights
    assert run(3).step_time_s >= communication_s
    # ZeRO-2 keeps its units from forward to backward: its reductions have the backward's links alone
    assert run(2).step_time_s < communication_s


def test_with_a_pipeline_each_stage_gathers_once_and_zero3_costs_what_zero2_does():
    two, three = run(2, stages=2, microbatches=4), run(3, stages=2, microbatches=4)
    assert three.step_time_s == pytest.approx(two.step_time_s)
    for result in (two, three):
        assert len(_kinds(result, DP_ALL_GATHER)) == 1  # once per step, before micro-batch 0's forward
        assert _kinds(result, DP_ALL_GATHER)[0].microbatch == 0
        assert len(_kinds(result, DP_REDUCE_SCATTER)) == 1  # once, after the last backward


def test_hsdp_adds_the_all_reduce_of_the_shard_across_the_groups():
    whole, hybrid = run(3, replicas=4), run(3, replicas=4, shard_group=2)
    tail = {name: _kinds(result, DP_REDUCE_SCATTER)[-1] for name, result in (("whole", whole), ("hybrid", hybrid))}
    rows = 1  # 4 rows over 4 replicas
    whole_s = [ring_gather_s(p, 4, INTRA) for p in PARAMS]  # ZeRO-3: the backward's gathers beside them too
    assert tail["whole"].end_s - tail["whole"].start_s == pytest.approx(reduce_tail_s(whole_s, rows, whole_s))
    # devices 0 and 1 shard together; device 0 all-reduces its half with device 2 of the other group
    hsdp_s = [ring_gather_s(p, 2, INTRA) + group_allreduce_s(p / 2, [0, 2], system()) for p in PARAMS]
    gathers_s = [ring_gather_s(p, 2, INTRA) for p in PARAMS]
    assert tail["hybrid"].end_s - tail["hybrid"].start_s == pytest.approx(reduce_tail_s(hsdp_s, rows, gathers_s))
    assert hsdp_s[0] > ring_gather_s(PARAMS[0], 2, INTRA)


def test_a_group_spanning_nodes_is_priced_on_the_inter_node_link():
    two_per_node = system(devices_per_node=2, nodes=2)
    # two members on each of two nodes: the ring inside the node, then half the bytes over each rail
    assert group_gather_s(1000, [0, 1, 2, 3], two_per_node) == pytest.approx(
        ring_gather_s(1000, 2, INTRA) + ring_gather_s(500, 2, INTER))
    # one member per node (T x C fill a node): a flat ring on the inter-node link
    assert group_gather_s(1000, [0, 1], system(devices_per_node=1, nodes=2)) == ring_gather_s(1000, 2, INTER)
    inside, across = run(2, replicas=4), run(2, replicas=4, where=two_per_node)
    assert across.step_time_s > inside.step_time_s


def test_the_planner_proposes_sharding_where_memory_needs_it():
    # whole replicas hold 2600 bytes of state, ZeRO-1 and ZeRO-2 1950 (2 gathers every unit), ZeRO-3 1800
    # (the shards and one unit pair): with the activations only ZeRO-3 fits 1900 bytes
    tight = system(memory_bytes=1900)
    kwargs = dict(stage_options=[1], microbatch_options=[1], checkpoints=["never"], schedules=["gpipe"],
                  replica_options=[2])
    assert search(Units(), tight, 4, zero_options=[0], **kwargs).best is None
    for found in (search(Units(), tight, 4, zero_options=[0], escalate_zero=True, **kwargs),  # --zero-options auto
                  search(Units(), tight, 4, zero_options=[0, 1, 2, 3], **kwargs)):
        assert found.best is not None and found.best.candidate.zero == 3 and found.best.result.fits
    roomy = search(Units(), system(memory_bytes=1e6), 4, zero_options=[0], escalate_zero=True, **kwargs)
    assert roomy.best.candidate.zero == 0  # auto shards only where memory needs it


def test_a_costs_files_fitted_gather_and_reduce_scatter_price_the_collectives():
    from sim.errors import GpipeInputError
    from sim.formats.costs_links import sharded_links

    fitted = {"backend": "gloo", "all_gather": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 5e2},
              "reduce_scatter": {"latency_s": 2e-4, "bandwidth_bytes_per_s": 4e2}}
    gather, reduce = sharded_links({"sharded": fitted})
    assert (gather.latency_s, gather.bandwidth_bytes_per_s, reduce.bandwidth_bytes_per_s) == (1e-4, 5e2, 4e2)
    assert sharded_links({}) == (None, None)
    with pytest.raises(GpipeInputError, match="sharded entry has no reduce_scatter fit"):
        sharded_links({"sharded": {"all_gather": fitted["all_gather"]}})

    class Measured(Units):
        def sharded_links(self, system):
            return gather, reduce, None

    partition = [len(PARAMS)]
    layout = ParallelLayout.for_partition(partition, 1, checkpoint="never", replicas=2, zero=2)
    result = simulate(Measured(), system(), partition, 4, layout)
    first_gather = _kinds(result, DP_ALL_GATHER)[0]
    assert first_gather.end_s - first_gather.start_s >= ring_gather_s(PARAMS[0], 2, gather)
    assert _kinds(result, DP_REDUCE_SCATTER)[-1].end_s - _kinds(result, DP_REDUCE_SCATTER)[-1].start_s == \
        pytest.approx(reduce_tail_s([ring_gather_s(p, 2, reduce) for p in PARAMS]))


def test_the_planner_searches_hsdp_shard_groups_where_asked():
    kwargs = dict(stage_options=[1], microbatch_options=[1], checkpoints=["never"], schedules=["gpipe"],
                  replica_options=[4], zero_options=[3])
    plain = search(Units(), system(), 8, top=10, **kwargs)
    hybrid = search(Units(), system(), 8, top=10, shard_group_options=[2, 3], **kwargs)
    assert {o.candidate.shard_group for o in plain.ranked} == {None}
    assert {o.candidate.shard_group for o in hybrid.ranked} == {None, 2}  # 3 does not divide D = 4


@pytest.mark.parametrize("zero,partition,microbatches,schedule,virtual", [
    (3, [4], 2, "gpipe", 1), (2, [4], 3, "gpipe", 1), (2, [2, 2], 4, "1f1b", 1), (3, [1, 1, 1, 1], 4, "interleaved", 2)])
def test_the_walk_without_spans_times_the_gathers_as_the_simpy_walk_does(zero, partition, microbatches, schedule,
                                                                          virtual):
    layout = ParallelLayout.for_partition(partition, microbatches, checkpoint="never", schedule=schedule, replicas=2,
                                          zero=zero, virtual_stages=virtual)
    recorded = simulate(Units(), system(), partition, 8, layout, record=True)
    walked = simulate(Units(), system(), partition, 8, layout, record=False)
    assert walked.step_time_s == recorded.step_time_s  # to the bit
    assert [s.busy_s for s in walked.stages] == [s.busy_s for s in recorded.stages]
