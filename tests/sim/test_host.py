"""A CPU host's effects (sim.engine.host), off unless costs turn them on; the warm-up after a long
wait: what the simulator charges, calibration reads back from a timeline, and the fit recovers from
points that paid it."""

from __future__ import annotations

import math

import pytest

from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.engine.host import IDLE_S, NO_HOST_EFFECTS, HostEffects, measured_paid_s, owed_s, paid_s
from sim.formats.timeline import Record
from tests.helpers.scenarios import IDEAL, GappedWorkload


def test_host_effects_are_off_unless_costs_turn_them_on():
    """The analytic and GPU models carry no host effects: every stage's costs have the empty record,
    no stage reports any, and a record of zeros is off too."""
    from sim.engine.stage_costs import CostTable
    from sim.workloads.models import get_workload

    workload = get_workload("transformer", {"layers": 4})
    assert CostTable(workload, get_system_device("h100-nvlink")).stage(4, 0, 2).host == NO_HOST_EFFECTS
    result = simulate(workload, IDEAL, [3, 3], batch_size=8, layout=ParallelLayout.for_partition([3, 3], 4))
    assert all(s.host is None and "host" not in s.to_dict() for s in result.stages)
    assert not NO_HOST_EFFECTS.on and not HostEffects(0.0).on and HostEffects(1e-4).on
    assert HostEffects.from_dict({"warm_up_s": -1e-5}) == NO_HOST_EFFECTS  # a negative fit is none


def get_system_device(name: str):
    from sim.catalog.hardware import get_system

    return get_system(name).device


def test_a_long_wait_sets_the_debt_a_short_one_keeps_it_and_work_pays_it_at_half_speed():
    assert owed_s(IDLE_S, 0.0, 3e-4) == 3e-4
    assert owed_s(IDLE_S * 0.99, 1e-4, 3e-4) == 1e-4  # a short wait: what was still owed
    assert owed_s(5 * IDLE_S, 1e-4, 3e-4) == 3e-4  # waits do not add up
    assert paid_s(1e-4, 3e-4) == 1e-4 and paid_s(5e-4, 3e-4) == 3e-4


def test_calibration_reads_back_from_a_timeline_what_each_action_paid():
    """Simulate with a warm-up, then read each action's time since its device's last long wait from
    the timeline, as calibration reads the executor's: what :func:`measured_paid_s` says it paid is
    the time it took beyond the same run without the warm-up, action by action."""
    from calibrate.noise.warm_up_fit import busy_since_wait_s

    for schedule, warm_s in (("gpipe", 1.5e-3), ("1f1b", 0.4e-3), ("1f1b", 5e-3)):
        runs = [simulate(GappedWorkload(4, 0.0, warm_s=w), IDEAL, [1, 2, 1], batch_size=6,
                         layout=ParallelLayout.for_partition([1, 2, 1], 6, checkpoint="except_last",
                                                             schedule=schedule)) for w in (warm_s, 0.0)]
        warm, unwarmed = ({(r.stage, r.kind, r.microbatch): r.duration_s for r in run.timeline.records
                       if r.kind in ("F", "R", "B")} for run in runs)
        since = busy_since_wait_s(runs[0].timeline.records, [0], IDLE_S)
        paid = {key: measured_paid_s(warm_s, since[(key[0], None, *key[1:])], seconds) for key, seconds in warm.items()}
        assert paid == pytest.approx({key: warm[key] - unwarmed[key] for key in warm}, abs=1e-12)
        assert sum(paid.values()) > warm_s  # more than one device paid


def test_each_stage_reports_the_warm_up_it_paid_as_part_of_its_busy_time():
    """A stage's ``host.warm_up_s`` is what the warm-up added to its busy time, in both of the simulator's
    walks (SimPy's with a timeline, the closed form without), and the report shows it."""
    from sim.views.report import format_summary

    for schedule in ("gpipe", "1f1b"):
        for record in (True, False):
            warm, unwarmed = (simulate(GappedWorkload(4, 0.0, warm_s=w), IDEAL, [1, 2, 1], batch_size=6,
                                       layout=ParallelLayout.for_partition([1, 2, 1], 6, checkpoint="except_last",
                                                                           schedule=schedule),
                                       record=record)
                              for w in (1.5e-3, 0.0))
            paid = [s.host.warm_up_s for s in warm.stages]
            assert paid == pytest.approx([w.busy_s - u.busy_s for w, u in zip(warm.stages, unwarmed.stages)], abs=1e-12)
            assert sum(paid) > 1.5e-3 and all(s.host is None for s in unwarmed.stages)  # off: no record
            assert warm.stages[0].to_dict()["host"] == {"warm_up_s": paid[0]}
            assert "host" not in unwarmed.stages[0].to_dict()
    assert "of it after waits" in format_summary(warm, IDEAL, "fp32")
    assert "of it after waits" not in format_summary(unwarmed, IDEAL, "fp32")


