"""The pure fits recover known parameters from synthetic data, and report their residuals."""

from __future__ import annotations

import numpy as np
import pytest

from calibrate.fit.least_squares import fit_affine, fit_constant, fit_link, fit_ring_allreduce, fit_roofline


def test_affine_recovers_slope_and_intercept_exactly():
    x = [1e-3, 2e-3, 5e-3, 1e-2, 3e-2]
    y = [1.7 * v + 4e-4 for v in x]
    line = fit_affine(x, y)
    assert line.slope == pytest.approx(1.7, rel=1e-9)
    assert line.intercept == pytest.approx(4e-4, rel=1e-9)
    assert line.worst_relative < 1e-9
    assert line.identifiable


def test_affine_residuals_are_relative_to_the_measurement():
    line = fit_affine([1.0, 2.0, 3.0], [1.0, 2.0, 3.3])
    predicted = [line(v) for v in (1.0, 2.0, 3.0)]
    expected = [(p - m) / m for p, m in zip(predicted, [1.0, 2.0, 3.3])]
    assert line.residuals == pytest.approx(expected, abs=1e-12)
    assert line.worst_relative > 0.001


def test_affine_with_one_distinct_x_keeps_the_slope_and_says_so():
    line = fit_affine([2.0, 2.0], [4.0, 4.4])
    assert not line.identifiable
    assert line.intercept == 0.0
    assert line.slope == pytest.approx(2.1)


def test_affine_respects_bounds():
    line = fit_affine([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], slope_bounds=(0.0, 10.0))
    assert line.slope >= 0.0


def test_link_recovers_latency_and_bandwidth():
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    one_way = [50e-6 + n / 3e9 for n in sizes]
    link = fit_link(sizes, one_way)
    assert link.latency_s == pytest.approx(50e-6, rel=1e-7)
    assert link.bandwidth_bytes_per_s == pytest.approx(3e9, rel=1e-7)


def ring_s(parties: int, nbytes: int, latency_s: float, bandwidth: float) -> float:
    return 2 * (parties - 1) / parties * nbytes / bandwidth + 2 * (parties - 1) * latency_s


def test_ring_allreduce_recovers_latency_and_bandwidth_from_one_group_size():
    sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
    seconds = [ring_s(2, n, 40e-6, 2.5e9) for n in sizes]
    fit = fit_ring_allreduce([2] * len(sizes), sizes, seconds)
    assert fit.latency_s == pytest.approx(40e-6, rel=1e-7)
    assert fit.bandwidth_bytes_per_s == pytest.approx(2.5e9, rel=1e-7)
    assert max(abs(r) for r in fit.residuals) < 1e-9


def test_ring_allreduce_pools_group_sizes_into_one_link():
    sizes = [4 << 10, 1 << 20, 16 << 20]
    parties = [n for n in (2, 4, 8) for _ in sizes]
    seconds = [ring_s(n, b, 15e-6, 8e9) for n, b in zip(parties, sizes * 3)]
    fit = fit_ring_allreduce(parties, sizes * 3, seconds)
    assert fit.latency_s == pytest.approx(15e-6, rel=1e-7)
    assert fit.bandwidth_bytes_per_s == pytest.approx(8e9, rel=1e-7)
    # the ring's 2(n-1) steps, not a ping-pong's one: an affine fit of n = 2 alone sees twice the latency
    assert fit_link(sizes, seconds[:3]).latency_s == pytest.approx(2 * 15e-6, rel=1e-6)


def test_ring_allreduce_refuses_what_cannot_be_fitted():
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_ring_allreduce([2, 2], [4096, 4096], [1e-4, 1e-4])
    with pytest.raises(ValueError, match="2 or more parties"):
        fit_ring_allreduce([1, 1], [4096, 8192], [1e-4, 2e-4])
    with pytest.raises(ValueError, match="as many"):
        fit_ring_allreduce([2], [4096, 8192], [1e-4, 2e-4])


def test_constant_recovers_a_shift():
    predicted = [0.1, 0.2, 0.4]
    constant, residuals = fit_constant([p + 0.003 for p in predicted], predicted)
    assert constant == pytest.approx(0.003, rel=1e-9)
    assert max(abs(r) for r in residuals) < 1e-9


