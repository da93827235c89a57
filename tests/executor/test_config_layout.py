import pytest

from executor.config import RunConfig
from sim.errors import GpipeInputError
from sim.formats.layout import ParallelLayout


def test_a_run_config_gives_the_layout_the_planner_and_simulator_take():
    config = RunConfig.of(model="mlp", partition=(1, 1, 1, 1), microbatches=4, schedule="1f1b", checkpoint="never",
                       replicas=2, zero=1, tensor_parallel=2, sequence_parallel=True)
    assert config.layout == ParallelLayout(4, 4, "never", "1f1b", replicas=2, zero=1, tensor_parallel=2,
                                           sequence_parallel=True)
    assert config.layout.processes * config.layout.tensor_parallel == config.world_size


def test_a_run_config_with_a_bad_degree_gives_a_one_line_error_for_its_layout():
    with pytest.raises(GpipeInputError, match="--zero 1 shards optimizer state"):
        RunConfig.of(model="mlp", partition=(1, 1), zero=1).layout