def test_the_time_since_a_long_wait_counts_compute_only_and_restarts_at_each_long_wait():
    from calibrate.noise.warm_up_fit import busy_since_wait_s

    ms = 1e-3
    records = [Record(0, "F", 0, 0, 1 * ms, step=1), Record(0, "recv_wait", 0, 1 * ms, 4 * ms, step=1),
               Record(0, "B", 0, 4 * ms, 5 * ms, step=1), Record(0, "send_grad", 0, 5 * ms, 5.2 * ms, step=1),
               Record(0, "F", 1, 5.2 * ms, 6 * ms, step=1), Record(0, "recv_wait", 1, 6 * ms, 7 * ms, step=1),
               Record(0, "B", 1, 7 * ms, 8 * ms, step=1), Record(0, "recv_wait", 1, 8 * ms, 11 * ms, step=1),
               Record(0, "F", 2, 11 * ms, 12 * ms, step=1), Record(1, "F", 0, 0, 1 * ms, step=0)]
    since = busy_since_wait_s(records, [1], IDLE_S)
    assert since == pytest.approx({(0, None, "F", 0): math.inf, (0, None, "B", 0): 0.0, (0, None, "F", 1): 1 * ms,
                                   (0, None, "B", 1): 1.8 * ms, (0, None, "F", 2): 0.0})


def _line(profiled: float) -> float:
    return 1.1 * profiled + 1e-4


def _observed(warm_s: float, with_waits: bool, factors: tuple[float, ...] = (1.0,), scaled: bool = False):
    """Actions on :func:`_line`, one warm forward and backward per run; on the small stages, a
    backward after a long wait and the forward after it pay a warm-up at half speed: ``warm_s`` times
    the run's after-wait factor (``factors`` in turn), recorded with the points where ``scaled``."""
    from calibrate.fit.observations import ActionPoints, Observations

    obs = Observations()
    forwards = obs.actions[(2, "F")] = ActionPoints()
    backwards = obs.actions[(2, "B")] = ActionPoints()

    def add(points: ActionPoints, profiled: float, measured: float, run: int, since: float, factor: float) -> None:
        points.profiled.append(profiled)
        points.fixed.append(0.0)
        points.measured.append(measured)
        points.runs.append(f"run {run}")
        points.since_wait.append(since)
        if scaled:
            points.warm_up_scale.append(factor)

    for run, profiled in enumerate((5e-5, 6e-5, 8e-5, 1e-4, 1.5e-4, 1e-3, 2e-3, 4e-3, 8e-3)):
        factor = factors[run % len(factors)]
        for points, scale in ((forwards, 1.0), (backwards, 2.0)):  # one warm action of each kind
            add(points, scale * profiled, _line(scale * profiled), run, math.inf, factor)
        if profiled < 2e-4:  # the small stage waits before its backward
            backward_work, forward_work = _line(2 * profiled), _line(profiled)
            backward_paid = paid_s(backward_work, warm_s * factor)
            forward_paid = paid_s(forward_work, warm_s * factor - backward_paid)
            add(backwards, 2 * profiled, backward_work + backward_paid, run, 0.0 if with_waits else math.inf, factor)
            add(forwards, profiled, forward_work + forward_paid, run,
                backward_work + backward_paid if with_waits else math.inf, factor)
    return obs


