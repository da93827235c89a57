import argparse

import pytest

from executor.launch.agent import launch_config
from executor.models.build import model_ref
from gpipe.train import add_arguments, config_from_args, even_partition
from sim.errors import GpipeInputError
from sim.formats.plan import ModelRef, Plan, save_plan


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_become_a_config():
    config = config_from_args(parse("--model", "transformer", "--layers", "2", "--stages", "2", "--batch", "8",
                                    "--microbatches", "4", "--schedule", "1f1b", "--checkpoint", "never"))
    assert config.partition == (2, 2) and config.options["layers"] == 2 and config.layout.schedule == "1f1b"
    assert config.layout.checkpoint == "never" and config.batch_size == 8


def test_plan_file_is_read_and_flags_override(tmp_path):
    plan = Plan.of(model=model_ref("mlp", {"width": 16}), partition=(5, 3), batch_size=12, microbatches=3)
    save_plan(plan, tmp_path / "plan.json")
    config = config_from_args(parse("--plan", str(tmp_path / "plan.json"), "--microbatches", "6"))
    assert config.partition == (5, 3) and config.options["width"] == 16 and config.layout.microbatches == 6


@pytest.mark.parametrize("argv,message", [
    (("--model", "mlp", "--stages", "9"), "more than the model's 8 layers"),
    (("--model", "mlp", "--partition", "4,4", "--stages", "3"), "--partition has 2 stages"),
    (("--model", "mlp", "--stages", "2", "--save-every", "2"), "need --checkpoint-dir"),
    (("--model", "mlp", "--option", "width"), "expected KEY=VALUE"),
    ((), "say what to train"),
])
def test_bad_flags_fail_with_one_line(argv, message):
    with pytest.raises(GpipeInputError, match=message):
        config_from_args(parse(*argv))


def test_even_partition():
    assert even_partition(8, 3) == (3, 3, 2)


def test_the_agent_is_torchruns_standalone_on_one_node_and_static_on_several():
    single = launch_config(4, parse("--model", "mlp"))
    assert (single.nproc_per_node, single.min_nodes, single.max_nodes) == (4, 1, 1)
    assert (single.rdzv_backend, single.rdzv_endpoint, single.start_method) == ("c10d", "localhost:0", "forkserver")
    multi = launch_config(4, parse("--model", "mlp", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                                   "h:29500", "--rdzv-timeout", "60", "--max-restarts", "2"))
    assert (multi.nproc_per_node, multi.min_nodes, multi.max_nodes, multi.max_restarts) == (2, 2, 2, 2)
    assert (multi.rdzv_backend, multi.rdzv_endpoint) == ("static", "h:29500")
    assert multi.rdzv_configs == {"timeout": 60, "rank": 1}
    with pytest.raises(GpipeInputError, match="do not split over --nnodes 3"):
        launch_config(4, parse("--model", "mlp", "--nnodes", "3", "--rdzv-endpoint", "h:1"))


@pytest.mark.parametrize("argv,message", [
    (("--node-rank", "2"), "--node-rank 2 is not a node of --nnodes 2; number the nodes 0 to 1, node 0 at the "
                           "--rdzv-endpoint"),
    (("--node-rank", "-1"), "--node-rank -1 is not a node of --nnodes 2; number the nodes 0 to 1, node 0 at the "
                            "--rdzv-endpoint"),
    (("--rdzv-endpoint", "node0"), "--rdzv-endpoint 'node0' is not HOST:PORT; give node 0's address and a free "
                                   "port, e.g. 10.0.0.1:29500"),
    (("--rdzv-timeout", "0",), "--rdzv-timeout must be a positive integer, got 0"),
])
def test_bad_node_flags_are_one_line(argv, message):
    flags = {"--node-rank": "0", "--rdzv-endpoint": "127.0.0.1:29500"}
    flags.update(dict(zip(argv[::2], argv[1::2])))
    args = parse("--model", "mlp", "--nnodes", "2", *[x for pair in flags.items() for x in pair])
    with pytest.raises(GpipeInputError) as error:
        launch_config(4, args)
    assert str(error.value) == message


def test_several_nodes_need_an_endpoint():
    with pytest.raises(GpipeInputError, match="needs --rdzv-endpoint HOST:PORT, node 0's address"):
        launch_config(4, parse("--model", "mlp", "--nnodes", "2"))


def test_an_ipv6_endpoint_is_split_at_the_last_colon():
    from executor.launch.agent import endpoint

    assert endpoint("[::1]:29500") == ("::1", 29500) and endpoint("node0:1") == ("node0", 1)


def test_a_plan_of_a_measured_torch_model_trains_without_the_analysis_options():
    from executor.config import RunConfig

    plan = Plan.of(model=ModelRef("mlp", {"layers": 4, "width": 8, "dtype": "fp32", "optimizer_slots": 2,
                                       "input_shape": "8"}, 4, 0),
                partition=(2, 2), batch_size=4, microbatches=2, checkpoint="never", schedule="gpipe",
                hardware={"system": "cpu", "nodes": 1})
    assert RunConfig.from_plan(plan).options == {"layers": 4, "width": 8}
