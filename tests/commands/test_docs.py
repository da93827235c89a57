"""Every command in README.md and docs/*.md runs, so the documentation cannot drift from the code.

Commands are the lines of ```sh blocks (a trailing ``\\`` continues a line, ``# ...`` ends it) and
the ``$ `` lines of ```console blocks, whose other lines are output that must appear. Each page's
commands run in order in a directory of their own (``benchmarks/`` linked in), so a plan written by
one command is read by the next. A command too long for the suite, or one that is not ``gpipe``,
must appear in exactly one of the tables below:

- ``SMALLER``: run these commands instead (the same command at small sizes);
- ``COVERED``: a test that runs the same command runs it (the test must exist);
- ``NOT_RUN``: why it is not run at all (installing packages, the suite itself).

A documented command in none of them is run as written; a table entry no page documents fails, so
the tables cannot outlive the docs.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess

import pytest

from tests.helpers import in_process

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

SMALLER: dict[str, list[str]] = {
    # docs/planning.md: a plan of 30,784 candidates and one of 4,619 at fewer nodes
    "gpipe plan --model transformer --layers 96 --d-model 1024 --ff 4096 --heads 16 --seq 512 --vocab 32000 "
    "--batch 512 --hardware h100-nvlink --nodes 8 --out plan.json":
        ["gpipe plan --model transformer --layers 96 --d-model 1024 --ff 4096 --heads 16 --seq 512 --vocab 32000 "
         "--batch 512 --hardware h100-nvlink --nodes 2 --out plan.json"],
    # docs/whatif.md: the 405B plan (8 s of search) at 16 nodes, one tensor-parallel degree and a smaller batch
    "gpipe plan --model hf:llama --option num_hidden_layers=126 --option hidden_size=16384 "
    "--option intermediate_size=53248 --option num_attention_heads=128 --option num_key_value_heads=8 "
    "--option vocab_size=128256 --option seq=8192 --precision bf16-model --hardware h100-nvlink "
    "--nodes 256 --batch 2048 --tensor-parallel-options 1,2,4,8 --dp-overlap --top 3 --out plan.json":
        ["gpipe plan --model hf:llama --option num_hidden_layers=126 --option hidden_size=16384 "
         "--option intermediate_size=53248 --option num_attention_heads=128 --option num_key_value_heads=8 "
         "--option vocab_size=128256 --option seq=8192 --precision bf16-model --hardware h100-nvlink "
         "--nodes 16 --batch 256 --tensor-parallel-options 8 --dp-overlap --top 3 --out plan.json"],
    "gpipe plan --model llama3-70b --train-tokens 15T --max-devices 1024 --batch 1024 "
    "--precision bf16-model --dp-overlap --hardware h100-nvlink,b200-nvlink,mi300x --top 3":
        ["gpipe plan --model llama3-70b --train-tokens 15T --max-devices 64 --batch 64 --precision bf16-model "
         "--dp-overlap --hardware h100-nvlink,mi300x --tensor-parallel-options 8 --top 3"],
    "gpipe plan --model my_pkg.models:build --hardware h100-nvlink --nodes 2 --out plan.json":
        ["gpipe plan --model tests.helpers.user_init_models:custom_init --hardware h100-nvlink --nodes 2 --out plan.json"],
    # docs/training.md: the same training commands, a few steps of a small model each
}
# minutes of calibration, two nodes, or one more torchrun launch each: the tests named run these
# commands (or the same run through the same code) and compare what they print or train
COVERED: dict[str, str] = {
    # a plan priced with a real calibration, trained and compared, its report written
    "gpipe train --plan plan.json --steps 20 --html run.html":
        "tests/commands/test_train_compare.py::test_train_plan_prints_the_plans_prediction_beside_the_measured_step_and_writes_the_report",
    # a plan trained over torchrun with --report and --trace, compared with the in-process pipeline
    "gpipe train --plan plan.json --steps 20 --report report.json --trace trace.json":
        "tests/executor/test_executor_worker.py::test_two_processes_match_the_in_process_pipeline",
    # the demo trains its two-stage plan with gpipe train --data text and checks the loss falls
    "gpipe train --model transformer --vocab 256 --stages 2 --data text --steps 20":
        "tests/commands/test_calibrate_demo.py::test_demo_writes_one_report_and_says_where",
    "gpipe train --model transformer --layers 4 --stages 2 --batch 16 --microbatches 4 --schedule 1f1b "
    "--checkpoint except_last --steps 20":
        "tests/executor/test_executor_worker.py::test_two_processes_match_the_in_process_pipeline",
    "gpipe train --model transformer --layers 4 --d-model 64 --ff 256 --heads 4 --seq 32 --vocab 256 "
    "--stages 2 --tensor-parallel 2 --batch 16 --microbatches 4 --steps 4 --clip-grad-norm 1.0":
        "tests/executor/test_executor_tensor_parallel.py::test_tensor_parallel_trains_what_one_process_trains",
    "gpipe train --plan plan.json --steps 200 --optimizer adamw --lr 3e-4 --weight-decay 0.1 --clip-grad-norm 1.0 "
    "--lr-schedule cosine --lr-warmup 20":
        "tests/executor/test_executor_worker.py::test_two_stages_train_as_one_with_adamw_clipping_and_cosine",
    "gpipe train --model mlp --batch 16 --microbatches 4 --stages 2 --schedule interleaved --virtual-stages 2 "
    "--steps 20":
        "tests/executor/test_interleaved.py::test_two_processes_two_chunks_each_match_in_process_and_resume_exactly",
    "gpipe train --model mlp --batch 16 --microbatches 8 --stages 2 --schedule zb-h1 --checkpoint never --steps 20":
        "tests/executor/test_executor_worker.py::test_two_processes_match_the_in_process_pipeline",
    "gpipe train --model mlp --batch 15 --microbatches 8 --stages 2 --schedule zbv --steps 20":
        "tests/executor/test_v_schedules.py::test_two_processes_in_a_v_match_in_process",
    ".venv/bin/python benchmarks/schedule_bubbles.py":
        "tests/sim/test_schedule.py::test_the_bubble_figure_orders_the_schedules_as_their_formulas",
    "gpipe train --model mlp --option width=16 --stages 2 --replicas 2 --batch 11 --microbatches 2 --steps 5":
        "tests/executor/test_executor_replicas.py::test_replicas_of_the_pipeline_train_as_one_process",
    "gpipe train --model mlp --stages 1 --replicas 2 --zero 1 --batch 10 --save-every 2 --checkpoint-dir ck":
        "tests/executor/test_executor_replicas.py::test_zero_equals_plain_and_resumes_exactly_after_a_kill",
    "gpipe train --model mlp --option width=16 --stages 1 --replicas 2 --zero 3 --batch 11 --microbatches 2 "
    "--steps 2 --save-every 2 --checkpoint-dir ck3":
        "tests/executor/test_executor_fully_sharded.py::"
        "test_zero3_saves_from_the_shards_and_resumes_at_one_replica_and_at_zero1",
    "gpipe train --model mlp --stages 1 --replicas 4 --zero 3 --shard-group 2 --batch 8 --microbatches 2 --steps 3":
        "tests/executor/test_executor_fully_sharded.py::test_sharded_replicas_train_what_one_process_trains",
    "gpipe train --model transformer --option experts=4 --option top_k=2 --option shared_experts=1 --stages 1 "
    "--replicas 2 --expert-parallel 2 --batch 16 --microbatches 4 --steps 4 --clip-grad-norm 1.0":
        "tests/executor/test_expert_parallel.py::"
        "test_two_stages_of_experts_sharded_over_two_replicas_train_as_one_process_and_resume_without",
    "gpipe train --model transformer --option experts=4 --option top_k=2 --option shared_experts=1 --stages 1 "
    "--replicas 4 --expert-parallel 2 --zero 3 --batch 16 --microbatches 2 --steps 4":
        "tests/executor/test_expert_parallel_sharded.py::"
        "test_zero3_with_experts_sharded_over_their_own_replicas_trains_as_one_process_and_resumes_without",
    "gpipe train --model hf:mixtral --option hidden_size=32 --option intermediate_size=32 "
    "--option num_hidden_layers=2 --option num_attention_heads=4 --option num_key_value_heads=2 "
    "--option vocab_size=64 --option num_local_experts=4 --option num_experts_per_tok=2 "
    "--option output_router_logits=true --option seq=8 --stages 1 --replicas 2 --expert-parallel 2 --batch 8 "
    "--microbatches 2 --steps 2":
        "tests/executor/test_hf_expert_parallel.py::test_hugging_face_experts_sharded_over_two_replicas_train_as_one_process",
    "gpipe train --plan plan.json":
        "tests/executor/test_executor_replicas.py::test_a_plan_file_carries_replicas_zero_and_placement",
    "gpipe train --plan plan.json --steps 4 --save-every 2 --checkpoint-dir ckpt --optimizer adam --lr 0.003":
        "tests/executor/test_hf_models.py::test_training_a_hugging_face_model_with_gpipe_train",
    "gpipe train --plan plan.json --steps 6 --save-every 2 --checkpoint-dir ckpt --resume --optimizer adam "
    "--lr 0.003":
        "tests/executor/test_hf_models.py::test_training_a_hugging_face_model_with_gpipe_train",
    "make demo": "tests/commands/test_calibrate_demo.py::test_demo_writes_one_report_and_says_where",
    "gpipe demo --steps 30 --out-dir out": "tests/commands/test_calibrate_demo.py::test_demo_writes_one_report_and_says_where",
    "gpipe calibrate --quick --out costs.json && gpipe validate --costs costs.json --limit 4":
        "tests/calibrate/test_calibrate_validate.py::test_calibrate_then_validate_end_to_end",
    "gpipe calibrate --model transformer --layers 4 --d-model 128 --ff 512 --seq 32 --batch 32 --out costs.json":
        "tests/calibrate/test_calibrate_validate.py::test_calibrate_then_validate_end_to_end",
    "gpipe validate --costs costs.json --json": "tests/calibrate/test_calibrate_validate.py::test_calibrate_then_validate_end_to_end",
    "gpipe calibrate --model transformer --layers 4 --d-model 128 --ff 512 --seq 32 --batch 32 --out costs_b.json":
        "tests/calibrate/test_calibrate_validate.py::test_calibrate_then_validate_end_to_end",
    "gpipe validate --costs costs.json costs_b.json":
        "tests/calibrate/test_calibrate_validate.py::test_calibrate_then_validate_end_to_end",
    "gpipe simulate --costs costs.json --model transformer --layers 4 --d-model 128 --ff 512 --seq 32 --batch 32 "
    "--hardware cpu --stages 2 --microbatches 4": "tests/sim/test_calibrate_costs.py::test_gpipe_simulate_takes_costs",
    # a plan priced with a costs file, simulated with it and with another (a costs file written by the test)
    "gpipe plan --costs costs.json --out priced.json":
        "tests/commands/test_plan_costs.py::test_a_plan_priced_with_costs_is_simulated_with_them_to_the_microsecond",
    "gpipe simulate --plan priced.json":
        "tests/commands/test_plan_costs.py::test_a_plan_priced_with_costs_is_simulated_with_them_to_the_microsecond",
    "gpipe simulate --plan priced.json --costs costs_b.json":
        "tests/commands/test_plan_costs.py::test_explicit_costs_win_over_the_recorded_ones_with_a_note",
    "gpipe train --model mlp --option width=16 --batch 10 --microbatches 4 --stages 4 --steps 3 --nnodes 2 "
    "--node-rank 0 --rdzv-endpoint 127.0.0.1:29500 --report report.json --trace trace.json":
        "tests/executor/test_executor_nodes.py::test_two_nodes_train_as_one_whichever_starts_first",
    "gpipe train --model mlp --option width=16 --batch 10 --microbatches 4 --stages 4 --steps 3 --nnodes 2 "
    "--node-rank 1 --rdzv-endpoint 127.0.0.1:29500":
        "tests/executor/test_executor_nodes.py::test_two_nodes_train_as_one_whichever_starts_first",
    # docs/planning.md: a user's system file, written by the test from the page's own example
    "gpipe simulate --model llama3-8b --stages 4 --microbatches 32 --batch 64 --hardware h100-96gb.json":
        "tests/commands/test_hardware_files.py::test_the_documented_files_and_commands_run",
    "gpipe plan --model llama3-8b --hardware h100-nvlink,h100-96gb.json --nodes 2 --batch 256 --top 3 --out plan.json":
        "tests/commands/test_hardware_files.py::test_the_documented_files_and_commands_run",
    "gpipe fit-gpu benchmarks/published_runs/dev.json": "tests/sim/test_gpu_model.py::test_the_committed_fractions_are_the_fit_of_the_development_set_alone",
    "gpipe error-bands benchmarks/published_runs/validation.json benchmarks/published_runs/validation_moe.json --out sim/evidence/error_bands.json":
        "tests/commands/test_error_bands_command.py::test_building_gives_the_shipped_file_and_the_development_set_is_refused",
    ".venv/bin/python -m pytest -q tests/sim/test_notebooks.py": "tests/sim/test_notebooks.py::test_notebook_runs_top_to_bottom",
}
NOT_RUN: dict[str, str] = {
    "make test": "the suite this test is part of",
    ".venv/bin/pip install jupyterlab && .venv/bin/jupyter lab notebooks/": "installs a package and opens a server",
    ".venv/bin/pip install kaleido==0.2.1 && gpipe demo --force --picture docs/demo_report.png":
        "installs a package; renders the committed picture",
}


def commands_of(page: str) -> list[tuple[str, list[str]]]:
    """(command, output lines it must print) in page order; ``gpipe`` for ``.venv/bin/gpipe``."""
    found: list[tuple[str, list[str]]] = []
    kind = None  # the open block's language, None outside blocks
    pending = ""
    for line in (ROOT / page).read_text().splitlines():
        if line.startswith("```"):
            kind = line[3:].strip() if kind is None else None
            continue
        if kind == "sh":
            line = re.sub(r"\s+#.*$", "", line).strip()
            if not line or line.startswith("#"):
                continue
            pending += line[:-1].strip() + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                found.append((normalised(pending), []))
                pending = ""
        elif kind == "console":
            if line.startswith("$ "):
                found.append((normalised(line[2:]), []))
            elif line.strip() and found:
                found[-1][1].append(line.strip())
    return found


def normalised(command: str) -> str:
    return " ".join(command.replace(".venv/bin/gpipe ", "gpipe ").split())


def documented_commands() -> list[tuple[str, str, list[str]]]:
    return [(page, command, output) for page in PAGES for command, output in commands_of(page)]


def run(command: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    args = shlex.split(command)
    if args[0] != "gpipe":
        raise AssertionError(f"{command!r} is not a gpipe command: give it a SMALLER, COVERED or NOT_RUN entry")
    # the ranks torchrun starts run in cwd too: they find the project on PYTHONPATH
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return in_process.gpipe(*args[1:], env=env, cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_documented_command_runs(page, tmp_path):
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    for command, output in commands_of(page):
        if command in COVERED or command in NOT_RUN:
            continue
        for actual in SMALLER.get(command, [command]):
            done = run(actual, tmp_path)
            said = done.stdout + done.stderr
            if output:  # a console block: what it prints, exit code and all
                for line in output:
                    assert line in said, f"{page}: {command!r} did not print {line!r}:\n{said[-1500:]}"
            else:
                assert done.returncode == 0, f"{page}: {actual!r} failed:\n{said[-1500:]}"


def test_every_table_entry_is_documented_and_every_covering_test_exists():
    documented = {command for _, command, _ in documented_commands()}
    for table in (SMALLER, COVERED, NOT_RUN):
        stale = set(table) - documented
        assert not stale, f"no page documents {sorted(stale)}; drop them from the tables"
    assert not (set(SMALLER) & set(COVERED)) and not (set(SMALLER) & set(NOT_RUN)) and not (set(COVERED) & set(NOT_RUN))
    for test in COVERED.values():
        path, _, name = test.partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{test} does not exist"


def test_every_command_that_is_not_gpipe_is_accounted_for():
    for page, command, _ in documented_commands():
        if not command.startswith("gpipe ") or "&&" in command:
            assert command in COVERED or command in NOT_RUN or command in SMALLER, f"{page}: {command!r}"


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    lines = readme.splitlines()
    assert lines[2].startswith("`gpipe` ")  # what it is, in one sentence, above the two commands
    assert lines[lines.index("```sh") + 1:lines.index("```sh") + 3] == [
        "make demo   # sets up .venv, then calibrates, plans, simulates and trains on this machine; writes "
        "out/report.html",
        "make test   # sets up .venv, then runs the whole test suite"]
    assert "![" in readme and (ROOT / "docs" / "demo_report.png").exists()
    for page in PAGES[1:]:
        assert f"({page})" in readme or f"({page}#" in readme or page.endswith("demo_report.md"), page
