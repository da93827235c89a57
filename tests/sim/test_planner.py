import pytest
from dataclasses import replace

from sim.catalog.hardware import get_system
from sim.engine.engine import simulate
from sim.workloads.models import get_workload
from sim.planner.search import (balanced_bound_s, candidates, choose_partition, lower_bound_s, search,
                                simulate_candidate)
from sim.engine.stage_costs import CostTable


def exhaustive(workload, system, batch, stage_options, microbatch_options, **space):
    table = CostTable(workload, system.device)
    results = []
    for c in candidates(stage_options, microbatch_options, batch, system=system, num_layers=workload.num_layers,
                        **space):
        partition = choose_partition(table, system, batch, c)
        if partition is None:
            continue
        result = simulate_candidate(workload, system, partition, batch, c)
        bound = lower_bound_s(table, batch, c, partition, system)
        assert bound <= result.step_time_s * (1 + 1e-12)
        assert balanced_bound_s(table, batch, c, system) <= bound * (1 + 1e-12)
        if result.fits:
            results.append(result.step_time_s)
    return sorted(results)


@pytest.mark.parametrize("system_name", ["ideal", "h100-pcie", "p100-pcie"])
def test_pruned_search_ranks_exactly_like_exhaustive_simulation(system_name):
    workload = get_workload("transformer", {"layers": 6, "d_model": 256, "ff": 1024, "seq": 128, "vocab": 1000})
    system = get_system(system_name)
    result = search(workload, system, 16, [1, 2, 4], list(range(1, 17)), top=5)
    expected = exhaustive(workload, system, 16, [1, 2, 4], list(range(1, 17)))
    assert [o.step_time_s for o in result.ranked] == pytest.approx(expected[:5], rel=1e-12)
    assert result.simulated < result.candidates


@pytest.mark.parametrize("system_name,nodes", [("h100-pcie", 2), ("a100-nvlink", 2), ("tpu-v3", 1)])
def test_pruned_search_over_replicas_and_interleaving_ranks_exactly_like_exhaustive(system_name, nodes):
    workload = get_workload("transformer", {"layers": 6, "d_model": 256, "ff": 1024, "seq": 128, "vocab": 1000})
    system = replace(get_system(system_name, nodes), devices_per_node=4)
    space = dict(replica_options=[1, 2, 4], virtual_options=[2], zero_options=[0, 1])
    result = search(workload, system, 24, [1, 2, 4], [1, 2, 4, 8, 12], top=6, **space)
    expected = exhaustive(workload, system, 24, [1, 2, 4], [1, 2, 4, 8, 12], **space)
    assert [o.step_time_s for o in result.ranked] == pytest.approx(expected[:6], rel=1e-12)
    assert result.simulated < result.candidates


def test_the_search_covers_replicas_placements_and_interleaving_within_the_devices():
    system = get_system("h100-nvlink", 2)  # 16 devices on two nodes
    found = candidates([1, 2, 4, 8, 16], [8], 64, checkpoints=["never"], replica_options=[1, 2, 4, 8, 16],
                       virtual_options=[2], zero_options=[0, 1], system=system, num_layers=12)
    assert all(c.replicas * c.stages <= 16 for c in found)
    assert {(c.replicas, c.stages) for c in found} >= {(16, 1), (1, 16), (2, 8), (4, 4)}
    # placements differ only across nodes, with D > 1 and K > 1
    assert {c.placement for c in found if (c.replicas, c.stages) == (4, 4)} == {"stages_adjacent", "replicas_adjacent"}
    assert {c.placement for c in found if (c.replicas, c.stages) == (2, 2)} == {"stages_adjacent"}
    assert {c.placement for c in found if c.replicas == 1} == {"stages_adjacent"}
    assert not [c for c in found if c.zero == 1 and c.replicas == 1]
    interleaved = [c for c in found if c.schedule == "interleaved"]
    assert interleaved and all(c.virtual_stages * c.stages <= 12 and c.stages > 1 for c in interleaved)
    assert all(c.virtual_stages == 1 for c in found if c.schedule != "interleaved")


def test_with_costs_linear_in_rows_the_best_plan_uses_all_stages_and_most_microbatches():
    from tests.helpers.scenarios import ListWorkload

    result = search(ListWorkload([1e-3] * 8), get_system("ideal"), 64, [1, 2, 4, 8], [1, 2, 4, 8, 16, 32, 64], top=3)
    best = result.best.candidate
    assert (best.stages, best.microbatches, best.checkpoint) == (8, 64, "never")


def test_memory_limits_force_more_stages_or_rematerialization():
    # the paper's Transformer-48 cannot fit on one 16 GB TPUv3 core
    workload = get_workload("transformer", {"layers": 48, "d_model": 2048, "ff": 8192, "heads": 32,
                                            "seq": 1024, "vocab": 32000})
    result = search(workload, get_system("tpu-v3"), 32, [1, 2, 4, 8], [1, 4, 32])
    assert result.best is not None and result.best.candidate.stages > 1
    assert all(o.result.fits for o in result.ranked)
    assert result.not_fitting > 0


