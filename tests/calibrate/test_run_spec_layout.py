from calibrate.fit.design import RunSpec
from sim.formats.layout import ParallelLayout


def test_a_design_run_gives_the_layout_the_simulator_takes():
    spec = RunSpec.of((2, 2, 2, 2), 4, "never", "interleaved", 8, replicas=2, tensor_parallel=2, virtual_stages=2)
    assert spec.layout == ParallelLayout(2, 4, "never", "interleaved", replicas=2, virtual_stages=2,
                                         tensor_parallel=2)
    assert spec.layout.stages == spec.stages and spec.layout.devices_per_stage * spec.layout.processes \
        == spec.processes
