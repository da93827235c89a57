"""The after-wait probe: what a wait costs the next forward at this moment, and the warm-up at a run's moment."""

from __future__ import annotations

import math
import time

import pytest
import torch

from calibrate.fit.design import RunSpec
from calibrate.fit.design_checks import run_speed_reference
from calibrate.noise.after_wait_probe import AfterWaitProbe, run_after_wait_probes, warm_up_factor
from calibrate.noise.speed import SpeedProbe
from calibrate.validate.comparison import Comparison
from calibrate.validate.summary import summarize
from calibrate.validate.table import format_table

OPTIONS = {"layers": 2, "d_model": 16, "ff": 32, "heads": 2, "seq": 8, "vocab": 32, "dropout": 0.0}


class ColdAfterIdle(torch.nn.Module):
    """A layer that spins ``cold_s`` longer when called ``idle_s`` or more after its last call, as a
    device that lost its working set while waiting does."""

    def __init__(self, cold_s: float, idle_s: float = 4e-3) -> None:
        super().__init__()
        self.cold_s, self.idle_s, self.last = cold_s, idle_s, -math.inf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        now = time.perf_counter()
        until = now + (self.cold_s if now - self.last >= self.idle_s else 0.0)
        while time.perf_counter() < until:
            pass
        self.last = time.perf_counter()
        return x


class StandIn:
    """What the after-wait probe reads of a speed probe: its module, its inputs, its device sync."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.inputs = module, torch.zeros(2)

    def _sync(self) -> None:
        pass


def test_the_probe_finds_the_time_a_wait_costs_the_first_layer_only():
    later_layer = ColdAfterIdle(cold_s=0.05)  # never called: the probe times the first layer alone
    probe = AfterWaitProbe(StandIn(torch.nn.Sequential(ColdAfterIdle(cold_s=2e-3), later_layer)))
    assert probe.measure(repeats=5, wait_s=6e-3) == pytest.approx(2e-3, abs=0.7e-3)
    assert later_layer.last == -math.inf
    assert abs(probe.measure(repeats=5, wait_s=0.0)) < 0.7e-3  # no wait, nothing lost


def test_the_probe_times_a_real_models_first_layer_without_touching_its_gradients_or_the_random_stream():
    speed = SpeedProbe.model("transformer", {**OPTIONS, "dropout": 0.5}, 16)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    probe = AfterWaitProbe(speed)
    assert probe.layer is speed.module[0]
    loss = probe.measure(repeats=3)
    assert torch.equal(torch.rand(3), expected)  # the random stream left as it was
    assert math.isfinite(loss) and abs(loss) < 0.1
    assert all(p.grad is None for p in speed.module.parameters()) and probe.layer.training
    with pytest.raises(ValueError, match="at least one pair, not 0"):
        probe.measure(repeats=0)


def test_the_factor_is_the_runs_median_probe_over_the_calibrations():
    assert warm_up_factor([1e-4, 3e-4, 9e-4], 2e-4) == pytest.approx(1.5)
    assert warm_up_factor([-1e-4], 2e-4) == 0.0  # a loss below zero is noise: no warm-up, not a gain
    for probes, reference in (([], 2e-4), ([3e-4], None), ([3e-4], 1e-6), ([3e-4], -2e-4)):
        assert warm_up_factor(probes, reference) == 1.0  # nothing to scale by
    assert run_after_wait_probes({"after_wait_probe_s": [[1.0, 2.0], [3.0, 4.0]]}) == [1.0, 2.0, 3.0, 4.0]
    assert run_after_wait_probes({}) == []


def test_the_calibrations_reference_is_the_median_loss_per_process_count():
    specs = [RunSpec.of((3,), 2, "never", "gpipe", 8), RunSpec.of((1, 2), 2, "never", "gpipe", 8)]
    reports = [{"speed_probe_s": [[1.0, 1.0]], "after_wait_probe_s": [[1e-4, 3e-4]]},
               {"speed_probe_s": [[2.0, 2.0]] * 2, "after_wait_probe_s": [[5e-4, 6e-4], [7e-4, 9e-4]]}]
    speed = run_speed_reference("transformer", specs, reports)
    assert speed["after_wait_reference_s"] == {"1": pytest.approx(2e-4), "2": pytest.approx(6.5e-4)}
    assert speed["reference_s"] == {"1": 1.0, "2": 2.0}


def _run(factors: list[float], speeds: list[float]) -> Comparison:
    """A two-stage run whose first stage's predicted busy time is 40% warm-up, measured as predicted
    at twice the calibration's after-wait loss."""
    return Comparison("K=2 M=6 [1,5]", 1.0, 1.0, [1, 1], [1, 1], [1.0] * len(speeds), speeds,
                      predicted_busy_s=[0.010, 0.5], measured_busy_s=[0.014, 0.5],
                      busy_rounds_at_reference_s=[[0.014] * len(speeds), [0.5] * len(speeds)],
                      predicted_warm_up_s=[0.004, 0.0], round_warm_up_factors=factors)