def test_duplicate_microbatch_splits_are_searched_once():
    found = candidates([2], range(1, 9), batch_size=4, checkpoints=["never"], schedules=["gpipe"])
    assert [c.microbatches for c in found] == [1, 2, 4]


@pytest.mark.parametrize("model,options", [
    ("transformer", {"layers": 5, "d_model": 64, "ff": 128, "heads": 4, "seq": 32, "vocab": 300, "dropout": 0.1,
                     "precision": "bf16"}),
    ("mlp", {"layers": 7, "width": 64}),
])
def test_every_ranges_memory_at_once_is_the_range_by_range_sum(model, options):
    """sim.engine.range_memory's furthest ends equal the sweep over CostTable's stage sums, for every policy,
    with and without ZeRO-1, at capacities from nothing fitting to everything."""
    from dataclasses import replace

    from sim.catalog.hardware import get_system
    from sim.workloads.models import get_workload
    from sim.planner.search import Candidate, Partitions
    from sim.engine.stage_costs import CostTable, held_sizes

    workload = get_workload(model, options)
    system = get_system("a100-nvlink")
    table = CostTable(workload, system.device)
    policies = ["never", "always", "except_last", "full"] + (["selective"] if model == "transformer" else [])
    for checkpoint in policies:
        for replicas, zero in ((1, 0), (4, 1)):
            for counts in (((1, 1, 0),), ((2, 3, 1), (0, 5, 0))):
                for capacity in (1e5, 1e6, 3e6, 1e9):
                    partitions = Partitions(table, replace(system, device=replace(system.device, memory_bytes=capacity)),
                                            64)
                    c = Candidate(2, 4, checkpoint, "gpipe", replicas, 1, zero)

                    def fits(first, end):
                        stash, saved, transient = held_sizes(table.stage(8, first, end), checkpoint)
                        peak = max(a * stash + b * saved + t * transient for a, b, t in counts)
                        return partitions._chunk_static(8, first, end, c) + peak <= capacity

                    expected, j = [], 0
                    for i in range(workload.num_layers):
                        j = max(j, i)
                        while j < workload.num_layers and fits(i, j + 1):
                            j += 1
                        expected.append(j)
                    assert partitions._memory_ends(8, counts, c) == expected


def test_zb_h1_is_searched_when_named_with_sound_bounds():
    from sim.schedules.schedule import PLANNED_SCHEDULES, SCHEDULES

    assert "zb-h1" in SCHEDULES and "zb-h1" not in PLANNED_SCHEDULES  # named, not searched by default
    workload = get_workload("transformer", {"layers": 6, "d_model": 256, "ff": 1024, "seq": 128, "vocab": 1000})
    system = get_system("h100-pcie")
    space = dict(schedules=SCHEDULES, checkpoints=("never", "full", "always"))
    result = search(workload, system, 16, [1, 2, 4], [1, 2, 4, 8, 16], top=5, **space)
    expected = exhaustive(workload, system, 16, [1, 2, 4], [1, 2, 4, 8, 16], **space)  # bounds checked there
    assert [o.step_time_s for o in result.ranked] == pytest.approx(expected[:5], rel=1e-12)
    assert any(o.candidate.schedule == "zb-h1" for o in result.ranked)
    assert not any(o.candidate.schedule == "zb-h1" and o.candidate.checkpoint == "full" for o in result.ranked)


def test_the_searches_of_each_t_sharing_a_ceiling_rank_as_searches_without_it(monkeypatch):
    """`gpipe plan` over several T (and several systems for the cheapest plan of all): each search ends once
    none of its bounds beats the best found so far; the ranking, the fastest and the cheapest are those of
    searches that run to their own ends, with fewer plans simulated."""
    import json

    import sim.planner.plan_search as plan_search
    from tests.helpers.in_process import gpipe

    command = ("plan", "--model", "transformer", "--layers", "8", "--d-model", "1024", "--ff", "4096", "--heads", "16",
               "--seq", "1024", "--hardware", "h100-nvlink,a100-nvlink", "--nodes", "2", "--batch", "64",
               "--train-tokens", "1B", "--top", "5", "--json", "--quiet")
    shared = gpipe(*command)
    assert shared.returncode == 0, shared.stderr
    monkeypatch.setattr(plan_search, "_ceiling", lambda parts, top: float("inf"))
    alone = gpipe(*command)
    assert alone.returncode == 0, alone.stderr
    with_ceiling, without = json.loads(shared.stdout), json.loads(alone.stdout)
    for key in ("ranked", "fastest", "cheapest"):
        assert with_ceiling[key] == without[key]
    assert with_ceiling["simulated"] <= without["simulated"]
