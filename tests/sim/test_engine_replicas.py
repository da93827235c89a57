"""The simulator with D data-parallel replicas, their placement, ZeRO-1 and the interleaved schedule."""

from dataclasses import replace

import pytest

from sim.catalog.hardware import FREE_LINK, Link, System, get_system
from sim.engine.allreduce import group_allreduce_s, ring_allreduce_s
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.engine.memory import peak_coefficients, peak_from_coefficients
from sim.engine.stage_costs import CostTable
from sim.errors import GpipeInputError
from sim.formats.timeline import DP_ALLREDUCE, RECV_WAIT, SEND_ACTIVATION
from sim.planner.search import Candidate, Partitions
from sim.workloads.workload import UniformWorkload

IDEAL = get_system("ideal")
MIB = 1 << 20


def spans(result, kinds=("F", "R", "B")):
    return [(r.stage, f"{r.kind}{r.microbatch}", round(r.start_s * 1e3, 9), round(r.end_s * 1e3, 9))
            for r in sorted(result.timeline.records, key=lambda r: (r.stage, r.start_s)) if r.kind in kinds]


def test_interleaved_literal_timeline():
    # K=2 devices, V=2 chunks of one layer: device 0 runs virtual stages 0 and 2, device 1 runs 1 and 3
    result = simulate(UniformWorkload(4), IDEAL, [1, 1, 1, 1], batch_size=2,
                      layout=ParallelLayout.for_partition([1, 1, 1, 1], 2, checkpoint="never",
                                                          schedule="interleaved", virtual_stages=2))
    assert spans(result) == [
        (0, "F0", 0, 1), (0, "F1", 1, 2), (0, "F0", 2, 3), (0, "F1", 3, 4),  # chunk 0 (stage 0), chunk 1 (stage 2)
        (0, "B0", 6, 8), (0, "B1", 9, 11), (0, "B0", 11, 13), (0, "B1", 13, 15),
        (1, "F0", 1, 2), (1, "F1", 2, 3), (1, "F0", 3, 4), (1, "B0", 4, 6), (1, "F1", 6, 7), (1, "B1", 7, 9),
        (1, "B0", 9, 11), (1, "B1", 11, 13),
    ]
    assert result.step_time_s == pytest.approx(15e-3)
    device0 = sorted((r for r in result.timeline.records if r.stage == 0 and r.kind in "FB"), key=lambda r: r.start_s)
    assert [r.virtual_stage for r in device0] == [0, 0, 2, 2, 2, 2, 0, 0]  # spans name their chunk, as executed
    assert result.bubble_fraction == pytest.approx(1 / 5)
    assert [s.layers for s in result.stages] == [2, 2]


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("groups", [1, 2, 3])  # M = groups x K
@pytest.mark.parametrize("virtual_stages", [2, 3, 4])
def test_interleaved_bubble_equals_the_formula_for_uniform_layers_and_free_links(stages, groups, virtual_stages):
    microbatches = groups * stages
    chunks = stages * virtual_stages
    result = simulate(UniformWorkload(chunks), IDEAL, [1] * chunks, batch_size=microbatches,
                      layout=ParallelLayout.for_partition([1] * chunks, microbatches, checkpoint="never",
                                                          schedule="interleaved", virtual_stages=virtual_stages), record=False)
    expected = (stages - 1) / (virtual_stages * microbatches + stages - 1)
    assert abs(result.bubble_fraction - expected) < 1e-9
    assert result.step_time_s == pytest.approx((virtual_stages * microbatches + stages - 1) * 3e-3)


def test_replicas_on_free_links_take_one_pipelines_step_plus_the_all_reduce():
    workload = UniformWorkload(8)
    one = simulate(workload, IDEAL, [2, 2, 2, 2], batch_size=8,
                   layout=ParallelLayout.for_partition([2, 2, 2, 2], 8, checkpoint="never"))
    four = simulate(workload, IDEAL, [2, 2, 2, 2], batch_size=32,
                    layout=ParallelLayout.for_partition([2, 2, 2, 2], 8, checkpoint="never", replicas=4))
    assert four.step_time_s == pytest.approx(one.step_time_s)  # free links: a free all-reduce
    assert four.throughput_samples_per_s == pytest.approx(4 * one.throughput_samples_per_s)
    assert four.replica_rows == [8, 8, 8, 8] and len(four.stages) == 16
    link = Link("collective", 1e9, 1e-5)
    slow = simulate(workload, IDEAL, [2, 2, 2, 2], batch_size=32,
                    layout=ParallelLayout.for_partition([2, 2, 2, 2], 8, checkpoint="never", replicas=4), allreduce_link=link)
    gradient_bytes = 2 * workload.param_bytes  # two layers per stage
    allreduce_s = 2 * 3 / 4 * gradient_bytes / 1e9 + 2 * 3 * 1e-5
    assert slow.step_time_s == pytest.approx(one.step_time_s + allreduce_s)
    reduces = [r for r in slow.timeline.records if r.kind == DP_ALLREDUCE]
    assert sorted((r.replica, r.stage) for r in reduces) == [(d, k) for d in range(4) for k in range(4)]
    assert all(r.duration_s == pytest.approx(allreduce_s) for r in reduces)


