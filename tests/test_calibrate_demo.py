"""The main job end to end: gpipe demo calibrates, plans, simulates, trains and writes one report."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_writes_one_report_and_says_where(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "sim.cli", "demo", "--out-dir", str(out), "--steps", "3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"report written to {out / 'report.html'}"
    assert "1/5 calibrating" in proc.stdout and "chosen: K=" in proc.stdout
    assert "x its time while calibrating" in proc.stdout
    page = (out / "report.html").read_text()
    for text in ("predicted timeline", "measured timeline", "Busy and bubble per stage",
                 "Peak activation memory per stage", "Prediction error", "step time", "stage 1 peak activation",
                 "step time at the calibration&#x27;s machine speed", "end-of-step span (last compute to step end)",
                 "the fitted per-step overhead"):
        assert text in page, text
    assert (out / "costs.json").exists() and (out / "plan.json").exists()
    again = subprocess.run([sys.executable, "-m", "sim.cli", "demo", "--out-dir", str(out), "--steps", "2"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "reusing" in again.stdout  # calibration is cached


def test_demo_rejects_a_bad_step_count():
    proc = subprocess.run([sys.executable, "-m", "sim.cli", "demo", "--steps", "0"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "steps" in proc.stderr
