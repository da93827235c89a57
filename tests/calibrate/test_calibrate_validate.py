"""End to end on a tiny model: gpipe calibrate (then its cache), gpipe validate, the table's content."""

from __future__ import annotations

import json
import shutil

import pytest

from calibrate.fit.design import RunSpec, calibration_design, run_config
from calibrate.validate.comparison import Comparison
from calibrate.validate.held_out_design import validation_design
from calibrate.validate.summary import summarize
from calibrate.validate.table import format_table
from gpipe.main import main
from tests.helpers.costs import TINY



def test_held_out_design_never_repeats_a_calibration_run():
    for layers in (3, 6, 10):
        held_out = validation_design(layers, 32)
        assert held_out and not set(held_out) & set(calibration_design(layers, 32, split_backward=True))
        assert {s.stages for s in held_out} == {1, 2}
        assert {s.layout.checkpoint for s in held_out} == {"always", "except_last", "never", "full"}
        with_core = validation_design(layers, 32, attention_core=True)
        assert {s.layout.checkpoint for s in with_core} - {s.layout.checkpoint for s in held_out} == {"selective"}
        # ZB-V where the model has a layer for each of its 2 x 2 chunks
        assert {s.layout.schedule for s in held_out} == {"gpipe", "1f1b", "zb-h1"} | ({"zbv"} if layers >= 4 else set())
        assert all(s.layout.virtual_stages == 2 and len(s.partition) == 4 and s.stages == 2 and "V=2" in s.label()
                   for s in held_out if s.layout.schedule == "zbv")
        assert any(32 % s.layout.microbatches for s in held_out)  # M that does not divide the batch
        # balanced and skewed over two processes
        assert len({s.partition for s in held_out if s.stages == 2 and s.layout.virtual_stages == 1}) == 2