def test_the_all_reduce_formula_flat_and_hierarchical():
    intra, inter = Link("nv", 1e10, 1e-6), Link("ib", 1e9, 1e-5)
    one_node = System("t", IDEAL.device, 4, intra, inter)
    # flat ring of 4 on the intra-node link: 2*3/4 of 1.2 kB at 10 GB/s + 6 latencies
    assert group_allreduce_s(1200, [0, 1, 2, 3], one_node) == pytest.approx(1.5 * 1200 / 1e10 + 6e-6)
    two_nodes = System("t", IDEAL.device, 2, intra, inter, nodes=2)
    # 2 per node: reduce-scatter + all-gather inside (1 MB at 10 GB/s, 2 latencies), then a ring of
    # two nodes over half the bytes on the inter-node link (0.5 MB at 1 GB/s, 2 latencies)
    expected = (1e6 / 1e10 + 2e-6) + (0.5e6 / 1e9 + 2e-5)
    assert group_allreduce_s(1e6, [0, 1, 2, 3], two_nodes) == pytest.approx(expected)
    # one member per node: a flat ring over the inter-node link
    assert group_allreduce_s(1e6, [0, 2], two_nodes) == pytest.approx(ring_allreduce_s(1e6, 2, inter))
    assert group_allreduce_s(1e6, [0, 2], two_nodes, link=intra) == pytest.approx(ring_allreduce_s(1e6, 2, intra))
    assert group_allreduce_s(1e6, [3], two_nodes) == 0.0


def _two_by_two(activation_bytes, param_bytes):
    """2 replicas x 2 stages on two nodes of two devices, a fast link inside and a slow one across."""
    system = System("two-nodes", IDEAL.device, 2, Link("nv", 1e11, 0.0), Link("ib", 1e9, 0.0), nodes=2)
    workload = UniformWorkload(4, activation_bytes=activation_bytes, param_bytes=param_bytes)
    return {placement: simulate(workload, system, [2, 2], 8,
                                ParallelLayout.for_partition([2, 2], 4, checkpoint="never", replicas=2,
                                                             placement=placement))
            for placement in ("stages_adjacent", "replicas_adjacent")}


def test_placements_put_pipeline_hops_or_all_reduces_on_the_node_link():
    results = _two_by_two(activation_bytes=MIB, param_bytes=MIB)
    sends = {p: {round(r.duration_s, 12) for r in res.timeline.records if r.kind == SEND_ACTIVATION}
             for p, res in results.items()}
    reduces = {p: {round(r.duration_s, 12) for r in res.timeline.records if r.kind == DP_ALLREDUCE}
               for p, res in results.items()}
    assert sends["stages_adjacent"] == {round(MIB / 1e11, 12)}  # replica inside a node
    assert sends["replicas_adjacent"] == {round(MIB / 1e9, 12)}  # stage 0 and stage 1 on different nodes
    gradient = 2 * MIB  # two layers per stage
    assert reduces["stages_adjacent"] == {round(gradient / 1e9, 12)}  # the two copies on different nodes
    assert reduces["replicas_adjacent"] == {round(gradient / 1e11, 12)}
    assert [s.device for s in results["replicas_adjacent"].stages] == [0, 1, 2, 3]
    assert [(s.replica, s.stage) for s in results["replicas_adjacent"].stages] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_placement_choice_follows_what_crosses_the_slow_link():
    heavy_activations = _two_by_two(activation_bytes=64 * MIB, param_bytes=1024)
    assert heavy_activations["stages_adjacent"].step_time_s < heavy_activations["replicas_adjacent"].step_time_s
    heavy_gradients = _two_by_two(activation_bytes=1024, param_bytes=64 * MIB)
    assert heavy_gradients["replicas_adjacent"].step_time_s < heavy_gradients["stages_adjacent"].step_time_s


