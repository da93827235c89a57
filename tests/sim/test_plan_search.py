"""The planner's search of a typed space: the best plan ``gpipe plan`` prints for the same question,
without a command line; the space is a frozen record; what cannot combine is one line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sim.catalog.hardware import get_system
from sim.errors import GpipeInputError
from sim.formats.costs import MeasuredWorkload
from sim.planner.plan_search import fastest_and_cheapest, search_plans
from sim.planner.space import SearchSpace, Target
from sim.planner.training_cost import Costing
from sim.workloads.models import get_workload
from tests.helpers import in_process
from tests.helpers.costs import synthetic_costs


def layout(entry: dict) -> tuple:
    return (entry["tensor_parallel"], entry["replicas"], entry["pipeline_stages"], entry["virtual_stages"],
            entry["microbatches"], entry["checkpoint"], entry["schedule"], list(entry["partition"]))


def option_layout(option) -> tuple:
    c = option.candidate
    return (c.tensor_parallel, c.replicas, c.stages, c.virtual_stages, c.microbatches, c.checkpoint, c.schedule,
            list(option.partition))


def command_best(*flags: str) -> dict:
    done = in_process.gpipe("plan", *flags, "--json", "--quiet")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["ranked"][0]


def test_the_space_searched_directly_gives_the_command_s_best_plan():
    system = get_system("h100-nvlink", 2)
    workload = get_workload("transformer", {"layers": 8, "precision": "bf16-model", "attention": "flash"})
    space = SearchSpace(hardware=(Target(system, workload, 64, "bf16-model"),), microbatches=(1, 2, 4, 8), zero=(0, 1),
                        tensor_parallel=(1, 2))
    found = search_plans(space, top=3)
    best = command_best("--model", "transformer", "--layers", "8", "--hardware", "h100-nvlink", "--nodes", "2",
                        "--batch", "64", "--microbatch-options", "1,2,4,8", "--zero-options", "0,1",
                        "--tensor-parallel-options", "1,2")
    assert option_layout(found.best) == layout(best)
    assert found.best.step_time_s == pytest.approx(best["step_time_s"], rel=1e-12)
    assert [p.system.name for p in found.planned] == ["h100-nvlink"]


def test_several_systems_ranked_by_cost_as_the_command_ranks_them():
    targets = tuple(Target(get_system(name), get_workload("transformer", {"layers": 8, "precision": "bf16-model",
                                                                         "attention": "flash"}), 32, "bf16-model")
                    for name in ("a100-nvlink", "h100-nvlink"))
    costing = Costing(train_tokens=1e9, rank_by="cost", several_systems=True)
    space = SearchSpace(hardware=targets, microbatches=(1, 2, 4), tensor_parallel=(1,))
    found = search_plans(space, costing, top=2)
    best = command_best("--model", "transformer", "--layers", "8", "--hardware", "a100-nvlink,h100-nvlink",
                        "--batch", "32", "--microbatch-options", "1,2,4", "--tensor-parallel-options", "1",
                        "--train-tokens", "1B", "--rank-by", "cost")
    assert (found.best.hardware, *option_layout(found.best)) == (best["hardware"], *layout(best))
    assert found.best.cost.cost == pytest.approx(best["training"]["cost"], rel=1e-12)
    fastest, cheapest = fastest_and_cheapest(space, costing, found.ranked)
    assert cheapest is found.best and fastest.step_time_s <= cheapest.step_time_s


def test_measured_costs_are_searched_per_stage_count_as_the_command_does(tmp_path):
    from sim.formats.costs import write_costs

    path = tmp_path / "costs.json"
    write_costs(synthetic_costs(), path)
    from sim.formats.costs import read_costs

    workload = MeasuredWorkload(read_costs(path))
    assert workload.measured_costs and not get_workload("mlp", {}).measured_costs
    space = SearchSpace(hardware=(Target(get_system("cpu"), workload, 8, "fp32"),), stages=(1, 2), microbatches=(2, 4))
    best = command_best("--costs", str(path), "--hardware", "cpu", "--stages-options", "1,2", "--microbatch-options",
                        "2,4")
    found = search_plans(space)
    assert option_layout(found.best) == layout(best)
    assert found.best.step_time_s == pytest.approx(best["step_time_s"], rel=1e-12)
    with pytest.raises(GpipeInputError, match="plan the analytic models; drop --costs"):
        search_plans(space, Costing(rank_by="cost"))


def test_the_space_is_a_frozen_record_and_what_cannot_combine_is_one_line():
    target = Target(get_system("a100-nvlink"), get_workload("transformer", {}), 16, "bf16")
    space = SearchSpace(hardware=(target,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        space.stages = (2,)  # type: ignore[misc]
    for wrong, message in ((dict(virtual_stages=(2,), schedules=("gpipe",)), "needs the interleaved schedule"),
                           (dict(zero=(1,), replicas=(1,)), "--zero-options 1 shards optimizer state"),
                           (dict(stages=(64,)), "--stages-options 64 exceeds the model's 6 layers"),
                           (dict(tensor_parallel=(3,)), "--tensor-parallel 3")):
        with pytest.raises(GpipeInputError, match=message) as info:
            search_plans(dataclasses.replace(space, **wrong))
        assert "\n" not in str(info.value)
