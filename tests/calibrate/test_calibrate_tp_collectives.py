"""The tensor-parallel collectives' calibration: a real measurement among two gloo ranks, and the
two ring links the simulator reads back."""

from __future__ import annotations

import pytest

from calibrate.measure import tp_collectives
from calibrate.measure.tp_collectives import OPS, calibrate_tensor_parallel, fit_tensor_parallel_links
from sim.formats.costs import tensor_parallel_link


def ring_points(parties, sizes, latency_s, bandwidth, pair_factor):
    """What the ring model gives: an all-reduce, and halves scaled by ``pair_factor``."""
    def all_reduce(n):
        return 2 * (parties - 1) / parties * n / bandwidth + 2 * (parties - 1) * latency_s

    return [{"op": op, "bytes": n, "seconds": all_reduce(n) * (1.0 if op == "all_reduce" else pair_factor / 2)}
            for n in sizes for op in OPS]


def test_the_links_are_fitted_apart_on_all_reduces_and_on_reduce_scatter_plus_all_gather_pairs():
    points = ring_points(2, [4096, 1 << 20, 16 << 20], 3e-5, 1e9, pair_factor=1.5)
    fits = fit_tensor_parallel_links(2, points)
    assert fits["all_reduce"]["latency_s"] == pytest.approx(3e-5, rel=1e-6)
    assert fits["all_reduce"]["bandwidth_bytes_per_s"] == pytest.approx(1e9, rel=1e-6)
    # a pair took 1.5 all-reduces: the link it is priced on is 1.5x slower in both terms
    assert fits["sequence_parallel"]["latency_s"] == pytest.approx(4.5e-5, rel=1e-6)
    assert fits["sequence_parallel"]["bandwidth_bytes_per_s"] == pytest.approx(1e9 / 1.5, rel=1e-6)


def test_the_costs_entry_is_what_the_simulator_reads(monkeypatch):
    monkeypatch.setattr(tp_collectives, "run_ranks",
                        lambda module, parties, device, sizes, repeats, what: ring_points(parties, sizes, 2e-5, 5e8, 2.0))
    entry = calibrate_tensor_parallel("cpu", quick=True)
    assert entry["backend"] == "gloo" and entry["parties"] == 2
    assert set(entry["measured_s"]) == set(OPS) and all(len(v) == 3 for v in entry["measured_s"].values())
    plain, paired = (tensor_parallel_link({"tensor_parallel": entry}, sequence) for sequence in (False, True))
    assert plain.latency_s == pytest.approx(2e-5, rel=1e-6) and paired.latency_s == pytest.approx(4e-5, rel=1e-6)
    assert tensor_parallel_link({}, False) is None


@pytest.mark.slow
def test_two_gloo_ranks_run_the_three_collectives():
    entry = calibrate_tensor_parallel("cpu", quick=True)
    assert entry["sizes_bytes"] == sorted(entry["sizes_bytes"]) and len(entry["sizes_bytes"]) == 3
    assert all(0 < t < 1.0 for times in entry["measured_s"].values() for t in times)
    assert entry["all_reduce"]["bandwidth_bytes_per_s"] > 0 and entry["sequence_parallel"]["latency_s"] >= 0
