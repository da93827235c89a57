"""The all-reduce calibration: group sizes per machine, and one real measurement among two ranks on each route."""

from __future__ import annotations

import os

import pytest

from calibrate.measure import collective
from calibrate.measure.collective import calibrate_allreduce, measure_allreduce, party_counts
from sim.formats.costs import allreduce_link


def test_group_sizes_are_two_and_the_most_the_machine_runs():
    assert party_counts(1) == []  # one core: no data-parallel group to measure
    assert party_counts(2) == [2]
    assert party_counts(8) == [2, 8]


def test_two_ranks_sum_small_gradients_over_gloo_and_through_shared_memory():
    sizes = (4 << 10, 256 << 10)
    routes = measure_allreduce(2, "cpu", sizes, repeats=3)
    # shared memory where the executor would take it: two ranks with a core each
    assert sorted(routes) == (["backend", "shared_memory"] if (os.cpu_count() or 1) >= 2 else ["backend"])
    for points in routes.values():
        assert [p["bytes"] for p in points] == list(sizes)
        assert all(0 < p["seconds"] < 1.0 for p in points)


def test_the_costs_entry_holds_the_points_and_a_fit_the_simulator_reads(monkeypatch):
    from calibrate.measure import collective

    calls = []

    def fake_measure(parties, device_type, sizes, repeats):
        calls.append((parties, device_type, tuple(sizes), repeats))
        return {route: [{"bytes": b, "seconds": 2 * (parties - 1) / parties * b / bandwidth + 2 * (parties - 1) * 3e-5}
                        for b in sizes]
                for route, bandwidth in (("backend", 1e9), ("shared_memory", 4e9))}

    monkeypatch.setattr(collective, "measure_allreduce", fake_measure)
    entry = calibrate_allreduce("cpu", quick=True, parties=[2, 4])
    assert [c[0] for c in calls] == [2, 4] and all(c[2] == collective.QUICK_SIZES_BYTES for c in calls)
    assert entry["backend"] == "gloo" and entry["parties"] == [2, 4]
    assert entry["sizes_bytes"] == list(collective.QUICK_SIZES_BYTES)
    assert len(entry["measured_s"]) == 2 and all(len(row) == 3 for row in entry["measured_s"])
    link = allreduce_link({"allreduce": entry})
    assert link.latency_s == pytest.approx(3e-5, rel=1e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    shared = allreduce_link({"allreduce": entry}, shared_memory=True)
    assert shared.bandwidth_bytes_per_s == pytest.approx(4e9, rel=1e-6) and shared.name.endswith("shared-memory all-reduce")
    assert len(entry["shared_memory"]["measured_s"]) == 2
    assert calibrate_allreduce("cpu", parties=[]) is None


def test_the_sharded_entry_fits_the_gather_and_the_reduce_scatter_the_simulator_reads(monkeypatch):
    from calibrate.measure import collective, rank_timing
    from sim.formats.costs_links import sharded_links

    bandwidths = {"all_gather": 2e9, "reduce_scatter": 1e9, "all_reduce": 3e9}

    def fake_run(module, parties, device_type, sizes, repeats, what):
        assert module == "calibrate.measure.tp_collectives"  # the same calls, among the data-parallel group
        return [{"op": op, "bytes": b, "seconds": (parties - 1) / parties * b / bandwidth + (parties - 1) * 2e-5}
                for b in sizes for op, bandwidth in bandwidths.items()]

    monkeypatch.setattr(rank_timing, "run_ranks", fake_run)
    entry = collective.calibrate_sharded("cpu", quick=True, parties=[2, 4])
    assert entry["parties"] == [2, 4] and len(entry["all_gather"]["measured"]) == 2 * len(collective.QUICK_SIZES_BYTES)
    gather, reduce = sharded_links({"sharded": entry})
    assert gather.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6) and gather.latency_s == pytest.approx(2e-5)
    assert reduce.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert collective.calibrate_sharded("cpu", parties=[]) is None


def test_the_expert_parallel_entry_fits_the_all_to_all_as_a_pairwise_exchange(monkeypatch):
    """Points made by the model (E-1) x latency + (E-1)/E x bytes / bandwidth give back its two figures."""
    from calibrate.measure import ep_collectives, rank_timing

    def fake_run(module, parties, device_type, sizes, repeats, what):
        assert module == "calibrate.measure.ep_collectives"
        return [{"bytes": b, "seconds": (parties - 1) * 3e-5 + (parties - 1) / parties * b / 2e9} for b in sizes]

    monkeypatch.setattr(rank_timing, "run_ranks", fake_run)
    entry = ep_collectives.calibrate_expert_parallel("cpu", quick=True, parties=[2, 4])
    assert entry["backend"] == "gloo" and entry["parties"] == [2, 4]
    link = entry["all_to_all"]
    assert link["latency_s"] == pytest.approx(3e-5, rel=1e-6) and link["bytes_per_s"] == pytest.approx(2e9, rel=1e-6)
    assert len(link["measured"]) == 2 * len(collective.QUICK_SIZES_BYTES)
    assert ep_collectives.calibrate_expert_parallel("cpu", parties=[]) is None


@pytest.mark.slow
def test_two_gloo_ranks_time_the_all_to_all():
    from calibrate.measure.ep_collectives import calibrate_expert_parallel

    entry = calibrate_expert_parallel("cpu", quick=True, parties=[2])
    assert [p["bytes"] for p in entry["all_to_all"]["measured"]] == list(collective.QUICK_SIZES_BYTES)
    assert all(p["seconds"] > 0 for p in entry["all_to_all"]["measured"])