def test_a_full_calibration_design_spans_the_rows_a_plan_can_give_a_micro_batch():
    """The whole batch in one micro-batch at K = 1 and 2, and 2-row forwards that keep their graphs at
    K = 1; a quick calibration's design leaves them out, and the held-out runs stay other runs."""
    full = calibration_design(6, 32, split_backward=True)
    quick = calibration_design(6, 32, split_backward=True, row_span=False)
    added = [s for s in full if s not in quick]
    assert [(s.stages, s.layout.microbatches, s.layout.checkpoint) for s in added] == [(1, 1, "always"), (1, 16, "never"),
                                                                          (2, 1, "always")]
    assert set(quick) < set(full) and not set(validation_design(6, 32)) & set(added)
    rows = {32 // s.layout.microbatches for s in full}
    assert min(rows) == 2 and max(rows) == 32


def test_a_full_calibration_has_a_run_under_full_at_each_k_and_the_quick_one_none():
    """Their backwards, each layer recomputed just before its own, measure the factor such a backward
    takes over the two lines; the held-out runs under full stay other runs (other M, other partition)."""
    full = [s for s in calibration_design(6, 32, split_backward=True) if s.layout.checkpoint == "full"]
    assert [(s.stages, s.layout.microbatches) for s in full] == [(1, 8), (2, 8)]
    assert not any(s.layout.checkpoint == "full" for s in calibration_design(6, 32, per_layer_recompute=False))
    held_out = [s for s in validation_design(6, 32) if s.layout.checkpoint == "full"]
    assert len(held_out) == 2 and not set(held_out) & set(full)


def test_held_out_design_adds_two_replicas_with_one_and_two_stages():
    held_out = validation_design(6, 32)
    replicated = [s for s in held_out if s.layout.replicas > 1]
    # whole replicas, then the same layouts under ZeRO-3 (FSDP2)
    assert [(s.layout.replicas, s.stages, s.layout.zero) for s in replicated] == [(2, 1, 0), (2, 2, 0), (2, 1, 3), (2, 2, 3)]
    assert held_out[-4:] == replicated  # after the single-pipeline runs, so --limit keeps those first
    assert all(s.processes == s.layout.replicas * s.stages for s in held_out)
    assert all(s.label().startswith("D=2 ") for s in replicated)
    assert [s.label().startswith("D=2 ZeRO-3 ") for s in replicated] == [False, False, True, True]
    # the ZeRO-3 runs reduce-scatter once per step, as before one stage's default became every micro-batch
    assert [s.layout.resolved_gradient_sync for s in replicated if s.layout.zero] == ["step", "step"]
    assert [run_config("mlp", {"layers": 6}, s, steps=1).layout.gradient_sync for s in replicated if s.layout.zero] == ["step", None]
    assert not any(s.label().startswith("D=") for s in held_out if s.layout.replicas == 1)
    assert [s for s in validation_design(6, 32, max_replicas=1) if s.layout.replicas > 1] == []
    assert [(s.layout.replicas, s.stages) for s in validation_design(6, 32, max_stages=1) if s.layout.replicas > 1] == [(2, 1)] * 2
    # every replica needs a row per micro-batch: batch 6 takes D=2 x M=3, not D=2 x M=4
    assert [(s.stages, s.layout.microbatches) for s in validation_design(6, 6) if s.layout.replicas > 1] == [(1, 3)]


def test_a_run_spec_passes_its_replicas_to_the_run_config():
    spec = RunSpec.of((2, 2), 4, "never", "1f1b", 8, replicas=2)
    config = run_config("mlp", {"layers": 4, "width": 8}, spec, steps=3)
    assert config.layout.replicas == 2 and config.stages == 2 and config.world_size == 4
    assert config.batch_size == 8  # the global batch
    assert run_config("mlp", {"layers": 4, "width": 8}, RunSpec.of((4,), 2, "never", "gpipe", 8), 3).layout.replicas == 1


def test_held_out_design_splits_stages_over_the_tensor_parallel_ranks_the_costs_file_profiled():
    assert all(s.layout.tensor_parallel == 1 for s in validation_design(6, 32))
    held_out = validation_design(6, 32, tensor_parallel=[2])
    split = [s for s in held_out if s.layout.tensor_parallel > 1]
    assert held_out[-len(split):] == split and len(split) == 2  # last, so --limit keeps the others first
    assert {(s.stages, s.layout.checkpoint) for s in split} == {(1, "never"), (1, "always")}
    assert all(s.processes == 2 and s.label().startswith("K=1 T=2 ") for s in split)
    config = run_config("transformer", {"layers": 2, "d_model": 16, "ff": 32, "heads": 2, "seq": 8, "vocab": 32},
                        split[0], steps=3)
    assert config.layout.tensor_parallel == 2 and config.world_size == 2 and not config.layout.sequence_parallel


def _comparison(run: str, predicted: float, measured: float, replicas: int = 1, oversubscribed: bool = False):
    return Comparison(run, predicted, measured, [100], [100], [measured], [1.0], replicas, oversubscribed)


def test_the_table_shows_d_and_keeps_oversubscribed_runs_out_of_the_errors():
    comparisons = [_comparison("K=1 M=1", 1.1, 1.0), _comparison("D=2 K=1 M=3", 0.95, 1.0, 2),
                   _comparison("D=2 K=2 M=4", 3.0, 1.0, 2, oversubscribed=True)]
    summary = summarize(comparisons)
    assert summary["runs"] == 2 and summary["oversubscribed_runs"] == 1
    assert summary["worst_step_error"] == pytest.approx(0.1)  # the +200% oversubscribed run is not in it
    result = {"runs": [c.to_dict() for c in comparisons], "summary": summary}
    lines = format_table(result).splitlines()
    assert lines[0].split()[:2] == ["D", "run"]
    assert lines[2].split()[0] == "1" and lines[3].split()[0] == "2"
    assert lines[4].split()[0] == "2*" and "+200.0%" in lines[4]
    assert lines[-1].startswith("* oversubscribed") and "1 run(s) left out" in lines[-1]
    assert not any(line.startswith("*") for line in format_table(
        {"runs": result["runs"][:2], "summary": summarize(comparisons[:2])}).splitlines())


def test_the_table_names_the_worst_stage_and_how_much_of_its_busy_time_is_after_waits():
    """The busy error's worst stage, with the share of its predicted busy time the warm-up after long
    waits makes up (sim.engine.host): the component this machine moves most from one moment to the next."""
    small = Comparison("K=2 M=6 [1,5]", 1.0, 1.0, [100, 100], [100, 100], [1.0], [1.0],
                       predicted_busy_s=[0.010, 0.50], measured_busy_s=[0.008, 0.50],
                       busy_rounds_at_reference_s=[[0.008], [0.50]], predicted_warm_up_s=[0.004, 0.0])
    even = Comparison("K=2 M=6 [3,3]", 1.0, 1.0, [100, 100], [100, 100], [1.0], [1.0],
                      predicted_busy_s=[0.5, 0.5], measured_busy_s=[0.5, 0.51], busy_rounds_at_reference_s=[[0.5], [0.51]])
    assert small.to_dict()["predicted_warm_up_s"] == [0.004, 0.0]
    table = format_table({"runs": [even.to_dict(), small.to_dict()], "summary": summarize([even, small])}, verbose=True)
    assert "worst 25.0%, by K=2 M=6 [1,5] stage 0 (40% after waits)" in table
    alone = format_table({"runs": [even.to_dict()], "summary": summarize([even])}, verbose=True)
    assert "by K=2 M=6 [3,3] stage 1;" in alone and "after waits" not in alone


@pytest.mark.slow
def test_calibrate_then_validate_end_to_end(tmp_path, capsys, tiny_quick_costs):
    costs = str(tmp_path / "costs.json")
    shutil.copy(tiny_quick_costs[0], costs)
    assert "costs written to" in tiny_quick_costs[1]
    data = json.load(open(costs))
    assert data["machine"]["cpu_cores"] >= 1 and data["machine"]["torch"]
    assert set(data["pipeline"]) >= {"1"}
    assert data["model"]["num_layers"] == 4
    assert set(data["speed"]["reference_s"]) == set(data["pipeline"])  # a reference pace per K
    assert set(data["speed"]["after_wait_reference_s"]) == set(data["pipeline"])  # and an after-wait loss
    assert ("allreduce" in data) == (data["machine"]["cpu_cores"] >= 2)  # a data-parallel group fits
    if "allreduce" in data:
        assert data["allreduce"]["parties"][0] == 2 and data["allreduce"]["bandwidth_bytes_per_s"] > 0
    assert all(v > 0 for v in data["speed"]["reference_s"].values())
    assert main(["calibrate", *TINY, "--out", costs, "--quick"]) == 0
    assert "reusing" in capsys.readouterr().out

    # a second calibration whose reference pace is 1.25 times slower judges the same measurements: the
    # same predicted step, against a measurement put at its reference 1.25 times longer
    slower = {**data, "speed": {**data["speed"], "reference_s": {k: v * 1.25 for k, v in
                                                                  data["speed"]["reference_s"].items()}}}
    other = str(tmp_path / "other.json")
    json.dump(slower, open(other, "w"))
    results = str(tmp_path / "validation.json")
    assert main(["validate", "--costs", costs, other, "--limit", "2", "--steps", "3", "--json", "--out",
                 results]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.load(open(results))
    # both runs measured; a run whose speed correction stayed out of bounds is shown but not judged
    assert printed["summary"]["runs"] + printed["summary"]["not_judged_runs"] == 2
    for run in printed["runs"]:
        assert run["measured_step_s"] > 0 and run["predicted_step_s"] > 0
        assert len(run["round_speeds"]) == printed["rounds"] and all(v > 0 for v in run["round_speeds"])
        assert run["measured_at_reference_s"] > 0
        assert len(run["round_warm_up_factors"]) == printed["rounds"] and all(f >= 0 for f in run["round_warm_up_factors"])
        assert len(run["predicted_peak_activation_bytes"]) == len(run["measured_peak_activation_bytes"])
        # components: busy per stage, the bubble and the end-of-step span on both sides
        assert len(run["predicted_busy_s"]) == len(run["measured_busy_s"]) == len(run["busy_errors"]) >= 1
        assert len(run["busy_errors_at_reference"]) == len(run["busy_errors"])
        assert all(v > 0 for v in run["measured_busy_at_reference_s"])
        assert all(v > 0 for v in run["predicted_busy_s"] + run["measured_busy_s"])
        assert 0 <= run["measured_bubble"] < 1 and run["predicted_end_span_s"] >= 0 and run["measured_end_span_s"] > 0

    for run in printed["runs"]:
        by_first, by_second = run["calibrations"]["step_errors_at_reference"]
        assert by_first == run["step_error_at_reference"]
        assert by_second == pytest.approx((1 + by_first) / 1.25 - 1)
        assert run["calibrations"]["predicted_steps_s"] == [run["predicted_step_s"]] * 2
        low, high = run["calibrations"]["step_error_intervals_at_reference"][1]
        assert (low, high) == (pytest.approx((1 + run["step_error_interval_at_reference"][0]) / 1.25 - 1),
                               pytest.approx((1 + run["step_error_interval_at_reference"][1]) / 1.25 - 1))
    assert printed["summary"]["across_calibrations"]["calibrations"] == 2
    assert "the moment of calibration (calibs: the step error as each of 2 costs files" in format_table(printed, verbose=True)


def test_validate_refuses_a_missing_costs_file(tmp_path, capsys):
    assert main(["validate", "--costs", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_run_with_more_processes_than_cores_is_still_predicted(monkeypatch):
    """D x K beyond the system's devices: predicted on a node with a device per process."""
    import sim.engine.engine
    from calibrate.fit.step_fit import predict
    from sim.catalog.hardware import get_system
    from tests.helpers.costs import synthetic_costs

    systems = []
    monkeypatch.setattr(sim.engine.engine, "simulate", lambda workload, system, *args, **kwargs: systems.append(system))
    devices = get_system("cpu").total_devices
    predict(synthetic_costs(), RunSpec.of((2, 1), 2, "never", "gpipe", 8, replicas=devices))
    predict(synthetic_costs(), RunSpec.of((3,), 2, "never", "gpipe", 8))
    assert (systems[0].nodes, systems[0].devices_per_node) == (1, 2 * devices)
    assert systems[0].intra_link == systems[1].intra_link  # the fitted link, as for a run that fits
    assert systems[1].devices_per_node == devices


def test_predicted_memory_is_compared_on_replica_zero_stage_by_stage():
    from types import SimpleNamespace

    from calibrate.validate.comparison import replica_zero_peak_bytes

    def device(replica, stage, peak):
        return SimpleNamespace(replica=replica, stage=stage, peak_activation_bytes=peak)

    placed = [device(0, 0, 10), device(1, 0, 11), device(0, 1, 20), device(1, 1, 21)]  # replicas adjacent
    assert replica_zero_peak_bytes(SimpleNamespace(stages=placed)) == [10, 20]
    one = [SimpleNamespace(stage=k, peak_activation_bytes=5 * k) for k in range(3)]  # no replica field
    assert replica_zero_peak_bytes(SimpleNamespace(stages=one)) == [0, 5, 10]


def test_a_zero3_runs_sharded_bytes_are_compared_field_by_field_with_the_accumulated_gradients():
    """Each rank's sharded bytes, the unsharded gradients accumulated until the reduce-scatter among
    them, each held to the executor's count on its own: a prediction off in that field alone, or off
    in two fields by amounts that cancel in their sum, is a memory error."""
    from types import SimpleNamespace

    from calibrate.validate.comparison import sharded_bytes
    from sim.engine.fsdp import ShardedMemory

    spec = RunSpec.of((2, 2), 4, "never", "1f1b", 8, replicas=2, zero=3)
    counted = {"parameter_bytes": 100, "gradient_bytes": 100, "optimizer_state_bytes": 200,
               "gathered_parameter_bytes_peak": 400, "accumulated_gradient_bytes": 400}

    def judged(**predicted):
        devices = [SimpleNamespace(replica=d, stage=k, sharded=ShardedMemory(**{**counted, **predicted}))
                   for k in range(2) for d in range(2)]
        report = {"ranks": [{"replica": d, "stage": k, **counted} for d in range(2) for k in range(2)]}
        ours, theirs = sharded_bytes(SimpleNamespace(stages=devices), report, spec)
        assert len(ours) == len(theirs) == 4 and theirs[0] == counted
        comparison = Comparison("D=2 ZeRO-3 K=2", 1.0, 1.0, [1, 1], [1, 1], [1.0], [1.0], 2,
                                predicted_sharded_bytes=ours, measured_sharded_bytes=theirs)
        return summarize([comparison])["worst_memory_error"]

    assert judged() == 0.0
    assert judged(accumulated_gradient_bytes=0) == pytest.approx(1.0)  # predicted none of the 400 held
    assert judged(accumulated_gradient_bytes=500, gathered_parameter_bytes_peak=300) == pytest.approx(0.25)


def test_components_bubble_and_end_of_step_span_from_literal_spans():
    from sim.formats.timeline import Record

    from calibrate.fit.step_components import end_of_step_span_s
    from calibrate.validate.comparison import bubble

    assert bubble([0.6, 0.8], 1.0) == pytest.approx(0.3)  # 1 - mean busy / step
    records = [Record(0, "F", 0, 0.0, 1.0, step=3), Record(1, "B", 0, 2.0, 4.0, step=3),
               Record(1, "optimizer", -1, 4.0, 4.5, step=3), Record(0, "allreduce_dp", -1, 4.2, 5.0, step=3),
               Record(0, "F", 0, 10.0, 11.0, step=4)]
    assert end_of_step_span_s(records, 3) == pytest.approx(1.0)  # last backward ends at 4, the step at 5
    assert end_of_step_span_s(records, 4) == 0.0


def test_a_measured_steps_start_span_joins_its_end_of_step_span():
    """The measured step runs from the previous step's end to its own: the time before its first
    action counts with its end-of-step span (the simulator puts both at its one step's end), and a
    stage that begins a step before the last one ended shortens it."""
    from sim.formats.timeline import Record, Timeline

    from calibrate.fit.step_components import measured_end_span_s, start_of_step_span_s

    def step(n, begin):  # F on stage 0 for 2 s, B on stage 1 for 3 s, the optimizer 0.5 s
        return [Record(0, "F", 0, begin, begin + 2.0, step=n), Record(1, "B", 0, begin + 2.0, begin + 5.0, step=n),
                Record(1, "optimizer", -1, begin + 5.0, begin + 5.5, step=n)]

    gapped = step(0, 0.0) + step(1, 6.0) + step(2, 12.0)  # 0.5 s between one step's end and the next's start
    assert start_of_step_span_s(gapped, 0) == 0.0  # no previous step
    assert start_of_step_span_s(gapped, 1) == pytest.approx(0.5)
    report = {"timeline": Timeline(gapped).to_dict(), "measured_steps": [1, 2]}
    assert measured_end_span_s(report) == pytest.approx(0.5 + 0.5)  # optimizer 0.5 s + 0.5 s before the step
    waiting = gapped + [Record(1, "recv_wait", 0, 3.0, 8.0, step=1)]  # stage 1 waits from early on: no work
    assert start_of_step_span_s(waiting, 1) == pytest.approx(0.5)
    overlapped = step(0, 0.0) + step(1, 5.2) + step(2, 10.4)  # stage 0 starts 0.3 s before the optimizer ends
    assert start_of_step_span_s(overlapped, 2) == pytest.approx(-0.3)
    report = {"timeline": Timeline(overlapped).to_dict(), "measured_steps": [1, 2]}
    assert measured_end_span_s(report) == pytest.approx(0.5 - 0.3)


def test_replica_zeros_wait_for_the_slowest_replica_measured_and_simulated():
    from types import SimpleNamespace

    from sim.formats.timeline import Record

    from calibrate.fit.step_components import predicted_replica_waits_s, replica_waits

    def record(replica, step, start, end, kind="F"):
        return {"stage": 0, "kind": kind, "microbatch": 0, "start_s": start, "end_s": end, "step": step,
                **({"replica": replica} if replica else {})}

    # two measured steps (step 0 is warm-up); replica 1 computes 0.2 s longer in step 1, 0.1 s shorter in step 2
    records = [record(0, 0, 0.0, 9.0), record(1, 0, 0.0, 1.0),
               record(0, 1, 0.0, 0.4), record(0, 1, 0.4, 1.0, "B"), record(1, 1, 0.0, 1.2),
               record(0, 2, 0.0, 1.0), record(1, 2, 0.0, 0.9), record(0, 2, 1.0, 1.5, "allreduce_dp")]
    report = {"stages": [{}], "measured_steps": [1, 2], "timeline": {"records": records}}
    waits, spread = replica_waits(report, 2)
    assert waits == [pytest.approx(0.1)]  # (0.2 + 0) / 2: an all-reduce is not compute
    busy = [1.0, 1.2, 1.0, 0.9]
    mean = sum(busy) / 4
    assert spread == pytest.approx((sum((b - mean) ** 2 for b in busy) / 4) ** 0.5 / mean)
    assert replica_waits(report, 1) == ([0.0], 0.0)
    # simulated: replica 0's last backward ends at 2.0, its all-reduce starts at 2.3 (replica 1's own is not read)
    simulated = SimpleNamespace(timeline=SimpleNamespace(records=[
        Record(0, "F", 0, 0.0, 1.0), Record(0, "B", 0, 1.0, 2.0), Record(0, "recv_wait", -1, 2.0, 2.3),
        Record(0, "allreduce_dp", -1, 2.3, 2.5), Record(0, "B", 0, 1.0, 2.3, replica=1),
        Record(0, "allreduce_dp", -1, 2.3, 2.5, replica=1)]))
    assert predicted_replica_waits_s(simulated, 1) == [pytest.approx(0.3)]
    assert predicted_replica_waits_s(SimpleNamespace(timeline=SimpleNamespace(records=[])), 2) == [0.0, 0.0]

    two = Comparison("D=2 K=1 M=3", 0.8, 1.0, [1], [1], [1.0], [1.0], 2, predicted_busy_s=[0.7],
                     measured_busy_s=[0.8], measured_replica_wait_s=[0.05], predicted_replica_wait_s=[0.04],
                     replica_busy_spread=0.1)
    assert two.replica_wait_points == (pytest.approx(5.0), pytest.approx(5.0))  # 0.04 s of 0.8, 0.05 s of 1.0
    table = format_table({"runs": [two.to_dict()], "summary": summarize([two])})
    assert "D=2 K=1 M=3: 40.0/50.0 ms (5.0/5.0 points; spread 10.0%)" in table
    one = Comparison("K=1 M=3", 0.9, 1.0, [1], [1], [1.0], [1.0])
    assert one.replica_wait_points == (0.0, 0.0)
    assert "replicas (D > 1)" not in format_table({"runs": [one.to_dict()], "summary": summarize([one])})


def test_the_gap_between_actions_is_device_time_outside_every_span_where_the_input_was_there():
    """Between two actions of a device: from the end of the first or its send to the second's start,
    where no wait for its input came between (the chores done while it was away are time the model
    spends waiting); other replicas, tensor-parallel ranks and steps not asked for are left out."""
    from sim.formats.timeline import Record

    from calibrate.fit.step_components import action_gaps_s

    records = [Record(0, "F", 0, 0.0, 1.0, step=3), Record(0, "send_act", 0, 1.0, 1.25, step=3),
               Record(0, "F", 1, 1.5, 2.5, step=3),  # 0.25 after the send
               Record(0, "recv_wait", 1, 2.75, 4.0, step=3), Record(0, "B", 1, 4.5, 6.0, step=3),  # 0.25 + 0.5
               Record(1, "F", 0, 1.0, 2.0, step=3), Record(1, "B", 0, 2.0, 3.0, step=3),  # none
               Record(1, "F", 0, 5.0, 6.0, step=3, replica=1), Record(1, "B", 0, 9.0, 9.5, step=3, replica=1),
               Record(1, "F", 0, 5.0, 6.0, step=3, tp=1), Record(1, "B", 0, 9.0, 9.5, step=3, tp=1),
               Record(0, "F", 0, 10.0, 11.0, step=4), Record(0, "B", 0, 19.0, 20.0, step=4)]
    gaps = action_gaps_s(records, [3])
    assert gaps.keys() == {(0, 3), (1, 3)} and gaps[(1, 3)] == [("F", 0.0)]
    assert gaps[(0, 3)] == [("F", pytest.approx(0.25))]  # keyed by the action it follows; B waited: none
    assert action_gaps_s(records, [4]) == {(0, 4): [("F", pytest.approx(8.0))]}
    # a zero-length wait span is no wait: the input was there
    records.insert(2, Record(0, "recv_wait", 1, 1.375, 1.375, step=3))
    assert action_gaps_s(records, [3])[(0, 3)] == [("F", pytest.approx(0.25))]


def test_split_runs_fit_the_split_stages_in_pipeline_factor():
    """Per kind, the ratio of a split run's measured actions (less K's per-action overhead, at the
    reference speed) to the split profile's times; the whole-stage runs leave it alone."""
    from calibrate.fit.design_fit import fit_tensor_parallel
    from tests.helpers.costs import synthetic_costs, with_split_profile

    data = with_split_profile(synthetic_costs())
    spec = RunSpec.of((3,), 2, "except_last", "gpipe", 4, 1, 2)
    profile = data["tensor_parallel_profile"]["2"]["times_s"]["1"]

    def profiled(kind, rows):  # the three layers' times at ``rows`` (affine in the rows measured)
        return sum(table[0] + (table[1] - table[0]) * (rows - 1) for table in profile[kind])

    factors = {"F": 1.2, "R": 0.9, "B": 1.5}
    # micro-batch 0 forwards without its graph (F), micro-batch 1, the last, keeps it (R's time)
    actions = [{"stage": 0, "kind": kind, "microbatch": m, "rows": 2,
                "duration_s": 2.0 * (factors[kind] * profiled(kind if (kind, m) != ("F", 1) else "R", 2) + 1e-4)}
               for kind, m in [("F", 0), ("F", 1), ("R", 0), ("B", 0), ("B", 1)]]
    whole = RunSpec.of((3,), 2, "never", "gpipe", 4)
    fitted = fit_tensor_parallel(data, [whole, spec], [{"actions": []}, {"actions": actions}], [1.0, 2.0])
    assert fitted.keys() == {"2"}
    assert fitted["2"]["R"] == pytest.approx(0.9) and fitted["2"]["B"] == pytest.approx(1.5)
    # F: micro-batch 0 at 1.2 x F's time, micro-batch 1 at 1.2 x R's (the same table here)
    assert fitted["2"]["F"] == pytest.approx(1.2)
    assert "optimizer" not in fitted["2"]  # reports without a timeline: nothing to fit it on


def test_a_split_stages_optimizer_step_is_scaled_by_the_factor_its_runs_measured():
    """The optimizer spans of a split run's rank 0 (its measured steps, at the reference speed)
    against K's optimizer line on the shard's bytes: a ratio through the origin, which prices
    the split stage's optimizer step; whole stages keep K's line."""
    from calibrate.fit.design_fit import fit_tensor_parallel
    from sim.formats.costs import MeasuredWorkload
    from sim.catalog.hardware import LOCAL_CPU
    from tests.helpers.costs import synthetic_costs, with_split_profile

    data = with_split_profile(synthetic_costs())
    spec = RunSpec.of((3,), 2, "except_last", "gpipe", 4, 1, 2)
    split = MeasuredWorkload(data, 1, tensor_parallel=2)
    shard = sum(int(layer["param_bytes"]) for layer in split.memory)
    predicted = MeasuredWorkload(data, 1).fit.optimizer(shard)
    records = [{"stage": 0, "kind": "optimizer", "microbatch": -1, "step": step, "start_s": 0.0,
                "end_s": 2.0 * 3.0 * predicted / 2} for step in (1, 2) for _ in range(2)]  # two spans a step
    records.append({"stage": 0, "kind": "optimizer", "microbatch": -1, "step": 1, "tp": 1, "start_s": 0.0,
                    "end_s": 1.0})  # another rank's: not counted
    report = {"actions": [], "measured_steps": [1, 2], "timeline": {"records": records}}
    assert fit_tensor_parallel(data, [spec], [report], [2.0]) == {"2": {"optimizer": pytest.approx(3.0)}}
    data["tensor_parallel_fit"] = {"2": {"F": 1.0, "R": 1.0, "B": 1.0, "optimizer": 3.0}}
    cost = MeasuredWorkload(data, 1, tensor_parallel=2).stage_cost(2, 0, 3, LOCAL_CPU)
    assert cost.optimizer_s == pytest.approx(3.0 * predicted)
    whole = MeasuredWorkload(data, 1).stage_cost(2, 0, 3, LOCAL_CPU)
    assert whole.optimizer_s == pytest.approx(MeasuredWorkload(data, 1).fit.optimizer(
        sum(int(layer["param_bytes"]) for layer in data["profile"]["memory"])))


def test_busy_time_at_the_reference_speed_takes_the_rounds_drift_out():
    """Two rounds that computed 10% and 30% slow than the calibration's pace: the busy error at the
    reference speed compares the prediction with each round's busy time divided by its speed."""
    from calibrate.validate.comparison import Comparison

    comparison = Comparison("K=1 M=2 [4] never gpipe", 0.10, 0.12, [1], [1], [0.11, 0.13], [1.1, 1.3],
                            predicted_busy_s=[0.10], measured_busy_s=[0.12], busy_rounds_at_reference_s=[[0.10, 0.10]])
    assert comparison.busy_errors == [pytest.approx(-1 / 6)]
    assert comparison.busy_errors_at_reference == [pytest.approx(0.0)]


def test_the_busy_errors_noise_stands_beside_them_in_the_table():
    """Each run's widest stage's interquartile range of its rounds' busy time over their median, and
    the summary's median of it, beside the busy errors: how much of an error one round's noise is."""
    from calibrate.validate.intervals import relative_spread
    from calibrate.validate.summary import summarize
    from calibrate.validate.table import format_table

    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0 / 3.0)
    assert relative_spread([1.0]) == 0.0
    run = _comparison("K=2 M=2 [2,2] never gpipe", 1.0, 1.0)
    run.busy_rounds_at_reference_s = [[1.0, 1.0, 1.0], [0.9, 1.0, 1.1, 1.2, 1.3]]  # the second's: 0.2 / 1.1
    summary = summarize([run])
    assert run.busy_round_spread == pytest.approx(0.2 / 1.1)
    assert summary["median_busy_round_spread"] == pytest.approx(0.2 / 1.1)
    table = format_table({"runs": [run.to_dict()], "summary": summary}, verbose=True)
    assert "  18.2% " in table.splitlines()[2] and "rounds spread a stage's busy time by 18.2%" in table


def test_each_kind_of_action_is_compared_at_the_reference_speed():
    """Per kind and stage, a step's predicted actions against the sum of the report's per-action
    medians, each round divided by its speed, the median over rounds; the table's summary gives the
    median signed error per kind."""
    from types import SimpleNamespace

    from sim.formats.timeline import Record

    from calibrate.validate.comparison import measured_kind_s, predicted_kind_s
    from calibrate.validate.summary import summarize
    from calibrate.validate.table import format_table

    def report(f0, b1):
        return {"actions": [{"stage": 0, "kind": "F", "microbatch": m, "rows": 2, "duration_s": f0} for m in (0, 1)]
                + [{"stage": 1, "kind": "B", "microbatch": 0, "rows": 2, "duration_s": b1}]}

    measured = measured_kind_s([report(0.011, 0.022), report(0.013, 0.026)], [1.1, 1.3], 2)
    assert measured == {"F": [pytest.approx(0.02), 0.0], "B": [0.0, pytest.approx(0.02)]}
    timeline = SimpleNamespace(records=[Record(0, "F", 0, 0.0, 0.009), Record(0, "F", 1, 0.01, 0.019),
                                        Record(1, "B", 0, 0.02, 0.045), Record(1, "B", 0, 0.02, 0.045, replica=1),
                                        Record(0, "send_act", 0, 0.009, 0.01)])
    predicted = predicted_kind_s(SimpleNamespace(timeline=timeline), 2)
    assert predicted == {"F": [pytest.approx(0.018), 0.0], "B": [0.0, pytest.approx(0.025)]}
    run = _comparison("K=2 M=2 [2,2] never gpipe", 1.0, 1.0)
    run.predicted_kind_s, run.measured_kind_at_reference_s = predicted, measured
    assert run.kind_errors_at_reference == {"F": [pytest.approx(-0.1), None], "B": [None, pytest.approx(0.25)]}
    summary = summarize([run])
    assert summary["median_kind_error_at_reference"] == {"F": pytest.approx(-0.1), "B": pytest.approx(0.25)}
    assert "B +25.0%, F -10.0%" in format_table({"runs": [run.to_dict()], "summary": summary})


def test_a_runs_gaps_per_kind_are_the_medians_calibration_fits_on():
    from sim.formats.timeline import Record, Timeline

    from calibrate.report.run_report import gap_rows
    from calibrate.fit.step_components import measured_gap_medians_s

    records = []
    for step, after_f, after_b in ((1, 0.125, 0.25), (2, 0.375, 0.75)):
        records += [Record(0, "F", 0, 0.0, 1.0, step=step), Record(0, "F", 1, 1.0 + after_f, 2.0, step=step),
                    Record(0, "B", 1, 2.5, 3.0, step=step), Record(0, "B", 0, 3.0 + after_b, 4.0, step=step)]
    records += [Record(1, "F", 0, 0.0, 1.0, step=1), Record(1, "B", 0, 9.0, 10.0, step=1)]  # another stage
    report = {"timeline": Timeline(records=records).to_dict(), "measured_steps": [1, 2]}
    # after F: 0.125 and 0.5 in step 1, 0.375 and 0.5 in step 2; after B: 0.25 and 0.75
    assert measured_gap_medians_s(report, 0) == {"B": 0.5, "F": 0.4375}
    rows = gap_rows(report, {"F": 0.21875, "B": 0.5})
    assert [row[0].split(" (")[0] for row in rows] == ["stage 0 between actions, after backward",
                                                       "stage 0 between actions, after forward"]
    assert [row[1:] for row in rows] == [("500000 us", "500000 us", "+0.0%"), ("218750 us", "437500 us", "-50.0%")]


def test_each_error_stands_beside_the_interval_its_own_rounds_allow():
    """The measured median's distribution-free interval (with 15 rounds the 4th and 12th, 96.5%
    coverage) turned into an interval of the error; the summary counts the runs whose interval does
    not reach zero and gives the worst run's, and the table prints both beside the errors."""
    from calibrate.validate.comparison import Comparison
    from calibrate.validate.intervals import median_interval
    from calibrate.validate.summary import summarize
    from calibrate.validate.table import format_table

    assert median_interval([float(v) for v in range(15, 0, -1)]) == (4.0, 12.0)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few rounds for 90%: the whole range
    rounds = [0.90 + 0.01 * i for i in range(15)]  # median 0.97, interval 0.93 .. 1.01
    near = Comparison("K=1 M=2", 1.0, 0.97, [1], [1], rounds, [1.0] * 15, predicted_busy_s=[0.5],
                      measured_busy_s=[0.5],
                      busy_rounds_at_reference_s=[[0.4 + 0.01 * i for i in range(15)]])
    far = Comparison("K=2 M=4", 0.8, 0.97, [1], [1], rounds, [1.0] * 15)
    low, high = near.step_error_interval_at_reference
    assert (low, high) == (pytest.approx(1.0 / 1.01 - 1.0), pytest.approx(1.0 / 0.93 - 1.0))
    assert near.busy_error_intervals_at_reference == [(pytest.approx(0.5 / 0.51 - 1.0), pytest.approx(0.5 / 0.43 - 1.0))]
    # each round's bubble 1 - busy / step; the 4th and 12th of 15; predicted 1 - 0.5 / 1.0
    bubbles = sorted(1 - (0.4 + 0.01 * i) / (0.90 + 0.01 * i) for i in range(15))
    assert near.bubble_error_interval_points == (pytest.approx((0.5 - bubbles[11]) * 100),
                                                 pytest.approx((0.5 - bubbles[3]) * 100))
    assert far.bubble_error_interval_points == (0.0, 0.0)  # no rounds of busy time
    summary = summarize([near, far])
    assert summary["runs_with_step_error_beyond_noise"] == 1  # far: -21% .. -14%, nowhere near zero
    # near's bubble: predicted 50%, its rounds' median interval 49.5..53.8%: zero within reach; a run
    # predicted as busy for 0.2 s (80% idle) is beyond it
    idle = Comparison("K=2 M=8", 1.0, 0.97, [1], [1], rounds, [1.0] * 15, predicted_busy_s=[0.2],
                      measured_busy_s=[0.5], busy_rounds_at_reference_s=near.busy_rounds_at_reference_s)
    assert summary["runs_with_bubble_error_beyond_noise"] == 0
    assert summarize([near, idle])["runs_with_bubble_error_beyond_noise"] == 1
    assert summary["worst_step_error_interval_at_reference"] == [pytest.approx(0.8 / 1.01 - 1.0),
                                                                  pytest.approx(0.8 / 0.93 - 1.0)]
    assert summary["median_step_error_half_width_at_reference"] == pytest.approx((1.0 / 0.93 - 1.0 / 1.01) / 2 * 0.9)
    table = format_table({"runs": [near.to_dict(), far.to_dict()], "summary": summary}, verbose=True)
    assert "-1..+8%" in table.splitlines()[2] and "-21..-14%" in table.splitlines()[3]
    assert "1 of 2 runs' step errors beyond" in table and "the worst run's in -21..-14%" in table
    assert "0 of 2 runs' bubble errors beyond their interval's reach of zero" in table


def test_the_half_calibrations_errors_stand_beside_the_whole_fits():
    """A run predicted at 0.9 and 1.1 s by the fits on the odd and the even design rounds, measured at
    1.0 s: its error by the halves is -10..+10%, 20 points apart, in the table and the summary."""
    from calibrate.validate.comparison import Comparison
    from calibrate.validate.summary import summarize
    from calibrate.validate.table import format_table

    run = Comparison("K=2 M=4", 1.0, 1.0, [1], [1], [1.0], [1.0], predicted_step_halves_s=[1.1, 0.9])
    without = Comparison("K=2 M=5", 1.0, 1.0, [1], [1], [1.0], [1.0])
    assert run.step_error_halves_at_reference == (pytest.approx(-0.1), pytest.approx(0.1))
    assert without.step_error_halves_at_reference is None
    summary = summarize([run, without])
    assert summary["median_halves_apart"] == summary["worst_halves_apart"] == pytest.approx(0.2)
    table = format_table({"runs": [run.to_dict(), without.to_dict()], "summary": summary}, verbose=True)
    assert "-10..+10%" in table.splitlines()[2] and "20.0 points apart (median)" in table
    assert "the calibration's own noise" not in format_table({"runs": [without.to_dict()],
                                                              "summary": summarize([without])}, verbose=True)


def test_a_costs_file_with_malformed_halves_is_refused_before_any_run():
    from calibrate.validate.held_out import check_fit_halves, validate
    from sim.errors import GpipeInputError

    check_fit_halves({})  # a quick calibration's file has none
    check_fit_halves({"fit_halves": [{"pipeline": {}}, {"pipeline": {}}]})
    for bad in ([{"pipeline": {}}], "halves", [{"pipeline": {}}, {"tensor_parallel_fit": {}}]):
        with pytest.raises(GpipeInputError, match="fit_halves"):
            check_fit_halves({"fit_halves": bad})
    with pytest.raises(GpipeInputError, match="calibrate --force"):
        validate({"fit_halves": "halves"}, progress=lambda message: pytest.fail("a run started"))


def test_other_calibrations_judge_the_same_run_beside_the_first():
    """One run measured once, judged by three calibrations at -10%, +6% and +2%: the range -10..+6%,
    16 points apart, the median +2%; per stage the median of the busy errors; the table's calibs column
    and summary line show them."""
    from calibrate.noise import across_calibrations

    def judged(step, busy, bubble, run="K=2 M=4"):
        return {"run": run, "step_error_at_reference": step, "busy_errors_at_reference": busy,
                "bubble_error_points": bubble, "predicted_step_s": 1.0 + step,
                "step_error_interval_at_reference": [step - 0.03, step + 0.03],
                "busy_error_intervals_at_reference": [[e - 0.03, e + 0.03] for e in busy],
                "bubble_error_interval_points": [bubble - 1.0, bubble + 1.0]}

    entry = across_calibrations.run_entry([judged(-0.10, [-0.2, 0.1], 3.0), judged(0.06, [0.0, 0.3], -1.0),
                                           judged(0.02, [0.05, -0.1], 0.5)])
    assert not entry["beyond_noise"]  # -13..-7% by one calibration, +3..+9% by another
    assert entry["step_error_range_at_reference"] == [-0.10, 0.06]
    assert entry["median"] == {"step_error_at_reference": 0.02, "busy_errors_at_reference": [0.0, 0.1],
                               "bubble_error_points": 0.5,
                               # results without after-wait probes: the busy errors at the reference speed
                               "busy_errors_at_probed_warm_up": [0.0, 0.1]}
    assert entry["predicted_steps_s"] == [0.9, 1.06, 1.02]
    other = across_calibrations.run_entry([judged(0.04, [0.04], 1.0), judged(-0.04, [-0.08], -2.0)])
    low = across_calibrations.run_entry([judged(-0.08, [0.0], 0.0, "K=1 M=4"), judged(-0.2, [0.0], 0.0, "K=1 M=4")])
    assert low["beyond_noise"] and low["step_error_intervals_at_reference"][0] == [-0.11, -0.05]
    assert across_calibrations.summary([entry, other, low])["runs_beyond_noise_by_every_calibration"] == ["K=1 M=4"]
    # stage 0: -23..-17%, -3..+3%, +2..+8%; stage 1: +7..+13%, +27..+33%, -13..-7%: neither beyond
    assert entry["busy_beyond_noise"] == [False, False]
    apart = across_calibrations.run_entry([judged(0.0, [0.1, 0.0], 0.0), judged(0.0, [0.2, 0.01], 0.0)])
    assert apart["busy_beyond_noise"] == [True, False]
    assert across_calibrations.summary([apart])["stages_beyond_noise_by_every_calibration"] == [
        ["K=2 M=4", 0, pytest.approx(0.15)]]
    # bubble: 2..4, -2..0, -0.5..+1.5 points: not beyond; 5..7 and 1.5..3.5: beyond, median +4.25
    assert not entry["bubble_beyond_noise"] and not low["bubble_beyond_noise"]
    high = across_calibrations.run_entry([judged(0.0, [0.0], 6.0, "K=2 M=12"), judged(0.0, [0.0], 2.5, "K=2 M=12")])
    assert across_calibrations.summary([entry, high])["bubbles_beyond_noise_by_every_calibration"] == [
        ["K=2 M=12", pytest.approx(4.25)]]
    summary = across_calibrations.summary([entry, other])
    assert summary["median_calibrations_apart"] == pytest.approx((0.16 + 0.08) / 2)
    assert summary["worst_calibrations_apart"] == pytest.approx(0.16)
    over = summary["median_over_calibrations"]
    assert over["worst_step_error_at_reference"] == pytest.approx(0.02)  # other's median is 0.0
    assert over["worst_busy_error_at_reference"] == pytest.approx(0.1)
    assert over["worst_bubble_error_points"] == pytest.approx(0.5)
    assert summary["calibrations"] == 3

    run = Comparison("K=2 M=4", 1.0, 1.0, [1], [1], [1.0], [1.0]).to_dict()
    run["calibrations"] = entry
    result = {"runs": [run], "summary": {**summarize([Comparison("K=2 M=4", 1.0, 1.0, [1], [1], [1.0], [1.0])]),
                                         "across_calibrations": summary}}
    table = format_table(result, verbose=True)
    assert "-10..+6%" in table.splitlines()[2] and "calibs" in table.splitlines()[0]
    assert "each of 3 costs files" in table and "12.0 points apart (median), 16.0 at worst" in table
    assert "0 of 1 runs' step errors beyond their interval's reach of zero, on the same side, by every" in table
    assert "0 stages' busy errors beyond their interval's reach of zero by every calibration" in table
    assert "0 runs' bubble errors beyond their interval's reach of zero by every calibration" in table
    assert "by every calibration (neither the machine's round-to-round noise nor the moment of calibration" in table
    # stage 1 of K=2 M=4 misses 5% by all three (+7..+13%, +27..+33%, -13..-7%), if not on one side
    assert "busy 1 of 3 stages; K=2 M=4 stage 1 +10.0%; step 0 of 1 runs; bubble 0 of 1 runs" in table


def test_an_error_past_its_goal_by_one_calibration_only_is_the_moment_of_calibrations():
    """Past the goals by every calibration: a step -12% by one calibration (interval -15..-9%, reaching
    inside 10%) is not, -14% and -18% with both intervals beyond -10% is; a stage +8% and +6.5%
    (intervals +7..+11 and +5.5..+9.5) is, +8% and +3% is not; a bubble of 4 and 5 points (both
    intervals beyond 3) is, 1 and 4 is not."""
    from calibrate.noise import across_calibrations

    def judged(step, busy, bubble, run, width=0.03):
        return {"run": run, "step_error_at_reference": step, "busy_errors_at_reference": busy,
                "bubble_error_points": bubble, "predicted_step_s": 1.0 + step,
                "step_error_interval_at_reference": [step - width, step + width],
                "busy_error_intervals_at_reference": [[e - width / 3, e + width] for e in busy],
                "bubble_error_interval_points": [bubble - 0.5, bubble + 0.5]}

    near = across_calibrations.run_entry([judged(-0.12, [0.08, 0.08], 1.0, "K=2 M=4"),
                                          judged(-0.14, [0.03, 0.065], 4.0, "K=2 M=4")])
    far = across_calibrations.run_entry([judged(-0.14, [0.08], 4.0, "K=1 M=5", 0.02),
                                         judged(-0.18, [0.06], 5.0, "K=1 M=5", 0.01)])
    assert near["past_goals"] == {"step": False, "busy": [False, True], "busy_at_probed_warm_up": [False, True],
                                  "bubble": False}
    goals = across_calibrations.summary([near, far])["past_goals_by_every_calibration"]
    assert goals["stages"] == 3
    assert goals["busy"] == [["K=2 M=4", 1, pytest.approx(0.0725)], ["K=1 M=5", 0, pytest.approx(0.07)]]
    assert goals["step"] == [["K=1 M=5", pytest.approx(-0.16)]]
    assert goals["bubble"] == [["K=1 M=5", pytest.approx(4.5)]]
    # a result saved before the goals were judged across calibrations counts as within them
    old = {key: value for key, value in far.items() if key != "past_goals"}
    assert across_calibrations.past_goals([old]) == {"stages": 1, "busy": [], "busy_at_probed_warm_up": [],
                                                     "step": [], "bubble": []}


def test_other_calibrations_must_be_of_the_same_model_and_process_counts(tmp_path, capsys):
    """Refused in one line, before any run: another model, batch or fitted K, or one file named twice."""
    from calibrate.noise.across_calibrations import check_same_calibration
    from calibrate.measure.machine import machine_stamp
    from sim.formats.costs import write_costs
    from sim.errors import GpipeInputError
    from tests.helpers.costs import synthetic_costs

    first = synthetic_costs()
    check_same_calibration(first, synthetic_costs(), "b.json")
    for change, message in (({"batch_size": 16}, "another batch size"), ({"model": {"name": "x"}}, "another model"),
                            ({"pipeline": {"1": first["pipeline"]["1"]}}, "fitted K in")):
        with pytest.raises(GpipeInputError, match=message):
            check_same_calibration(first, {**synthetic_costs(), **change}, "b.json")
    paths = []
    for name, change in (("a.json", {}), ("b.json", {"batch_size": 16})):
        paths.append(str(tmp_path / name))
        write_costs({**synthetic_costs(), "machine": machine_stamp("cpu"), **change}, paths[-1])
    assert main(["validate", "--costs", paths[0], paths[1]]) == 2
    err = capsys.readouterr().err
    assert "b.json" in err and "another batch size" in err and len(err.strip().splitlines()) == 1
    assert main(["validate", "--costs", paths[0], paths[0]]) == 2
    assert "names a file twice" in capsys.readouterr().err


def test_the_measured_bubble_is_the_median_rounds_not_the_bubble_of_medians_from_different_rounds():
    """Per round 1 - 0.4/0.9, 1 - 0.5/0.5 and 1 - 0.6/0.7: the median round's bubble 14.3%, inside the
    interval the rounds give, where the median busy time over the median step (28.6%) is no round's."""
    run = Comparison("D=2 K=1 M=3", 0.7, 0.7, [1], [1], [0.9, 0.5, 0.7], [1.0] * 3, 2, predicted_busy_s=[0.5],
                     measured_busy_s=[0.5], busy_rounds_at_reference_s=[[0.4, 0.5, 0.6]])
    assert run.measured_bubble == pytest.approx(1 - 0.6 / 0.7)
    low, high = run.bubble_error_interval_points
    assert low <= run.bubble_error_points <= high
    without_rounds = Comparison("D=2 K=1 M=3", 0.7, 0.7, [1], [1], [0.7], [1.0], 2, predicted_busy_s=[0.5],
                                measured_busy_s=[0.5])
    assert without_rounds.measured_bubble == pytest.approx(1 - 0.5 / 0.7)


def test_errors_past_their_goal_beyond_their_own_rounds_noise_are_named():
    from calibrate.validate.summary import beyond_goals

    # the step 1.18-1.22 s, predicted 1.0 (-16.7% at the median); busy 1.12-1.16 s, predicted 0.96 (-15.8%);
    # each round's bubble 4.4-5.1% against 4% predicted
    rounds = [1.18 + 0.01 * i for i in range(5)]
    slow = Comparison("K=1 M=2", 1.0, 1.2, [1], [1], rounds, [1.0] * 5, predicted_busy_s=[0.96],
                      measured_busy_s=[1.14], busy_rounds_at_reference_s=[[1.12 + 0.01 * i for i in range(5)]])
    goals = beyond_goals([slow])
    assert [run for run, *_ in goals["step"]] == ["K=1 M=2"] and goals["step"][0][1] == pytest.approx(-1 / 6)
    assert [(run, stage) for run, stage, *_ in goals["busy"]] == [("K=1 M=2", 0)] and goals["stages"] == 1
    assert goals["bubble"] == [] and "busy_at_probed_warm_up" not in goals  # within 3 points; no probes taken
    # -11.5% at the median round, past the goal, but its rounds (1.05-1.30 s) put it anywhere in -23..-5%
    noisy = Comparison("K=1 M=3", 1.0, 1.13, [1], [1], [1.05, 1.13, 1.30], [1.0] * 3)
    assert noisy.step_error_at_reference == pytest.approx(1 / 1.13 - 1) and beyond_goals([noisy])["step"] == []