def test_the_fit_finds_the_warm_up_the_points_paid_and_the_line_beneath_it():
    """On a small stage, a backward after a long wait and the forward after it pay a 0.25 ms warm-up
    at half speed (the backward all its work, the forward the rest). The fit finds the warm-up within
    its grid's step and the line under it; with the warm-up left out of the fit (no waits seen), the
    line tilts to carry it."""
    from calibrate.fit.pipeline_fit import fit_pipeline

    warm_s = 0.25e-3
    pipeline, residuals = fit_pipeline(_observed(warm_s, True), {2: 1})
    assert pipeline["2"]["host"]["warm_up_s"] == pytest.approx(warm_s, abs=5e-6)
    assert residuals["2"]["warm up"]["warm_up_s"] == pipeline["2"]["host"]["warm_up_s"]
    for kind in ("F", "B"):
        fitted = pipeline["2"]["actions"][kind]
        assert fitted["slope"] == pytest.approx(1.1, rel=2e-2) and fitted["intercept"] == pytest.approx(1e-4, rel=0.1)
        assert fitted["worst_relative"] < 0.03
    unseen = fit_pipeline(_observed(warm_s, False), {2: 1})[0]["2"]
    assert unseen["host"]["warm_up_s"] == 0.0 and unseen["actions"]["F"]["worst_relative"] > 0.1


def test_the_fit_finds_the_warm_up_at_the_calibrations_probe_from_runs_at_other_moments():
    """Runs whose after-wait probe stood at half and at one and a half times the calibration's paid
    that much of a 0.25 ms warm-up: with each run's factor the fit finds 0.25 ms and lines that fit;
    without, one warm-up cannot fit both kinds of run."""
    from calibrate.fit.pipeline_fit import fit_pipeline

    warm_s = 0.25e-3
    scaled = fit_pipeline(_observed(warm_s, True, (0.5, 1.5), scaled=True), {2: 1})[0]["2"]
    assert scaled["host"]["warm_up_s"] == pytest.approx(warm_s, abs=5e-6)
    assert scaled["actions"]["F"]["worst_relative"] < 0.03 and scaled["actions"]["B"]["worst_relative"] < 0.03
    unscaled = fit_pipeline(_observed(warm_s, True, (0.5, 1.5)), {2: 1})[0]["2"]
    assert max(unscaled["actions"][kind]["worst_relative"] for kind in "FB") > 0.1


def test_the_costs_file_carries_the_warm_up_to_every_stage():
    """A costs record's host entry (a CPU host's, sim.engine.host) reaches the fit; without one, and in
    a version 1 file that had none, the effects are off; version 1's warm_up_s becomes the host entry."""
    from sim.formats.costs import MeasuredWorkload, PipelineFit
    from sim.formats.costs_v1 import upgrade
    from tests.helpers.costs import synthetic_costs

    entry = {"threads": 1, "actions": {k: {"slope": 1.0, "intercept": 0.0, "cold_start_s": 0.0} for k in "FRB"},
             "send": {"slope": 0.0, "intercept": 0.0}, "optimizer": {"slope": 0.0, "intercept": 0.0},
             "step_overhead_s": 0.0, "gap_after_s": {}}
    assert PipelineFit.from_dict(entry).host == NO_HOST_EFFECTS  # measured on no CPU host
    assert PipelineFit.from_dict({**entry, "host": {"warm_up_s": 2e-4}}).host == HostEffects(2e-4)
    old = {**synthetic_costs(), "version": 1}
    old["pipeline"] = {"2": {**old["pipeline"]["2"], "warm_up_s": 2e-4}, "1": old["pipeline"]["1"]}
    upgraded = upgrade(old)
    assert upgraded["pipeline"]["2"]["host"] == {"warm_up_s": 2e-4} and "warm_up_s" not in upgraded["pipeline"]["2"]
    assert upgraded["pipeline"]["1"]["host"] == {"warm_up_s": 0.0}  # files from before it: off
    workload = MeasuredWorkload(upgraded, stages=2)
    assert all(workload.stage_cost(2, a, b, workload_device(workload)).host == HostEffects(2e-4)
               for a, b in ((0, 1), (1, 3)))
    assert MeasuredWorkload(upgraded, stages=1).stage_cost(2, 0, 3, workload_device(workload)).host == NO_HOST_EFFECTS


def workload_device(workload):
    from sim.catalog.hardware import LOCAL_CPU

    assert workload.device_name == LOCAL_CPU.name
    return LOCAL_CPU
