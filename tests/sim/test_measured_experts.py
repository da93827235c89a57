"""Expert parallelism priced from a costs file (sim.formats.measured_experts): a synthetic record whose
middle layer holds routed experts, split over E = 2 by hand and through `gpipe simulate --costs`."""

from __future__ import annotations

import json

import pytest

from sim.catalog.hardware import Link, get_system
from sim.engine.engine import simulate
from sim.errors import GpipeInputError
from sim.formats.costs import MeasuredWorkload, write_costs
from sim.formats.layout import ParallelLayout
from sim.formats.measured_experts import fitted_all_to_all_s
from sim.workloads.moe.expert_parallel import check_expert_parallel, with_expert_parallel
from sim.workloads.moe.layers import expected_max_load
from tests.helpers.costs import MOE_A2A as A2A, MOE_ROUTED_BYTES as ROUTED_BYTES, MOE_SLOPES as SLOPES, moe_costs
from tests.helpers.in_process import gpipe


def split(data: dict, expert_parallel: int = 2, replicas: int = 2) -> tuple[MeasuredWorkload, object]:
    system = get_system("cpu")
    workload = with_expert_parallel(MeasuredWorkload(data), system, expert_parallel, None, "gpipe")
    return workload.bind(system, 1, "always", 2, replicas)


def test_e_changes_the_routed_excess_and_the_all_to_alls_by_hand():
    """Stage of all three layers, 4 rows, --checkpoint always: the forward grows by the F line's slope
    (1.5) times the most loaded rank's excess of routed work, plus three all-to-alls (the counts, the
    dispatch, the combine) on the fitted exchange; the backward by B's excess and two all-to-alls."""
    data = moe_costs()
    one, system = MeasuredWorkload(data).bind(get_system("cpu"), 1, "always", 2, 2)
    two, _ = split(data)
    device = system.device
    rows, assignments = 4, 4 * 8 * 2
    load = expected_max_load(2 * 4 * 8, 2, 2)
    link = Link("a2a", A2A["bytes_per_s"], A2A["latency_s"])
    hidden_s = fitted_all_to_all_s(link, 2, assignments * 16 * 4)  # fp32 rows of d_model 16
    assert hidden_s == pytest.approx(5e-5 + 0.5 * assignments * 64 / 2e8)
    forward_a2a_s = fitted_all_to_all_s(link, 2, 4 * 8) + 2 * hidden_s
    base, ep = one.stage_cost(rows, 0, 3, device), two.stage_cost(rows, 0, 3, device)
    assert ep.forward_s - base.forward_s == pytest.approx(1.5 * (load - 1) * SLOPES["F"] * assignments
                                                          + forward_a2a_s)
    assert ep.backward_s - base.backward_s == pytest.approx(1.5 * (load - 1) * SLOPES["B"] * assignments
                                                            + 2 * hidden_s)
    assert (ep.ep_forward_s, ep.ep_backward_s) == (pytest.approx(forward_a2a_s), pytest.approx(2 * hidden_s))
    # each rank holds half the routed experts: their parameters, gradients and AdamW's two moments
    assert base.static_bytes - ep.static_bytes == (ROUTED_BYTES // 2) * 4
    assert [c.expert_grad_bytes for c in two.layer_costs(rows, device)] == [0, ROUTED_BYTES // 2, 0]


def test_each_ranks_state_bytes_hold_half_the_routed_experts_and_the_step_shows_the_exchanges():
    workload, system = split(moe_costs())
    layout = ParallelLayout(1, 2, "always", "gpipe", replicas=2, expert_parallel=2)
    result = simulate(workload, system, (3,), 8, layout, allreduce_link=workload.allreduce_link(system))
    params = 1000 + 2000 - ROUTED_BYTES // 2 + 3000
    assert [s.state_bytes for s in result.stages] == [(params, params, 2 * params)] * 2
    kinds = {r.kind for r in result.timeline.records}
    assert {"dispatch_ep", "combine_ep"} <= kinds


def test_a_costs_file_without_the_experts_profile_or_split_over_t_is_one_line():
    with pytest.raises(GpipeInputError, match="no profile of its routed experts"):
        split(moe_costs(experts=False))
    workload = MeasuredWorkload(moe_costs())
    with pytest.raises(GpipeInputError, match="whole stages"):
        check_expert_parallel(workload, 2, None, tensor_parallel=2)
    with pytest.raises(GpipeInputError, match="does not divide"):
        split(moe_costs(), expert_parallel=3)


def test_simulate_prices_a_measured_mixture_split_over_two_ranks(tmp_path):
    """`gpipe simulate --costs FILE --expert-parallel 2`: each rank's bytes hold half the routed experts, and
    the step is longer than at E = 1 by the exchanges; `gpipe plan --costs` searches E and prices the plan
    it proposes as simulate does; an ETP other than T over a costs file is one line."""
    path = tmp_path / "costs.json"
    write_costs(moe_costs(), path)
    common = ["simulate", "--costs", str(path), "--stages", "1", "--replicas", "2", "--batch", "8",
              "--microbatches", "2", "--checkpoint", "always", "--json"]
    ep = gpipe(*common, "--expert-parallel", "2")
    assert ep.returncode == 0, ep.stderr
    plain = gpipe(*common)
    assert plain.returncode == 0, plain.stderr
    split_run, whole_run = json.loads(ep.stdout), json.loads(plain.stdout)
    params = 1000 + 2000 - ROUTED_BYTES // 2 + 3000
    assert [d["parameter_bytes"] for d in split_run["stages"]] == [params, params]
    assert split_run["expert_parallel"] == 2
    assert split_run["step_time_s"] > whole_run["step_time_s"]
    one = ["plan", "--costs", str(path), "--stages-options", "1", "--replicas-options", "2", "--batch", "8",
           "--microbatch-options", "2", "--checkpoints", "always", "--schedules", "gpipe", "--zero-options", "0"]
    planned = gpipe(*one, "--json")
    assert planned.returncode == 0, planned.stderr
    by_e = {p.get("expert_parallel", 1): p for p in json.loads(planned.stdout)["ranked"]}
    assert set(by_e) == {1, 2}  # auto: every E dividing the experts and T x C x D
    # the search prices a costs file's forwards as under except_last (a plan's own policy rebinds them in
    # simulate): 0.01% apart here, so the E = 2 plan is the one simulate prices
    assert by_e[2]["step_time_s"] == pytest.approx(split_run["step_time_s"], rel=1e-3)
    assert by_e[1]["step_time_s"] == pytest.approx(whole_run["step_time_s"], rel=1e-9)
    assert [s["parameter_bytes"] for s in by_e[2]["stages"]] == [params, params]
    refused = gpipe(*one, "--expert-parallel-options", "2", "--expert-tensor-parallel-options", "2")
    assert refused.returncode == 2 and "a costs file prices whole experts" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
