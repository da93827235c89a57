"""Context parallelism in the simulator and planner: each sequence split over C devices of the node,
ring attention's exchange beside the attention, and one line for what cannot be split."""

import json

import pytest

from gpipe.main import main
from sim.catalog.hardware import get_system
from sim.catalog.kernel_model import ring_exposed_s
from sim.errors import GpipeInputError
from sim.formats.plan import load_plan
from sim.workloads.models import get_workload
from sim.workloads.tensor_parallel import with_tensor_parallel
from tests.helpers import in_process

LONG = {"layers": 2, "d_model": 512, "ff": 2048, "heads": 8, "kv_heads": 2, "seq": 4096, "vocab": 8000,
        "attention": "flash", "precision": "bf16-model"}


def split(tp=1, cp=1, hardware="h100-nvlink"):
    workload, groups = with_tensor_parallel(get_workload("transformer", LONG), get_system(hardware), tp, tp > 1, cp)
    return workload, groups


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_each_device_holds_its_block_of_every_sequence(cp):
    whole, _ = split()
    part, groups = split(cp=cp)
    s, d, e = LONG["seq"], LONG["d_model"], LONG["kv_heads"] * LONG["d_model"] // LONG["heads"]
    assert groups.devices_per_node == 8 // cp
    assert part.parameter_count == whole.parameter_count  # the position table is whole on every device
    a, b = whole.layers[1], part.layers[1]
    # the projections' FLOPs and every saved byte split C ways; the attention's queries s/C against all s keys
    projections = lambda spec: spec.flops_per_row - spec.attention_flops_per_row  # noqa: E731
    assert projections(b) == pytest.approx(projections(a) / cp)
    assert b.attention_flops_per_row == pytest.approx(a.attention_flops_per_row / cp)
    assert b.saved_bytes_per_row == pytest.approx(a.saved_bytes_per_row / cp)
    assert b.cp_steps == cp - 1 and b.cp_exchange_bytes_per_row == pytest.approx(2 * (s // cp) * e * 2)
    assert part.layers[0].params == whole.layers[0].params


def test_the_ring_exchange_hides_behind_the_attention_up_to_its_length():
    assert ring_exposed_s(0, 1.0, 0.0, 0.0) == (0.0, 0.0)
    # 3 sends of 1 s beside 3/4 of a 2 s attention forward (and 4 s backward, twice the bytes)
    assert ring_exposed_s(3, 1.0, 2.0, 4.0) == pytest.approx((3 - 1.5, 6 - 3.0))
    assert ring_exposed_s(3, 0.1, 2.0, 4.0) == (0.0, 0.0)
    part, groups = split(cp=4)
    cost = part.layer_costs(1, groups.device)[1]
    no_ring, _ = split(cp=4)
    no_ring.tp_link = None  # the same split with the exchange left out
    bare = no_ring.layer_costs(1, groups.device)[1]
    assert cost.forward_s >= bare.forward_s and cost.backward_s >= bare.backward_s


def test_the_c_copies_sum_their_gradients_on_the_node():
    _, groups = split(cp=4)
    part, _ = split(cp=4)
    unsplit = get_workload("transformer", LONG)
    assert part.layer_costs(1, groups.device)[1].optimizer_s > unsplit.layer_costs(1, groups.device)[1].optimizer_s


@pytest.mark.parametrize("change,tp,cp,message", [
    ({}, 1, 3, "does not divide seq=4096"),
    ({"attention": "eager"}, 1, 2, "add --option attention=flash"),
    ({}, 2, 8, "16 devices per stage must divide"),
    ({}, 1, 0, "--context-parallel"),
])
def test_what_cannot_be_split_is_one_line(change, tp, cp, message):
    with pytest.raises(GpipeInputError, match=message):
        with_tensor_parallel(get_workload("transformer", {**LONG, **change}), get_system("h100-nvlink"), tp, False, cp)


def test_the_plan_carries_c_and_the_executor_refuses_it(tmp_path, capsys):
    flags = ["--model", "transformer", *[f"--option={k}={v}" for k, v in LONG.items() if k != "precision"],
             "--precision", "bf16-model", "--hardware", "h100-nvlink", "--nodes", "2", "--batch", "8"]
    out = tmp_path / "plan.json"
    assert main(["plan", *flags, "--context-parallel", "2", "--tensor-parallel-options", "1", "--dp-overlap",
                 "--quiet", "--json",
                 "--out", str(out)]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(r["context_parallel"] == 2 for r in ranked)
    plan = load_plan(out)
    assert plan.context_parallel == 2 and plan.dp_overlap
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(ranked[0]["step_time_s"], rel=1e-12)
    proc = in_process.gpipe("train", "--plan", str(out))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "context_parallel" in proc.stderr
