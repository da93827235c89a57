"""Calibration and validation with D data-parallel replicas: predictions price the measured
all-reduce, and the held-out D = 2 runs are measured and predicted end to end."""

from __future__ import annotations

import json

import pytest

from calibrate.fit.design import RunSpec
from calibrate.fit.step_fit import predict
from sim.catalog.hardware import Link
from tests.helpers.costs import synthetic_costs


def test_predict_passes_replicas_and_the_measured_allreduce_link_to_the_simulator(monkeypatch):
    import sim.engine.engine

    calls = []
    monkeypatch.setattr(sim.engine.engine, "simulate", lambda *args, **kwargs: calls.append((args[4], kwargs)))
    data = synthetic_costs()
    predict(data, RunSpec.of((3,), 2, "never", "gpipe", 8, replicas=2))
    predict(data, RunSpec.of((3,), 2, "never", "gpipe", 8))
    layout, kwargs = calls[0]
    assert (layout.replicas, layout.virtual_stages) == (2, 1)
    assert kwargs == {"allreduce_link": Link("fitted gloo all-reduce", 5e8, 2e-5)}
    layout, kwargs = calls[1]
    assert (layout.replicas, layout.virtual_stages) == (1, 1)
    assert kwargs == {"allreduce_link": None}  # one replica: nothing to average


def test_a_run_with_more_processes_than_cores_is_predicted_as_if_each_had_a_core(monkeypatch):
    """D x K above the cores: the cores' sharing is a CPU host's effect the simulator does not model
    (sim.engine.host; validation leaves such runs out of its summary), so each of D + 1 one-stage
    replicas on D cores is predicted as busy as one of D replicas that fit, each on a core of its own."""
    import sim.engine.engine
    from sim.catalog.hardware import get_system

    cores = get_system("cpu").total_devices
    data = synthetic_costs()
    crowded = RunSpec.of((3,), 1, "never", "gpipe", 8 * (cores + 1), replicas=cores + 1)
    fitting = RunSpec.of((3,), 1, "never", "gpipe", 8 * cores, replicas=cores)
    shared, alone = predict(data, crowded), predict(data, fitting)
    assert len(shared.stages) == cores + 1
    assert [s.busy_s for s in shared.stages] == [alone.stages[0].busy_s] * (cores + 1)
    calls = []
    real = sim.engine.engine.simulate
    monkeypatch.setattr(sim.engine.engine, "simulate", lambda *args, **kwargs: calls.append((args, kwargs))
                        or real(*args, **kwargs))
    predict(data, crowded)
    assert calls[0][0][4].replicas == cores + 1 and calls[0][0][4].virtual_stages == 1
    assert calls[0][0][1].total_devices == cores + 1  # the system made room for every process


def _ring_s(nbytes: int, parties: int, latency_s: float, bandwidth: float) -> float:
    return 2 * (parties - 1) / parties * nbytes / bandwidth + 2 * (parties - 1) * latency_s


def test_a_slower_measured_allreduce_lengthens_a_one_stage_step_by_the_ring_model():
    """K = 1: the all-reduce of the whole model's gradients sits between the last backward and the
    optimizer step, with nothing to hide behind."""
    fast, slow = synthetic_costs(), synthetic_costs()
    slow["allreduce"] = {**slow["allreduce"], "latency_s": 1e-3, "bandwidth_bytes_per_s": 1e6}
    spec = RunSpec.of((3,), 2, "never", "gpipe", 8, replicas=2)
    grad_bytes = sum(layer["param_bytes"] for layer in fast["profile"]["memory"])
    extra_s = _ring_s(grad_bytes, 2, 1e-3, 1e6) - _ring_s(grad_bytes, 2, 2e-5, 5e8)
    assert predict(slow, spec).step_time_s - predict(fast, spec).step_time_s == pytest.approx(extra_s, rel=1e-6)


