"""Expert parallelism in the simulator, planner and replay (sim.workloads.moe.expert_parallel)."""

from __future__ import annotations

import json
import math

import pytest

from sim.catalog.hardware import Link, get_system
from sim.engine.engine import simulate
from sim.engine.stage_costs import CostTable
from sim.errors import GpipeInputError
from sim.evidence.replay_search import expert_options
from sim.formats.layout import ParallelLayout
from sim.formats.timeline import EP_COMBINE, EP_DISPATCH, KIND_NAMES
from sim.workloads.models import get_workload
from sim.workloads.moe.expert_parallel import (ExpertSplit, all_to_all_s, remote_domains_per_token,
                                               with_expert_parallel)
from sim.workloads.moe.workload import MoEWorkload, builtin_workload
from sim.workloads.tensor_parallel import with_tensor_parallel

MOE = {"layers": 2, "d_model": 64, "ff": 128, "heads": 4, "seq": 32, "vocab": 128, "experts": 8, "top_k": 2,
       "expert_ff": 32, "precision": "bf16"}
FAST = Link("fast", 1e9, 0.0)
SLOW = Link("slow", 1e8, 0.0)


def _moe():
    return builtin_workload("transformer", dict(MOE))


def test_layout_refuses_e_times_etp_not_dividing_the_group():
    with pytest.raises(GpipeInputError, match="does not divide T x C x D"):
        ParallelLayout(1, 1, replicas=2, expert_parallel=4)


def test_layout_takes_zero_2_with_expert_parallelism_and_refuses_hsdp_of_the_experts():
    assert ParallelLayout(1, 1, replicas=2, zero=2, expert_parallel=2).expert_data_parallel == 1
    assert ParallelLayout(1, 1, replicas=4, zero=3, expert_parallel=2).expert_data_parallel == 2
    with pytest.raises(GpipeInputError, match="HSDP of the routed experts .* is not modelled"):
        ParallelLayout(1, 1, replicas=4, zero=3, expert_parallel=2, shard_group=2)


def test_e_not_dividing_the_experts_is_one_line():
    with pytest.raises(GpipeInputError, match="does not divide .* 8 routed experts"):
        with_expert_parallel(_moe(), get_system("h100-nvlink"), 3, None, "1f1b")


def test_e_on_a_dense_model_is_one_line():
    with pytest.raises(GpipeInputError, match="has none"):
        with_expert_parallel(get_workload("transformer"), get_system("h100-nvlink"), 2, None, "1f1b")


def test_all_to_all_by_hand():
    # 4 ranks in one domain: 3/4 of 1 MB over 1 GB/s
    assert all_to_all_s(1e6, 4, 4, FAST, SLOW) == pytest.approx(0.75e-3)
    # 4 ranks, 2 per domain: 1/4 inside (0.25 ms), 2/4 across at 100 MB/s (5 ms): the slower part
    assert all_to_all_s(1e6, 4, 2, FAST, SLOW) == pytest.approx(5e-3)
    assert all_to_all_s(1e6, 1, 1, FAST, SLOW) == 0.0


def test_workload_prices_two_all_to_alls_of_tokens_topk_dmodel_bytes():
    split = _moe().split_experts(ExpertSplit(4, 1, 4, FAST, SLOW))
    cost = split.layer_costs(1, get_system("h100-nvlink").device)[1]
    payload = 32 * 2 * 64 * 2  # tokens x top_k x d_model x bf16 bytes, for one row
    assert cost.ep_forward_s == pytest.approx(2 * payload * 3 / 4 / 1e9)
    assert cost.ep_backward_s == pytest.approx(cost.ep_forward_s)