def test_roofline_recovers_both_efficiencies():
    rng = np.random.default_rng(0)
    flops = rng.uniform(1e6, 1e9, 40)
    traffic = rng.uniform(1e5, 1e8, 40)
    peak_flops, peak_bw, overhead = 1e11, 2e10, 1e-5
    times = np.maximum(flops / (0.4 * peak_flops), traffic / (0.7 * peak_bw)) + overhead
    fit = fit_roofline(flops, traffic, times, peak_flops, peak_bw, overhead)
    assert fit.efficiency == pytest.approx(0.4, rel=1e-6)
    assert fit.bandwidth_efficiency == pytest.approx(0.7, rel=1e-6)


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        fit_affine([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        fit_affine([1.0, 2.0], [1.0, -1.0])


def test_the_step_overhead_is_bounded_by_the_measured_end_of_step_span(monkeypatch):
    """A whole-step misfit of 20 ms is not all end-of-step time when the runs measured 3 ms there
    beyond what the model predicts: the overhead stops at that bound and the rest stays visible as
    the prediction's error. A bound above the misfit leaves the plain fit."""
    from types import SimpleNamespace

    import calibrate.fit.step_fit as step_fit
    from calibrate.fit.design import RunSpec

    predicted = {1: 0.080, 2: 0.100}  # by M: predicted steps without overhead
    monkeypatch.setattr(step_fit, "predict",
                        lambda data, spec, system_name="cpu": SimpleNamespace(step_time_s=predicted[spec.layout.microbatches]))
    monkeypatch.setattr(step_fit, "predicted_end_span_s", lambda result: 0.002)
    specs = [RunSpec.of((3, 3), m, "never", "gpipe", 8) for m in (1, 2)]
    reports = [{"step_time_s": predicted[s.layout.microbatches] + 0.020, "end_span_s": 0.005} for s in specs]
    monkeypatch.setattr(step_fit, "measured_end_span_s", lambda report: report["end_span_s"])
    data = {"pipeline": {"2": {}}}
    summary = step_fit.fit_step_overhead(data, specs, reports)
    assert summary["2"]["unconstrained_s"] == pytest.approx(0.020, rel=1e-6)
    assert summary["2"]["end_span_bound_s"] == pytest.approx(0.003)
    assert data["pipeline"]["2"]["step_overhead_s"] == pytest.approx(0.003)
    assert summary["2"]["worst_relative"] == pytest.approx(0.017 / 0.1, rel=1e-6)  # what the bound leaves
    for report in reports:
        report["end_span_s"] = 0.050
    step_fit.fit_step_overhead(data, specs, reports)
    assert data["pipeline"]["2"]["step_overhead_s"] == pytest.approx(0.020, rel=1e-6)


def test_the_gap_after_each_kind_of_action_is_the_median_of_what_the_runs_measured():
    """A chore done once a step while a message was away (a long gap) does not move the fitted gap;
    a kind no design run had takes the median of all gaps."""
    from calibrate.fit.observations import ActionPoints, Observations
    from calibrate.fit.pipeline_fit import fit_pipeline

    obs = Observations()
    obs.actions[(2, "F")] = ActionPoints([1e-3, 2e-3], [1e-4, 1e-4], [1.1e-3, 2.1e-3], ["a", "b"])
    obs.gaps[2] = {"F": [50e-6, 60e-6, 70e-6, 600e-6, 55e-6], "B": [150e-6, 140e-6, 160e-6]}
    pipeline, residuals = fit_pipeline(obs, {2: 1})
    gaps = pipeline["2"]["gap_after_s"]
    assert gaps["F"] == pytest.approx(60e-6) and gaps["B"] == pytest.approx(150e-6)
    assert gaps["R"] == gaps["I"] == gaps["W"] == pytest.approx(105e-6)  # of all eight: (70 + 140) / 2
    assert residuals["2"]["gap after F"]["points"] == 5 and "gap after R" not in residuals["2"]
    obs.gaps.clear()
    assert fit_pipeline(obs, {2: 1})[0]["2"]["gap_after_s"] == {}


def test_an_action_measured_in_several_rounds_is_fitted_at_its_median_round():
    """Rounds 15% fast, typical and 15% slow: the line goes through the typical round, as validation
    compares a run's median round; every round's point on relative residuals settles below it."""
    from calibrate.fit.observations import ActionPoints, Observations
    from calibrate.fit.pipeline_fit import fit_pipeline

    def observed(identities: bool) -> Observations:
        obs = Observations()
        points = obs.actions[(2, "F")] = ActionPoints()
        for round_pace in (0.85, 1.0, 1.15):
            for microbatch, profiled in enumerate((1e-3, 2e-3, 4e-3)):
                points.profiled.append(profiled)
                points.fixed.append(1e-4)
                points.measured.append(round_pace * 1.1 * profiled)
                points.runs.append("K=2 M=3")
                if identities:
                    points.actions.append((0, 0, microbatch))
        return obs

    typical = observed(True).actions[(2, "F")].typical()
    assert len(typical.measured) == 3 and typical.measured == pytest.approx([1.1e-3, 2.2e-3, 4.4e-3])
    def predicted_s(line: dict, profiled: float) -> float:
        fixed = 1e-4
        return line["slope"] * (profiled - fixed) + line.get("fixed_slope", line["slope"]) * fixed + line["intercept"]

    line = fit_pipeline(observed(True), {2: 1})[0]["2"]["actions"]["F"]
    every_round = fit_pipeline(observed(False), {2: 1})[0]["2"]["actions"]["F"]
    for profiled in (1e-3, 2e-3, 4e-3):
        assert predicted_s(line, profiled) == pytest.approx(1.1 * profiled, rel=1e-6)
        assert predicted_s(every_round, profiled) < 0.99 * 1.1 * profiled


def test_a_split_backward_is_fitted_as_i_and_w_where_a_run_had_one_and_its_first_stage_apart():
    """A zb-h1 run's first stage has no input gradient to compute: its W is the whole backward, on a
    line of its own (W_first, the backward's profile, B's overhead), and its I is on no line but
    priced at its measured median; the other stages' I and W get lines of their own, and a K
    without a split run has none (the stage's costs then take the backward's factor)."""
    from calibrate.fit.observations import ActionPoints, Observations, fitted_kind
    from calibrate.fit.pipeline_fit import fit_pipeline

    bounds = [(0, 2), (2, 4)]
    assert [fitted_kind({"stage": s, "kind": k, "microbatch": 0}, bounds, "always", 4)
            for s in (0, 1) for k in "FBIW"] == ["F", "B", None, "W_first", "F", "B", "I", "W"]
    # a forward that keeps its graph has a line of its own
    assert [fitted_kind({"stage": 1, "kind": "F", "microbatch": m}, bounds, "except_last", 4) for m in range(4)] == [
        "F", "F", "F", "F_graph"]
    assert fitted_kind({"stage": 0, "kind": "F", "microbatch": 0}, bounds, "never", 4) == "F_graph"
    obs = Observations()
    for kind, factor in (("F", 1.1), ("R", 1.0), ("B", 1.05), ("I", 1.3), ("W", 1.2)):
        obs.actions[(2, kind)] = ActionPoints([1e-3, 1e-3], [1e-4, 1e-4], [factor * 1e-3] * 2, ["a", "b"])
    obs.actions[(2, "W_first")] = ActionPoints([1e-3, 2e-3], [1e-4, 1e-4], [1.15e-3, 2.3e-3], ["a", "b"])
    obs.first_input[2] = [5e-5, 4e-5, 9e-5]
    obs.actions[(1, "F")] = ActionPoints([1e-3], [1e-4], [1e-3], ["c"])
    pipeline, residuals = fit_pipeline(obs, {1: 2, 2: 1})
    assert pipeline["2"]["actions"]["I"]["slope"] == pytest.approx(1.3)
    assert pipeline["2"]["actions"]["W"]["slope"] == pytest.approx(1.2)
    first = pipeline["2"]["actions"]["W_first"]
    assert first["slope"] == pytest.approx(1.15)
    assert first["intercept"] == pytest.approx(pipeline["2"]["actions"]["B"]["intercept"], abs=1e-12)
    assert pipeline["2"]["first_input_s"] == pytest.approx(5e-5)
    assert "action W" in residuals["2"] and set(pipeline["1"]["actions"]) == {"F", "R", "B"}
    assert "first_input_s" not in pipeline["1"]


def test_the_action_line_recovers_a_scale_for_each_part_and_the_overhead():
    """Profiled times with a fixed part of 1 ms per call: a pipeline that pays a fifth of it and 1.2x
    the rows' part, plus 0.3 ms an action, is recovered exactly."""
    from calibrate.fit.least_squares import fit_action

    fixed = [1e-3, 1e-3, 2e-3, 2e-3]
    profiled = [f + work for f, work in zip(fixed, [1e-3, 8e-3, 2e-3, 16e-3])]
    measured = [1.2 * (p - f) + 0.2 * f + 3e-4 for p, f in zip(profiled, fixed)]
    line = fit_action(profiled, fixed, measured, ["a", "a", "b", "b"])
    assert line.slope == pytest.approx(1.2) and line.fixed_slope == pytest.approx(0.2)
    assert line.intercept == pytest.approx(3e-4) and max(map(abs, line.residuals)) < 1e-9
    assert line.to_dict()["fixed_slope"] == pytest.approx(0.2)


def test_the_action_line_keeps_one_slope_where_the_fixed_share_does_not_vary():
    from calibrate.fit.least_squares import fit_action

    profiled = [2e-3, 4e-3, 8e-3]
    line = fit_action(profiled, [p / 4 for p in profiled], [1.5 * p for p in profiled])
    assert line.fixed_slope is None and line.slope == pytest.approx(1.5) and "fixed_slope" not in line.to_dict()
    one = fit_action([2e-3] * 3, [5e-4] * 3, [3.1e-3, 3.0e-3, 2.9e-3])  # one row count: no overhead to fit
    assert one.intercept == pytest.approx(0.0, abs=1e-12) and one.slope == pytest.approx(1.5, rel=0.01)


def test_the_action_line_tells_a_cold_start_from_its_overhead_where_the_points_hold_both():
    """Cold actions (the first of their kind on a device, or after another kind) pay 0.3 ms more: the
    line finds it beside the 0.1 ms every action pays; with every point cold the two cannot be told
    apart and the overhead carries it."""
    from calibrate.fit.least_squares import fit_action

    profiled = [1e-3, 2e-3, 4e-3, 1e-3, 2e-3, 4e-3, 8e-3]
    cold = [1, 1, 1, 0, 0, 0, 0]
    measured = [1.2 * p + 1e-4 + 3e-4 * c for p, c in zip(profiled, cold)]
    line = fit_action(profiled, [0.0] * 7, measured, cold=cold)
    assert line.slope == pytest.approx(1.2) and line.intercept == pytest.approx(1e-4)
    assert line.cold_start_s == pytest.approx(3e-4) and line.to_dict()["cold_start_s"] == pytest.approx(3e-4)
    everything_cold = fit_action(profiled[:3], [0.0] * 3, measured[:3], cold=[1, 1, 1])
    assert everything_cold.cold_start_s == 0.0 and everything_cold.intercept == pytest.approx(4e-4)
    with pytest.raises(ValueError, match="cold mark per point"):
        fit_action(profiled, [0.0] * 7, measured, cold=[1, 0])


def test_the_calibration_marks_cold_actions_from_the_runs_schedule():
    """The marks calibration fits on come from the schedule the simulator walks: each stage's first
    action of the step, its first forward under GPipe and 1F1B alike."""
    from calibrate.fit.design import RunSpec
    from calibrate.fit.observations import cold_marks, starts_cold_in

    for schedule in ("gpipe", "1f1b"):
        marks = cold_marks(RunSpec.of((3, 3), 4, "never", schedule, 8))
        assert [key for key, cold in marks.items() if cold] == [(0, "F", 0), (1, "F", 0)]
    report_action = {"stage": 1, "kind": "F", "microbatch": 0, "duration_s": 1e-3}
    assert starts_cold_in(marks, report_action) and not starts_cold_in(marks, {**report_action, "microbatch": 1})


def test_every_run_counts_alike_in_the_action_line_whatever_its_number_of_actions():
    """Eight small actions from one run and one large action from another, the two runs disagreeing:
    weighted by run, the line splits the difference between them instead of following the eight."""
    from calibrate.fit.least_squares import fit_action

    profiled, fixed = [1e-3] * 8 + [1e-2], [0.0] * 9
    measured = [1.0e-3] * 8 + [1.2e-2]
    by_run = fit_action(profiled, fixed, measured, ["small"] * 8 + ["large"])
    by_action = fit_action(profiled, fixed, measured)
    # the overhead would be negative, so it stays at 0: (s - 1)^2 + (s / 1.2 - 1)^2 is least at
    # s = (1 + 1/1.2) / (1 + 1/1.44), where eight equal points of their own would pull s to 1.016
    assert by_run.intercept == pytest.approx(0.0, abs=1e-12) and by_run.slope == pytest.approx((1 + 1 / 1.2) / (1 + 1 / 1.44))
    assert by_action.slope == pytest.approx((8 + 1 / 1.2) / (8 + 1 / 1.44))


def test_the_replica_spread_keeps_a_processs_own_deviation_and_not_the_machines():
    """Two stages slowed together (a machine-wide moment) deviate from each other by nothing; one
    stage alone 20% slow in one step of four leaves a symmetric spread whose slower-of-two excess
    is what two such processes would straggle by."""
    from calibrate.fit.least_squares import replica_spread
    from sim.engine.stragglers import expected_max, straggle_fraction

    together = [[c * 10e-3, c * 20e-3] for c in (0.8, 1.0, 1.2, 1.0)]
    assert replica_spread([together], quantiles=8) == pytest.approx([0.0] * 8)
    alone = [[10e-3, 20e-3], [12e-3, 20e-3], [10e-3, 20e-3], [10e-3, 20e-3]]
    spread = replica_spread([alone], quantiles=8)
    assert spread == pytest.approx([-0.2 / 2 ** 0.5] + [0.0] * 6 + [0.2 / 2 ** 0.5])
    assert replica_spread([[[1.0], [2.0]]]) == []  # one stage: nothing to pair
    # the slower of two draws from {-1, +1}: +1 three times in four
    assert expected_max([-1.0, 1.0], 2) == pytest.approx(0.5) and expected_max([-1.0, 1.0], 1) == 0.0
    assert straggle_fraction(spread, 1) == 0.0 and straggle_fraction([], 2) == 0.0
    assert straggle_fraction(spread, 4) > straggle_fraction(spread, 2) > 0.0


def test_the_halves_of_a_calibration_fit_its_odd_and_its_even_rounds_apart(monkeypatch):
    """The design repeated round after round: one half fits rounds 1, 3, 5, the other 2, 4, 6, each on
    a copy of the measured data; the whole fit's terms are left as they were."""
    import calibrate.fit.design_fit as design_fit
    from calibrate.fit.design import RunSpec

    seen = []

    def fake_fit(data, specs, reports, speeds, threads_of):
        seen.append([r["round"] for r in reports])
        data["pipeline"] = {"2": {"rounds": [r["round"] for r in reports]}}
        return {}

    monkeypatch.setattr(design_fit, "fit_in_pipeline", fake_fit)
    specs = [RunSpec.of((3, 3), m, "never", "gpipe", 8) for m in (2, 4)] * 6
    reports = [{"round": i // 2 + 1} for i in range(12)]
    data = {"pipeline": {"2": {"rounds": "all"}}, "profile": {"rows": [1, 2]}}
    halves = design_fit.fit_halves(data, 2, specs, reports, [1.0] * 12, {2: 1})
    assert seen == [[1, 1, 3, 3, 5, 5], [2, 2, 4, 4, 6, 6]]
    assert [h["pipeline"]["2"]["rounds"] for h in halves] == seen and set(halves[0]) == {"pipeline"}
    assert data == {"pipeline": {"2": {"rounds": "all"}}, "profile": {"rows": [1, 2]}}


def test_a_backward_under_full_takes_a_time_per_layer_beyond_the_backward_and_recompute_lines():
    """Under --checkpoint full a backward reruns each layer's forward first: its points (the stage's
    backward and recompute profiled, its layer count) fit the time per layer it takes beyond the two
    lines summed, whichever way those lines split their fixed part between scale and overhead; its
    forward is a plain forward."""
    from calibrate.fit.observations import ActionPoints, Observations, fitted_kind, profiled_action_parts
    from calibrate.fit.pipeline_fit import fit_pipeline
    from sim.formats.costs import ActionFit, MeasuredWorkload
    from tests.helpers.costs import synthetic_costs

    bounds = [(0, 1), (1, 3)]
    assert [fitted_kind({"stage": 1, "kind": k, "microbatch": 0}, bounds, "full", 4) for k in "FB"] == ["F", "B_full"]
    assert fitted_kind({"stage": 1, "kind": "B", "microbatch": 0}, bounds, "always", 4) == "B"
    workload = MeasuredWorkload(synthetic_costs(), 2)
    action = {"stage": 1, "kind": "B", "microbatch": 0, "rows": 2}
    assert profiled_action_parts(workload, "full", action, bounds, 4) == profiled_action_parts(
        workload, "never", action, bounds, 4)  # the backward's profile; the recompute's is kept beside it
    obs = Observations()
    for kind, factor in (("F", 1.1), ("R", 1.0), ("B", 1.05)):
        obs.actions[(2, kind)] = ActionPoints([1e-3, 2e-3], [1e-4, 1e-4], [factor * 1e-3, factor * 2e-3], ["a", "b"])
    lines = fit_pipeline(obs, {2: 1})[0]["2"]["actions"]
    backward, recompute = ActionFit.from_dict(lines["B"]), ActionFit.from_dict(lines["R"])
    # two stages of 2 and 3 layers, 0.5 ms for each layer after the first beyond the two lines
    profiles = [((3e-3, 2e-4), (2e-3, 1e-4), 2), ((6e-3, 2e-4), (4e-3, 1e-4), 3)]
    obs.actions[(2, "B_full")] = ActionPoints(
        [b[0] for b, _, _ in profiles], [b[1] for b, _, _ in profiles],
        [backward(*b) + recompute(*r) + (n - 1) * 5e-4 for b, r, n in profiles], ["c", "c"], [(0, 0, 0), (1, 0, 0)],
        [r for _, r, _ in profiles], [n for _, _, n in profiles])
    pipeline, residuals = fit_pipeline(obs, {2: 1})
    assert pipeline["2"]["full_backward_per_layer_s"] == pytest.approx(5e-4)
    assert "B_full" not in pipeline["2"]["actions"] and residuals["2"]["action B_full"]["worst_relative"] < 1e-9
    # a backward faster than the two lines summed takes none: the work the term stands for takes time
    obs.actions[(2, "B_full")].measured[:] = [0.9 * (backward(*b) + recompute(*r)) for b, r, _ in profiles]
    assert fit_pipeline(obs, {2: 1})[0]["2"]["full_backward_per_layer_s"] == 0.0
    assert "full_backward_per_layer_s" not in fit_pipeline(Observations(actions={(2, "F"): obs.actions[(2, "F")]}),
                                                      {2: 1})[0]["2"]


def test_the_ring_gather_fit_recovers_its_link():
    from calibrate.fit.least_squares import fit_ring_gather

    latency_s, bandwidth = 3e-5, 2e9
    points = [(n, b) for n in (2, 4) for b in (4e3, 1e6, 16e6)]
    seconds = [(n - 1) / n * b / bandwidth + (n - 1) * latency_s for n, b in points]
    fit = fit_ring_gather([n for n, _ in points], [b for _, b in points], seconds)
    assert fit.latency_s == pytest.approx(latency_s, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
