import dataclasses

import pytest

from sim.engine.engine import simulate
from sim.errors import GpipeInputError
from sim.formats.layout import ParallelLayout
from sim.planner.search import Candidate
from sim.workloads.workload import UniformWorkload
from tests.helpers.scenarios import IDEAL


def test_degrees_multiply_into_devices_and_processes():
    layout = ParallelLayout(4, 8, "never", "1f1b", replicas=2, tensor_parallel=2, context_parallel=3)
    assert layout.devices_per_stage == 6
    assert layout.devices_per_replica == 24
    assert layout.total_devices == 48
    assert layout.processes == 8
    assert ParallelLayout(2, 4, schedule="interleaved", virtual_stages=3).virtual_stage_count == 6


def test_the_planner_candidate_is_the_layout():
    assert Candidate is ParallelLayout
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelLayout(2, 2).stages = 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(stages=0, microbatches=1), "stages (K) must be a positive integer, got 0"),
    (dict(stages=2, microbatches=0), "micro-batches (M) must be a positive integer, got 0"),
    (dict(stages=2, microbatches=1, checkpoint="sometimes"), "unknown checkpoint policy 'sometimes'"),
    (dict(stages=2, microbatches=1, schedule="zigzag"), "unknown schedule 'zigzag'"),
    (dict(stages=2, microbatches=1, replicas=0), "replicas (D) must be a positive integer, got 0; use --replicas"),
    (dict(stages=2, microbatches=1, replicas=True), "replicas (D) must be a positive integer, got True"),
    (dict(stages=2, microbatches=1, virtual_stages=2), "--virtual-stages 2 needs --schedule interleaved"),
    (dict(stages=2, microbatches=1, schedule="zbv", virtual_stages=3), "use --virtual-stages 2, not 3"),
    (dict(stages=2, microbatches=1, zero=4), "--zero must be 0, 1, 2 or 3, got 4"),
    (dict(stages=2, microbatches=1, replicas=4, zero=1, shard_group=2), "--shard-group 2 shards parameters and gradients"),
    (dict(stages=2, microbatches=1, replicas=4, zero=3, shard_group=3), "--shard-group 3 does not divide --replicas 4"),
    (dict(stages=2, microbatches=1, zero=1), "--zero 1 shards optimizer state"),
    (dict(stages=2, microbatches=1, replicas=2, zero=3, gradient_sync="often"),
     "--gradient-sync must be step or microbatch, got 'often'"),
    (dict(stages=2, microbatches=1, replicas=2, zero=1, gradient_sync="step"),
     "--gradient-sync step says when sharded gradients are reduce-scattered, which needs --zero 2 or 3"),
    (dict(stages=2, microbatches=1, placement="random"), "unknown placement 'random'"),
    (dict(stages=2, microbatches=1, tensor_parallel=0), "tensor_parallel (T) must be a positive integer"),
    (dict(stages=2, microbatches=1, context_parallel=0), "context_parallel (C) must be a positive integer"),
    (dict(stages=2, microbatches=1, sequence_parallel="yes"), "sequence_parallel must be true or false"),
])
def test_a_bad_degree_is_refused_in_one_line_where_it_is_built(kwargs, message):
    with pytest.raises(GpipeInputError) as error:
        ParallelLayout(**kwargs)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_the_gradient_sync_is_the_trainers_default_unless_given():
    assert ParallelLayout(1, 4, replicas=2, zero=3).resolved_gradient_sync == "microbatch"  # FSDP2, DeepSpeed
    assert ParallelLayout(2, 4, replicas=2, zero=2).resolved_gradient_sync == "step"  # torch's pipeline schedules
    assert ParallelLayout(1, 4, replicas=2, zero=3, gradient_sync="step").resolved_gradient_sync == "step"
    assert ParallelLayout(2, 4, replicas=2, zero=3, gradient_sync="microbatch").resolved_gradient_sync == "microbatch"
    assert ParallelLayout(1, 4, replicas=2, zero=1).resolved_gradient_sync == "step"  # whole gradients: once a step


def test_for_partition_reads_k_from_the_partition_and_v():
    assert ParallelLayout.for_partition([1, 1, 1, 1], 4, schedule="interleaved", virtual_stages=2).stages == 2
    with pytest.raises(GpipeInputError, match="partition has 3 entries, not a multiple of --virtual-stages 2"):
        ParallelLayout.for_partition([1, 1, 1], 4, schedule="interleaved", virtual_stages=2)


def test_simulate_refuses_a_partition_the_layout_does_not_spread_over():
    with pytest.raises(GpipeInputError, match="partition has 2 entries but the layout has K=4 stages"):
        simulate(UniformWorkload(2), IDEAL, [1, 1], 4, ParallelLayout(4, 4))