def test_experts_padded_to_capacity_load_every_rank_alike():
    """Dropless, the most loaded of E ranks sets the grouped matmuls' time; with a capacity factor every expert
    computes its padded capacity, counted once in the assignments (capacity factor x top-k), never again as
    imbalance."""
    whole = _moe()
    dropless = whole.split_experts(ExpertSplit(4, 1, 4, FAST, SLOW))
    padded = MoEWorkload("padded", {}, {**whole.options, "capacity_factor": 1.0}).split_experts(
        ExpertSplit(4, 1, 4, FAST, SLOW))
    assert dropless.rank_load(32) > 1.1
    assert padded.rank_load(32) == 1.0
    device = get_system("h100-nvlink").device
    assert padded.layer_costs(1, device)[1].forward_s < dropless.layer_costs(1, device)[1].forward_s


def test_overlapping_schedule_hides_the_all_to_all_behind_compute():
    shown = ExpertSplit(4, 1, 4, FAST, SLOW, overlapped=True).exposed_s(1.0, 1.0, 0.5, 0.5)
    assert shown == pytest.approx((0.5, 0.5))
    assert ExpertSplit(4, 1, 4, FAST, SLOW, overlapped=True).exposed_s(1.0, 1.0, 2.0, 2.0) == (0.0, 0.0)
    assert ExpertSplit(4, 1, 4, FAST, SLOW).exposed_s(1.0, 1.0, 2.0, 2.0) == (1.0, 1.0)


def test_expert_state_shrinks_by_e():
    device = get_system("h100-nvlink").device
    whole = _moe().layer_costs(1, device)[1]
    split = _moe().split_experts(ExpertSplit(4, 1, 4, FAST, SLOW)).layer_costs(1, device)[1]
    experts = 8 * (3 * 64 * 32 + 2 * 32 + 64)  # E x ((gate, up, down) x d x f + biases): the built-in's experts
    assert whole.param_bytes - split.param_bytes == experts * 3 // 4 * 4  # fp32 weights, 3/4 of them gone
    assert split.expert_grad_bytes == experts // 4 * 4


def test_simulated_timeline_shows_dispatch_and_combine():
    system = get_system("h100-nvlink")
    workload, groups = with_tensor_parallel(_moe(), system, 1)
    workload = with_expert_parallel(workload, system, 2, None, "1f1b")
    layout = ParallelLayout(1, 2, "never", "1f1b", replicas=2, expert_parallel=2)
    result = simulate(workload, groups, [workload.num_layers], 4, layout, costs=CostTable(workload, groups.device))
    kinds = {r.kind for r in result.timeline.records}
    assert {EP_DISPATCH, EP_COMBINE} <= kinds
    assert KIND_NAMES[EP_DISPATCH] == "expert dispatch (all-to-all)"


def test_a_split_backward_shows_the_backward_all_to_alls_where_the_executor_runs_them():
    """Under zb-h1 a backward's all-to-alls sit in I (the exchange's reverse is on the input-gradient
    path), except on the first stage, whose input needs no gradient: its W is the whole backward."""
    system = get_system("h100-nvlink")
    workload, groups = with_tensor_parallel(_moe(), system, 1)
    workload = with_expert_parallel(workload, system, 2, None, "zb-h1")
    half = workload.num_layers // 2
    layout = ParallelLayout(2, 2, "never", "zb-h1", replicas=2, expert_parallel=2)
    result = simulate(workload, groups, [half, workload.num_layers - half], 4, layout,
                      costs=CostTable(workload, groups.device))
    records = result.timeline.records
    actions = [r for r in records if r.kind in ("F", "I", "W") and r.end_s > r.start_s]
    issued_in = {}
    for span in (r for r in records if r.kind in (EP_DISPATCH, EP_COMBINE)):
        assert span.end_s > span.start_s, span  # each shows its time (a 0 s I of the first stage would not)
        (owner,) = [a for a in actions if (a.stage, a.replica, a.microbatch) == (span.stage, span.replica,
                                                                                   span.microbatch)
                    and a.start_s <= span.start_s and span.end_s <= a.end_s]
        issued_in.setdefault(span.stage, set()).add(owner.kind)
    assert issued_in == {0: {"F", "W"}, 1: {"F", "I"}}