@pytest.mark.parametrize("argv,message", [
    (("--weight-decay", "-0.1"), "--weight-decay must be 0 or more, got -0.1; use --weight-decay 0 for none"),
    (("--clip-grad-norm", "0"), "--clip-grad-norm must be positive, got 0.0; leave it out for no clipping"),
    (("--clip-grad-norm", "-2"), "--clip-grad-norm must be positive, got -2.0; leave it out for no clipping"),
    (("--optimizer", "lamb"), "unknown optimizer 'lamb'; choose one of sgd, adam, adamw"),
    (("--lr-schedule", "linear"), "unknown --lr-schedule 'linear'; choose one of constant, cosine"),
    (("--lr-warmup", "-1"), "--lr-warmup must be 0 or more steps, got -1"),
])
def test_bad_optimizer_settings_exit_2_with_one_line(argv, message, capsys):
    from gpipe.main import main

    assert main(["train", "--model", "mlp", "--stages", "2", "--steps", "3", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"gpipe: error: {message}"]


@pytest.mark.parametrize("command", [["simulate"], ["plan", "--quiet"], ["calibrate", "--out", "unused.json"]])
def test_an_unknown_optimizer_is_one_line_for_every_command(command, capsys, tmp_path, monkeypatch):
    from gpipe.main import main

    monkeypatch.chdir(tmp_path)
    assert main([*command, "--model", "mlp", "--optimizer", "lamb"]) == 2
    assert capsys.readouterr().err.splitlines() == ["gpipe: error: unknown optimizer 'lamb'; choose one of sgd, "
                                                   "adam, adamw"]
    assert not (tmp_path / "unused.json").exists()


def test_optimizer_flags_become_a_config():
    config = config_from_args(parse("--model", "mlp", "--stages", "2", "--optimizer", "adam", "--weight-decay",
                                    "0.1", "--clip-grad-norm", "1.5", "--lr-schedule", "cosine", "--lr-warmup",
                                    "3", "--steps", "20"))
    assert (config.optimizer, config.weight_decay, config.clip_grad_norm) == ("adam", 0.1, 1.5)
    assert (config.lr_schedule, config.lr_warmup_steps, config.steps) == ("cosine", 3, 20)
    default = config_from_args(parse("--model", "mlp", "--stages", "2"))
    assert (default.optimizer, default.clip_grad_norm, default.lr_schedule) == ("adamw", None, "constant")


def test_gpipe_plan_output_trains_with_the_planned_optimizer(tmp_path):
    from gpipe.main import main

    path = str(tmp_path / "plan.json")
    assert main(["plan", "--model", "mlp", "--layers", "4", "--width", "16", "--batch", "8", "--optimizer", "sgd",
                 "--stages-options", "2", "--microbatch-options", "2", "--quiet", "--out", path]) == 0
    config = config_from_args(parse("--plan", path))
    assert config.optimizer == "sgd"
    assert "dtype" not in config.options and "optimizer_slots" not in config.options  # the simulator's only
    assert config_from_args(parse("--plan", path, "--optimizer", "adam")).optimizer == "adam"


def test_a_report_into_a_missing_directory_is_refused_before_training(tmp_path):
    from gpipe.train import run

    missing = tmp_path / "no" / "report.json"
    with pytest.raises(GpipeInputError) as error:
        run(parse("--model", "mlp", "--stages", "2", "--report", str(missing)))
    assert str(error.value) == f"--report {missing}: directory {missing.parent} does not exist; create it first"


def test_zero_stages_is_one_line_not_a_one_stage_run():
    with pytest.raises(GpipeInputError, match="--stages must be a positive integer, got 0"):
        config_from_args(parse("--model", "mlp", "--stages", "0"))


TORCH_FREE_REFUSALS = [
    (("--replicas", "0"), "--replicas must be a positive integer, got 0; use --replicas 1 or more"),
    (("--threads", "-1"), "--threads must be 0 (cores / workers) or more, got -1"),
    (("--timeout", "0"), "--timeout must be a positive number of seconds, got 0.0; a stuck receive fails after it "
                         "(default 300)"),
    (("--timeout", "nan"), "--timeout must be a positive number of seconds, got nan; a stuck receive fails after "
                           "it (default 300)"),
    (("--warmup-steps", "-1"), "--warmup-steps must be 0 (every step measured) or more, got -1"),
    (("--max-restarts", "-1"), "--max-restarts must be 0 (none) or more, got -1"),
    (("--microbatches", "-1"), "micro-batches (M) must be a positive integer, got -1; use --microbatches 1 or more"),
    (("--steps", "0"), "steps must be a positive integer, got 0; use --steps 1 or more"),
]


def test_flags_that_need_no_model_are_refused_before_torch_is_imported(tmp_path):
    """Each a one-line error with exit code 2 in a process that never imports torch (these flags
    used to reach the ranks: a zero --timeout failed each one's rendezvous, --threads -1 its
    set_num_threads, and --replicas 0 was reported as a micro-batch count)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("import contextlib, io, json, sys\n"
              "from gpipe.main import main\n"
              "out = []\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    err = io.StringIO()\n"
              "    with contextlib.redirect_stderr(err):\n"
              "        code = main(['train', '--model', 'mlp', '--stages', '2', *argv])\n"
              "    out.append([code, err.getvalue().splitlines()])\n"
              "print(json.dumps({'results': out, 'torch': 'torch' in sys.modules}))\n")
    argvs = [list(argv) for argv, _ in TORCH_FREE_REFUSALS]
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", script, json.dumps(argvs)], capture_output=True, text=True,
                          check=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": root})
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["results"] == [[2, [f"gpipe: error: {message}"]] for _, message in TORCH_FREE_REFUSALS]
    assert not seen["torch"]


def test_a_node_rank_without_several_nodes_is_refused():
    with pytest.raises(GpipeInputError) as error:
        launch_config(2, parse("--model", "mlp", "--node-rank", "5"))
    assert str(error.value) == ("--node-rank 5 names a node of several, but --nnodes is 1; leave --node-rank out, "
                                "or give every node --nnodes N and node 0's --rdzv-endpoint")
