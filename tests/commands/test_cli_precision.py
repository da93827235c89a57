"""``--precision``: one flag on simulate, plan, train and calibrate; the what-if default; where the
chosen precision shows; measured costs keep theirs; bad input is one line."""

from __future__ import annotations

import argparse
import json

import pytest

from gpipe.main import main
from sim.catalog.hardware import SYSTEMS
from sim.formats.plan import Plan, load_plan, save_plan
from sim.workloads.precision import choose_precision
from tests.helpers.costs import write_v1_costs
from tests.helpers.in_process import gpipe

TRANSFORMER = ["--model", "transformer", "--layers", "4", "--d-model", "256", "--ff", "1024", "--heads", "4",
               "--seq", "128", "--vocab", "1000", "--batch", "8"]


@pytest.mark.parametrize("command", [
    ["simulate", "--model", "mlp"],
    ["plan", "--model", "mlp", "--quiet"],
    ["train", "--model", "mlp", "--stages", "2"],
    ["calibrate", "--model", "mlp"],
])
def test_unknown_precision_is_one_line_and_exit_2_on_every_command(command, tmp_path):
    proc = gpipe(*command, "--precision", "fp16")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    trained = command[0] in ("train", "calibrate")  # bf16-model is a planning option
    choices = "fp32, bf16" if trained else "fp32, bf16, bf16-autocast, bf16-model, fp8"
    assert proc.stderr == f"gpipe: error: unknown precision 'fp16'; choose one of {choices}\n"
    assert proc.stdout == ""


def test_the_what_if_default_is_the_precision_people_train_in_on_that_device():
    expected = {"a100-nvlink": "bf16", "a100-40gb-nvlink": "bf16", "h100-nvlink": "bf16", "h100-pcie": "bf16",
                "h200-nvlink": "bf16", "b200-nvlink": "bf16", "gb200-nvl72": "bf16", "mi300x": "bf16",
                "mi325x": "bf16", "tpu-v2": "bf16", "tpu-v3": "bf16", "tpu-v4": "bf16", "tpu-v5e": "bf16",
                "tpu-v5p": "bf16", "tpu-v6e": "bf16",
                "p100-pcie": "fp32", "v100-nvlink": "fp32", "cpu": "fp32", "ideal": "fp32"}
    assert {name: system.device.default_precision for name, system in SYSTEMS.items()} == expected
    for system in SYSTEMS.values():  # every default has a peak to run at
        assert system.device.default_precision in system.device.peak_flops
        assert choose_precision(None, system.device) == system.device.default_precision


# on an A100 the transformer's bf16 is the trainers' mixed precision (sim.workloads.precision)
@pytest.mark.parametrize("hardware,precision", [("a100-nvlink", "bf16-model"), ("v100-nvlink", "fp32")])
def test_simulate_prints_and_reports_the_chosen_precision(hardware, precision, capsys):
    args = ["simulate", *TRANSFORMER, "-K", "2", "-M", "4", "--hardware", hardware]
    assert main(args) == 0
    assert f"precision    {precision}" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["precision"] == precision and data["model"]["options"]["precision"] == precision


def test_bf16_autocast_is_faster_and_keeps_fp32_weights_on_an_a100(capsys):
    """Compute at the bf16 peak (16x the fp32 one on an A100); fp32 weights, gradients and optimizer
    state either way, so the static bytes are equal."""
    results = {}
    large = ["--model", "transformer", "--layers", "8", "--d-model", "1024", "--ff", "4096", "--heads", "16",
             "--seq", "512", "--vocab", "32000", "--batch", "32"]
    for precision in ("fp32", "bf16-autocast"):
        assert main(["simulate", *large, "-K", "2", "-M", "4", "--partition", "5,5", "--hardware", "a100-nvlink",
                     "--precision", precision, "--json"]) == 0
        results[precision] = json.loads(capsys.readouterr().out)
    assert results["bf16-autocast"]["precision"] == "bf16"  # autocast's own name
    # mostly compute-bound: ~12x here (the memory-bound ops, layer norms, softmax, casts, do not speed up)
    assert results["bf16-autocast"]["step_time_s"] < results["fp32"]["step_time_s"] / 8
    assert [s["static_bytes"] for s in results["bf16-autocast"]["stages"]] == \
        [s["static_bytes"] for s in results["fp32"]["stages"]]