def test_replay_searches_null_expert_keys_and_refuses_them_on_a_dense_model():
    run = {"expert_parallel": None, "expert_tensor_parallel": None}
    pairs = expert_options(run, _moe(), 1, 1, 4)
    assert pairs == [(1, 1), (2, 1), (4, 1)]
    assert expert_options({"expert_parallel": 2, "expert_tensor_parallel": 1}, _moe(), 1, 1, 4) == [(2, 1)]
    with pytest.raises(GpipeInputError, match="has none"):
        expert_options({"expert_parallel": 2}, get_workload("transformer"), 1, 1, 4)


def test_planner_finds_an_expert_parallel_plan_where_e1_does_not_fit():
    from tests.helpers.in_process import gpipe

    narrow = ["plan", "--model", "qwen3-30b-a3b", "--hardware", "h100-nvlink", "--nodes", "2", "--batch", "16",
              "--stages-options", "1", "--replicas-options", "16", "--microbatch-options", "1",
              "--checkpoints", "full", "--tensor-parallel-options", "1", "--zero-options", "0,1", "--quiet", "--json"]
    alone = gpipe(*narrow, "--expert-parallel-options", "1")
    assert alone.returncode == 2 and "fits" in alone.stderr
    found = gpipe(*narrow)
    assert found.returncode == 0, found.stderr
    best = json.loads(found.stdout)["ranked"][0]
    assert best["expert_parallel"] > 1


def test_simulate_refuses_expert_parallelism_on_a_dense_model_in_one_line():
    from tests.helpers.in_process import gpipe

    done = gpipe("simulate", "--model", "transformer", "--replicas", "2", "--stages", "1", "--batch", "4",
                 "--expert-parallel", "2")
    assert done.returncode == 2 and "has none" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_plan_file_keeps_expert_keys_only_when_set():
    from sim.formats.plan import ModelRef, Plan

    model = ModelRef(name="transformer", options={}, num_layers=4, parameter_count=1)
    plain = Plan.of(model=model, partition=(4,), batch_size=4, microbatches=1, replicas=2)
    assert "expert_parallel" not in plain.to_dict() and "expert_tensor_parallel" not in plain.to_dict()
    split = Plan.of(model=model, partition=(4,), batch_size=4, microbatches=1, replicas=2, expert_parallel=2)
    assert split.to_dict()["expert_parallel"] == 2 and split.layout.expert_parallel == 2


def test_zero1_splits_expert_state_over_the_expert_data_parallel_group_alike_in_planner_and_engine():
    from sim.engine.range_memory import RangeMemory
    from sim.planner.search import Partitions, _sharding

    system = get_system("h100-nvlink")
    workload, groups = with_tensor_parallel(_moe(), system, 1)
    split = with_expert_parallel(workload, system, 4, None, "1f1b")  # E = 4 of D = 4: no expert-DP peers
    layout = ParallelLayout(1, 1, "never", "1f1b", replicas=4, zero=1, expert_parallel=4)
    table = CostTable(split, groups.device)
    engine = simulate(split, groups, [split.num_layers], 4, layout, costs=table).stages[0].static_bytes
    layers = split.num_layers
    planner = Partitions(table, groups, 4)._chunk_static(1, 0, layers, layout)
    ranges = RangeMemory(table.layers(1), (), "never", _sharding(layout), 4).static[0, layers]
    assert engine == planner == ranges
    gradient, optimizer = table.gradient_and_optimizer_bytes(1, 0, layers)
    experts = table.expert_gradient_bytes(1, 0, layers)
    held_whole = optimizer * experts // gradient  # the experts' state is not split: each rank holds its own
    assert engine > table.stage(1, 0, layers).static_bytes - optimizer + held_whole


def test_dualpipev_shows_less_all_to_all_than_1f1b():
    system = get_system("h100-nvlink", 2)
    workload, groups = with_tensor_parallel(_moe(), system, 1)
    device = groups.device
    hidden = with_expert_parallel(workload, system, 8, None, "dualpipev").layer_costs(1, device)[1]
    shown = with_expert_parallel(workload, system, 8, None, "1f1b").layer_costs(1, device)[1]
    assert shown.ep_forward_s > 0 and hidden.ep_forward_s < shown.ep_forward_s


