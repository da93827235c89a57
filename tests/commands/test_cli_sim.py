"""The command-line interface other tools script against."""

import json
import re
import subprocess
import sys

import pytest

from gpipe.main import main

GPIPE = [sys.executable, "-m", "gpipe.main"]


def run(*args):
    return subprocess.run([*GPIPE, *args], capture_output=True, text=True, timeout=120)


def test_simulate_json_interface():
    proc = run("simulate", "--model", "uniform", "--layers", "16", "--stages", "4", "--microbatches", "8",
               "--checkpoint", "never", "--hardware", "ideal", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["bubble_fraction"] == pytest.approx(3 / 11, abs=1e-9)
    assert data["partition"] == [4, 4, 4, 4]
    assert data["step_time_s"] == pytest.approx(11 * 4 * 3e-3)
    assert data["throughput_samples_per_s"] > 0
    assert [set(s) >= {"peak_memory_bytes", "busy_s"} for s in data["stages"]] == [True] * 4


def test_simulate_writes_trace_and_html(tmp_path):
    trace, html = tmp_path / "t.json", tmp_path / "t.html"
    assert main(["simulate", "--model", "transformer", "--stages", "2", "--microbatches", "4", "--partition",
                 "2,4", "--schedule", "1f1b", "--batch", "8", "--hardware", "h100-nvlink",
                 "--trace", str(trace), "--html", str(html)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"forward 0", "backward 3"}
    assert "plotly" in html.read_text()[:100000].lower()


@pytest.mark.parametrize("args,message", [
    (["--stages", "0"], "stages (K) must be a positive integer, got 0"),
    (["--microbatches", "-2"], "micro-batches (M) must be a positive integer, got -2"),
    (["--batch", "0"], "batch size must be a positive integer, got 0"),
    (["--stages", "17"], "17 stages for a model of 16 layers"),
    (["--partition", "3,5"], "partition 3,5 sums to 8 layers but the model has 16"),
    (["--partition", "8,8", "--stages", "3"], "--partition has 2 entries but --stages 3 x --virtual-stages 1 needs 3"),
    (["--model", "resnet"], "unknown model 'resnet'"),
    (["--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["--schedule", "zigzag"], "unknown schedule 'zigzag'"),
    (["--hardware", "h100-nvlink", "--replicas", "4", "--stages", "4"],
     "4 replicas x 4 stages need 16 devices but h100-nvlink with 1 node"),
    (["--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
    (["--schedule", "interleaved", "--virtual-stages", "8", "--stages", "4"], "32 chunks but the model has 16 layers"),
    (["--schedule", "interleaved", "--stages", "4", "--microbatches", "6"], "multiple of stages"),
    (["--zero", "1"], "--zero 1 shards optimizer state"),
    (["--placement", "scattered"], "unknown placement 'scattered'"),
    (["--checkpoint", "sometimes"], "unknown checkpoint policy 'sometimes'"),
    (["--hardware", "h100-nvlink", "--stages", "16", "--partition", "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1"],
     "16 stages need 16 devices"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    # on the ideal system, whose devices never run out (an --hardware in args comes later and wins)
    proc = run("simulate", "--model", "uniform", "--layers", "16", "--hardware", "ideal", *args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_a_plan_that_does_not_fit_says_which_stage_and_what_to_do():
    proc = run("simulate", "--model", "transformer", "--layers", "48", "--d-model", "2048", "--ff", "8192",
               "--heads", "32", "--seq", "1024", "--vocab", "32000", "--batch", "32", "--stages", "2",
               "--microbatches", "4", "--hardware", "tpu-v3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "does not fit in memory: stage" in proc.stderr and "over by" in proc.stderr


def test_simulate_and_plan_do_not_import_torch(tmp_path):
    code = ("import sys; from gpipe.main import main; "
            "main(['simulate', '--model', 'transformer', '--json']); "
            f"main(['plan', '--model', 'mlp', '--quiet', '--out', r'{tmp_path / 'p.json'}']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_plan_writes_a_plan_that_simulate_reads_back(tmp_path):
    out = tmp_path / "plan.json"
    proc = run("plan", "--model", "transformer", "--hardware", "a100-nvlink", "--batch", "32",
               "--microbatch-options", "1-32", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "rank" in proc.stdout and "plan written to" in proc.stdout
    plan = json.loads(out.read_text())
    assert plan["version"] == 1 and sum(plan["partition"]) == plan["model"]["num_layers"]
    again = run("simulate", "--plan", str(out), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"])


@pytest.mark.parametrize("args,message", [
    (["--microbatch-options", "1-x"], "--microbatch-options '1-x' is not a list of integers"),
    (["--stages-options", "0,2"], "every value of --stages-options must be a positive integer, got 0"),
    (["--stages-options", "64"], "--stages-options 64 exceeds the model's 6 layers"),
    (["--batch", "-4"], "batch size must be a positive integer, got -4"),
    (["--hardware", "h100-nvlink", "--replicas-options", "16"],
     "16 replicas x 1 stages need 16 devices but h100-nvlink with 1 node(s) has 8"),
    (["--virtual-stages-options", "2", "--schedules", "gpipe"], "--virtual-stages-options 2 needs the interleaved schedule"),
    (["--virtual-stages-options", "4", "--schedules", "interleaved", "--stages-options", "2"],
     "8 chunks but the model has 6 layers"),
    (["--schedules", "interleaved", "--stages-options", "2", "--microbatch-options", "3,5"], "a multiple of stages (K)"),
    (["--zero-options", "1", "--replicas-options", "1"], "--zero-options 1 shards optimizer state"),
    (["--zero-options", "0,4"], "give auto, or ZeRO stages 0 to 3"),
    (["--gradient-sync-options", "step,often"], "--gradient-sync-options 'step,often': give auto, or step"),
    (["--gradient-sync", "step"], "write --gradient-sync-options step"),
])
def test_plan_bad_input(args, message):
    proc = run("plan", "--model", "transformer", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_plan_searches_replicas_and_interleaving_and_writes_them(tmp_path):
    out = tmp_path / "plan.json"
    proc = run("plan", "--model", "transformer", "--layers", "8", "--hardware", "h100-nvlink", "--nodes", "2",
               "--batch", "64", "--microbatch-options", "1,2,4,8", "--zero-options", "0,1", "--out", str(out), "--json",
               "--quiet", "--top", "40")
    assert proc.returncode == 0, proc.stderr
    ranked = json.loads(proc.stdout)["ranked"]
    assert all({"replicas", "virtual_stages", "zero", "placement"} <= set(entry) for entry in ranked)
    assert len({e["replicas"] for e in ranked}) > 1
    assert all(e["replicas"] * len(e["partition"]) // e["virtual_stages"] <= 16 for e in ranked)
    assert all(e["pipeline_stages"] == len(e["partition"]) // e["virtual_stages"] == len(e["stages"]) // e["replicas"]
               for e in ranked)
    times = [e["step_time_s"] for e in ranked]
    assert times == sorted(times)
    plan = json.loads(out.read_text())
    best = ranked[0]
    assert [plan[k] for k in ("replicas", "virtual_stages", "zero", "placement")] == \
        [best[k] for k in ("replicas", "virtual_stages", "zero", "placement")]
    again = run("simulate", "--plan", str(out), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"])
    table = run("plan", "--model", "transformer", "--layers", "8", "--hardware", "h100-nvlink", "--nodes", "2",
                "--batch", "64", "--microbatch-options", "1,2,4,8", "--quiet")
    assert "   D   K  V   M" in table.stdout and "placement" in table.stdout


def test_gradient_sync_in_simulate_plan_and_the_plan_file(tmp_path):
    """--gradient-sync on simulate; plan ranks both syncs where listed and writes the one chosen (the
    default alone otherwise, the plan file then without the key); a ZeRO-0/1 run refuses it in one line."""
    flags = ["--model", "transformer", "--layers", "4", "--hardware", "h100-nvlink", "--batch", "64"]
    bad = run("simulate", *flags, "--stages", "1", "--replicas", "2", "--zero", "1", "--gradient-sync", "microbatch")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "needs --zero 2 or 3" in bad.stderr
    bad = run("simulate", *flags, "--gradient-sync", "often")
    assert bad.returncode == 2 and "unknown --gradient-sync 'often'" in bad.stderr
    steps = {}
    for sync in ("step", "microbatch"):
        proc = run("simulate", *flags, "--stages", "1", "--replicas", "2", "--zero", "3", "--microbatches", "4",
                   "--gradient-sync", sync, "--json")
        assert proc.returncode == 0, proc.stderr
        steps[sync] = json.loads(proc.stdout)
    assert steps["step"]["gradient_sync"] == "step" and steps["microbatch"]["gradient_sync"] == "microbatch"
    assert steps["microbatch"]["step_time_s"] > steps["step"]["step_time_s"]
    assert steps["microbatch"]["stages"][0]["accumulated_gradient_bytes"] == 0
    assert steps["step"]["stages"][0]["accumulated_gradient_bytes"] > 0
    space = [*flags, "--stages-options", "1", "--replicas-options", "2", "--microbatch-options", "4", "--checkpoints",
             "never", "--schedules", "gpipe", "--zero-options", "3", "--tensor-parallel-options", "1", "--quiet"]
    out = tmp_path / "plan.json"
    proc = run("plan", *space, "--gradient-sync-options", "step,microbatch", "--json", "--top", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    ranked = json.loads(proc.stdout)["ranked"]
    assert sorted(e["gradient_sync"] for e in ranked) == ["microbatch", "step"]
    assert json.loads(out.read_text())["gradient_sync"] == ranked[0]["gradient_sync"] == "step"  # memory is free here
    again = run("simulate", "--plan", str(out), "--json")
    assert json.loads(again.stdout)["gradient_sync"] == "step"
    from executor.config import RunConfig
    from sim.formats.plan import load_plan

    assert RunConfig.from_plan(load_plan(str(out))).layout.gradient_sync == "step"  # what gpipe train --plan runs
    table = run("plan", *space, "--gradient-sync-options", "step,microbatch")
    assert "3/step" in table.stdout and "3/mb" in table.stdout
    proc = run("plan", *space, "--json", "--out", str(out))
    assert [e["gradient_sync"] for e in json.loads(proc.stdout)["ranked"]] == ["microbatch"]  # one stage's default
    assert "gradient_sync" not in json.loads(out.read_text())


def test_plan_that_nothing_fits_names_the_overflowing_stage():
    proc = run("plan", "--model", "transformer", "--layers", "48", "--d-model", "2048", "--ff", "8192",
               "--heads", "32", "--seq", "1024", "--vocab", "32000", "--batch", "32", "--hardware", "tpu-v3",
               "--stages-options", "1,2", "--tensor-parallel-options", "1", "--zero-options", "0", "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "no plan among" in proc.stderr and "more stages" in proc.stderr
    assert re.search(r"stage \d+ needs [\d.]+ GiB", proc.stderr)


def test_output_piped_into_head_ends_quietly():
    """``gpipe plan ... --json | head -c 200``: no BrokenPipeError traceback, the SIGPIPE status."""
    big = ["plan", "--model", "uniform", "--layers", "64", "--hardware", "h100-nvlink", "--nodes", "8",
           "--stages-options", "64", "--microbatch-options", "1-8", "--checkpoints", "never", "--schedules",
           "gpipe", "--top", "8", "--json", "--quiet"]  # about 100 KB of JSON, more than a pipe buffers
    proc = subprocess.run(f"{sys.executable} -m gpipe.main {' '.join(big)} | head -c 200; exit ${{PIPESTATUS[0]}}",
                          shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert len(proc.stdout) == 200
    assert proc.stderr == ""
    assert proc.returncode == 141


def test_the_simulator_alone_refuses_a_torch_model_it_was_not_given_a_way_to_measure():
    from sim.errors import GpipeInputError
    from sim.workloads.resolve import resolve_workload

    with pytest.raises(GpipeInputError, match="is a torch model and needs measuring"):
        resolve_workload("my_pkg.models:net", {})
    with pytest.raises(GpipeInputError, match="no model"):
        resolve_workload(None, {})


def test_the_planner_searches_selective_recompute_where_there_is_an_attention_core():
    transformer = run("plan", "--model", "transformer", "--hardware", "a100-nvlink", "--microbatch-options", "4",
                      "--checkpoints", "selective,full", "--tensor-parallel-options", "1", "--json", "--quiet",
                      "--top", "50")
    assert transformer.returncode == 0, transformer.stderr
    assert {o["checkpoint"] for o in json.loads(transformer.stdout)["ranked"]} == {"selective", "full"}
    mlp = run("plan", "--model", "mlp", "--hardware", "a100-nvlink", "--microbatch-options", "4", "--json", "--quiet",
              "--top", "100")
    assert "selective" not in {o["checkpoint"] for o in json.loads(mlp.stdout)["ranked"]}
    refused = run("plan", "--model", "mlp", "--hardware", "a100-nvlink", "--checkpoints", "selective", "--quiet")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "--checkpoint selective recomputes the attention core" in refused.stderr


def test_simulate_prints_the_zb_h1_lists_and_its_smaller_bubble(capsys):
    common = ["simulate", "--model", "uniform", "--layers", "4", "--stages", "4", "--microbatches", "8",
              "--checkpoint", "never", "--hardware", "ideal"]
    assert main([*common, "--schedule", "zb-h1", "--print-schedule", "--json"]) == 0
    zb = json.loads(capsys.readouterr().out)  # --json: the result alone
    assert main([*common, "--schedule", "1f1b", "--json"]) == 0
    one_f_one_b = json.loads(capsys.readouterr().out)
    # uniform layers: F 1 ms, B 2 ms, W half of it; bubble (K-1)(F+I-W) against (K-1)(F+B)
    assert zb["step_time_s"] == pytest.approx(8 * 3e-3 + 3 * 1e-3)
    assert one_f_one_b["step_time_s"] == pytest.approx(8 * 3e-3 + 3 * 3e-3)
    assert main([*common, "--schedule", "zb-h1", "--print-schedule"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].startswith("stage 3: 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0")


def test_the_executable_runs_exit_handlers_flushes_and_keeps_the_status(tmp_path):
    """``gpipe.main.command`` ends with ``os._exit`` to skip torch's teardown: what the teardown is for
    (exit handlers, buffered output) still happens, and the status is main's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    script = ("import atexit, sys\n"
              "from gpipe import main as cli\n"
              "atexit.register(lambda: print('exit handler ran'))\n"
              "sys.argv = ['gpipe', *sys.argv[1:]]\n"
              "cli.command()\n")
    env = {**os.environ, "PYTHONPATH": root}
    ok = subprocess.run([sys.executable, "-c", script, "simulate", "--model", "mlp", "--stages", "2"],
                        capture_output=True, text=True, cwd=tmp_path, env=env)
    assert ok.returncode == 0
    assert ok.stdout.splitlines()[-1] == "exit handler ran" and "bubble" in ok.stdout
    refused = subprocess.run([sys.executable, "-c", script, "simulate", "--model", "mlp", "--stages", "0"],
                             capture_output=True, text=True, cwd=tmp_path, env=env)
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == ["gpipe: error: stages (K) must be a positive integer, got 0; use --stages "
                                           "1 or more"]


def test_an_hf_model_without_transformers_says_how_to_install_it(monkeypatch, capsys):
    """transformers is the optional extra ``hf``: without it, an hf: model is one line naming it."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails as if absent
    for command in (["simulate", "--model", "hf:llama", "--stages", "2"],
                    ["simulate", "--model", "hf:llama", "--stages", "2", "--tensor-parallel", "2",
                     "--hardware", "h100-nvlink"]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "transformers" in err[0] and "pip install -e '.[hf]'" in err[0], err


def test_compile_prices_torch_compiles_fused_regions_on_simulate_and_plan(capsys, tmp_path):
    from sim.formats.plan import load_plan

    model = ["--model", "transformer", "--layers", "4", "--d-model", "512", "--ff", "2048", "--heads", "8", "--seq",
             "512", "--vocab", "8000", "--batch", "8", "--hardware", "h100-nvlink", "--option", "attention=eager"]
    steps = {}
    for name, flags in (("eager", []), ("flag", ["--compile"]), ("option", ["--option", "compile=true"])):
        assert main(["simulate", *model, "-K", "2", "-M", "4", *flags, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        steps[name] = data["step_time_s"]
        assert data["model"]["options"]["compile"] is (name != "eager")
    assert steps["flag"] == steps["option"] < steps["eager"]
    assert main(["simulate", *model, "-K", "2", "-M", "4", "--compile"]) == 0
    assert "compile: torch.compile's fused elementwise regions, each region's memory traffic counted once" in \
        capsys.readouterr().out
    out = tmp_path / "plan.json"
    assert main(["plan", *model, "--compile", "--microbatch-options", "1,2", "--out", str(out), "--quiet"]) == 0
    assert "compile: torch.compile's" in capsys.readouterr().out
    assert load_plan(out).model.options["compile"] is True


@pytest.mark.parametrize("args,message", [
    (["simulate", "--model", "mlp", "--compile"], "unknown option(s) compile for model mlp"),
    (["train", "--model", "transformer", "--stages", "2", "--option", "compile=true"],
     "compile=true prices torch.compile's fused elementwise regions, a planning option"),
])
def test_compile_where_it_is_not_modelled_is_one_line(args, message):
    from tests.helpers.in_process import gpipe

    proc = gpipe(*args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_a_costs_file_from_before_an_option_existed_matches_the_options_default(capsys):
    """benchmarks/results/calibration_costs_cpu.json predates ``compile``: it was measured eager."""
    import os

    costs = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "calibration_costs_cpu.json")
    model = ["--model", "transformer", "--layers", "4", "--d-model", "128", "--ff", "512", "--heads", "4", "--seq",
             "32", "--vocab", "256", "-K", "2", "--costs", costs, "--json"]
    assert "compile" not in json.load(open(costs))["model"]["options"]
    assert main(["simulate", *model]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0
    assert main(["simulate", *model, "--compile"]) == 2  # measured eager, not compiled
