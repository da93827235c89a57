"""The costs file round-trips, and the measured workload gives the simulator exact stage costs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sim.catalog.hardware import LOCAL_CPU, Link, get_system
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.errors import GpipeInputError
from sim.formats.costs import allreduce_link, interpolate, load_costs_workload, read_costs, write_costs
from sim.workloads.models import get_workload
from tests.helpers.costs import ROWS, affine_times, design_runs, synthetic_costs, with_split_profile

V100 = get_system("v100-nvlink").device  # a what-if device


@pytest.fixture
def costs_file(tmp_path):
    path = tmp_path / "costs.json"
    write_costs(synthetic_costs(), path)
    return str(path)


def test_round_trip(costs_file):
    data = read_costs(costs_file)
    assert data["kind"] == "gpipe-costs" and data["version"] == 2
    assert {k: v for k, v in data.items() if k not in ("kind", "version")} == synthetic_costs()


def test_interpolation_is_exact_for_affine_costs_and_extrapolates():
    assert interpolate(ROWS, [3.0, 5.0, 9.0], 3) == pytest.approx(7.0)
    assert interpolate(ROWS, [3.0, 5.0, 9.0], 8) == pytest.approx(17.0)


def test_stage_union_counts_each_storage_once(costs_file):
    w = load_costs_workload(costs_file, "mlp", {"layers": 3, "width": 8})
    # layers 0..2 at 3 rows: input 12 + own 30 + out0 24 (a saves output) + own 0 + out1 48 (c saves input)
    # + own 15; the last output is not saved
    assert w.stage_saved_bytes(3, 0, 3) == 12 + 30 + 24 + 48 + 15
    # layer 1 alone: its input (the stash) and nothing it saves
    assert w.stage_saved_bytes(3, 1, 2) == 24


def test_stage_cost_adds_fitted_constants(costs_file):
    w, _ = load_costs_workload(costs_file, "mlp", {"layers": 3, "width": 8}).bind(get_system("cpu"), 2, "always")
    cost = w.stage_cost(2, 0, 2, LOCAL_CPU)
    forward = sum(1e-4 + 1e-3 * (i + 1) * 2 for i in range(2))
    assert cost.forward_s == pytest.approx(1.5 * forward + 1e-4)
    # the send is the sender's time after the action, not the action's: busy time leaves it out as
    # the executor's report does
    assert cost.activation_send_s == pytest.approx(2e-5 + 1e-9 * 32) and cost.gradient_send_s == 0.0
    last = w.stage_cost(2, 2, 3, LOCAL_CPU)
    backward = 2e-4 + 2e-3 * 3 * 2
    assert last.backward_s == pytest.approx(1.5 * backward + 1e-4)
    assert last.gradient_send_s == pytest.approx(2e-5 + 1e-9 * 32) and last.activation_send_s == 0.0
    assert last.optimizer_s == pytest.approx(1e-8 * 3000 + 1e-5)
    assert last.step_overhead_s == pytest.approx(5e-4)  # kept apart, drawn as its own span
    assert cost.stash_bytes == 8 and last.stash_bytes == 32
    assert cost.gap_after_s == ()  # a costs file whose design runs had no gap has none
    assert cost.cold_start_s == ()  # nor cold starts where the lines fitted none


def test_the_fitted_cold_starts_reach_every_kind_i_and_w_taking_the_backwards(tmp_path):
    data = synthetic_costs()
    lines = data["pipeline"]["2"]["actions"]
    lines["F"]["cold_start_s"], lines["R"]["cold_start_s"], lines["B"]["cold_start_s"] = 3e-4, 1e-4, 2e-4
    path = tmp_path / "costs.json"
    write_costs(data, path)
    w, _ = load_costs_workload(str(path), "mlp", {"layers": 3, "width": 8}).bind(get_system("cpu"), 2, "never")
    assert w.stage_cost(2, 0, 2, LOCAL_CPU).cold_start_s == pytest.approx((3e-4, 1e-4, 2e-4, 2e-4, 2e-4))
    assert w.stage_cost(2, 0, 2, V100).cold_start_s == ()  # a what-if device prices its kernels alone
    lines["F_graph"] = {**lines["F"], "cold_start_s": 1e-4}  # a forward keeping its graph, on its own line
    write_costs(data, path)
    for checkpoint, microbatches, forward in (("never", 4, 1e-4), ("except_last", 4, 3e-4), ("except_last", 1, 1e-4),
                                              ("always", 4, 3e-4)):  # the step's first forward's line
        w, _ = load_costs_workload(str(path), "mlp", {"layers": 3, "width": 8}).bind(
            get_system("cpu"), 2, checkpoint, microbatches)
        assert w.stage_cost(2, 0, 2, LOCAL_CPU).cold_start_s[0] == pytest.approx(forward), checkpoint


def test_an_action_scales_the_profiles_fixed_part_apart_from_the_part_that_grows_with_rows(tmp_path):
    """Each synthetic layer costs 0.1 ms whatever its rows (the profile's line at zero rows) plus its
    rows' work: with the fixed part scaled by 0.2 and the rest by 1.5, a two-layer stage's forward at
    2 rows is 1.5 x work + 0.2 x 0.2 ms + the overhead; W takes the backward's factor at those rows."""
    data = synthetic_costs()
    data["pipeline"]["2"]["actions"] = {k: {"slope": 1.5, "fixed_slope": 0.2, "intercept": 1e-4, "cold_start_s": 0.0} for k in "FRB"}
    path = tmp_path / "costs.json"
    write_costs(data, path)
    w, _ = load_costs_workload(str(path), "mlp", {"layers": 3, "width": 8}).bind(get_system("cpu"), 2, "always")
    assert w.profiled_parts_s("F", 1, 4) == (pytest.approx(1e-4 + 2e-3 * 4), pytest.approx(1e-4))
    cost = w.stage_cost(2, 0, 2, LOCAL_CPU)
    work = sum(1e-3 * (i + 1) * 2 for i in range(2))
    assert cost.forward_s == pytest.approx(1.5 * work + 0.2 * 2e-4 + 1e-4)
    backward_work = sum(2e-3 * (i + 1) * 2 for i in range(2))
    assert cost.backward_s == pytest.approx(1.5 * backward_work + 0.2 * 4e-4 + 1e-4)


def test_a_forward_that_keeps_its_graph_is_priced_on_its_own_line_where_calibration_fitted_one(tmp_path):
    """never: every forward keeps its graph (the profile's forward with grad, R, on the F_graph line);
    except_last: one in M does; always: none. Without the line all take the forward's."""
    data = synthetic_costs()
    data["profile"]["times_s"] = {t: {**kinds, "R": [affine_times(1.5e-3 * (i + 1), 1e-4) for i in range(3)]}
                                  for t, kinds in data["profile"]["times_s"].items()}
    data["pipeline"]["2"]["actions"]["F_graph"] = {"slope": 1.8, "intercept": 3e-4, "cold_start_s": 0.0}
    path = tmp_path / "costs.json"
    write_costs(data, path)
    workload = load_costs_workload(str(path), "mlp", {"layers": 3, "width": 8})
    no_grad = sum(1e-4 + 1e-3 * (i + 1) * 2 for i in range(2))
    with_grad = sum(1e-4 + 1.5e-3 * (i + 1) * 2 for i in range(2))
    forward = {policy: workload.bind(get_system("cpu"), 2, policy, 4)[0].stage_cost(2, 0, 2, LOCAL_CPU).forward_s
               for policy in ("never", "except_last", "always")}
    assert forward["never"] == pytest.approx(1.8 * with_grad + 3e-4)
    assert forward["always"] == pytest.approx(1.5 * no_grad + 1e-4)
    assert forward["except_last"] == pytest.approx((3 * forward["always"] + forward["never"]) / 4)
    del data["pipeline"]["2"]["actions"]["F_graph"]
    write_costs(data, path)
    plain, _ = load_costs_workload(str(path), "mlp", {"layers": 3, "width": 8}).bind(get_system("cpu"), 2, "never")
    assert plain.stage_cost(2, 0, 2, LOCAL_CPU).forward_s == pytest.approx(1.5 * with_grad + 1e-4)


def test_fitted_i_and_w_lines_price_a_split_backward_and_the_first_stage_keeps_the_whole_backward(tmp_path):
    """Where a design run split its backward, W is its own line on the profiled W and I its own line on
    the profiled I (the split's cost is what I + W take beyond the fitted whole backward); the first
    stage's W stays the whole backward and its I nothing, or, where calibration fitted them, W the
    whole backward on its own line and I the measured time. Without I and W lines both take the
    backward's factor."""
    from sim.engine.stage_costs import input_grad_time_s, weight_grad_time_s

    data = synthetic_costs()
    for kinds in data["profile"]["times_s"].values():
        kinds["I"] = [affine_times(1.2e-3 * (i + 1), 1e-4) for i in range(3)]
        kinds["W"] = [affine_times(0.9e-3 * (i + 1), 1e-4) for i in range(3)]
    plain_path, split_path = tmp_path / "plain.json", tmp_path / "split.json"
    write_costs(data, plain_path)
    data["pipeline"]["2"]["actions"]["I"] = {"slope": 1.25, "intercept": 2e-4, "cold_start_s": 0.0}
    data["pipeline"]["2"]["actions"]["W"] = {"slope": 2.0, "intercept": 3e-4, "cold_start_s": 0.0}
    write_costs(data, split_path)
    options = {"layers": 3, "width": 8}
    split, _ = load_costs_workload(str(split_path), "mlp", options).bind(get_system("cpu"), 2, "never")
    plain, _ = load_costs_workload(str(plain_path), "mlp", options).bind(get_system("cpu"), 2, "never")
    cost = split.stage_cost(2, 1, 3, LOCAL_CPU)
    input_grad = sum(1e-4 + 1.2e-3 * (i + 1) * 2 for i in (1, 2))
    weight_grad = sum(1e-4 + 0.9e-3 * (i + 1) * 2 for i in (1, 2))
    assert weight_grad_time_s(cost, "never", first=False) == pytest.approx(2.0 * weight_grad + 3e-4)
    assert input_grad_time_s(cost, "never", first=False) == pytest.approx(1.25 * input_grad + 2e-4)
    first = split.stage_cost(2, 0, 1, LOCAL_CPU)
    assert weight_grad_time_s(first, "never", first=True) == pytest.approx(first.backward_s)
    assert input_grad_time_s(first, "never", first=True) == 0.0
    data["pipeline"]["2"]["actions"]["W_first"] = {"slope": 1.5, "intercept": 3e-4, "cold_start_s": 0.0}
    data["pipeline"]["2"]["first_input_s"] = 4e-5
    measured_path = tmp_path / "measured_first.json"
    write_costs(data, measured_path)
    measured, _ = load_costs_workload(str(measured_path), "mlp", options).bind(get_system("cpu"), 2, "never")
    first = measured.stage_cost(2, 0, 1, LOCAL_CPU)
    assert weight_grad_time_s(first, "never", first=True) == pytest.approx(1.5 * (2e-4 + 2e-3 * 2) + 3e-4)
    assert weight_grad_time_s(first, "full", first=True) == pytest.approx(
        first.recompute_s + 1.5 * (2e-4 + 2e-3 * 2) + 3e-4)  # full recomputes the layers first
    assert input_grad_time_s(first, "never", first=True) == pytest.approx(4e-5)
    later = measured.stage_cost(2, 1, 3, LOCAL_CPU)  # only the first stage's are apart
    assert later.first_weight_grad_s is None and later.first_input_s == 0.0
    unfitted = plain.stage_cost(2, 1, 3, LOCAL_CPU)
    backward = sum(2e-4 + 2e-3 * (i + 1) * 2 for i in (1, 2))
    factor = unfitted.backward_s / backward - 1e-4 / backward  # the backward's slope, without its intercept
    assert unfitted.weight_grad_s == pytest.approx(factor * weight_grad)
    assert input_grad_time_s(unfitted, "never", first=False) == pytest.approx(
        unfitted.backward_s - factor * weight_grad + factor * (input_grad + weight_grad - backward))


def test_the_fitted_gap_between_actions_reaches_every_stage_on_the_measured_device_only(tmp_path):
    data = synthetic_costs()
    data["pipeline"]["2"]["gap_after_s"] = {"F": 7e-5, "R": 7e-5, "B": 9e-5, "I": 7e-5, "W": 7e-5}
    path = tmp_path / "costs.json"
    write_costs(data, path)
    w, system = load_costs_workload(str(path), "mlp", {"layers": 3, "width": 8}).bind(get_system("cpu"), 2, "always")
    assert {w.stage_cost(r, a, b, LOCAL_CPU).gap_after_s for r, a, b in ((1, 0, 1), (3, 1, 3))} == {
        (7e-5, 7e-5, 9e-5, 7e-5, 7e-5)}
    assert w.stage_cost(2, 0, 2, V100).gap_after_s == ()  # a what-if device: the executor's CPU time is not its
    gapped = simulate(w, system, [1, 2], 8, ParallelLayout.for_partition([1, 2], 4, checkpoint="always"))
    starts = sorted(r.start_s for r in gapped.timeline.records if r.stage == 0 and r.kind in "FRB")
    ends = sorted(r.end_s for r in gapped.timeline.records if r.stage == 0 and r.kind in "FRB")
    assert min(b - a for a, b in zip(ends, starts[1:])) >= 7e-5 - 1e-12


def test_selective_prices_the_attention_core_the_profile_measured():
    """--checkpoint selective from a costs file: the forward as never's, each backward longer by the
    profiled core rerun (at the fitted backward slope), each micro-batch holding the core's bytes less;
    a file whose profile did not measure a core refuses it in one line."""
    from sim.formats.costs import MeasuredWorkload
    from sim.workloads.workload import check_checkpoint_for

    data = synthetic_costs()
    with pytest.raises(GpipeInputError, match="gpipe calibrate --force"):
        check_checkpoint_for(MeasuredWorkload(data), "selective")
    for i, memory in enumerate(data["profile"]["memory"]):
        memory["core_bytes"] = [3 * r if i == 1 else 0 for r in ROWS]
    core = [[0.0] * len(ROWS), affine_times(5e-4, 5e-5), [0.0] * len(ROWS)]
    for kinds in data["profile"]["times_s"].values():
        kinds["C"] = core

    def bound(checkpoint):
        return MeasuredWorkload(data).bind(get_system("cpu"), 1, checkpoint, 2)

    (selective, system), (never, _) = bound("selective"), bound("never")
    assert check_checkpoint_for(selective, "selective") == "selective"
    cost, plain = selective.stage_cost(2, 0, 3, LOCAL_CPU), never.stage_cost(2, 0, 3, LOCAL_CPU)
    assert cost.forward_s == plain.forward_s and cost.backward_s == plain.backward_s
    assert cost.core_recompute_s == pytest.approx(1.5 * (5e-5 + 5e-4 * 2))
    assert cost.core_saved_bytes == 6
    one = simulate(selective, system, (3,), 4, ParallelLayout.for_partition((3,), 2, checkpoint="selective"))
    other = simulate(never, system, (3,), 4, ParallelLayout.for_partition((3,), 2, checkpoint="never"))
    assert one.step_time_s == pytest.approx(other.step_time_s + 2 * cost.core_recompute_s)
    assert one.stages[0].peak_activation_bytes == other.stages[0].peak_activation_bytes - 2 * 6


def test_a_stage_split_over_t_ranks_is_priced_from_the_split_profile():
    """--tensor-parallel T with measured costs: the file's profile of the layers split over T ranks
    (times, this rank's bytes and parameters), K's pipeline fits, the cores shared by K x T processes;
    the pipeline sees each stage's T ranks as one device."""
    from sim.formats.costs import MeasuredWorkload
    from sim.workloads.tensor_parallel import with_tensor_parallel

    data = with_split_profile(synthetic_costs())
    workload = MeasuredWorkload(data)
    assert workload.tensor_parallel_options == [1, 2]
    split, groups = with_tensor_parallel(workload, get_system("cpu"), 2)
    assert groups.devices_per_node == get_system("cpu").devices_per_node // 2
    split, system = split.bind(groups, 1, "never", 2)
    assert split.tensor_parallel == 2 and split.fit.threads == 2  # K = 1's fit, the T=2 profile's one thread
    whole, _ = workload.bind(get_system("cpu"), 1, "never", 2)
    cost, plain = split.stage_cost(2, 0, 3, LOCAL_CPU), whole.stage_cost(2, 0, 3, LOCAL_CPU)
    forward = sum(1e-4 + 1e-3 * (i + 1) * 2 for i in range(3))
    assert plain.forward_s == pytest.approx(1.5 * forward + 1e-4)
    assert cost.forward_s == pytest.approx(1.5 * 3 * forward + 1e-4)
    assert cost.static_bytes == plain.static_bytes // 2
    assert cost.saved_bytes == plain.saved_bytes - 2 * 2 * 2  # layers a and c own 2 bytes per row less
    result = simulate(split, system, (3,), 4, ParallelLayout.for_partition((3,), 2, checkpoint="never"))
    assert result.stages[0].peak_activation_bytes == 2 * cost.saved_bytes
    assert split.describe()["parameter_count"] == whole.describe()["parameter_count"]
    # the in-pipeline factors calibration fitted on split runs take the place of K's slopes
    data["tensor_parallel_fit"] = {"2": {"F": 0.8, "R": 0.9, "B": 1.1}}
    fitted, _ = MeasuredWorkload(data).split(2).bind(groups, 1, "never", 2)
    assert fitted.fit.actions["F"].slope == 0.8 and fitted.fit.actions["B"].intercept == 1e-4
    assert fitted.stage_cost(2, 0, 3, LOCAL_CPU).forward_s == pytest.approx(0.8 * 3 * forward + 1e-4)
    assert MeasuredWorkload(data).fit.actions["F"].slope == 1.5  # whole stages keep K's


def test_a_split_the_costs_file_did_not_profile_is_one_line():
    from sim.formats.costs import MeasuredWorkload
    from sim.workloads.tensor_parallel import default_sequence_parallel, with_tensor_parallel

    plain = MeasuredWorkload(synthetic_costs())
    with pytest.raises(GpipeInputError, match=r"no profile of the layers split over 2 ranks .*--tensor-parallel 2"):
        with_tensor_parallel(plain, get_system("cpu"), 2)
    split = MeasuredWorkload(with_split_profile(synthetic_costs()))
    assert default_sequence_parallel(2, None, split) is False  # profiled without it, as gpipe train runs
    assert default_sequence_parallel(2, None) is True
    with pytest.raises(GpipeInputError, match="drop --sequence-parallel"):
        with_tensor_parallel(split, get_system("cpu"), 2, sequence_parallel=True)
    with pytest.raises(GpipeInputError, match="--efficiency-from"):
        with_tensor_parallel(split, get_system("a100-nvlink"), 2)


def test_replicas_are_priced_with_the_threads_and_fits_of_d_x_k_processes():
    """D = 2 replicas of one stage on two cores: two processes of one thread each, as the executor
    runs them, so the one-thread profile and the fits of two processes (K = 2's), not K = 1's."""
    from sim.formats.costs import MeasuredWorkload

    data = json.loads(json.dumps(synthetic_costs()))  # the two fits share their tables in the literal
    data["profile"]["times_s"]["1"] = {kind: [[2 * v for v in row] for row in table]
                                       for kind, table in data["profile"]["times_s"]["2"].items()}
    data["pipeline"]["2"]["actions"]["F"] = {"slope": 2.0, "intercept": 1e-4, "cold_start_s": 0.0}
    forward = sum(1e-4 + 1e-3 * (i + 1) * 2 for i in range(3))
    one, _ = MeasuredWorkload(data).bind(get_system("cpu"), 1, "never", 2)
    two, _ = MeasuredWorkload(data).bind(get_system("cpu"), 1, "never", 2, replicas=2)
    assert one.stage_cost(2, 0, 3, LOCAL_CPU).forward_s == pytest.approx(1.5 * forward + 1e-4)
    assert two.stage_cost(2, 0, 3, LOCAL_CPU).forward_s == pytest.approx(2.0 * 2 * forward + 1e-4)


def test_the_slowest_of_d_replicas_delays_each_stages_allreduce_by_the_measured_spread(tmp_path):
    """A process's compute deviates by -10% or +10% in a step, equally often: the slower of two
    replicas runs 5% of a replica's compute past the typical one, and the all-reduce waits for it;
    one replica, or a costs file without the spread, waits for nothing."""
    data = synthetic_costs()
    path, plain_path = tmp_path / "costs.json", tmp_path / "plain.json"
    write_costs(data, plain_path)
    data["pipeline"]["2"]["replica_spread"] = [-0.1, 0.1]
    write_costs(data, path)

    def step(costs, replicas: int):
        w, system = load_costs_workload(str(costs), "mlp", {"layers": 3, "width": 8}).bind(
            get_system("cpu"), 1, "never", 2, replicas)
        return simulate(w, system, [3], 8,
                        ParallelLayout.for_partition([3], 2, checkpoint="never", replicas=replicas))

    for replicas in (1, 2):
        spread, plain = step(path, replicas), step(plain_path, replicas)
        compute = plain.stages[0].busy_s - (1e-8 * 6000 + 1e-5)  # the stage's busy time less its optimizer step
        expected = 0.05 * compute if replicas == 2 else 0.0
        assert spread.step_time_s - plain.step_time_s == pytest.approx(expected, rel=1e-6, abs=1e-12)
        waits = [r for r in spread.timeline.records if r.kind == "recv_wait" and r.microbatch == -1]
        assert bool(waits) == (replicas == 2)


def test_bind_puts_the_fitted_link_in_the_cpu_system_only(costs_file):
    w = load_costs_workload(costs_file, "mlp", {"layers": 3, "width": 8})
    _, cpu = w.bind(get_system("cpu"), 2)
    assert cpu.intra_link.latency_s == 3e-5 and cpu.intra_link.bandwidth_bytes_per_s == 1e9
    _, other = w.bind(get_system("v100-nvlink"), 2)
    assert other.intra_link == get_system("v100-nvlink").intra_link


def test_simulation_uses_measured_costs(costs_file):
    w, system = load_costs_workload(costs_file, "mlp", {"layers": 3, "width": 8}).bind(get_system("cpu"), 1, "never")
    result = simulate(w, system, (3,), 4, ParallelLayout.for_partition((3,), 1, checkpoint="never"))
    cost = w.stage_cost(4, 0, 3, LOCAL_CPU)
    assert result.step_time_s == pytest.approx(cost.forward_s + cost.backward_s + cost.optimizer_s + cost.step_overhead_s)
    assert result.stages[0].peak_activation_bytes == w.stage_saved_bytes(4, 0, 3)


def test_what_if_on_a_catalog_device_uses_the_fitted_efficiency(costs_file):
    w = load_costs_workload(costs_file, "mlp", {"layers": 3, "width": 8})
    expected = get_workload("mlp", {"layers": 3, "width": 8}).layer_costs(
        4, replace(V100, efficiency=0.25, bandwidth_efficiency=0.5))
    assert list(w.layer_costs(4, V100)) == list(expected)


def test_wrong_model_wrong_version_and_missing_file_are_one_line_errors(costs_file, tmp_path):
    with pytest.raises(GpipeInputError, match="was measured for mlp"):
        load_costs_workload(costs_file, "mlp", {"layers": 4})
    data = json.load(open(costs_file))
    data["version"] = 99
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(GpipeInputError, match="version"):
        read_costs(str(bad))
    with pytest.raises(GpipeInputError, match="does not exist"):
        read_costs(str(tmp_path / "none.json"))


def test_the_measured_allreduce_reads_back_as_a_link_on_the_measured_system_only(costs_file):
    data = read_costs(costs_file)
    link = allreduce_link(data)
    assert isinstance(link, Link)
    assert (link.latency_s, link.bandwidth_bytes_per_s) == (2e-5, 5e8)
    w = load_costs_workload(costs_file, "mlp", {"layers": 3, "width": 8})
    assert w.allreduce_link(get_system("cpu")) == link
    assert w.allreduce_link(get_system("v100-nvlink")) is None  # measured here, not there
    assert allreduce_link({k: v for k, v in data.items() if k != "allreduce"}) is None  # older files


def test_a_run_whose_processes_fit_the_cores_is_priced_on_the_shared_memory_route(tmp_path):
    data = synthetic_costs()
    data["allreduce"]["shared_memory"] = {"measured_s": [[1e-5, 2e-5]], "latency_s": 1e-6,
                                          "bandwidth_bytes_per_s": 4e9}
    path = tmp_path / "costs.json"
    write_costs(data, path)
    w = load_costs_workload(str(path), "mlp", {"layers": 3, "width": 8})
    cpu = get_system("cpu")
    fits, _ = w.bind(cpu, 1, replicas=2)  # 2 processes on the file's 2 cores: the executor sums in shared memory
    crowded, _ = w.bind(cpu, 2, replicas=2)  # 4 processes: gloo
    assert (fits.allreduce_link(cpu).latency_s, fits.allreduce_link(cpu).bandwidth_bytes_per_s) == (1e-6, 4e9)
    assert crowded.allreduce_link(cpu) == allreduce_link(data)
    data["allreduce"]["shared_memory"] = {"latency_s": 1e-6}  # malformed: refused when the file is read
    write_costs(data, path)
    with pytest.raises(GpipeInputError, match="has no bandwidth_bytes_per_s"):
        load_costs_workload(str(path), "mlp", {"layers": 3, "width": 8})


@pytest.mark.parametrize("entry, says", [
    ([1, 2], "is list, not an object"),
    ({"bandwidth_bytes_per_s": 5e8}, "has no latency_s"),
    ({"latency_s": 2e-5}, "has no bandwidth_bytes_per_s"),
    ({"latency_s": "fast", "bandwidth_bytes_per_s": 5e8}, "is not a number"),
    ({"latency_s": -1e-5, "bandwidth_bytes_per_s": 5e8}, "latency_s -1e-05 is not a finite time"),
    ({"latency_s": float("nan"), "bandwidth_bytes_per_s": 5e8}, "latency_s nan is not a finite time"),
    ({"latency_s": 2e-5, "bandwidth_bytes_per_s": 0}, "bandwidth_bytes_per_s 0.0 is not positive"),
])
def test_a_malformed_allreduce_entry_is_one_line_before_any_work(entry, says, tmp_path, capsys):
    data = synthetic_costs()
    data["allreduce"] = entry
    path = tmp_path / "costs.json"
    write_costs(data, path)
    with pytest.raises(GpipeInputError, match=says) as caught:
        allreduce_link(read_costs(path))
    assert "\n" not in str(caught.value) and "gpipe calibrate --force" in str(caught.value)
    with pytest.raises(GpipeInputError, match=says):
        load_costs_workload(str(path), "mlp", {"layers": 3, "width": 8})
    from gpipe.main import main

    assert main(["simulate", "--costs", str(path), "--hardware", "cpu", "-K", "1", "-M", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_gpipe_simulate_takes_costs(costs_file, capsys):
    from gpipe.main import main

    code = main(["simulate", "--model", "mlp", "--layers", "3", "--width", "8", "--costs", costs_file,
                 "--hardware", "cpu", "-K", "2", "-M", "2", "--batch", "4", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["partition"] and out["step_time_s"] > 0


def test_simulate_and_plan_take_model_options_and_batch_from_the_costs_file(costs_file, capsys):
    """With --costs and no --model, the file says what was measured (mlp, 3 layers, batch 8)."""
    from gpipe.main import main

    explicit = ["--model", "mlp", "--layers", "3", "--width", "8", "--batch", "8"]
    for extra in ([], explicit):
        assert main(["simulate", "--costs", costs_file, "--hardware", "cpu", "-K", "2", "-M", "2", "--json",
                     *extra]) == 0
    implied, given = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert implied == given
    assert implied["model"]["name"] == "mlp" and implied["batch_size"] == 8
    assert main(["plan", "--costs", costs_file, "--hardware", "cpu", "--microbatch-options", "1,2", "--json",
                 "--quiet"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(r["batch_size"] == 8 for r in ranked)


def test_a_flag_that_contradicts_the_costs_file_is_one_line(costs_file, capsys):
    from gpipe.main import main

    assert main(["simulate", "--costs", costs_file, "--hardware", "cpu", "-K", "2", "--layers", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "was measured for mlp" in err and "layers': 5" in err


def test_calibration_summary_warns_when_the_fit_misses_a_design_run_by_much():
    from gpipe.calibrate import summary_text

    assert "warning" not in summary_text(design_runs([0.02, -0.05]))
    noisy = summary_text(design_runs([0.02, -0.26]))
    assert "misses its own design run" in noisy and "by -26% (goal 12%)" in noisy and "--force" in noisy


def test_calibration_summary_gives_each_design_runs_busy_error_and_the_gap_between_actions():
    from gpipe.calibrate import summary_text

    data = design_runs([0.0])
    data["design"][0].update(measured_busy_s=[0.05, 0.04], predicted_busy_s=[0.045, 0.042])
    data["pipeline"] = {"2": {**synthetic_costs()["pipeline"]["2"], "gap_after_s": {"F": 8.4e-5, "B": 1.4e-4},
                              "replica_spread": [-0.1, 0.1]}}
    text = summary_text(data)
    assert "busy per stage -10.0%/+5.0%" in text and "between actions, after F 84/B 140 us" in text
    assert "the slowest of 2 replicas +5.0% of their compute" in text
    assert "busy" not in summary_text(design_runs([0.0]))  # a costs file from before it was kept


def test_calibration_summary_publishes_the_allreduce_fit_and_its_points():
    from gpipe.calibrate import summary_text

    text = summary_text({**design_runs([0.0]), "allreduce": synthetic_costs()["allreduce"]})
    assert "all-reduce (gloo, ring model): latency 20.0 us, bandwidth 0.50 GB/s" in text
    assert "all-reduce among 2 ranks: 4 KiB 0.044 ms, 64 KiB 0.171 ms" in text
    assert "all-reduce" not in summary_text(design_runs([0.0]))


def test_plan_searches_the_split_backward_schedules_by_default_only_where_the_profile_timed_them(tmp_path):
    """With costs whose profile timed I and W apart the split's cost is measured, so gpipe plan's
    default search includes zb-h1, zbv and dualpipev; a profile without them (a quick calibration,
    an older file) and the analytic models leave them to --schedules."""
    from types import SimpleNamespace

    from sim.formats.costs import write_costs
    from gpipe.plan_space import default_schedules
    from sim.schedules.schedule import PLANNED_SCHEDULES, SCHEDULES

    plain, split = synthetic_costs(), synthetic_costs()
    for kinds in split["profile"]["times_s"].values():
        kinds["I"], kinds["W"] = kinds["B"], kinds["B"]
    paths = {}
    for name, data in (("plain", plain), ("split", split)):
        paths[name] = str(tmp_path / f"{name}.json")
        write_costs(data, paths[name])
    assert default_schedules(SimpleNamespace(schedules=None, costs=paths["split"])).split(",") == list(SCHEDULES)
    assert default_schedules(SimpleNamespace(schedules=None, costs=paths["plain"])).split(",") == list(PLANNED_SCHEDULES)
    assert default_schedules(SimpleNamespace(schedules=None, costs=None)).split(",") == list(PLANNED_SCHEDULES)
    assert default_schedules(SimpleNamespace(schedules="zbv", costs=None)) == "zbv"


def test_a_backward_under_full_takes_the_time_per_layer_calibration_measured_beyond_the_two_lines(tmp_path):
    """--checkpoint full reruns each layer just before its backward: without a measured time per layer
    its backward is the backward's and the recompute's lines summed; with one, that sum plus the time
    for each of the stage's layers after its first; other policies never use it."""
    from sim.engine.stage_costs import backward_time_s

    options = {"layers": 3, "width": 8}
    data = synthetic_costs()
    plain_path, fitted_path = tmp_path / "plain.json", tmp_path / "fitted.json"
    write_costs(data, plain_path)
    data["pipeline"]["2"]["full_backward_per_layer_s"] = 5e-4
    write_costs(data, fitted_path)
    plain, _ = load_costs_workload(str(plain_path), "mlp", options).bind(get_system("cpu"), 2, "full")
    fitted, _ = load_costs_workload(str(fitted_path), "mlp", options).bind(get_system("cpu"), 2, "full")
    before, after = plain.stage_cost(2, 1, 3, LOCAL_CPU), fitted.stage_cost(2, 1, 3, LOCAL_CPU)
    # the synthetic lines: 1.5 x the profile + 0.1 ms, at 2 rows
    backward = 1.5 * sum(2e-4 + 2e-3 * (i + 1) * 2 for i in (1, 2)) + 1e-4
    recompute = 1.5 * sum(1e-4 + 1e-3 * (i + 1) * 2 for i in (1, 2)) + 1e-4
    assert backward_time_s(before, "full") == pytest.approx(backward + recompute)
    assert backward_time_s(after, "full") == pytest.approx(backward + recompute + 5e-4)  # the second layer's
    one_layer = fitted.stage_cost(2, 2, 3, LOCAL_CPU)  # nothing beyond the two lines: the lines hold one call
    assert backward_time_s(one_layer, "full") == pytest.approx(one_layer.backward_s + one_layer.recompute_s)
    assert backward_time_s(after, "never") == backward_time_s(before, "never") == pytest.approx(backward)
    assert backward_time_s(after, "always") == pytest.approx(backward)
