import argparse

import pytest

from executor.cli import add_arguments, config_from_args, even_partition, torchrun_command
from sim.errors import GpipeInputError
from sim.plan import ModelRef, Plan, save_plan
from executor.models import model_ref


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_become_a_config():
    config = config_from_args(parse("--model", "transformer", "--layers", "2", "--stages", "2", "--batch", "8",
                                    "--microbatches", "4", "--schedule", "1f1b", "--checkpoint", "never"))
    assert config.partition == (2, 2) and config.options["layers"] == 2 and config.schedule == "1f1b"
    assert config.checkpoint == "never" and config.batch_size == 8


def test_plan_file_is_read_and_flags_override(tmp_path):
    plan = Plan(model=model_ref("mlp", {"width": 16}), partition=(5, 3), batch_size=12, microbatches=3)
    save_plan(plan, tmp_path / "plan.json")
    config = config_from_args(parse("--plan", str(tmp_path / "plan.json"), "--microbatches", "6"))
    assert config.partition == (5, 3) and config.options["width"] == 16 and config.microbatches == 6


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


def test_torchrun_command_single_and_multi_node():
    single = torchrun_command("c.json", 4, parse("--model", "mlp"))
    assert "--standalone" in single and single[single.index("--nproc-per-node") + 1] == "4"
    multi = torchrun_command("c.json", 4, parse("--model", "mlp", "--nnodes", "2", "--rdzv-endpoint", "h:29500"))
    assert multi[multi.index("--nproc-per-node") + 1] == "2" and "c10d" in multi and "--standalone" not in multi
    with pytest.raises(GpipeInputError, match="do not split over --nnodes 3"):
        torchrun_command("c.json", 4, parse("--model", "mlp", "--nnodes", "3", "--rdzv-endpoint", "h:1"))


def test_a_plan_of_a_measured_torch_model_trains_without_the_analysis_options():
    from executor.config import RunConfig

    plan = Plan(model=ModelRef("mlp", {"layers": 4, "width": 8, "dtype": "fp32", "optimizer_slots": 2,
                                       "input_shape": "8"}, 4, 0),
                partition=(2, 2), batch_size=4, microbatches=2, checkpoint="never", schedule="gpipe",
                hardware={"system": "cpu", "nodes": 1})
    assert RunConfig.from_plan(plan).options == {"layers": 4, "width": 8}
