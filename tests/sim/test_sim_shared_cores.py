"""Processes that outnumber their cores take turns on them: processor sharing in the simulator."""

import pytest
import simpy

from sim.engine.engine import simulate
from sim.engine.shared_cores import CoreSharing, SharedCores
from sim.errors import GpipeInputError
from sim.workloads.workload import UniformWorkload
from tests.helpers.scenarios import IDEAL, spans


def _finish_times(cores: int, jobs: list[tuple[float, float, int]]) -> list[float]:
    """When each (start_s, work_s, processes) job finishes on ``cores`` shared cores."""
    env = simpy.Environment()
    pool = SharedCores(env, cores)
    ends = [0.0] * len(jobs)

    def job(i, start_s, work_s, processes):
        yield env.timeout(start_s)
        yield pool.compute(work_s, processes)
        ends[i] = env.now

    for i, spec in enumerate(jobs):
        env.process(job(i, *spec))
    env.run()
    return ends


def test_jobs_share_the_cores_equally_and_speed_up_as_others_finish():
    assert _finish_times(1, [(0, 1, 1), (0, 1, 1)]) == pytest.approx([2, 2])
    # the short job runs at half speed until done at 2 s, the long one alone after it
    assert _finish_times(1, [(0, 1, 1), (0, 2, 1)]) == pytest.approx([2, 3])
    assert _finish_times(2, [(0, 1, 1)] * 3) == pytest.approx([1.5] * 3)
    assert _finish_times(2, [(0, 1, 1), (0, 1, 1)]) == pytest.approx([1, 1])  # a core each
    # the first alone for 0.5 s, then both at half speed until the first is done, the second alone after
    assert _finish_times(1, [(0, 1, 1), (0.5, 1, 1)]) == pytest.approx([1.5, 2.0])
    # a job standing for two processes takes two of the three shares
    assert _finish_times(2, [(0, 1, 2), (0, 1, 1)]) == pytest.approx([1.5, 1.5])
    assert _finish_times(1, [(0, 0, 1)]) == [0]


def test_a_two_stage_pipeline_on_one_core_literal_timeline():
    """Stage 1's F0 and stage 0's F1 run side by side at half speed, as do stage 0's B1 and
    stage 1's B0; the step is all the work of both stages one after another."""
    result = simulate(UniformWorkload(2), IDEAL, [1, 1], batch_size=2, microbatches=2, checkpoint="never",
                      core_sharing=CoreSharing(1))
    assert spans(result) == [
        (0, "F0", 0, 1), (0, "F1", 1, 3), (0, "B1", 6, 10), (0, "B0", 10, 12),
        (1, "F0", 1, 3), (1, "F1", 3, 4), (1, "B1", 4, 6), (1, "B0", 6, 10),
    ]
    assert result.step_time_s == pytest.approx(12e-3)
    assert [s.busy_s for s in result.stages] == pytest.approx([9e-3, 9e-3])  # elapsed, as the executor times


@pytest.mark.parametrize("record", [True, False])
def test_replicas_slow_each_other_and_enough_cores_change_nothing(record):
    args = (UniformWorkload(4), IDEAL, [2, 2], 8, 4, "except_last", "1f1b")
    alone = simulate(*args, replicas=2, record=record)
    for cores in (4, 8):  # D x K = 4 processes, a core each: the same figures to the bit
        same = simulate(*args, replicas=2, record=record, core_sharing=CoreSharing(cores))
        assert same.step_time_s == alone.step_time_s
        assert [s.busy_s for s in same.stages] == [s.busy_s for s in alone.stages]
    shared = simulate(*args, replicas=2, record=record, core_sharing=CoreSharing(2))
    compute_s = sum(s.busy_s for s in alone.stages)  # every process's work, done alone
    # two cores do the four processes' work no faster than two at a time, nor slower than one
    assert compute_s / 2 * (1 - 1e-12) <= shared.step_time_s <= compute_s
    assert shared.step_time_s > alone.step_time_s
    assert all(s.busy_s >= a.busy_s for s, a in zip(shared.stages, alone.stages))
    # a stage of T = 2 tensor-parallel processes counts twice: slower again on the same cores
    split = simulate(*args, replicas=2, record=record, core_sharing=CoreSharing(2, processes_per_device=2))
    assert split.step_time_s > shared.step_time_s


def test_core_sharing_refuses_a_count_that_is_not_positive():
    with pytest.raises(GpipeInputError, match="cores must be a positive integer, got 0"):
        CoreSharing(0)
    with pytest.raises(GpipeInputError, match="processes_per_device"):
        CoreSharing(2, processes_per_device=True)
