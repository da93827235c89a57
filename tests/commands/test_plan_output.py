"""What ``gpipe plan`` prints answers the question: the best plan of each hardware kind, one row for
plans equal but for placement, short partitions, efficiencies labelled as given, assumed (with days
and dollars across a range) or uncalibrated, the hardware a cheapest line left out, and names
suggested for a typo."""

import json
import shlex

import pytest

from gpipe.main import build_parser, main
from gpipe.plan_rows import compact_partition
from sim.catalog.efficiency_note import ASSUMED_EFFICIENCY_RANGE
from sim.catalog.hardware import get_system
from sim.planner.efficiency_range import at_efficiency
from sim.planner.search import search
from sim.workloads.models import get_workload

GPT = ["--model", "transformer", "--option", "layers=8", "--option", "d_model=768", "--option", "ff=3072",
       "--option", "heads=16", "--option", "seq=512", "--option", "vocab=5000", "--batch", "32", "--quiet"]
THREE = "h100-nvlink,b200-nvlink,mi300x"
# wide enough layers that the step follows the FLOP/s efficiency (GPT's are memory-bound on a B200)
WIDE = ["--model", "llama3-8b", "--batch", "64", "--quiet"]
# a layout whose every stage is a whole node (T = 8): the two placements predict the same step
WHOLE_NODES = ["--model", "transformer", "--layers", "8", "--d-model", "1024", "--ff", "4096", "--heads", "16",
               "--seq", "512", "--vocab", "32000", "--hardware", "h100-nvlink", "--nodes", "4",
               "--tensor-parallel-options", "8", "--batch", "64", "--quiet"]


def plan(capsys, *flags) -> str:
    assert main(["plan", *flags]) == 0
    return capsys.readouterr().out


def table_rows(text: str, header: str = "rank") -> list[list[str]]:
    """The rows of the first table under a line starting with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 1:]:
        cells = line.split()
        if not cells or not (cells[0].isdigit() or cells[0].startswith(">")):
            break
        rows.append(cells)
    return rows


def test_several_hardware_kinds_show_the_best_plan_of_each(capsys):
    out = plan(capsys, *GPT, "--hardware", THREE, "--top", "3")
    assert {row[1] for row in table_rows(out)} == {"b200-nvlink"}  # the ranking alone shows one kind
    best = table_rows(out.split("best per hardware")[1])
    assert [row[1] for row in best] == ["b200-nvlink", "mi300x", "h100-nvlink"]
    assert [row[0] for row in best] == ["1", ">3", ">3"]
    data = json.loads(plan(capsys, *GPT, "--hardware", THREE, "--top", "3", "--json"))
    steps = {name: entry["best"]["step_time_s"] for name, entry in data["hardware"].items()}
    assert set(steps) == set(THREE.split(",")) and min(steps.values()) == data["ranked"][0]["step_time_s"]


def test_plans_equal_but_for_placement_share_one_row(capsys):
    ranked = json.loads(plan(capsys, *WHOLE_NODES, "--top", "4", "--json"))["ranked"]
    layout = lambda e: (e["replicas"], e["pipeline_stages"], e["virtual_stages"], e["microbatches"],  # noqa: E731
                        e["checkpoint"], e["schedule"], tuple(e["partition"]))
    twins = [(a, b) for i, a in enumerate(ranked) for b in ranked[i + 1:]
             if layout(a) == layout(b) and a["placement"] != b["placement"] and a["step_time_s"] == b["step_time_s"]]
    assert twins, "the scenario should hold plans equal but for placement"
    rows = table_rows(plan(capsys, *WHOLE_NODES, "--top", "4"))
    assert len(rows) == 4
    shown = [tuple(row[2:9]) + (row[-1],) for row in rows]  # D K V M checkpoint schedule placement ... partition
    assert len(set(shown)) == 4, rows
    assert all(row[8] == "any" for row in rows)


@pytest.mark.parametrize("partition,text", [
    ([2] * 8, "8x2"), ([9, 9, 9, 7], "3x9,7"), ([11] + [10] * 6 + [11], "11,6x10,11"), ([41, 41], "2x41"),
    ([5], "5"), ([1, 2] * 32, "64x1-2"), ([3] * 40, "40x3"),
])
def test_partitions_are_written_run_length_encoded(partition, text):
    assert compact_partition(partition) == text


def test_tables_stay_narrow_with_days_and_dollars(capsys):
    out = plan(capsys, *GPT, "--hardware", THREE, "--top", "3", "--train-tokens", "1B")
    lines = out.splitlines()
    table = lines[1:lines.index(next(line for line in lines if line.startswith("placement:")))]
    assert table and max(len(line) for line in table) < 140, table


def test_an_efficiency_the_user_gave_is_labelled_given(capsys):
    out = plan(capsys, *GPT, "--hardware", "b200-nvlink", "--efficiency", "0.7", "--train-tokens", "1B", "--top", "1")
    line = next(line for line in out.splitlines() if line.startswith("b200-nvlink x1 node(s):"))
    assert "efficiency given (70%" in line and "assumed" not in out
    data = json.loads(plan(capsys, *GPT, "--hardware", "b200-nvlink", "--efficiency", "0.7", "--top", "1", "--json"))
    assert data["hardware"]["b200-nvlink"]["efficiency"] == "given"


def test_an_assumed_efficiency_gives_days_and_dollars_across_its_range(capsys):
    out = plan(capsys, *WIDE, "--hardware", "mi300x", "--train-tokens", "1T", "--top", "1")
    fastest = next(line for line in out.splitlines() if line.startswith("fastest:"))
    low, high = ASSUMED_EFFICIENCY_RANGE
    assert f"(efficiency assumed, at {low:.0%}..{high:.0%} of peak FLOP/s: " in fastest
    data = json.loads(plan(capsys, *WIDE, "--hardware", "mi300x", "--train-tokens", "1T", "--top", "1",
                           "--json"))
    entry = data["hardware"]["mi300x"]
    at_low, at_high = entry["best_at_efficiency_range"]
    point = entry["best"]["training"]
    assert at_low["days"] > point["days"] > at_high["days"] and at_low["cost"] > point["cost"] > at_high["cost"]
    assert f"{at_low['days']:.1f}..{at_high['days']:.1f} days" in fastest


def test_a_plan_simulated_again_at_its_own_efficiency_gives_its_step():
    """The range's ends come from the searched plan simulated again, not scaled: at the assumed
    efficiency itself the step is the search's, to the last bit; at the ends it is not 1/efficiency."""
    workload = get_workload("transformer", {"layers": 4, "d_model": 4096, "ff": 16384, "heads": 32, "seq": 2048,
                                            "vocab": 32000, "precision": "bf16"})
    system = get_system("mi300x")
    option = search(workload, system, 32, [1, 2, 4], [1, 2, 4, 8], replica_options=[1, 2]).best
    option.hardware = system.name
    again = at_efficiency(option, workload, system, 32, system.device.efficiency)
    assert again.step_time_s == option.step_time_s
    slow = at_efficiency(option, workload, system, 32, system.device.efficiency / 2).step_time_s
    assert option.step_time_s < slow < 2 * option.step_time_s  # not all of the step is matmuls


