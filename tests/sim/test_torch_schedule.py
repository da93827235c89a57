"""torch.distributed.pipelining's schedule CSV: our lists round-trip through it, a plan's CSV predicts
the plan's step, the CSVs torch itself writes are simulated, and a file this cannot run is one line."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from gpipe.main import main
from sim.catalog.hardware import get_system
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.errors import GpipeInputError
from sim.formats.plan import load_plan
from sim.planner.partition import even_partition
from sim.schedules.schedule import build_schedule
from sim.schedules.torch_schedule import read_schedule_csv, schedule_shape, write_schedule_csv
from sim.workloads.models import get_workload


def torch_csv(path, schedule_class, stages: int, virtual: int, microbatches: int, v_shaped: bool = False) -> str:
    """The CSV torch's own ``schedule_class`` dumps for rank 0's view of K x V stages, loop-placed or
    in a V (its compute-only order is the same for every rank; no process group is needed to build it)."""
    indices = (0, 2 * stages - 1) if v_shaped else range(0, stages * virtual, stages)
    local = [SimpleNamespace(num_stages=stages * virtual, group_size=stages, group_rank=0, stage_index=s,
                             submod=torch.nn.Identity()) for s in indices]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schedule = schedule_class(local, microbatches, loss_fn=lambda output, target: output)
    schedule._dump_csv(str(path), format="compute_only")
    return str(path)


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_our_lists_round_trip_through_torchs_csv(tmp_path, schedule, virtual, checkpoint, stages):
    microbatches = 2 * stages
    ours = build_schedule(stages, microbatches, schedule, checkpoint, virtual)
    path = str(tmp_path / "schedule.csv")
    write_schedule_csv(ours, path)
    assert "R" not in open(path).read()  # torch has no recompute action: it is put back on reading
    lists, m, v = read_schedule_csv(path, checkpoint)
    assert (lists, m, v) == (ours, microbatches, virtual)


def test_a_plans_csv_predicts_the_plans_step(tmp_path, capsys):
    plan_path, csv_path = tmp_path / "plan.json", tmp_path / "plan.csv"
    flags = ["--model", "uniform", "--layers", "16", "--batch", "16", "--hardware", "v100-nvlink"]
    assert main(["plan", *flags, "--stages-options", "4", "--schedules", "interleaved", "--checkpoints",
                 "except_last", "--out", str(plan_path), "--schedule-csv-out", str(csv_path)]) == 0
    assert "schedule written to" in capsys.readouterr().out
    plan = load_plan(str(plan_path))
    assert plan.layout.schedule == "interleaved" and plan.layout.virtual_stages >= 2
    lists, m, v = read_schedule_csv(str(csv_path), plan.layout.checkpoint)
    result = simulate(get_workload("uniform", {"layers": 16}), get_system("v100-nvlink"), plan.partition, 16,
                      ParallelLayout.for_partition(plan.partition, m, checkpoint=plan.layout.checkpoint,
                                                   schedule="interleaved", virtual_stages=v),
                      actions=lists)
    assert result.step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=1e-12)
    assert main(["simulate", *flags, "--partition", ",".join(map(str, plan.partition)), "--checkpoint",
                 plan.layout.checkpoint, "--schedule-csv", str(csv_path), "--json"]) == 0


@pytest.mark.parametrize("stages,virtual,microbatches", [(2, 2, 4), (4, 2, 8), (2, 3, 6)])
def test_the_csvs_torch_writes_are_simulated(tmp_path, stages, virtual, microbatches):
    """Torch's interleaved 1F1B predicts what ours does (the same order); its interleaved zero-bubble
    schedule, with I and W, a smaller bubble."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

    workload, system = get_workload("uniform", {"layers": 8 * virtual}), get_system("ideal")
    partition = even_partition(8 * virtual, stages * virtual)

    def predicted(actions=None):
        return simulate(workload, system, partition, 16,
                        ParallelLayout.for_partition(partition, microbatches, checkpoint="never",
                                                     schedule="interleaved", virtual_stages=virtual), actions=actions)

    ours = predicted()
    one_f_one_b = predicted(read_schedule_csv(torch_csv(tmp_path / "a.csv", ScheduleInterleaved1F1B, stages, virtual,
                                                        microbatches))[0])
    zero_bubble = predicted(read_schedule_csv(torch_csv(tmp_path / "b.csv", ScheduleInterleavedZeroBubble, stages,
                                                        virtual, microbatches))[0])
    assert one_f_one_b.step_time_s == pytest.approx(ours.step_time_s, rel=1e-12)
    assert zero_bubble.bubble_fraction < ours.bubble_fraction


