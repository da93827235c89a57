"""The simulator against literal timelines, the bubble formula and the GPipe memory formula."""

import pytest

from sim.catalog.hardware import FREE_LINK, Link, System, get_system
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.engine.memory import peak_activation_bytes
from sim.engine.stage_costs import CostTable
from sim.workloads.workload import UniformWorkload
from tests.helpers.scenarios import IDEAL, GappedWorkload, spans


def test_two_stages_two_microbatches_literal_timeline():
    result = simulate(UniformWorkload(2), IDEAL, [1, 1], batch_size=2,
                      layout=ParallelLayout.for_partition([1, 1], 2, checkpoint="never"))
    assert spans(result) == [
        (0, "F0", 0, 1), (0, "F1", 1, 2), (0, "B1", 5, 7), (0, "B0", 7, 9),
        (1, "F0", 1, 2), (1, "F1", 2, 3), (1, "B1", 3, 5), (1, "B0", 5, 7),
    ]
    assert result.step_time_s == pytest.approx(9e-3)


def test_recompute_runs_before_the_gradient_arrives():
    result = simulate(UniformWorkload(2), IDEAL, [1, 1], batch_size=2,
                      layout=ParallelLayout.for_partition([1, 1], 2, checkpoint="except_last"))
    assert spans(result) == [
        (0, "F0", 0, 1), (0, "F1", 1, 2), (0, "B1", 5, 7), (0, "R0", 7, 8), (0, "B0", 8, 10),
        (1, "F0", 1, 2), (1, "F1", 2, 3), (1, "B1", 3, 5), (1, "R0", 5, 6), (1, "B0", 6, 8),
    ]


