"""The simulator's view of a parameter shared across stages: one copy per stage, an all-reduce."""

import pytest

from gpipe.workload_flags import resolve_workload
from sim.catalog.hardware import Link, get_system
from sim.engine.engine import ring_allreduce_s, simulate
from sim.formats.layout import ParallelLayout
from sim.formats.timeline import SHARED_ALLREDUCE
from sim.workloads.workload import LayerCost, SharedParameter, WorkloadCapabilities


class Tied(WorkloadCapabilities):
    """Four 1 ms / 2 ms layers; layers 0 and 3 share a 1000-byte weight (3000 static bytes)."""

    name = "tied"
    num_layers = 4
    shared_parameters = (SharedParameter("0.weight", (0, 3), 1000, 3000),)

    def layer_costs(self, rows, device):
        return [LayerCost(f"l{i}", 1e-3, 2e-3, 1e-3, 10, 10, 1000 if i in (0, 3) else 100,
                          1000 if i in (0, 3) else 100, 1000 if i in (0, 3) else 100, 10)
                for i in range(4)]

    def describe(self):
        return {"name": "tied", "options": {}, "num_layers": 4, "parameter_count": 0}


class Untied(Tied):
    shared_parameters = ()


def test_one_stage_holds_one_copy_and_reduces_nothing():
    result = simulate(Tied(), get_system("h100-nvlink"), (4,), 4,
                      ParallelLayout.for_partition((4,), 2, checkpoint="never"))
    assert result.stages[0].static_bytes == 3000 + 2 * 300  # the shared weight once, two 100-byte layers
    assert not [r for r in result.timeline.records if r.kind == SHARED_ALLREDUCE]


def test_two_owners_each_hold_a_copy_and_wait_for_the_all_reduce():
    system = get_system("h100-nvlink")
    result = simulate(Tied(), system, (2, 2), 4, ParallelLayout.for_partition((2, 2), 2, checkpoint="never"))
    assert [s.static_bytes for s in result.stages] == [3000 + 300, 300 + 3000]
    spans = [r for r in result.timeline.records if r.kind == SHARED_ALLREDUCE]
    assert sorted(r.stage for r in spans) == [0, 1]
    expected = ring_allreduce_s(1000, 2, system.intra_link)
    assert all(r.duration_s == pytest.approx(expected) for r in spans)
    # the all-reduce starts when the later owner (stage 0, whose backwards end last) is done
    assert spans[0].start_s == spans[1].start_s
    without = simulate(Untied(), system, (2, 2), 4, ParallelLayout.for_partition((2, 2), 2, checkpoint="never"))
    assert result.step_time_s == pytest.approx(without.step_time_s + expected)


def test_ring_all_reduce_follows_its_formula():
    link = Link("l", 1e9, 1e-6)
    assert ring_allreduce_s(1000, 1, link) == 0
    assert ring_allreduce_s(1000, 2, link) == pytest.approx(1000 / 1e9 + 2e-6)
    assert ring_allreduce_s(1200, 4, link) == pytest.approx(1.5 * 1200 / 1e9 + 6e-6)


def test_a_tied_torch_model_is_found_by_the_meta_analysis():
    w = resolve_workload("tests.helpers.sample_models:tied_lm", {"input_shape": "8:int64", "optimizer_slots": 2})
    (shared,) = w.shared_parameters
    assert shared.layers == (0, 3) and shared.param_bytes == 32 * 16 * 4 and shared.static_bytes == 4 * shared.param_bytes
    untied_count = sum(p.parameters for p in w.profiles)
    assert w.parameter_count == untied_count - 32 * 16
    two = simulate(w, get_system("a100-nvlink"), (2, 2), 8,
                   ParallelLayout.for_partition((2, 2), 2, checkpoint="never"))
    assert any(r.kind == SHARED_ALLREDUCE for r in two.timeline.records)


def test_measured_costs_carry_the_shared_parameters(tmp_path):
    from tests.helpers.costs import synthetic_costs

    from sim.formats.costs import load_costs_workload, write_costs

    data = synthetic_costs()  # three layers of 1000, 2000 and 3000 parameter bytes, no optimizer state
    data["shared_parameters"] = [{"name": "0.weight", "layers": [0, 2], "param_bytes": 1000}]
    write_costs(data, tmp_path / "c.json")
    workload, system = load_costs_workload(str(tmp_path / "c.json"), "mlp", {"layers": 3, "width": 8}).bind(
        get_system("cpu"), 2, "never")
    assert workload.describe()["parameter_count"] == (1000 + 2000 + 3000 - 1000) // 4
    one = simulate(workload, system, (3,), 4, ParallelLayout.for_partition((3,), 2, checkpoint="never"))
    assert one.stages[0].static_bytes == 2 * (1000 + 2000 + 3000) - 2 * 1000  # weights and gradients, once
    two = simulate(workload, system, (2, 1), 4, ParallelLayout.for_partition((2, 1), 2, checkpoint="never"))
    assert any(r.kind == SHARED_ALLREDUCE for r in two.timeline.records)