def test_zero_divides_optimizer_state_over_the_replicas():
    workload = UniformWorkload(4)  # per layer: 4 MiB weights, 4 MiB gradient, 8 MiB Adam state
    plain = simulate(workload, IDEAL, [2, 2], 16,
                     ParallelLayout.for_partition([2, 2], 4, checkpoint="never", replicas=4))
    zero = simulate(workload, IDEAL, [2, 2], 16,
                    ParallelLayout.for_partition([2, 2], 4, checkpoint="never", replicas=4, zero=1))
    assert {s.static_bytes for s in plain.stages} == {2 * (4 + 4 + 8) * MIB}
    assert {s.static_bytes for s in zero.stages} == {2 * (4 + 4 + 8 // 4) * MIB}
    assert zero.step_time_s == plain.step_time_s and zero.zero == 1
    planner = Partitions(CostTable(workload, IDEAL.device), IDEAL, 16)
    for z, result in ((0, plain), (1, zero)):  # the planner's memory check holds what the engine holds
        assert planner._chunk_static(1, 0, 2, Candidate(2, 4, "never", "gpipe", 4, 1, z)) == result.stages[0].static_bytes
    assert [s.peak_activation_bytes for s in zero.stages] == [s.peak_activation_bytes for s in plain.stages]


def test_uneven_replicas_train_torch_chunk_rows_and_the_all_reduce_waits_for_the_slowest(list_workload):
    workload = list_workload([1e-3] * 4)  # times grow with rows
    result = simulate(workload, IDEAL, [2, 2], batch_size=5,
                      layout=ParallelLayout.for_partition([2, 2], 3, checkpoint="never", replicas=2))
    assert result.replica_rows == [3, 2]  # torch.chunk(5 rows, 2)
    assert result.microbatch_rows == [1, 1, 1]
    alone = simulate(workload, IDEAL, [2, 2], batch_size=3,
                     layout=ParallelLayout.for_partition([2, 2], 3, checkpoint="never"))
    assert result.step_time_s == pytest.approx(alone.step_time_s)
    busy = {(s.replica, s.stage): s.busy_s for s in result.stages}
    assert busy[(1, 0)] < busy[(0, 0)]
    waits = [r for r in result.timeline.records if r.kind == RECV_WAIT and r.microbatch == -1]
    assert {(r.replica, r.stage) for r in waits} == {(1, 0), (1, 1)}  # replica 1 waits for replica 0 to finish


def test_replicas_are_refused_in_one_line():
    workload = UniformWorkload(4)
    system = get_system("h100-nvlink")
    with pytest.raises(GpipeInputError, match="2 replicas x 8 stages need 16 devices but h100-nvlink with 1 node"):
        simulate(UniformWorkload(8), system, [1] * 8, 8, ParallelLayout.for_partition([1] * 8, 2, replicas=2))
    with pytest.raises(GpipeInputError, match="--zero 1 .* --replicas 2 or more"):
        simulate(workload, system, [2, 2], 8, ParallelLayout.for_partition([2, 2], 2, zero=1))
    with pytest.raises(GpipeInputError, match="splits .* into only 3 parts, too few for 4 replicas"):
        simulate(workload, system, [2, 2], 6, ParallelLayout.for_partition([2, 2], 1, replicas=4))
    with pytest.raises(GpipeInputError, match="multiple of stages"):
        simulate(workload, system, [1, 1, 1, 1], 3,
                 ParallelLayout.for_partition([1, 1, 1, 1], 3, schedule="interleaved", virtual_stages=2))
    with pytest.raises(GpipeInputError, match="needs --schedule interleaved"):
        simulate(workload, system, [1, 1, 1, 1], 4, ParallelLayout.for_partition([1, 1, 1, 1], 4, virtual_stages=2))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never", "full"])
@pytest.mark.parametrize("replicas,zero", [(1, 0), (2, 1)])
def test_memory_estimate_matches_the_simulation_interleaved(list_workload, checkpoint, replicas, zero):
    workload = list_workload([1e-3, 2e-3, 1e-3, 3e-3, 1e-3, 1e-3], saved_bytes=7, input_bytes=2)
    partition = [1, 2, 1, 2]  # K=2 devices, V=2 chunks each
    result = simulate(workload, IDEAL, partition, batch_size=8 * replicas,
                      layout=ParallelLayout.for_partition(partition, 4, checkpoint=checkpoint,
                                                          schedule="interleaved", virtual_stages=2,
                                                          replicas=replicas, zero=zero))
    table = CostTable(workload, IDEAL.device)
    costs = table.stages(2, partition)
    planner = Partitions(table, IDEAL, 8 * replicas)
    candidate = Candidate(2, 4, checkpoint, "interleaved", replicas, 2, zero)
    bounds = [(0, 1), (1, 3), (3, 4), (4, 6)]
    for stage in result.stages:
        chunks = [costs[stage.stage], costs[stage.stage + 2]]
        points = peak_coefficients(2, 4, "interleaved", checkpoint, stage.stage, 2)
        assert peak_from_coefficients(chunks, points, checkpoint) == stage.peak_activation_bytes
        static = sum(planner._chunk_static(2, *bounds[s], candidate) for s in (stage.stage, stage.stage + 2))
        assert static == stage.static_bytes  # the planner's memory check counts what the engine holds


def test_a_calibrated_collective_link_replaces_the_systems_links():
    system = replace(get_system("h100-nvlink", 2), devices_per_node=2)
    workload = UniformWorkload(4)
    base = simulate(workload, system, [2, 2], 8,
                    ParallelLayout.for_partition([2, 2], 2, checkpoint="never", replicas=2), record=False)
    free = simulate(workload, system, [2, 2], 8,
                    ParallelLayout.for_partition([2, 2], 2, checkpoint="never", replicas=2), record=False, allreduce_link=FREE_LINK)
    assert free.step_time_s < base.step_time_s
