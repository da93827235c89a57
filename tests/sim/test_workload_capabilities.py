from sim.workloads.workload import UniformWorkload
from tests.helpers.scenarios import IDEAL


def test_every_workload_answers_its_capabilities_without_a_probe():
    from sim.formats.measured_workload import MeasuredWorkload
    from sim.workloads.models import get_workload
    from tests.helpers.costs import synthetic_costs

    measured = MeasuredWorkload(synthetic_costs())
    for workload in (UniformWorkload(2), get_workload("mlp", {}), get_workload("transformer", {}), measured):
        assert isinstance(workload.has_attention_core, bool)
        assert isinstance(tuple(workload.shared_parameters), tuple)
        assert workload.measured_costs == (workload is measured)
        assert (workload.stage_cost is None) == (workload is not measured)
        bound, system = workload.bind(IDEAL, 1)
        assert (bound is workload and system is IDEAL) or workload is measured
    assert UniformWorkload(2).allreduce_link(IDEAL) is None and UniformWorkload(2).planned_from is None
    assert get_workload("transformer", {}).has_attention_core and not get_workload("mlp", {}).has_attention_core