def _write(path, rows):
    path.write_text("\n".join(",".join(row) for row in rows) + "\n")
    return str(path)


@pytest.mark.parametrize("rows,message", [
    ([["0F0", "0X0"]], "cell '0X0' is not an action torch writes"),
    ([["0F0"], ["1F0", "1B0"]], "stage 0, micro-batch 0 has actions ['F']"),
    ([["0F0", "0B0"], ["1B0", "1F0"]], "the schedule deadlocks: every rank waits for an input no rank produces "
                                       "(rank 0 at 0B0, rank 1 at 1B0)"),
    ([["0F0", "1F0", "1B0", "0B0"], ["2F0", "3F0", "3B0", "2B0"]], "stage 1 runs on rank 0, not rank 1"),
    ([["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"], ["4F0", "5F0", "5B0", "4B0"]],
     "stage 2 runs on rank 1, not rank 2"),
    ([], "holds no actions"),
])
def test_a_csv_this_cannot_run_is_one_line(tmp_path, capsys, rows, message):
    path = _write(tmp_path / "bad.csv", rows)
    with pytest.raises(GpipeInputError, match=None) as info:
        read_schedule_csv(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert main(["simulate", "--model", "uniform", "--layers", "8", "--schedule-csv", path]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_torchs_v_shaped_csvs_are_our_v_schedules(tmp_path, name, stages):
    """torch's ScheduleZBVZeroBubble and ScheduleDualPipeV dump the lists our zbv and dualpipev build
    (DualPipeV's overlapped pairs as their forward then backward), so they predict the same step."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    schedule_class = ScheduleZBVZeroBubble if name == "zbv" else ScheduleDualPipeV
    for microbatches in sorted({2 * stages, 2 * stages + 3, 4 * stages}):
        path = torch_csv(tmp_path / f"{name}{microbatches}.csv", schedule_class, stages, 2, microbatches, True)
        lists, m, v = read_schedule_csv(path, "except_last")
        assert (lists, m, v) == (build_schedule(stages, microbatches, name, "except_last", 2), microbatches, 2)
        assert schedule_shape(lists, v) == name
    workload, system = get_workload("uniform", {"layers": 16}), get_system("v100-nvlink")
    partition, microbatches = even_partition(16, 2 * stages), 4 * stages
    path = torch_csv(tmp_path / "sim.csv", schedule_class, stages, 2, microbatches, True)
    ours = simulate(workload, system, partition, 2 * microbatches,
                    ParallelLayout.for_partition(partition, microbatches, checkpoint="never", schedule=name,
                                                 virtual_stages=2))
    theirs = simulate(workload, system, partition, 2 * microbatches,
                      ParallelLayout.for_partition(partition, microbatches, checkpoint="never", schedule=name,
                                                   virtual_stages=2),
                      actions=read_schedule_csv(path, "never")[0])
    assert theirs.bubble_fraction == pytest.approx(ours.bubble_fraction, rel=1e-12)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedules_round_trip_and_simulate_from_the_command_line(tmp_path, capsys, name):
    ours = build_schedule(3, 6, name, "always", 2)
    path = str(tmp_path / "v.csv")
    write_schedule_csv(ours, path)
    assert read_schedule_csv(path, "always") == (ours, 6, 2)
    assert main(["simulate", "--model", "uniform", "--layers", "12", "--checkpoint", "always", "--hardware", "ideal",
                 "--schedule-csv", path, "--json"]) == 0
    import json
    from_csv = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--model", "uniform", "--layers", "12", "--checkpoint", "always", "--stages", "3",
                 "--hardware", "ideal", "--microbatches", "6", "--schedule", name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(from_csv["step_time_s"], rel=1e-12)