def test_1f1b_literal_timeline():
    result = simulate(UniformWorkload(2), IDEAL, [1, 1], batch_size=3,
                      layout=ParallelLayout.for_partition([1, 1], 3, checkpoint="never", schedule="1f1b"))
    assert spans(result) == [
        (0, "F0", 0, 1), (0, "F1", 1, 2), (0, "B0", 4, 6), (0, "F2", 6, 7), (0, "B1", 7, 9), (0, "B2", 10, 12),
        (1, "F0", 1, 2), (1, "B0", 2, 4), (1, "F1", 4, 5), (1, "B1", 5, 7), (1, "F2", 7, 8), (1, "B2", 8, 10),
    ]


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8, 16, 24])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 7, 8, 32])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_equals_the_formula_for_uniform_layers_and_free_links(stages, microbatches, schedule):
    result = simulate(UniformWorkload(48), IDEAL, [48 // stages] * stages, batch_size=microbatches,
                      layout=ParallelLayout.for_partition([48 // stages] * stages, microbatches, checkpoint="never",
                                                          schedule=schedule),
                      record=False)
    expected = (stages - 1) / (microbatches + stages - 1)
    assert abs(result.bubble_fraction - expected) < 1e-9
    assert result.step_time_s == pytest.approx((microbatches + stages - 1) * 3e-3 * 48 / stages)


def test_link_latency_and_bandwidth_delay_the_next_stage():
    link = Link("slow", bandwidth_bytes_per_s=1e9, latency_s=1e-3)
    system = System("test", IDEAL.device, 8, link, link)
    workload = UniformWorkload(2, activation_bytes=1_000_000)  # 1 ms on the wire + 1 ms latency
    result = simulate(workload, system, [1, 1], batch_size=1,
                      layout=ParallelLayout.for_partition([1, 1], 1, checkpoint="never"))
    assert spans(result) == [(0, "F0", 0, 1), (0, "B0", 8, 10), (1, "F0", 3, 4), (1, "B0", 4, 6)]
    sends = spans(result, kinds=("send_act", "send_grad"))
    assert sends == [(0, "send_act0", 1, 3), (1, "send_grad0", 6, 8)]


def test_shared_pcie_serialises_concurrent_transfers_on_one_node():
    shared = Link("pcie", bandwidth_bytes_per_s=1e9, latency_s=0.0, shared=True)
    dedicated = Link("nvlink", bandwidth_bytes_per_s=1e9, latency_s=0.0)
    workload = UniformWorkload(4, activation_bytes=2_000_000)  # 2 ms per transfer
    times = {}
    for link in (shared, dedicated):
        system = System("t", IDEAL.device, 8, link, link)
        times[link.name] = simulate(workload, system, [1, 1, 1, 1], batch_size=8,
                                    layout=ParallelLayout.for_partition([1, 1, 1, 1], 8, checkpoint="never")).step_time_s
    assert times["pcie"] > times["nvlink"]


def test_gpipe_memory_formula_with_and_without_rematerialization(list_workload):
    layers, stages, microbatches, rows = 8, 2, 4, 3
    workload = list_workload([1e-3] * layers, saved_bytes=10, input_bytes=1)
    per_stage_saved = (layers // stages) * 10 * rows
    stash = 1 * rows
    never = simulate(workload, IDEAL, [4, 4], rows * microbatches,
                     ParallelLayout.for_partition([4, 4], microbatches, checkpoint="never"))
    always = simulate(workload, IDEAL, [4, 4], rows * microbatches,
                      ParallelLayout.for_partition([4, 4], microbatches, checkpoint="always"))
    for stage in never.stages:
        assert stage.peak_activation_bytes == microbatches * per_stage_saved
    for stage in always.stages:
        # all M boundary inputs stashed, plus one micro-batch's activations inside the stage (which
        # include its own stashed input, counted once)
        assert stage.peak_activation_bytes == (microbatches - 1) * stash + per_stage_saved


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never", "full"])
def test_partitioner_memory_estimate_matches_the_simulation(list_workload, schedule, checkpoint):
    workload = list_workload([1e-3, 2e-3, 1e-3, 3e-3, 1e-3, 1e-3], saved_bytes=7, input_bytes=2)
    partition = [1, 2, 1, 2]
    result = simulate(workload, IDEAL, partition, batch_size=10,
                      layout=ParallelLayout.for_partition(partition, 5, checkpoint=checkpoint, schedule=schedule))
    table = CostTable(workload, IDEAL.device)
    for k, cost in enumerate(table.stages(2, partition)):
        estimate = peak_activation_bytes(cost, 4, 5, schedule, checkpoint, k)
        assert estimate == result.stages[k].peak_activation_bytes


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_full_recompute_holds_every_layers_input_and_one_layer_at_a_time(list_workload, schedule):
    """``--checkpoint full``: per micro-batch in flight, each layer's input (2 bytes a row here); during
    a backward, the layer being recomputed adds its saved tensors besides its own input (7 - 2 a row),
    the layers before it still holding theirs: at most all inputs + 5 a row, once. Backward costs a
    forward more; there is no R action."""
    workload = list_workload([1e-3] * 6, saved_bytes=7, input_bytes=2)
    rows, microbatches = 2, 4
    full = simulate(workload, IDEAL, [3, 3], batch_size=rows * microbatches,
                    layout=ParallelLayout.for_partition([3, 3], microbatches, checkpoint="full", schedule=schedule))
    never = simulate(workload, IDEAL, [3, 3], batch_size=rows * microbatches,
                     layout=ParallelLayout.for_partition([3, 3], microbatches, checkpoint="never",
                                                         schedule=schedule))
    in_flight = {"gpipe": [4, 4], "1f1b": [2, 1]}[schedule]  # most micro-batches held at once per stage
    for stage, held in zip(full.stages, in_flight):
        assert stage.peak_activation_bytes == held * 3 * 2 * rows + (7 - 2) * rows
        assert stage.busy_s == pytest.approx(never.stages[stage.stage].busy_s * 4 / 3)  # F + (B + F) per layer
    assert "R" not in {r.kind for r in full.timeline.records}


def test_uneven_batch_splits_like_torch_chunk():
    result = simulate(UniformWorkload(4), IDEAL, [2, 2], batch_size=10,
                      layout=ParallelLayout.for_partition([2, 2], 4))
    assert result.microbatch_rows == [3, 3, 3, 1]
    small = simulate(UniformWorkload(4), IDEAL, [2, 2], batch_size=2, layout=ParallelLayout.for_partition([2, 2], 4))
    assert small.microbatches == 2


def test_memory_that_does_not_fit_is_reported():
    tiny = System("tiny", IDEAL.device.__class__("tiny", {"fp32": 1e12}, 1024, 1e9), 8, FREE_LINK, FREE_LINK)
    result = simulate(UniformWorkload(4), tiny, [2, 2], batch_size=4, layout=ParallelLayout.for_partition([2, 2], 4))
    assert not result.fits and not result.stages[0].fits


@pytest.mark.parametrize("hardware,nodes", [("a100-nvlink", 2), ("ideal", 1)])
def test_the_walk_without_spans_equals_the_simpy_processes(hardware, nodes):
    """record=False walks the action lists in closed form (sim.engine.replica_run.ReplicaRun.walk); it must
    give SimPy's step, busy times and peaks exactly, links and recompute included."""
    from sim.workloads.models import get_workload

    system = get_system(hardware, nodes)
    workload = get_workload("transformer", {"layers": 6, "d_model": 64, "ff": 256, "heads": 4, "seq": 32,
                                            "vocab": 100})
    cases = 0
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for checkpoint in ("always", "except_last", "never", "full", "selective"):
            for stages, microbatches, replicas in ((1, 3, 1), (2, 4, 2), (4, 8, 1), (4, 4, 2)):
                if schedule == "interleaved" and stages == 1:
                    continue
                parts = stages * virtual
                partition = [8 // parts + (i < 8 % parts) for i in range(parts)]
                runs = [simulate(workload, system, partition, 16,
                                 ParallelLayout.for_partition(partition, microbatches, checkpoint=checkpoint,
                                                              schedule=schedule, virtual_stages=virtual,
                                                              replicas=replicas), record=record) for record in (True, False)]
                spanned, walked = runs
                assert walked.step_time_s == spanned.step_time_s
                assert [s.busy_s for s in walked.stages] == [s.busy_s for s in spanned.stages]
                assert ([s.peak_memory_bytes for s in walked.stages]
                        == [s.peak_memory_bytes for s in spanned.stages])
                cases += 1
    assert cases == 55


def test_the_gap_between_two_actions_delays_each_but_the_first_and_is_not_busy():
    """A gap follows every action of a device but its last, as long as its kind's: with two stages
    of 1 ms forwards and 2 ms backwards, 0.25 ms after a forward and 0.5 ms after a backward, stage 1
    starts F0 at 1 ms, and each later action starts a gap after the previous one ends or when its
    input arrives, whichever is later."""
    result = simulate(GappedWorkload(2, 0.25e-3, backward_gap_s=0.5e-3), IDEAL, [1, 1], batch_size=2,
                      layout=ParallelLayout.for_partition([1, 1], 2, checkpoint="never"))
    assert spans(result) == [
        (0, "F0", 0, 1), (0, "F1", 1.25, 2.25), (0, "B1", 5.5, 7.5), (0, "B0", 8, 10),
        (1, "F0", 1, 2), (1, "F1", 2.25, 3.25), (1, "B1", 3.5, 5.5), (1, "B0", 6, 8),
    ]
    assert result.step_time_s == pytest.approx(10e-3)
    assert [s.busy_s for s in result.stages] == pytest.approx([6e-3, 6e-3])
    gapless = simulate(GappedWorkload(2, 0.0), IDEAL, [1, 1], batch_size=2,
                       layout=ParallelLayout.for_partition([1, 1], 2, checkpoint="never"))
    assert gapless.step_time_s == pytest.approx(9e-3)
    assert result.bubble_fraction > gapless.bubble_fraction


def test_the_steps_first_action_on_a_device_pays_its_kinds_cold_start_as_busy_time():
    """The first action of each device's step starts cold: with two stages of 1 ms forwards and 2 ms
    backwards, a cold forward 0.5 ms longer (and a cold backward 0.25 ms, which no device opens with),
    GPipe's F0 pays it on both stages and nothing else does, under 1F1B as under GPipe."""
    cold = (0.5e-3, 0.0, 0.25e-3, 0.0, 0.0)
    result = simulate(GappedWorkload(2, 0.0, cold_s=cold), IDEAL, [1, 1], batch_size=2,
                      layout=ParallelLayout.for_partition([1, 1], 2, checkpoint="never"))
    assert spans(result) == [
        (0, "F0", 0, 1.5), (0, "F1", 1.5, 2.5), (0, "B1", 6, 8), (0, "B0", 8, 10),
        (1, "F0", 1.5, 3), (1, "F1", 3, 4), (1, "B1", 4, 6), (1, "B0", 6, 8),
    ]
    assert [s.busy_s for s in result.stages] == pytest.approx([6.5e-3, 6.5e-3])
    for schedule in ("gpipe", "1f1b"):
        cold_run, warm_run = (simulate(GappedWorkload(2, 0.0, cold_s=c), IDEAL, [1, 1], batch_size=4,
                                       layout=ParallelLayout.for_partition([1, 1], 4, checkpoint="never",
                                                                           schedule=schedule)) for c in (cold, ()))
        assert [a.busy_s - b.busy_s for a, b in zip(cold_run.stages, warm_run.stages)] == pytest.approx([5e-4, 5e-4])


def test_after_a_long_wait_a_device_runs_at_half_speed_until_its_warm_up_is_paid():
    """Two stages of 1 ms forwards and 2 ms backwards under GPipe: stage 1's F0 waits 1 ms (under
    sim.engine.host.IDLE_S: nothing), stage 0's B1 waits 3 ms for its gradient and pays the warm-up; a
    warm-up longer than B1's work is paid at half speed into B0, which did not wait. Busy time."""
    for warm_s, b1_end, b0_end in ((0.5e-3, 7.5, 9.5), (3e-3, 9, 12)):
        result = simulate(GappedWorkload(2, 0.0, warm_s=warm_s), IDEAL, [1, 1], batch_size=2,
                          layout=ParallelLayout.for_partition([1, 1], 2, checkpoint="never"))
        assert spans(result) == [
            (0, "F0", 0, 1), (0, "F1", 1, 2), (0, "B1", 5, b1_end), (0, "B0", b1_end, b0_end),
            (1, "F0", 1, 2), (1, "F1", 2, 3), (1, "B1", 3, 5), (1, "B0", 5, 7),
        ]
        assert [s.busy_s for s in result.stages] == pytest.approx([6e-3 + warm_s, 6e-3])
        walked = simulate(GappedWorkload(2, 0.0, warm_s=warm_s), IDEAL, [1, 1], batch_size=2,
                          layout=ParallelLayout.for_partition([1, 1], 2, checkpoint="never"), record=False)
        assert walked.step_time_s == result.step_time_s == pytest.approx(b0_end * 1e-3)


def test_the_senders_time_delays_the_message_and_its_next_action_and_is_not_busy():
    """A send's own time on the sender (a copy on the CPU) follows the action that made the message;
    the message leaves after it. The V schedule's hand-off between the chunks of one device is no send."""
    result = simulate(GappedWorkload(2, 0.0, 0.5e-3), IDEAL, [1, 1], batch_size=2,
                      layout=ParallelLayout.for_partition([1, 1], 2, checkpoint="never"))
    assert spans(result) == [
        (0, "F0", 0, 1), (0, "F1", 1.5, 2.5), (0, "B1", 6.5, 8.5), (0, "B0", 9, 11),
        (1, "F0", 1.5, 2.5), (1, "F1", 3, 4), (1, "B1", 4, 6), (1, "B0", 6.5, 8.5),
    ]
    assert [s.busy_s for s in result.stages] == pytest.approx([6e-3, 6e-3])
    v = simulate(GappedWorkload(2, 0.0, 0.5e-3), IDEAL, [1, 1], batch_size=1,
                 layout=ParallelLayout.for_partition([1, 1], 1, checkpoint="never", schedule="zbv",
                                                     virtual_stages=2))
    assert v.step_time_s == pytest.approx(v.stages[0].busy_s)  # one device, chunks hand over in memory


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbv", 2)])
def test_the_walk_equals_the_simpy_processes_with_a_gap_between_actions(schedule, virtual):
    for stages, microbatches in ((1, 3), (2, 4), (4, 8)):
        if virtual > 1 and stages == 1:
            continue
        partition = [1] * (stages * virtual)
        workload = GappedWorkload(stages * virtual, 0.3e-3, 0.2e-3, 0.45e-3,
                                  cold_s=(0.1e-3, 0.2e-3, 0.3e-3, 0.4e-3, 0.5e-3), warm_s=0.7e-3)
        spanned, walked = (simulate(workload, IDEAL, partition, 8,
                                    ParallelLayout.for_partition(partition, microbatches, checkpoint="except_last",
                                                                 schedule=schedule, virtual_stages=virtual), record=record)
                           for record in (True, False))
        assert walked.step_time_s == spanned.step_time_s
        assert [s.busy_s for s in walked.stages] == [s.busy_s for s in spanned.stages]