def test_the_warm_up_at_the_runs_moment_scales_the_warm_up_alone_and_in_the_rounds_seconds():
    doubled = _run([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert doubled.busy_errors_at_reference == pytest.approx([-4 / 14, 0.0])
    assert doubled.predicted_busy_at_probed_warm_up_s == pytest.approx([0.014, 0.5])
    assert doubled.busy_errors_at_probed_warm_up == pytest.approx([0.0, 0.0])
    # a round twice as slow in everything: its loss doubled in seconds is the calibration's at the reference speed
    slow = _run([2.0], [2.0])
    assert slow.predicted_busy_at_probed_warm_up_s == pytest.approx([0.010, 0.5])
    assert _run([], [1.0]).busy_errors_at_probed_warm_up == _run([], [1.0]).busy_errors_at_reference
    assert doubled.to_dict()["warm_up_factor"] == 2.0


def test_the_table_shows_the_probes_range_and_the_busy_errors_at_the_runs_moment():
    runs = [_run([2.0, 1.8, 2.2], [1.0] * 3), _run([0.9, 1.1, 1.0], [1.0] * 3)]
    summary = summarize(runs)
    assert summary["warm_up_factor_range"] == [1.0, 2.0] and summary["round_warm_up_factor_range"] == [0.9, 2.2]
    assert summary["worst_busy_stage_at_probed_warm_up"]["warm_up_factor"] == 1.0
    table = format_table({"runs": [r.to_dict() for r in runs], "summary": summary}, verbose=True)
    assert "x1.00-x2.00 over the runs (x0.90-x2.20 over rounds)" in table
    assert "(40% after waits; after-wait probe x2.00); rounds" in table  # the worst at the reference speed
    probed = next(line for line in table.splitlines() if line.startswith("the after-wait loss at each run's moment"))
    assert probed.endswith("(40% after waits; after-wait probe x1.00)")  # the worst once the probe scales it
    goals = next(line for line in table.splitlines() if line.startswith("past the goals"))
    assert "busy 2 of 4 stages; K=2 M=6 [1,5] stage 0 -28.6% (-29..-29%)" in goals  # both runs' first stages
    assert goals.endswith("with the warm-up at each run's after-wait probe 1 of 4; K=2 M=6 [1,5] stage 0 -28.6% "
                          "(-29..-29%); step 0 of 2 runs; bubble 0 of 2 runs")
    unprobed = [_run([], [1.0])]
    assert "after-wait" not in format_table({"runs": [r.to_dict() for r in unprobed], "summary": summarize(unprobed)},
                                            verbose=True)


def test_the_calibration_summary_gives_the_probes_loss_beside_the_fitted_warm_up():
    from gpipe.calibrate import summary_text
    from tests.helpers.costs import design_runs, synthetic_costs

    data = design_runs([0.0])
    data["pipeline"] = {"2": {**synthetic_costs()["pipeline"]["2"], "host": {"warm_up_s": 4.15e-4}}}
    assert "after-wait probe" not in summary_text(data)  # a costs file from before the probe
    data["speed"] = {"reference_s": {"2": 0.018}, "after_wait_reference_s": {"2": 2.44e-4}}
    assert ("half speed until 415 us are lost (meanwhile the after-wait probe, the first layer's forward "
            "after a 9 ms wait, lost 244 us)") in summary_text(data)


def test_a_stage_beyond_noise_by_every_calibration_shows_its_error_at_the_runs_probe():
    from calibrate.noise import across_calibrations

    run = _run([2.0, 2.0, 2.0], [1.0] * 3).to_dict()
    run["calibrations"] = across_calibrations.run_entry([run, run])
    summary = {**summarize([_run([2.0, 2.0, 2.0], [1.0] * 3)]),
               "across_calibrations": across_calibrations.summary([run["calibrations"]])}
    line = next(line for line in format_table({"runs": [run], "summary": summary}, verbose=True).splitlines()
                if "beyond their interval's reach of zero by every calibration" in line and "stage" in line)
    assert line.endswith("K=2 M=6 [1,5] stage 0 -28.6% (40% after waits; +0.0% at the run's after-wait probe)")
