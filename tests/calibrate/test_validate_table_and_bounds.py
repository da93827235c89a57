"""gpipe validate's table in its two views, and the speed bounds its held-out rounds are held to."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from calibrate.fit.design import RunSpec
from calibrate.noise import across_calibrations
from calibrate.validate.comparison import Comparison
from calibrate.validate.held_out import speeds_within_bounds
from calibrate.validate.summary import summarize
from calibrate.validate.table import NOT_JUDGED_MARK, format_table

NOISE_COLUMNS = ("spread", "interval", "halves", "calibs")
NOISE_LINES = ("noise beside the errors", "the calibration's own noise", "the moment of calibration (calibs",
               "beyond their interval's reach of zero", "the after-wait loss at each run's moment",
               "after-wait probe", "rounds spread", "rounds of one run spread")


def _run(label: str, predicted: float = 1.0, not_judged: str | None = None) -> Comparison:
    rounds = [0.95, 1.0, 1.05, 1.1, 0.9]
    return Comparison(label, predicted, 1.0, [100], [100], rounds, [1.0, 1.1, 0.9, 1.0, 1.0],
                      predicted_busy_s=[0.5], measured_busy_s=[0.52],
                      busy_rounds_at_reference_s=[[0.5, 0.52, 0.54, 0.5, 0.51]],
                      predicted_step_halves_s=[0.95, 1.05], predicted_warm_up_s=[0.1],
                      round_warm_up_factors=[1.0, 1.5, 2.0, 1.0, 1.2], not_judged=not_judged)


def _result(*comparisons: Comparison) -> dict:
    runs = [c.to_dict() for c in comparisons]
    for run in runs:
        run["calibrations"] = across_calibrations.run_entry([run, run])
    summary = {**summarize(comparisons), "across_calibrations": across_calibrations.summary(
        [run["calibrations"] for run in runs if not run["not_judged"]])}
    return {"runs": runs, "summary": summary}


def test_the_default_table_shows_the_errors_and_leaves_this_machines_noise_to_verbose():
    result = _result(_run("K=1 M=3 [4] never gpipe", 1.2), _run("K=2 M=5 [2,2] never gpipe", 0.9))
    narrow, verbose = format_table(result), format_table(result, verbose=True)
    narrow_header, verbose_header = narrow.splitlines()[0].split(), verbose.splitlines()[0].split()
    assert not set(NOISE_COLUMNS) & set(narrow_header) and set(NOISE_COLUMNS) <= set(verbose_header)
    # the prediction's errors are in both, the same figures
    for column in ("pred", "meas", "err", "@ref", "err@ref", "mem", "busy", "busy@ref", "bubble", "end"):
        assert column in narrow_header
    assert [line.split()[:7] for line in narrow.splitlines()[2:4]] == [
        line.split()[:7] for line in verbose.splitlines()[2:4]]
    assert "+20.0%" in narrow.splitlines()[2] and "-10.0%" in narrow.splitlines()[3]
    for text in ("step time error: median", "peak activation memory error", "components: busy time per stage",
                 "past the goals by more than their own rounds allow (", "past the goals by more than their own "
                 "rounds allow by every calibration"):
        assert text in narrow and text in verbose, text
    for text in NOISE_LINES:
        assert text not in narrow and text in verbose, text
    assert len(narrow.splitlines()[0]) < len(verbose.splitlines()[0])


def test_a_run_not_judged_is_shown_marked_and_left_out_of_the_errors():
    judged, swung = _run("K=1 M=3 [4] never gpipe", 1.02), _run("K=2 M=5 [2,2] never gpipe", 3.0,
                                                                "round 2 speed x40.1 outside x0.5..x2, measured twice")
    summary = summarize([judged, swung])
    assert summary["runs"] == 1 and summary["not_judged_runs"] == 1 and summary["oversubscribed_runs"] == 0
    assert summary["worst_step_error"] == pytest.approx(0.02)  # the +200% run is not in it
    assert summarize([judged])["not_judged_runs"] == 0
    assert swung.to_dict()["not_judged"].startswith("round 2 speed x40.1") and judged.to_dict()["not_judged"] is None
    for verbose in (False, True):
        lines = format_table(_result(judged, swung), verbose=verbose).splitlines()
        assert lines[2].split()[0] == "1" and lines[3].split()[0] == "1" + NOT_JUDGED_MARK
        assert lines[-1].startswith(f"{NOT_JUDGED_MARK} not judged: a round's speed correction stayed outside "
                                    "x0.5..x2 after it was measured again")
        assert lines[-1].endswith("1 run(s) left out of the errors above: K=2 M=5 [2,2] never gpipe (round 2 "
                                  "speed x40.1 outside x0.5..x2, measured twice)")
    assert "not judged" not in format_table(_result(judged))


def _reports(paces: list[float]) -> list[dict]:
    """One report per pace: every rank's speed probe at that pace, before and after."""
    return [{"speed_probe_s": [[pace, pace], [pace, pace]], "round": i} for i, pace in enumerate(paces)]