def test_the_cheapest_line_names_the_hardware_without_a_price(capsys):
    out = plan(capsys, *GPT, "--hardware", "h100-nvlink,gb200-nvl72", "--train-tokens", "1B", "--top", "2")
    cheapest = next(line for line in out.splitlines() if line.startswith("cheapest"))
    assert cheapest.startswith("cheapest of the priced hardware (no list price for gb200-nvl72; give "
                               "--price-per-device-hour to price it): h100-nvlink, ")
    out = plan(capsys, *GPT, "--hardware", "gb200-nvl72,tpu-v5p", "--train-tokens", "1B", "--top", "1")
    assert "cheapest: unknown, no list price for gb200-nvl72, tpu-v5p" in out


@pytest.mark.parametrize("flags,message", [
    (["--model", "lama3-70b"], "unknown model 'lama3-70b' (did you mean llama3-70b?); choose one of"),
    (["--model", "transformr"], "unknown model 'transformr' (did you mean transformer?)"),
    (["--hardware", "h100"], "unknown hardware 'h100' (did you mean h100-nvlink or h100-pcie?); choose one of"),
    (["--hardware", "a100-nvlink,mi300"], "unknown hardware 'mi300' (did you mean mi300x?)"),
])
def test_an_unknown_name_suggests_the_names_it_resembles(flags, message, capsys):
    assert main(["plan", *flags, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_cpu_figures_without_costs_say_they_are_uncalibrated_and_how_to_calibrate(capsys):
    out = plan(capsys, "--model", "transformer", "--layers", "6", "--d-model", "128", "--batch", "8",
               "--hardware", "cpu", "--top", "1", "--quiet")
    note = next(line for line in out.splitlines() if line.startswith("cpu: uncalibrated"))
    command = note.split("measure it with ")[1].split(", then add")[0]
    assert command == "gpipe calibrate --model transformer --layers 6 --d-model 128 --batch 8 --out costs.json"
    args = build_parser(shlex.split(command)[1:]).parse_args(shlex.split(command)[1:])  # calibrate's real flags
    assert (args.model, args.layers, args.d_model, args.batch) == ("transformer", 6, 128, 8)
    assert main(["simulate", "--model", "transformer", "--layers", "6", "--hardware", "cpu", "--stages", "2"]) == 0
    assert "cpu: uncalibrated" in capsys.readouterr().out
    given = plan(capsys, "--model", "transformer", "--layers", "6", "--hardware", "cpu", "--efficiency", "0.5",
                 "--top", "1", "--quiet")
    assert "uncalibrated" not in given and "cpu: efficiency given (50%" in given
    assert "uncalibrated" not in plan(capsys, "--model", "uniform", "--hardware", "cpu", "--top", "1", "--quiet")