def test_a_costs_files_all_to_all_is_read_as_a_link_and_a_bad_one_is_one_line():
    from sim.formats.costs_links import expert_parallel_link

    assert expert_parallel_link({}) is None
    link = expert_parallel_link({"expert_parallel": {"all_to_all": {"latency_s": 1e-4, "bytes_per_s": 2e9}}})
    assert (link.latency_s, link.bandwidth_bytes_per_s) == (1e-4, 2e9)
    with pytest.raises(GpipeInputError, match="no bytes_per_s"):
        expert_parallel_link({"expert_parallel": {"all_to_all": {"latency_s": 1e-4}}})


def test_a_planned_expert_parallel_layout_is_simulated_again_from_its_plan_file(tmp_path):
    from tests.helpers.in_process import gpipe

    path = tmp_path / "plan.json"
    planned = gpipe("plan", "--model", "qwen3-30b-a3b", "--hardware", "h100-nvlink", "--nodes", "2", "--batch", "16",
                    "--stages-options", "1", "--replicas-options", "16", "--microbatch-options", "1",
                    "--checkpoints", "full", "--tensor-parallel-options", "1", "--zero-options", "0,1",
                    "--expert-parallel-options", "16", "--quiet", "--out", str(path))
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(path.read_text())
    assert plan["expert_parallel"] == 16 and "expert_tensor_parallel" not in plan
    again = gpipe("simulate", "--plan", str(path), "--json")
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    assert result["expert_parallel"] == 16
    assert result["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"], rel=1e-9)


def test_simulate_reports_each_ranks_state_bytes_under_expert_parallelism():
    from tests.helpers.in_process import gpipe

    def stage(*flags):
        done = gpipe("simulate", "--model", "transformer", "--option", "experts=4", "--option", "top_k=2",
                     "--layers", "2", "--replicas", "2", "--stages", "1", "--batch", "4", "--microbatches", "1",
                     "--hardware", "cpu", "--json", *flags)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["stages"][0]

    whole, split = stage(), stage("--expert-parallel", "2")
    assert "parameter_bytes" not in whole  # without expert parallelism the output is as it was
    assert split["parameter_bytes"] + split["gradient_bytes"] + split["optimizer_state_bytes"] == split["static_bytes"]
    assert split["static_bytes"] < whole["static_bytes"]
    assert split["optimizer_state_bytes"] == 2 * split["parameter_bytes"]  # Adam's two fp32 slots, no ZeRO


@pytest.mark.parametrize("model, value, message", [
    ("qwen3-30b-a3b", "3", "does not divide qwen3-30b-a3b's 128 routed experts"),
    ("transformer", "2", "has none"),
])
def test_plan_refuses_an_expert_parallel_option_the_model_cannot_take_in_one_line(model, value, message):
    from tests.helpers.in_process import gpipe

    done = gpipe("plan", "--model", model, "--hardware", "h100-nvlink", "--batch", "8", "--stages-options", "1",
                 "--tensor-parallel-options", "1", "--expert-parallel-options", value, "--quiet")
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


AM_ROW = {"id": "am-style", "hardware": "h100-nvlink", "nodes": 1, "model": "transformer",
          "options": {"layers": 4, "d_model": 256, "ff": 512, "heads": 4, "seq": 128, "vocab": 512, "experts": 8,
                      "top_k": 2, "expert_ff": 128},
          "tensor_parallel": 1, "pipeline_stages": 1, "replicas": 4, "context_parallel": 1, "expert_parallel": 2,
          "expert_tensor_parallel": 1, "virtual_stages": None, "microbatch_size": 1, "global_batch": 8,
          "checkpoint": "never", "sequence_parallel": False, "precision": "bf16", "zero": 3, "measured_step_s": 1.0}


def _resolve(model, options):
    return builtin_workload(model, options)


