"""The simulator holds each optimizer's state: --optimizer in gpipe simulate, plan files, costs files.

Adam and AdamW keep two fp32 tensors the size of the parameters (exp_avg, exp_avg_sq); SGD without
momentum keeps none. Parameter counts to check against come from the executor's torch models.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from executor.models.build import build_meta_model
from executor.runtime.shapes import stage_module
from gpipe.main import main
from sim.catalog.hardware import LOCAL_CPU
from sim.errors import GpipeInputError
from sim.formats.costs import load_costs_workload, write_costs
from sim.formats.plan import ModelRef, Plan, load_plan
from sim.workloads.optimizers import OPTIMIZER_SLOTS

FP32_BYTES = 4
MODELS = {
    "mlp": {"layers": 4, "width": 64},
    "transformer": {"layers": 2, "d_model": 32, "ff": 64, "heads": 4, "seq": 8, "vocab": 64},
    "cnn": {"layers": 2, "channels": 8, "image": 8},
}


def flags(options: dict) -> list[str]:
    return [arg for key, value in options.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def simulate_json(capsys, *argv: str) -> dict:
    assert main(["simulate", *argv, "--stages", "2", "--microbatches", "2", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def stage_parameters(model: str, options: dict, partition: list[int]) -> list[int]:
    net = build_meta_model(model, options)
    return [sum(p.numel() for p in stage_module(net, tuple(partition), k).parameters())
            for k in range(len(partition))]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_adam_holds_two_fp32_copies_of_the_parameters_more_than_sgd(model, capsys):
    argv = ["--model", model, *flags(MODELS[model])]
    sgd = simulate_json(capsys, *argv, "--optimizer", "sgd")
    adam = simulate_json(capsys, *argv, "--optimizer", "adam")
    adamw = simulate_json(capsys, *argv, "--optimizer", "adamw")
    default = simulate_json(capsys, *argv)
    assert sgd["partition"] == adam["partition"]
    params = stage_parameters(model, MODELS[model], sgd["partition"])
    assert all(p > 0 for p in params)
    for k, count in enumerate(params):
        assert adam["stages"][k]["static_bytes"] - sgd["stages"][k]["static_bytes"] == 2 * FP32_BYTES * count
        assert sgd["stages"][k]["static_bytes"] == 2 * FP32_BYTES * count  # weights and gradients only
    assert [s["static_bytes"] for s in adamw["stages"]] == [s["static_bytes"] for s in adam["stages"]]
    assert [s["static_bytes"] for s in default["stages"]] == [s["static_bytes"] for s in adamw["stages"]]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "opt_user_net.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def net(depth=4):
            return nn.Sequential(*[nn.Linear(16, 16) for _ in range(depth)])

        def example_batch(rows):
            return torch.randn(rows, 16), torch.randn(rows, 16)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "opt_user_net:net"
    sys.modules.pop("opt_user_net", None)


def test_a_user_model_on_the_meta_device_holds_the_optimizer_state_too(user_module, capsys):
    sgd = simulate_json(capsys, "--model", user_module, "--optimizer", "sgd")
    adam = simulate_json(capsys, "--model", user_module, "--optimizer", "adam")
    for s, a in zip(sgd["stages"], adam["stages"]):
        assert a["static_bytes"] - s["static_bytes"] == 2 * FP32_BYTES * 2 * (16 * 16 + 16)  # 2 layers a stage


def test_uniform_model_follows_the_optimizer(capsys):
    sgd = simulate_json(capsys, "--model", "uniform", "--layers", "4", "--optimizer", "sgd")
    adam = simulate_json(capsys, "--model", "uniform", "--layers", "4", "--optimizer", "adam")
    assert [a["static_bytes"] / s["static_bytes"] for s, a in zip(sgd["stages"], adam["stages"])] == [2.0, 2.0]


def test_plan_file_records_the_optimizer_and_simulate_reads_it(tmp_path, capsys):
    path = str(tmp_path / "plan.json")
    argv = ["plan", "--model", "mlp", *flags(MODELS["mlp"]), "--stages-options", "2", "--microbatch-options", "2",
            "--quiet", "--out", path]
    assert main([*argv, "--optimizer", "sgd"]) == 0
    capsys.readouterr()
    plan = load_plan(path)
    assert plan.optimizer == "sgd" and plan.model.options["optimizer_slots"] == 0
    assert main(["simulate", "--plan", path, "--json"]) == 0
    from_plan = json.loads(capsys.readouterr().out)
    direct = simulate_json(capsys, "--model", "mlp", *flags(MODELS["mlp"]), "--optimizer", "sgd",
                           "--partition", ",".join(map(str, plan.partition)), "--checkpoint", plan.layout.checkpoint,
                           "--schedule", plan.layout.schedule)
    assert [s["static_bytes"] for s in from_plan["stages"]] == [s["static_bytes"] for s in direct["stages"]]
    assert main([*argv]) == 0
    assert load_plan(path).optimizer == "adamw"


def test_a_plan_whose_optimizer_contradicts_its_state_is_refused():
    model = ModelRef("mlp", {"layers": 2, "optimizer_slots": 0}, num_layers=2)
    with pytest.raises(GpipeInputError, match="plan's optimizer adamw keeps 2 state tensors per parameter"):
        Plan.of(model=model, partition=(1, 1), batch_size=4, microbatches=2, optimizer="adamw")
    with pytest.raises(GpipeInputError, match="unknown optimizer 'rmsprop'"):
        Plan.of(model=model, partition=(1, 1), batch_size=4, microbatches=2, optimizer="rmsprop")


def costs_data(optimizer: str) -> dict:
    rows = [1, 2]
    memory = [{"name": f"l{i}", "param_bytes": 1000 * (i + 1), "own_bytes": [8, 16], "input_bytes": [4, 8],
               "output_bytes": [4, 8], "saves_input": True, "saves_output": False} for i in range(2)]
    times = {kind: [[1e-3, 2e-3], [1e-3, 2e-3]] for kind in "FRB"}
    fit = {"threads": 1, "actions": {k: {"slope": 1.0, "intercept": 0.0, "cold_start_s": 0.0} for k in "FRB"},
           "send": {"slope": 0.0, "intercept": 0.0}, "optimizer": {"slope": 1e-8, "intercept": 0.0},
           "step_overhead_s": 0.0, "gap_after_s": {}}
    return {"machine": {"cpu_cores": 2, "device": "cpu"}, "system": "cpu", "catalog_device": LOCAL_CPU.name,
            "model": {"name": "mlp", "options": {"layers": 2, "width": 8}, "num_layers": 2}, "batch_size": 4,
            "precision": "fp32", "optimizer": optimizer, "optimizer_slots": OPTIMIZER_SLOTS[optimizer],
            "shared_parameters": [],
            "profile": {"rows": rows, "times_s": {"1": times}, "memory": memory}, "pipeline": {"1": fit}}


def test_measured_costs_hold_the_state_of_the_optimizer_calibration_used(tmp_path):
    static = {}
    for optimizer in ("sgd", "adamw"):
        path = str(tmp_path / f"{optimizer}.json")
        write_costs(costs_data(optimizer), path)
        workload = load_costs_workload(path, "mlp", {"layers": 2, "width": 8})
        assert workload.optimizer == optimizer
        static[optimizer] = workload.stage_cost(2, 0, 2, LOCAL_CPU).static_bytes
    assert static["adamw"] - static["sgd"] == 2 * 3000  # two copies of the 3000 parameter bytes
    with pytest.raises(GpipeInputError, match="was measured with adamw .* drop --optimizer"):
        load_costs_workload(path, "mlp", {"layers": 2, "width": 8, "optimizer_slots": 0})


def test_plan_with_costs_records_the_measured_optimizer(tmp_path, capsys):
    costs = str(tmp_path / "costs.json")
    write_costs(costs_data("sgd"), costs)
    out = str(tmp_path / "plan.json")
    assert main(["plan", "--model", "mlp", "--layers", "2", "--width", "8", "--batch", "4", "--costs", costs,
                 "--stages-options", "1", "--microbatch-options", "1,2", "--quiet", "--out", out]) == 0
    assert load_plan(out).optimizer == "sgd"


def test_calibration_cache_is_per_optimizer(tmp_path):
    from gpipe.calibrate import cached
    from calibrate.measure.machine import machine_stamp

    path = str(tmp_path / "costs.json")
    write_costs({**costs_data("adamw"), "machine": machine_stamp("cpu")}, path)
    assert cached(path, "mlp", {"layers": 2, "width": 8}, 4, "cpu", "adamw") is not None
    assert cached(path, "mlp", {"layers": 2, "width": 8}, 4, "cpu", "sgd") is None
