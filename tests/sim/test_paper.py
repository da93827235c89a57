"""The Table 2 replay: one description for every cell, gaps computed from the paper's numbers."""

from __future__ import annotations

import json

import pytest

from gpipe.main import main
from sim.catalog.hardware import get_system
from sim.evidence.paper import MICROBATCHES, PAPER_TABLE2, STAGES, bubble_points, format_table, replay
from sim.workloads.workload import UniformWorkload


@pytest.fixture(scope="module")
def cells():
    return replay()


def test_every_cell_is_replayed_and_normalised_to_k2_m1(cells):
    assert {(c.stages, c.microbatches) for c in cells} == set(PAPER_TABLE2)
    base = next(c for c in cells if (c.stages, c.microbatches) == (2, 1))
    assert base.simulated == 1.0
    for c in cells:
        assert c.gap == pytest.approx(c.simulated / PAPER_TABLE2[c.stages, c.microbatches] - 1)
        assert c.simulated == pytest.approx(c.throughput_samples_per_s / base.throughput_samples_per_s)


def test_throughput_grows_with_m_and_k(cells):
    by = {(c.stages, c.microbatches): c.simulated for c in cells}
    for k in STAGES:
        assert by[k, 1] < by[k, 4] < by[k, 32]
    for m in MICROBATCHES[1:]:
        assert by[2, m] < by[4, m] < by[8, m]


def test_the_m32_row_lands_near_the_paper(cells):
    # the regime the bubble model is meant for (M >> K): within 20% of the paper
    for c in cells:
        if c.microbatches == 32:
            assert abs(c.gap) < 0.2, c


def test_memory_is_reported_honestly(cells):
    by = {(c.stages, c.microbatches): c for c in cells}
    capacity = get_system("tpu-v3").device.memory_bytes
    assert not by[2, 32].fits and by[2, 32].peak_memory_bytes > capacity  # weights alone overflow
    assert by[8, 32].fits


def test_uniform_bubble_equals_the_formula():
    ideal = get_system("ideal")
    for k, m, bubble in bubble_points((2, 4), (1, 3, 8), UniformWorkload(8), ideal, 8, "never"):
        assert bubble == pytest.approx((k - 1) / (m + k - 1))


def test_table_text_and_cli(cells, capsys, tmp_path):
    text = format_table(cells)
    assert "6.30 /" in text and "Not captured" in text
    html = tmp_path / "paper.html"
    assert main(["paper", "--json", "--html", str(html)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["cells"]) == 9 and data["not_captured"]
    assert html.stat().st_size > 1000 and "plotly" in html.read_text()[:200000]