def test_replay_of_an_fsdp_row_with_expert_parallelism_is_modelled_with_its_layout():
    from sim.evidence.replay import replay

    done = replay(dict(AM_ROW), _resolve)
    assert done.modelled and done.predicted_step_s > 0
    layout = done.layout
    assert (layout["zero"], layout["expert_parallel"], layout["expert_tensor_parallel"], layout["replicas"]) == (3, 2, 1, 4)
    assert not any("zero null" in line or "expert_parallel null" in line for line in done.assumed)  # all stated
    hsdp = replay({**AM_ROW, "shard_group": 2}, _resolve)  # HSDP of the experts: not modelled, said in one line
    assert not hsdp.modelled and hsdp.predicted_step_s is None
    assert "--shard-group 2 with --expert-parallel 2" in hsdp.reason and "\n" not in hsdp.reason
    searched = replay({**AM_ROW, "shard_group": 2, "expert_parallel": None}, _resolve)  # E null: E = 1 with HSDP
    assert searched.modelled and searched.layout["expert_parallel"] == 1


def test_plan_searches_zero3_with_expert_parallelism():
    from tests.helpers.in_process import gpipe

    done = gpipe("plan", "--model", "transformer", "--option", "experts=4", "--option", "top_k=2", "--hardware",
                 "h100-nvlink", "--nodes", "1", "--batch", "8", "--zero-options", "3", "--expert-parallel-options", "2",
                 "--schedules", "gpipe,1f1b", "--quiet", "--json")
    assert done.returncode == 0, done.stderr
    ranked = json.loads(done.stdout)["ranked"]
    assert ranked and all(p["expert_parallel"] == 2 and p["zero"] == 3 for p in ranked)


def _zero3_e2_d4():
    system = get_system("h100-nvlink")
    workload, groups = with_tensor_parallel(_moe(), system, 1)
    split = with_expert_parallel(workload, system, 2, None, "1f1b")
    return split, groups, ParallelLayout(1, 1, "never", "1f1b", replicas=4, zero=3, expert_parallel=2)


def test_zero3_shards_the_rest_over_d_and_the_experts_over_their_expert_data_parallel_group_by_hand():
    split, groups, layout = _zero3_e2_d4()
    sharded = simulate(split, groups, [split.num_layers], 4, layout).stages[0].sharded
    params = _moe().parameter_count  # fp32 weights, gradients; Adam's two fp32 slots
    experts = 2 * 8 * (3 * 64 * 32 + 2 * 32 + 64)  # layers x experts x ((gate, up, down) x d x f + biases)
    edp = 4 // 2  # T x C x D / (E x ETP)
    per_rank = (params - experts) // 4 + experts // 2 // edp  # the rest over D, the experts over E, then EDP
    assert (sharded.parameter_bytes, sharded.gradient_bytes, sharded.optimizer_state_bytes) == (
        4 * per_rank, 4 * per_rank, 8 * per_rank)


def test_zero3_with_expert_parallelism_alike_in_planner_and_engine():
    from sim.engine.range_memory import RangeMemory
    from sim.planner.search import Partitions

    split, groups, layout = _zero3_e2_d4()
    table = CostTable(split, groups.device)
    layers = split.num_layers
    engine = simulate(split, groups, [layers], 4, layout, costs=table).stages[0].static_bytes
    partitions = Partitions(table, groups, 4)
    planner = partitions._chunk_static(1, 0, layers, layout)
    ranges = RangeMemory(table.layers(1), (), "never", partitions._sharding(layout), 4).static[0, layers]
    assert engine == planner == ranges


def test_the_experts_reduce_scatter_runs_on_their_own_group():
    from sim.engine.fsdp import Collectives

    split, groups, _layout = _zero3_e2_d4()
    layer = CostTable(split, groups.device).layers(1)[1]  # a MoE block
    whole = Collectives((0, 1, 2, 3), (0,), groups)
    apart = Collectives((0, 1, 2, 3), (0,), groups, expert_devices=(0, 2))
    unit, expert_unit = whole.units([layer], [1.0])[0], apart.units([layer], [1.0])[0]
    assert unit.reduce_s == whole.reduce_scatter_s(layer.grad_bytes)
    rest = layer.grad_bytes - layer.expert_grad_bytes
    assert expert_unit.reduce_s == pytest.approx(whole.reduce_scatter_s(rest)
                                                 + Collectives((0, 2), (0,), groups).reduce_scatter_s(
                                                     layer.expert_grad_bytes))