@pytest.mark.parametrize("model,hardware,expected", [
    ("transformer", "a100-nvlink", "bf16-model"),  # a GPU the trainers train on: their mixed precision
    ("llama3-8b", "h100-nvlink", "bf16-model"),  # a named model is the transformer of its shape
    ("mlp", "a100-nvlink", "bf16"),  # autocast, the only bf16 modelled for the mlp
    ("transformer", "tpu-v4", "bf16"),  # not a GPU
])
def test_bf16_means_the_trainers_mixed_precision_on_their_gpus(model, hardware, expected, capsys):
    assert main(["simulate", "--model", model, "--hardware", hardware, "--precision", "bf16", "-K", "1", "-M", "1",
                 "--batch", "1", *(["--option", "seq=128", "--option", "num_hidden_layers=2"] if model == "llama3-8b" else []), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == expected


def test_the_trainers_bf16_keeps_bf16_weights_and_fp32_master_weights(capsys):
    """18 bytes a parameter with Adam (bf16 weights, fp32 gradients, master weights and two moments)
    against autocast's 16 (fp32 weights, gradients and two moments)."""
    static = {}
    for precision in ("bf16", "bf16-autocast", "bf16-model"):
        assert main(["simulate", *TRANSFORMER, "-K", "1", "-M", "1", "--hardware", "h100-nvlink", "--precision",
                     precision, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        static[precision] = data["stages"][0]["static_bytes"] / data["parameter_count"]
    assert static["bf16"] == static["bf16-model"] == pytest.approx(18, rel=1e-3)
    assert static["bf16-autocast"] == pytest.approx(16, rel=1e-3)


def test_plan_header_json_and_plan_file_carry_the_precision(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *TRANSFORMER, "--hardware", "h100-nvlink", "--microbatch-options", "1,2,4",
                 "--out", str(out), "--quiet"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "on h100-nvlink, precision bf16-model" in head  # bf16 as the trainers run it on an H100
    plan = load_plan(out)
    assert plan.precision == "bf16-model" and "precision" not in plan.model.options
    assert main(["plan", *TRANSFORMER, "--hardware", "h100-nvlink", "--microbatch-options", "1,2",
                 "--precision", "fp32", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "fp32"
    # simulate --plan predicts at the plan's precision, and says so
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["precision"] == "bf16-model"
    assert again["step_time_s"] == pytest.approx(plan.predicted["step_time_s"])
    # a model of a GPU's size: the depth search stays short (a 256-wide one fits tens of thousands of layers)
    assert main(["plan", "--model", "transformer", "--layers", "4", "--d-model", "4096", "--ff", "16384", "--heads",
                 "32", "--seq", "2048", "--vocab", "32000", "--batch", "8", "--hardware", "h100-nvlink", "--max-layers",
                 "--stages-options", "2", "--microbatch-options", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16-model"


def test_a_device_without_bf16_units_refuses_bf16_in_one_line():
    proc = gpipe("simulate", "--model", "mlp", "--hardware", "v100-nvlink", "--precision", "bf16")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "V100-SXM2-32GB has no bf16 units" in proc.stderr and "--precision fp32" in proc.stderr


def _costs(precision: str | None) -> dict:
    """A minimal measured mlp (2 layers, batch 4) at ``precision`` (None: a file from before), as a
    version 1 file held it (read with that version's defaults)."""
    layer = {"name": "Sequential", "param_bytes": 80, "own_bytes": [0, 0], "input_bytes": [16, 32],
             "output_bytes": [16, 32], "saves_input": True, "saves_output": True}
    data = {"machine": {"cpu_cores": 1, "device": "cpu"}, "system": "cpu",
            "model": {"name": "mlp", "options": {"layers": 2, "width": 4}, "num_layers": 2},
            "batch_size": 4, "optimizer_slots": 0,
            "profile": {"rows": [1, 2], "times_s": {"1": {k: [[1e-4, 2e-4]] * 2 for k in "FRB"}},
                        "memory": [layer, layer]}, "pipeline": {}}
    if precision:
        data["precision"] = precision
    return data


@pytest.mark.parametrize("stored,given,expected", [
    ("bf16", None, "bf16"), (None, None, "fp32"), ("bf16", "bf16", "bf16"), (None, "fp32", "fp32"),
])
def test_measured_costs_predict_at_their_own_precision(tmp_path, capsys, stored, given, expected):
    path = tmp_path / "costs.json"
    write_v1_costs(_costs(stored), path)
    flags = [] if given is None else ["--precision", given]
    # the h100 would default to bf16: the file decides, not the device
    assert main(["simulate", "--costs", str(path), "--hardware", "cpu", "-K", "2", "-M", "2", "--json",
                 *flags]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == expected


def test_a_precision_that_contradicts_the_costs_file_is_one_line(tmp_path):
    path = tmp_path / "costs.json"
    write_v1_costs(_costs("bf16"), path)
    for command in (["simulate", "-K", "2"], ["plan", "--quiet"]):
        proc = gpipe(*command, "--costs", str(path), "--hardware", "cpu", "--precision", "fp32")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1
        assert "contradicts the costs file, which was measured at bf16" in proc.stderr


def test_calibration_cache_tells_precisions_apart(tmp_path, monkeypatch):
    from gpipe import calibrate as cli

    monkeypatch.setattr("calibrate.measure.machine.same_machine", lambda a, b: True)
    path = tmp_path / "costs.json"
    write_v1_costs({**_costs("bf16"), "batch_size": 4}, path)
    options = {"layers": 2, "width": 4}
    assert cli.cached(str(path), "mlp", options, 4, "cpu", "sgd", "bf16") is not None
    assert cli.cached(str(path), "mlp", options, 4, "cpu", "sgd", "fp32") is None
    write_v1_costs(_costs(None), path)  # written before precisions were recorded: fp32
    assert cli.cached(str(path), "mlp", options, 4, "cpu", "sgd") is not None
    assert cli.cached(str(path), "mlp", options, 4, "cpu", "sgd", "bf16") is None


def _train_args(*argv):
    from gpipe.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_train_trains_at_the_plans_precision_unless_told_otherwise(tmp_path):
    """A plan written by gpipe plan (its model options include the analysis option
    optimizer_slots) trains at its precision; --precision overrides; the executor's default is fp32."""
    from gpipe.train import config_from_args

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "mlp", "--layers", "4", "--width", "32", "--batch", "8", "--hardware",
                 "a100-nvlink", "--microbatch-options", "2", "--out", str(out), "--quiet"]) == 0
    assert "optimizer_slots" in load_plan(out).model.options
    config = config_from_args(_train_args("--plan", str(out)))
    assert config.precision == "bf16" and "optimizer_slots" not in config.options
    assert config_from_args(_train_args("--plan", str(out), "--precision", "fp32")).precision == "fp32"
    assert config_from_args(_train_args("--model", "mlp", "--stages", "2")).precision == "fp32"
    fp32_plan = tmp_path / "old.json"
    save_plan(Plan.of(model=load_plan(out).model, partition=(2, 2), batch_size=8, microbatches=2), fp32_plan)
    assert config_from_args(_train_args("--plan", str(fp32_plan))).precision == "fp32"


def test_a_plan_with_an_unknown_precision_is_one_line(tmp_path):
    out = tmp_path / "plan.json"
    out.write_text(json.dumps({"version": 1, "model": {"name": "mlp", "num_layers": 8}, "partition": [8],
                               "batch_size": 8, "microbatches": 2, "precision": "fp4"}))
    proc = gpipe("simulate", "--plan", str(out))
    assert proc.returncode == 2 and "unknown precision 'fp4'" in proc.stderr and proc.stderr.count("\n") == 1
