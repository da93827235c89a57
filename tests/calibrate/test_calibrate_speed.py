"""The speed reference: probes that time fixed work, and the factor that puts a measurement at the reference pace."""

from __future__ import annotations

import pytest
import torch

from calibrate.noise.speed import SpeedProbe, probe_rows, reference_s, run_probes, speed_factor
from calibrate.validate.comparison import Comparison

OPTIONS = {"layers": 2, "d_model": 16, "ff": 32, "heads": 2, "seq": 8, "vocab": 32, "dropout": 0.0}


def test_factor_is_the_mean_probe_over_the_reference():
    assert speed_factor([2.0, 4.0], 2.0) == pytest.approx(1.5)
    assert speed_factor([1.0], 2.0) == pytest.approx(0.5)


def test_without_a_reference_or_probes_nothing_is_corrected():
    assert speed_factor([3.0], None) == 1.0
    assert speed_factor([], 2.0) == 1.0


def test_reference_is_the_median_probe_and_needs_one():
    assert reference_s([3.0, 1.0, 2.0, 10.0, 2.5]) == 2.5
    with pytest.raises(ValueError):
        reference_s([])


def test_run_probes_flattens_every_rank_before_and_after():
    assert run_probes({"speed_probe_s": [[1.0, 2.0], [3.0, 4.0]]}) == [1.0, 2.0, 3.0, 4.0]
    assert run_probes({}) == []


@pytest.mark.parametrize("make", [lambda: SpeedProbe.block(),
                                  lambda: SpeedProbe.model("transformer", OPTIONS, 16)])
def test_probes_time_real_work_and_leave_the_random_stream_alone(make):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    probe = make()
    pace = probe.measure(budget_s=0.0, min_runs=3)
    assert torch.equal(torch.rand(3), expected)
    assert 0 < pace < 1.0


def test_model_probe_runs_an_eighth_of_the_batch():
    assert probe_rows(32) == 4 and probe_rows(4) == 1


def test_comparison_at_reference_divides_each_round_by_its_factor():
    run = Comparison("r", predicted_step_s=1.0, measured_step_s=1.2, predicted_peak_bytes=[1],
                     measured_peak_bytes=[1], measured_rounds_s=[1.2, 1.5, 0.9], round_speeds=[1.2, 1.5, 0.9])
    assert run.step_error == pytest.approx(-1 / 6)
    assert run.measured_at_reference_s == pytest.approx(1.0)
    assert run.step_error_at_reference == pytest.approx(0.0)
    assert run.to_dict()["step_error_at_reference"] == pytest.approx(0.0)