def test_simulate_prices_zero3_with_expert_parallelism_and_refuses_hsdp_of_the_experts_in_one_line():
    from tests.helpers.in_process import gpipe

    flags = ["simulate", "--model", "transformer", "--option", "experts=4", "--option", "top_k=2", "--layers", "2",
             "--replicas", "4", "--stages", "1", "--batch", "8", "--expert-parallel", "2", "--zero", "3",
             "--hardware", "h100-nvlink"]
    done = gpipe(*flags, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stages"][0]["gathered_parameter_bytes_peak"] > 0
    refused = gpipe(*flags, "--shard-group", "2")
    assert refused.returncode == 2 and "--shard-group 2 with --expert-parallel 2" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_a_token_reaches_each_other_domain_unless_all_its_experts_are_elsewhere():
    # 4 experts over 2 domains, top-2: of the 6 pairs, 1 lies wholly in the other domain... and 1 wholly in
    # one's own, so the other domain is missed with probability C(2, 2) / C(4, 2) = 1/6
    assert remote_domains_per_token(4, 2, 2) == pytest.approx(5 / 6)
    assert remote_domains_per_token(128, 8, 1) == 0.0  # one domain: nothing crosses
    assert remote_domains_per_token(64, 1, 8) == pytest.approx(7 / 8)  # top-1: another domain 7 times in 8
    # many experts, top-8 over 2 domains: almost always both, so one copy crosses in place of the 4 an
    # all-to-all sends (8 assignments, half of them in the other domain)
    assert 0.99 < remote_domains_per_token(128, 8, 2) < 1.0
    # DeepSeek-V3's group-limited routing (8 groups, a token's experts in its best 4) over 8 nodes: a node is
    # missed when its group is, C(7, 4) / C(8, 4) = 1/2, so 3.5 other nodes, not the 4.6 of plain top-8
    assert remote_domains_per_token(256, 8, 8, 8, 4) == pytest.approx(7 * 0.5)
    assert remote_domains_per_token(256, 8, 8) == pytest.approx(7 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert remote_domains_per_token(256, 8, 16, 8, 4) == remote_domains_per_token(256, 8, 16)  # groups span nodes


def test_a_deduplicated_dispatch_sends_less_across_domains_and_the_rest_inside():
    payload = 8e6
    per_assignment = all_to_all_s(payload, 8, 4, FAST, SLOW)
    deduplicated = all_to_all_s(payload, 8, 4, FAST, SLOW, across_bytes=payload / 4)
    assert deduplicated < per_assignment
    assert deduplicated == pytest.approx(max(payload * 7 / 8 / 1e9, payload / 4 / 1e8), rel=1e-9)


def test_the_dispatcher_option_is_checked_in_one_line():
    from sim.workloads.moe.options import resolve_moe_options

    with pytest.raises(GpipeInputError, match="dispatcher='nccl' for model moe; use one of alltoall, deepep, hybridep"):
        resolve_moe_options({"d_model": 64, "heads": 4, "dispatcher": "nccl"}, "moe")
    assert resolve_moe_options({"d_model": 64, "heads": 4, "dispatcher": "deepep"}, "moe")["dispatcher"] == "deepep"
    for groups, routed in ((3, 1), (4, 5), (4, 0)):  # 3 does not divide 8 experts; 5 of 4 groups; none of 4
        with pytest.raises(GpipeInputError, match=f"expert_groups={groups}, routed_groups={routed} for model moe"):
            resolve_moe_options({"d_model": 64, "heads": 4, "expert_groups": groups, "routed_groups": routed}, "moe")