@pytest.mark.slow
def test_validation_measures_and_predicts_two_replicas_and_a_v(tiny_quick_costs):
    """The held-out D = 2 runs (whole replicas, then ZeRO-3) and the ZB-V run (two chunks per rank, the
    backward split) measured and predicted, peak activation memory exact, and under ZeRO-3 each rank's
    sharded bytes exact."""
    from calibrate.fit.design import run_config
    from calibrate.measure.runs import run_configs
    from calibrate.validate.comparison import compare
    from calibrate.validate.held_out_design import machine_processes, validation_design
    from calibrate.validate.summary import summarize
    from calibrate.validate.table import format_table
    costs, _ = tiny_quick_costs
    with open(costs) as handle:
        data = json.load(handle)
    held_out = validation_design(data["model"]["num_layers"], data["batch_size"])
    specs = [s for s in held_out if s.layout.replicas > 1] + [s for s in held_out if s.layout.schedule == "zbv"]
    assert [(s.layout.replicas, s.stages, s.layout.virtual_stages, s.layout.zero) for s in specs] == [
        (2, 1, 1, 0), (2, 2, 1, 0), (2, 1, 1, 3), (2, 2, 1, 3), (1, 2, 2, 0)]
    # a quick calibration leaves I and W out: the split is priced by the analytic rule, memory is exact anyway
    assert all("W" not in kinds for kinds in data["profile"]["times_s"].values())
    model = data["model"]
    reports = run_configs([run_config(model["name"], model["options"], s, 3) for s in specs])
    comparisons = [compare(data, s, [r], machine_processes("cpu")) for s, r in zip(specs, reports)]
    for spec, report, comparison in zip(specs, reports, comparisons):
        assert len(report["speed_probe_s"]) == len(report["after_wait_probe_s"]) == spec.processes  # every rank probed
        assert len(report["stages"]) == spec.stages  # replica 0's stages
        assert comparison.measured_step_s > 0 and comparison.predicted_step_s > 0
        if spec.layout.zero:  # each rank's shards and gathered units, as the simulator prices them
            assert len(comparison.measured_sharded_bytes) == spec.processes
            assert comparison.measured_sharded_bytes == comparison.predicted_sharded_bytes
            # activations are not compared under FSDP2: the counter takes the gathered weights a layer saves
            # for its backward, whose storage FSDP frees after the forward, for activations (executor.runtime.memory)
        else:
            assert comparison.measured_peak_bytes == comparison.predicted_peak_bytes  # exact, as for D = 1
    assert comparisons[1].oversubscribed == (4 > machine_processes("cpu"))
    for comparison in comparisons[:2]:  # replica 0's wait for the other, from both replicas' timelines
        assert len(comparison.measured_replica_wait_s) == len(comparison.predicted_replica_wait_s) \
            == len(comparison.measured_busy_s)
        assert all(wait >= 0.0 for wait in comparison.measured_replica_wait_s) and comparison.replica_busy_spread > 0
    assert comparisons[4].measured_replica_wait_s == [] and comparisons[4].replica_wait_points == (0.0, 0.0)
    table = format_table({"runs": [c.to_dict() for c in comparisons], "summary": summarize(comparisons)})
    assert all(line.lstrip().startswith("2") for line in table.splitlines()[2:6])
    assert "V=2" in table.splitlines()[6]
    assert "replicas (D > 1): replica 0's wait" in table


def test_simulate_and_plan_price_replicas_on_the_costs_files_allreduce(tmp_path, capsys):
    """The composition root hands the calibrated all-reduce to the simulator: a slower measured
    all-reduce lengthens `gpipe simulate --replicas 2` by the ring model, and `gpipe plan` ranks
    with it."""
    from gpipe.main import main
    from sim.formats.costs import write_costs

    paths = {}
    for name, latency_s, bandwidth in (("fast", 2e-5, 5e8), ("slow", 1e-3, 1e6)):
        data = synthetic_costs()
        data["allreduce"] = {**data["allreduce"], "latency_s": latency_s, "bandwidth_bytes_per_s": bandwidth}
        paths[name] = str(tmp_path / f"{name}.json")
        write_costs(data, paths[name])
    steps = {}
    for name, path in paths.items():
        assert main(["simulate", "--costs", path, "--hardware", "cpu", "-K", "1", "-M", "2", "--replicas", "2",
                     "--json"]) == 0
        steps[name] = json.loads(capsys.readouterr().out)["step_time_s"]
    grad_bytes = sum(layer["param_bytes"] for layer in synthetic_costs()["profile"]["memory"])
    extra_s = _ring_s(grad_bytes, 2, 1e-3, 1e6) - _ring_s(grad_bytes, 2, 2e-5, 5e8)
    assert steps["slow"] - steps["fast"] == pytest.approx(extra_s, rel=1e-6)
    ranked = {}
    for name, path in paths.items():
        assert main(["plan", "--costs", path, "--hardware", "cpu", "--replicas-options", "2", "--stages-options", "1",
                     "--microbatch-options", "2", "--schedules", "gpipe", "--checkpoints", "never", "--json",
                     "--quiet"]) == 0
        ranked[name] = json.loads(capsys.readouterr().out)["ranked"][0]["step_time_s"]
    assert ranked["slow"] - ranked["fast"] == pytest.approx(extra_s, rel=1e-6)
