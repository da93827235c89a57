"""benchmarks/calibration_spread.py: the measured side across validations (their moments)."""

from __future__ import annotations

import pytest

from benchmarks.calibration_spread import outside, spread


def _run(name: str, measured_bubble: float, busy_s: list[float], step_s: float, predicted_busy_s: list[float],
         predicted_step_s: float) -> dict:
    predicted_bubble = 1 - sum(predicted_busy_s) / len(predicted_busy_s) / predicted_step_s
    return {"run": name, "step_error_at_reference": 0.0, "busy_errors_at_reference": [0.0] * len(busy_s),
            "bubble_error_points": 0.0, "measured_bubble": measured_bubble, "predicted_bubble": predicted_bubble,
            "measured_busy_s": busy_s, "measured_step_s": step_s, "predicted_busy_s": predicted_busy_s,
            "predicted_step_s": predicted_step_s}


def test_outside_is_signed_distance_beyond_the_range():
    assert outside(5.0, [4.0, 6.0]) == 0.0
    assert outside(3.0, [4.0, 6.0]) == -1.0
    assert outside(6.5, [4.0, 6.0]) == 0.5


def test_the_last_validations_predictions_are_placed_among_every_moments_measurement():
    # two moments measured one run: bubble 10% then 14%; stage 0 took 0.80 then 0.70 of the step
    first = {"runs": [_run("K=2 M=8", 0.10, [0.80, 0.90], 1.0, [0.5, 0.5], 1.0)]}
    last = {"runs": [_run("K=2 M=8", 0.14, [0.70, 0.94], 1.0, [0.60, 0.76], 0.8)]}
    row = spread([first, last])["runs"][0]
    assert row["measured_bubbles"] == pytest.approx([10.0, 14.0])
    # the last prediction: busy 0.60 and 0.76 of a 0.8 s step, so shares 0.75 and 0.95, bubble 15%
    assert row["predicted_bubble"] == pytest.approx(15.0)
    assert row["bubble_outside_points"] == pytest.approx(1.0)
    assert row["predicted_busy_shares"] == pytest.approx([0.75, 0.95])
    assert row["share_outside"][0] == 0.0  # within 0.70..0.80
    assert row["share_outside"][1] == pytest.approx(0.01 / 0.94)  # beyond the range's top, relative to it
    assert row["bubble_error_vs_median_points"] == pytest.approx(3.0)  # 15 against the median of 10 and 14
    assert row["share_errors_vs_median"] == pytest.approx([0.75 / 0.75 - 1, 0.95 / 0.92 - 1])
    moments = spread([first, last])["summary"]["moments"]
    assert moments["bubbles_within_measured_range"] == 0
    assert moments["shares_within_measured_range"] == 1
    assert moments["worst_measured_bubble_range_points"] == pytest.approx(4.0)
    assert moments["worst_share_outside"]["stage"] == 1


def test_an_error_recurring_past_its_goal_at_every_moment_is_named_and_a_scattered_one_is_not():
    """Busy +7%, +8%, +9% at three moments: mean +8%, its 90% interval +6.3..+9.7% past 5%. Step +12%,
    -4%, +20%: mean +9.3% but the interval reaches far inside 10%. A validation judged by two
    calibrations counts by their median."""
    from benchmarks.calibration_spread import goals, mean_interval

    def result(busy, step, median=None):
        run = {**_run("K=2 M=8", 0.1, [1.0], 1.0, [1.0], 1.0), "busy_errors_at_reference": [busy],
               "step_error_at_reference": step}
        if median is not None:
            run["calibrations"] = {"median": {"busy_errors_at_reference": [median], "step_error_at_reference": step,
                                              "bubble_error_points": 0.0}}
        return {"runs": [run]}

    mean, low, high = mean_interval([0.07, 0.08, 0.09])
    assert mean == pytest.approx(0.08) and low == pytest.approx(0.08 - 2.919986 * 0.01 / 3 ** 0.5)
    table = goals([result(0.07, 0.12), result(0.30, -0.04, median=0.08), result(0.09, 0.20)])
    assert table["past_goals"] == [["K=2 M=8", "busy stage 0", pytest.approx(0.08), pytest.approx(low),
                                    pytest.approx(high)]]
    step = next(e for e in table["errors"] if e["error"] == "step")
    assert step["mean"] == pytest.approx(0.28 / 3) and not step["past_goal"]
