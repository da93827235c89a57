"""Deepest model that fits: against a hand count, against the partitioner, and through gpipe plan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gpipe.main import main
from sim.catalog.hardware import get_system
from sim.engine.stage_costs import CostTable
from sim.planner.max_layers import depth_limits, max_depth
from sim.planner.search import Candidate, choose_partition
from sim.workloads.models import get_workload


def _system(capacity_bytes):
    ideal = get_system("ideal")
    return replace(ideal, device=replace(ideal.device, memory_bytes=capacity_bytes))


def test_depth_matches_a_hand_count(list_workload):
    # per layer: 100 weight + 100 gradient bytes; 10 saved and 1 input byte per row
    make = lambda n: list_workload([1e-3] * n)  # noqa: E731
    system = _system(2400)
    never = max_depth(make, system, 4, 1, [1], "never")
    assert never.depth == 10  # 10 x (200 + 4 x 10) = 2400
    # always, M=4 (one row each): peak 200L + 10L (one micro-batch recomputed) + 3 stashed rows
    always = max_depth(make, system, 4, 1, [4], "always")
    assert always.depth == 11
    m = always.memory[0]
    assert (m.weights_bytes, m.gradient_bytes, m.activation_bytes, m.stash_bytes) == (1100, 1100, 110, 3)
    assert m.total_bytes <= 2400
    assert not never.capped and not always.capped


def test_a_model_that_fits_deeper_than_the_search_is_reported_as_fitting_at_least_that_deep(list_workload,
                                                                                          monkeypatch):
    import sim.planner.max_layers as max_layers

    monkeypatch.setattr(max_layers, "MAX_DEPTH", 48)
    tried = []

    def make(n):
        tried.append(n)
        return list_workload([1e-3] * n)

    limit = max_depth(make, _system(1e15), 4, 2, [1, 4], "never")
    assert (limit.depth, limit.capped, sum(m.layers for m in limit.memory)) == (48, True, 48)
    assert max(tried) == 48 and len(set(tried)) <= 8  # doubled up to the bound, never past it
    table = max_layers.format_limits([(limit, limit)], _system(1e15), 4, "list", "fp32")
    assert "   >=48 layers" in table and table.count(">=: still fits at 48 layers, the deepest searched") == 1
    assert max_depth(make, _system(2400), 4, 1, [1], "never").depth == 10  # below the bound: exact, as before


def test_a_small_model_on_a_large_device_answers_at_the_bound(capsys):
    """The default transformer on an 80 GB A100 fits far deeper than any model is trained: the search
    stops at MAX_DEPTH (it once doubled past 100,000 layers, for minutes and gigabytes)."""
    from sim.planner.max_layers import MAX_DEPTH

    assert main(["plan", "--max-layers", "--model", "transformer", "--hardware", "a100-nvlink",
                 "--stages-options", "1,2", "--microbatch-options", "16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["limits"]
    for row in rows:
        for limit in (row["with_rematerialization"], row["without"]):
            assert (limit["depth"], limit["capped"]) == (MAX_DEPTH, True)
            assert sum(m["layers"] for m in limit["memory"]) == MAX_DEPTH + 2  # the embedding and the head


TRANSFORMER = {"d_model": 1024, "ff": 4096, "heads": 8, "seq": 256, "vocab": 8000}


@pytest.fixture(scope="module")
def limits():
    system = get_system("a100-40gb-nvlink")
    make = lambda n: get_workload("transformer", {**TRANSFORMER, "layers": n})  # noqa: E731
    return system, make, depth_limits(make, system, 64, [1, 2, 4], [1, 8, 64])


def test_limits_are_exact_against_the_partitioner(limits):
    system, make, pairs = limits
    for pair in pairs:
        for limit in pair:
            candidate = Candidate(limit.stages, limit.microbatches, limit.checkpoint, "gpipe")
            for depth, expected in ((limit.depth, True), (limit.depth + 1, False)):
                table = CostTable(make(depth), system.device)
                assert (choose_partition(table, system, 64, candidate) is not None) is expected
            assert all(m.total_bytes <= system.device.memory_bytes for m in limit.memory)
            assert sum(m.layers for m in limit.memory) == limit.depth + 2 and not limit.capped


def test_rematerialization_and_more_stages_fit_deeper_models(limits):
    _, _, pairs = limits
    for with_remat, without in pairs:
        assert with_remat.depth > without.depth > 0
    depths = [pair[0].depth for pair in pairs]
    assert depths == sorted(depths) and depths[-1] > 3 * depths[0]


def test_gpipe_plan_max_layers(capsys):
    args = ["plan", "--max-layers", "--model", "transformer", "--d-model", "1024", "--ff", "4096",
            "--heads", "8", "--seq", "256", "--vocab", "8000", "--hardware", "a100-40gb-nvlink", "--batch", "64",
            "--stages-options", "1,2", "--microbatch-options", "1,8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "deepest transformer" in out and "stashed inputs" in out and "K=2 checkpoint always" in out
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["stages"] for row in data["limits"]] == [1, 2]
    assert data["limits"][1]["with_rematerialization"]["depth"] > data["limits"][1]["without"]["depth"]
