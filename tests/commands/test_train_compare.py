"""``gpipe train --plan`` closes the loop: the plan's predicted step beside the measured one, and
``--html`` writes the report of that run."""

import html
import json
import re

import pytest

from tests.helpers import in_process

VERDICT = re.compile(r"^(Within the goal|FLAGGED|Not judged): predicted (\d+\.\d+) ms, measured (\d+\.\d+) ms per "
                     r"step \(([+-]\d+\.\d)%\)", re.M)


@pytest.fixture(scope="module")
def calibrated_plan(tiny_quick_costs, tmp_path_factory):
    """A two-stage plan priced with a real calibration of this machine: (plan path, its JSON)."""
    path = tmp_path_factory.mktemp("compare") / "plan.json"
    proc = in_process.gpipe("plan", "--costs", tiny_quick_costs[0], "--stages-options", "2", "--microbatch-options", "2,4",
                            "--out", str(path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    return path, json.loads(path.read_text())


@pytest.mark.slow  # a calibration, then gpipe train
def test_train_plan_prints_the_plans_prediction_beside_the_measured_step_and_writes_the_report(calibrated_plan,
                                                                                               tmp_path):
    path, plan = calibrated_plan
    page = tmp_path / "run.html"
    proc = in_process.gpipe("train", "--plan", str(path), "--steps", "4", "--html", str(page))
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = VERDICT.findall(proc.stdout)
    assert len(found) == 1, proc.stdout
    kind, predicted_ms, measured_ms, error = found[0]
    assert kind in ("Within the goal", "FLAGGED")  # priced with a calibration of this machine: judged
    assert float(predicted_ms) == pytest.approx(plan["predicted"]["step_time_s"] * 1e3, abs=0.006)
    median = re.search(r"median step (\d+\.\d+) ms", proc.stdout).group(1)
    assert measured_ms == median
    assert float(error) == pytest.approx((float(predicted_ms) / float(measured_ms) - 1) * 100, abs=0.2)
    assert "(speed probe)" in proc.stdout
    text = page.read_text()
    verdict_line = next(line for line in proc.stdout.splitlines() if VERDICT.match(line))
    for part in (html.escape(verdict_line), "predicted timeline", "measured timeline", "Busy and bubble per stage",
                 "Peak activation memory per stage", "Training loss per step", "Calibration fit: its",
                 "stage 1 busy per step"):
        assert part in text, part


@pytest.mark.slow  # a calibration, then gpipe train
def test_flags_that_change_the_plan_are_re_predicted_and_said(calibrated_plan):
    path, plan = calibrated_plan
    other = 4 if plan["microbatches"] != 4 else 2
    proc = in_process.gpipe("train", "--plan", str(path), "--steps", "3", "--microbatches", str(other))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"re-predicted for the flags' changes to the plan: microbatches {plan['microbatches']} -> {other}" \
        in proc.stdout


@pytest.mark.slow  # a calibration, then gpipe train
def test_html_without_a_plan_or_with_its_costs_gone_is_one_line_before_training(calibrated_plan, tmp_path):
    proc = in_process.gpipe("train", "--model", "mlp", "--stages", "2", "--html", str(tmp_path / "r.html"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "gpipe: error: --html compares the run with its plan's prediction; give --plan FILE (written by gpipe "
        "plan --out or gpipe demo)"]
    path, plan = calibrated_plan
    moved = tmp_path / "plan.json"
    moved.write_text(json.dumps({**plan, "costs": {**plan["costs"], "sha256": "0" * 64}}))
    proc = in_process.gpipe("train", "--plan", str(moved), "--html", str(tmp_path / "r.html"))
    assert proc.returncode == 2 and "gpipe: step" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpipe: error: --html compares with the plan's prediction, but "
                                                   "costs file") and "changed since plan" in lines[0], lines


def test_a_plan_priced_with_the_catalog_is_shown_but_not_judged(tmp_path):
    path = tmp_path / "plan.json"
    assert in_process.gpipe("plan", "--model", "mlp", "--stages-options", "2", "--hardware", "cpu",
                            "--microbatch-options", "2", "--out", str(path), "--quiet").returncode == 0
    # --json: the run and its verdict as one object on stdout, the ranks' lines on stderr
    proc = in_process.gpipe("train", "--plan", str(path), "--steps", "3", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)  # the whole of stdout
    verdict = summary["comparison"]["verdict"]
    assert VERDICT.search(verdict).group(1) == "Not judged"
    assert "uncalibrated cpu figures" in verdict
    assert len(summary["losses"]) == 3 and len(summary["step_times_s"]) == 3 and summary["steps"] == 3
    assert f"{summary['comparison']['predicted_step_s'] * 1e3:.2f} ms" in verdict
    assert summary["comparison"]["measured_step_s"] == summary["step_time_s"] > 0
    assert summary["plan"]["partition"] == json.loads(path.read_text())["partition"]
    assert summary["report"] is None and summary["html"] is None
    assert "gpipe: step 2 loss" in proc.stderr and "median step" in proc.stderr
