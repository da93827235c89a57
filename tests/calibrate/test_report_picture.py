"""The README's picture: the report's timelines and loss curve in one figure; refused without Kaleido."""

import sys

import pytest

from calibrate.report.report_html import loss_figure
from calibrate.report.report_picture import picture_figure, write_png
from sim.catalog.hardware import get_system
from sim.errors import GpipeInputError
from sim.planner.search import Candidate, simulate_candidate
from sim.views.figures import compare_figure
from sim.workloads.models import get_workload


def test_the_timelines_go_left_and_the_loss_right():
    workload = get_workload("uniform", {"layers": 4})
    result = simulate_candidate(workload, get_system("ideal"), [2, 2], 8, Candidate(2, 4, "never", "gpipe"),
                                record=True)
    steps = compare_figure([result.timeline, result.timeline], ["predicted", "measured"], memory=False)
    fig = picture_figure(steps, loss_figure([5.6, 4.0, 3.1], "text", 256), "demo")
    titles = [a.text for a in fig.layout.annotations]
    assert titles[:3] == ["predicted step (simulator)", "training loss per step", "measured step (executor)"]
    assert {t.xaxis for t in fig.data if t.name == "loss"} == {"x2"}  # the right-hand panel
    assert len([t for t in fig.data if t.name != "loss"]) == len(steps.data)


def test_without_kaleido_the_picture_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "kaleido", None)
    with pytest.raises(GpipeInputError, match="pip install kaleido"):
        write_png(loss_figure([1.0], "text"), str(tmp_path / "x.png"))
