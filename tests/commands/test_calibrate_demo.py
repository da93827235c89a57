"""The main job end to end: gpipe demo calibrates, plans, simulates, trains and writes one report."""

import html
import json
import math

import pytest

from tests.helpers import in_process


@pytest.mark.slow
def test_demo_writes_one_report_and_says_where(tmp_path):
    out = tmp_path / "demo"
    proc = in_process.gpipe("demo", "--out-dir", str(out), "--steps", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"report written to {out / 'report.html'}"
    assert "1/5 calibrating" in proc.stdout and "chosen: K=" in proc.stdout
    assert "round 1/" not in proc.stdout + proc.stderr  # calibration's progress: bars at a terminal only
    losses = json.loads((out / "train_report.json").read_text())["losses"]
    assert len(losses) == 8 and losses[-1] < math.log(256) - 1.0, losses  # the text is learnt
    assert "losses over 8 steps" in proc.stdout
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith(("Within the goal: ", "FLAGGED: "))]
    # the speed probe's reading, in either of its two forms: a pace 0.5% or more off, or the same speed
    assert len(verdicts) == 1 and any(form in verdicts[0] for form in (
        "while calibrating (speed probe)", "the machine ran at its calibration's speed (speed probe)")), proc.stdout
    page = (out / "report.html").read_text()
    assert page.count("step time at") == 0  # one step error: the drift is a fact beside it, not a second error
    for text in ("predicted timeline", "measured timeline", "Busy and bubble per stage",
                 "Peak activation memory per stage", "Prediction error", "step time", "stage 1 peak activation",
                 html.escape(verdicts[0]), "Calibration fit: its 6 design runs reproduced within",
                 "end-of-step span (last compute to step end, and last step&#x27;s end to first action)",
                 "the fitted per-step overhead", "stage 0 between actions", "Training loss per step (the shipped Shakespeare"):
        assert text in page, text
    assert (out / "costs.json").exists() and (out / "plan.json").exists()
    costs_written = (out / "costs.json").stat().st_mtime
    again = in_process.gpipe("demo", "--out-dir", str(out), "--steps", "2", "--data", "synthetic", "--quiet")
    assert again.returncode == 0 and (out / "costs.json").stat().st_mtime == costs_written  # calibration is cached
    said = again.stdout.strip().splitlines()
    assert len(said) == 3 and said[0].startswith("losses over 2 steps") and said[2].startswith("report written")
    assert said[1].startswith(("Within the goal: ", "FLAGGED: ")), said
    assert "synthetic random tokens" in (out / "report.html").read_text()
    summary = in_process.gpipe("demo", "--out-dir", str(out), "--steps", "2", "--data", "synthetic", "--json")
    assert summary.returncode == 0, summary.stderr[-2000:]
    data = json.loads(summary.stdout)  # the whole of stdout: one object
    assert len(data["losses"]) == 2 and data["data"] == "synthetic"
    assert data["verdict"].startswith(("Within the goal: ", "FLAGGED: ")) and data["report"] == str(out / "report.html")
    assert data["chosen"] == max(data["best_per_stages"], key=lambda best: best["stages"])
    assert data["predicted_step_s"] > 0 and data["measured_step_s"] > 0 and data["plan"] == str(out / "plan.json")


def test_demo_rejects_a_bad_step_count():
    proc = in_process.gpipe("demo", "--steps", "0")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "steps" in proc.stderr


def test_an_out_dir_that_cannot_be_made_is_one_line_before_any_work(tmp_path):
    """It was a FileNotFoundError traceback from os.makedirs (and a directory it could not write to
    failed only when the demo wrote its first file, after the calibration)."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    proc = in_process.gpipe("demo", "--out-dir", str(taken / "out"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"gpipe: error: --out-dir {taken / 'out'} cannot be written (Not a "
                                        "directory); give a directory this user can create and write"]


@pytest.mark.parametrize("command", [["demo"], ["calibrate"], ["validate", "--costs", "unused.json"]])
def test_one_step_is_refused_where_the_first_is_a_warm_up(command):
    """A single step would be timed with its warm-up in it (the report's fallback when no step is
    left after the warm-up): refused in one line, before anything runs."""
    proc = in_process.gpipe(*command, "--steps", "1")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["gpipe: error: steps must be an integer of at least 2, got 1; the first "
                                        "step is a warm-up, left out of the timing; use --steps 2 or more"]


def test_the_chosen_line_says_when_fewer_stages_are_predicted_faster():
    """The demo trains the best plan with the most stages; where one with fewer is predicted faster,
    its line says so rather than leave the choice looking like the planner's best."""
    from types import SimpleNamespace

    from gpipe.demo import chosen_line

    def best(stages: int, step_s: float, virtual: int = 1):
        candidate = SimpleNamespace(stages=stages, virtual_stages=virtual, microbatches=2, checkpoint="never",
                                    schedule="interleaved" if virtual > 1 else "gpipe")
        return (SimpleNamespace(candidate=candidate, partition=[6 // (stages * virtual)] * (stages * virtual),
                                step_time_s=step_s), None, None)

    slower = chosen_line({1: best(1, 0.0543), 2: best(2, 0.0609, virtual=2)})
    assert slower == ("chosen: K=2 V=2 M=2 partition [1, 1, 1, 1] never interleaved (a pipeline, the most "
                      "stages this machine has room for; K=1 is predicted faster, 54.3 ms)")
    assert chosen_line({1: best(1, 0.07), 2: best(2, 0.06)}) == "chosen: K=2 M=2 partition [3, 3] never gpipe"


def test_the_busy_rows_show_the_warm_up_part_of_a_stage_s_busy_time():
    from calibrate.report.run_report import busy_rows
    from sim.engine.engine import StageResult
    from sim.engine.host import HostPaid

    stages = [StageResult(k, 3, 0.05, 0, 0, 0, 1e9, True, host=HostPaid(w)) for k, w in enumerate((0.002, 0.0))]
    rows = busy_rows(stages, [0.04, 0.05])
    assert [row[0] for row in rows] == ["stage 0 busy per step",
                                        "of it, running slow after waits of 2 ms or more for its input (the fitted "
                                        "warm-up)", "stage 1 busy per step"]
    assert rows[0][1:] == ("50.00 ms", "40.00 ms", "+25.0%") and rows[1][1:] == ("2.00 ms", "-", "-")