def test_a_held_out_round_out_of_the_speed_bounds_is_measured_again_then_not_judged():
    """Two runs of two processes, two rounds each (run 0, run 1, run 0, run 1) against a reference
    pace of 0.01 s: run 0's first round probed 40x slow, again fine; run 1's second 0.3x, again 0.3x."""
    specs = [RunSpec.of((2, 2), m, "never", "gpipe", 8) for m in (3, 5)]
    data = {"speed": {"reference_s": {"2": 0.01}}}
    asked, said = [], []

    def remeasure(indices):
        asked.append(list(indices))
        return _reports([{0: 0.011, 3: 0.003}[i] for i in indices])

    reports, not_judged = speeds_within_bounds(data, specs, _reports([0.4, 0.01, 0.012, 0.003]), remeasure, said.append)
    assert asked == [[0, 3]]
    assert [r["speed_probe_s"][0][0] for r in reports] == [0.011, 0.01, 0.012, 0.003]
    assert not_judged == {1: "round 2 speed x0.3 outside x0.5..x2, measured twice"}
    assert said == ["held-out K=2 M=3 [2,2] never gpipe; K=2 M=5 [2,2] never gpipe: speed x40 outside x0.5..x2; "
                    "measuring 2 round(s) again"]
    # inside the bounds, or without a reference for the run's process count (nothing to correct): nothing again
    for reference in ({"2": 0.01}, {"4": 0.01}):
        asked.clear()
        _, none = speeds_within_bounds({"speed": {"reference_s": reference}}, specs,
                                       _reports([0.015, 0.006, 0.01, 0.019] if "2" in reference else [4.0] * 4),
                                       remeasure, said.append)
        assert none == {} and asked == []


@pytest.mark.slow
def test_gpipe_validate_reports_a_run_whose_speed_probe_stays_40x_off_as_not_judged(tmp_path, monkeypatch,
                                                                                     tiny_quick_costs):
    """End to end: the executor's real reports, the first held-out run's probe planted 40x slow each time
    it is measured; the other run is judged, the command succeeds."""
    import calibrate.measure.runs as runs
    from gpipe.main import main

    real = runs.run_configs
    first, planted_rounds = [], []

    def planted(configs, *args, **kwargs):
        reports = real(configs, *args, **kwargs)
        for config, report in zip(configs, reports):
            key = (config.partition, config.layout.microbatches, config.layout.checkpoint, config.layout.schedule)
            first[:1] = first[:1] or [key]
            if key == first[0]:
                report["speed_probe_s"] = [[pace * 40 for pace in rank] for rank in report["speed_probe_s"]]
                planted_rounds.append(key)
        return reports

    monkeypatch.setattr(runs, "run_configs", planted)
    out = tmp_path / "validation.json"
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        status = main(["validate", "--costs", tiny_quick_costs[0], "--limit", "2", "--rounds", "1", "--steps", "3",
                       "--out", str(out)])
    assert status == 0, errors.getvalue()
    result = json.loads(out.read_text())
    swung, other = result["runs"]
    assert swung["not_judged"].startswith("round 1 speed x") and swung["not_judged"].endswith(", measured twice")
    assert other["not_judged"] is None
    assert result["summary"]["not_judged_runs"] == 1 and result["summary"]["runs"] == 1
    table = printed.getvalue()
    assert f"{NOT_JUDGED_MARK} not judged: " in table and len(planted_rounds) == 2  # measured, then once more
    assert "interval" not in table.splitlines()[0]  # the default view


def test_gpipe_validate_verbose_prints_the_noise_columns(tmp_path, monkeypatch, capsys):
    """The flag reaches the table (the validation itself stubbed out: no run starts)."""
    import calibrate.validate.held_out as held_out
    from calibrate.measure.machine import machine_stamp
    from gpipe.main import main
    from sim.formats.costs import write_costs
    from tests.helpers.costs import synthetic_costs

    path = str(tmp_path / "costs.json")
    write_costs({**synthetic_costs(), "machine": machine_stamp("cpu")}, path)
    monkeypatch.setattr(held_out, "validate", lambda *args, **kwargs: _result(_run("K=1 M=3 [4] never gpipe")))
    for flags, shown in (([], False), (["--verbose"], True)):
        assert main(["validate", "--costs", path, *flags]) == 0
        header = capsys.readouterr().out.splitlines()[0].split()
        assert ("halves" in header) == shown and ("calibs" in header) == shown
