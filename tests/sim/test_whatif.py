import json

import pytest

from sim.catalog.hardware import get_system
from sim.errors import GpipeInputError
from sim.formats.costs import write_costs
from tests.helpers.costs import synthetic_costs
from sim.planner.search import Candidate
from sim.planner.whatif import efficiency_from_costs, simulate_candidate, with_efficiency
from sim.workloads.models import get_workload

SMALL = {"layers": 4, "d_model": 512, "ff": 2048, "heads": 8, "seq": 256, "vocab": 8000}


def test_a_lower_efficiency_makes_compute_bound_steps_slower():
    workload = get_workload("transformer", SMALL)
    system = get_system("a100-nvlink")
    candidate = Candidate(2, 8, "except_last", "gpipe")
    fast = simulate_candidate(workload, with_efficiency(system, 0.8), 64, candidate)
    slow = simulate_candidate(workload, with_efficiency(system, 0.2), 64, candidate)
    assert slow.step_time_s > 2 * fast.step_time_s


@pytest.mark.parametrize("value", [0.0, -0.3, 7.0])
def test_an_efficiency_that_is_not_a_fraction_is_refused(value):
    with pytest.raises(GpipeInputError, match="not a fraction of peak"):
        with_efficiency(get_system("h100-nvlink"), value)


@pytest.mark.parametrize("value", ["1.5", "nan", "0"])
def test_gpipe_plan_takes_an_efficiency_of_at_most_the_peak(value, capsys):
    """A user's --efficiency is a fraction of the catalog's peak; 1.5 passed before (the bound a
    roofline fit of a CPU may reach), though the message said (0, 1]."""
    from gpipe.main import main

    assert main(["plan", "--model", "mlp", "--hardware", "a100-nvlink", "--quiet", "--efficiency", value]) == 2
    assert capsys.readouterr().err.splitlines() == [f"gpipe: error: --efficiency {float(value)} is not a fraction "
                                                   "of peak; use a value in (0, 1]"]


def test_efficiency_is_read_from_a_costs_file(tmp_path):
    path = tmp_path / "costs.json"
    write_costs({**synthetic_costs(), "efficiency": {"efficiency": 0.37, "bandwidth_efficiency": 0.21}}, path)
    assert efficiency_from_costs(str(path)) == (0.37, 0.21)
    write_costs({**synthetic_costs(), "efficiency": None}, path)
    with pytest.raises(GpipeInputError, match="no fitted efficiency"):
        efficiency_from_costs(str(path))
    with pytest.raises(GpipeInputError, match="does not exist"):
        efficiency_from_costs(str(tmp_path / "missing.json"))


def test_a_candidate_that_does_not_fit_is_still_simulated_with_a_balanced_split():
    workload = get_workload("transformer", {**SMALL, "layers": 48, "d_model": 2048, "ff": 8192,
                                            "heads": 32, "seq": 1024, "vocab": 32000})
    result = simulate_candidate(workload, get_system("tpu-v3"), 32, Candidate(2, 4, "never", "gpipe"))
    assert not result.fits and sum(result.partition) == workload.num_layers


def _tensor_parallel_plan(capsys, costs, *flags):
    from gpipe.main import main

    assert main(["plan", "--model", "transformer", "--layers", "4", "--d-model", "64", "--ff", "256", "--heads", "4",
                 "--seq", "32", "--vocab", "256", "--batch", "8", "--hardware", "cpu", "--efficiency-from", str(costs),
                 "--tensor-parallel-options", "2", "--stages-options", "1", "--microbatch-options", "1", "--top", "1",
                 "--quiet", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["ranked"][0]


@pytest.mark.parametrize("sequence", [False, True])
def test_measured_tensor_parallel_collectives_price_a_split_layer_on_this_system(tmp_path, capsys, sequence):
    """A plan on the system a costs file measured pays its tensor-parallel collectives on the measured
    link of their kind (all-reduces, or reduce-scatter + all-gather pairs with sequence parallelism):
    a second of latency per ring step on that link shows in the step, on the other one it does not."""
    def costs(all_reduce_latency_s, pair_latency_s):
        path = tmp_path / f"costs-{all_reduce_latency_s}-{pair_latency_s}.json"
        write_costs({**synthetic_costs(), "efficiency": {"efficiency": 0.5, "bandwidth_efficiency": 0.5},
                     "tensor_parallel": {"backend": "gloo", "parties": 2,
                                         "all_reduce": {"latency_s": all_reduce_latency_s, "bandwidth_bytes_per_s": 1e9},
                                         "sequence_parallel": {"latency_s": pair_latency_s,
                                                               "bandwidth_bytes_per_s": 1e9}}}, path)
        return path

    flag = "--sequence-parallel" if sequence else "--no-sequence-parallel"
    base, all_reduce_slow, pair_slow = (_tensor_parallel_plan(capsys, costs(*latencies), flag)["step_time_s"]
                                        for latencies in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)))
    used, unused = (pair_slow, all_reduce_slow) if sequence else (all_reduce_slow, pair_slow)
    assert used - base >= 4 * 4 * 2 * 1.0  # 4 blocks of at least 4 collectives, each a 2-party ring of 2 steps
    assert unused == pytest.approx(base, rel=1e-9)
