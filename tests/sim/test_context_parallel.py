"""Context parallelism in the simulator and planner: each sequence split over C devices of the node
or, T x C filling whole nodes, a ring across them; ring attention's exchange beside the attention,
and one line for what cannot be split."""

import copy
import json

import pytest

from gpipe.main import main
from sim.catalog.hardware import get_system
from sim.catalog.user_systems import resolve_system
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


@pytest.mark.parametrize("change,tp,cp,hardware,message", [
    ({}, 1, 3, "h100-nvlink", "does not divide seq=4096"),
    ({"attention": "eager"}, 1, 2, "h100-nvlink", "add --option attention=flash"),
    # 128 devices neither divide a 72-GPU rack nor fill whole racks: a group would straddle two
    ({}, 2, 64, "gb200-nvl72", "128 devices per stage must divide gb200-nvl72's 72 devices per node or fill whole"),
    ({}, 1, 0, "h100-nvlink", "--context-parallel"),
    ({}, 1, 16, "h100-nvlink", "16 devices per stage but h100-nvlink with 1 node\\(s\\) has 8; use --nodes 2"),
])
def test_what_cannot_be_split_is_one_line(change, tp, cp, hardware, message):
    with pytest.raises(GpipeInputError, match=message) as raised:
        with_tensor_parallel(get_workload("transformer", {**LONG, **change}), get_system(hardware), tp, False, cp)
    assert "\n" not in str(raised.value)


def test_the_planner_searches_only_the_t_whose_group_the_nodes_hold():
    from sim.planner.space import SearchSpace, tensor_parallel_values

    space = SearchSpace((), context_parallel=8)
    workload = get_workload("transformer", {**LONG, "heads": 16, "kv_heads": 16})
    assert tensor_parallel_values(space, workload, get_system("h100-nvlink", 2)) == [1, 2]  # 8 and 16 devices
    assert tensor_parallel_values(space, workload, get_system("h100-nvlink", 8)) == [1, 2, 4, 8]


def test_tensor_parallelism_beyond_a_node_is_refused_with_context_parallelism_too():
    from sim.workloads.tensor_parallel import check_context_parallel

    with pytest.raises(GpipeInputError, match="--tensor-parallel 16 spans more than a node"):
        check_context_parallel(2, get_workload("transformer", {**LONG, "heads": 16, "kv_heads": 16}),
                               get_system("h100-nvlink", 4), 16)


def test_a_ring_across_nodes_crosses_the_inter_node_link():
    """T x C = 2 x 8 on 8-GPU nodes: TP inside a node, four CP ranks per node, the ring over two
    nodes; its steps wait for the inter-node link, its gradients are summed on the node's link then
    across the two nodes, and the stage is one group per node pair; memory is the same split."""
    from sim.engine.allreduce import ring_allreduce_s

    system = get_system("h100-nvlink", 4)
    workload = get_workload("transformer", LONG)
    across, groups = with_tensor_parallel(workload, system, 2, True, 8)
    assert across.cp_link == system.inter_link and across.cp_ranks_per_node == 4
    assert (groups.devices_per_node, groups.nodes, groups.total_devices) == (1, 2, 2)
    sixteen = resolve_system({"base": "h100-nvlink", "gpus_per_node": 16})  # the same 16 devices on one node
    inside, _ = with_tensor_parallel(workload, sixteen, 2, True, 8)
    assert inside.cp_link is None
    assert [layer.saved_bytes_per_row for layer in across.layers] == [layer.saved_bytes_per_row
                                                                       for layer in inside.layers]
    spec = across.layers[1]
    send_s = system.inter_link.transfer_s(spec.cp_exchange_bytes_per_row * 1)
    assert send_s > system.intra_link.transfer_s(spec.cp_exchange_bytes_per_row * 1)
    on_node = copy.copy(across)
    on_node.cp_link, on_node.cp_ranks_per_node = None, 8  # the same ring priced as if on the node's link
    far, near = across.layer_costs(1, groups.device)[1], on_node.layer_costs(1, groups.device)[1]
    grad = far.grad_bytes
    expected = (ring_allreduce_s(grad, 4, system.intra_link) + ring_allreduce_s(grad / 4, 2, system.inter_link)
                - ring_allreduce_s(grad, 8, system.intra_link))
    assert far.optimizer_s - near.optimizer_s == pytest.approx(expected)
    assert far.backward_s >= near.backward_s and far.saved_bytes == near.saved_bytes


def test_a_stage_of_whole_nodes_sends_and_reduces_across_nodes():
    """Each group of T x C = 16 devices is one device per node of the pipeline's system, so a hop
    between stages and a stage's data-parallel all-reduce both cross the inter-node link."""
    from sim.engine.allreduce import data_parallel_group, group_allreduce_s
    from sim.workloads.tensor_parallel import tensor_parallel_system

    system = get_system("h100-nvlink", 8)
    groups = tensor_parallel_system(system, 16)
    assert (groups.devices_per_node, groups.nodes) == (1, 4)
    assert groups.link_between(0, 1) == system.inter_link
    members = data_parallel_group(0, 2, 2)
    assert group_allreduce_s(1e9, members, groups) == pytest.approx(ring_allreduce_s_inter(1e9, 2, system))


def ring_allreduce_s_inter(nbytes, parties, system):
    from sim.engine.allreduce import ring_allreduce_s

    return ring_allreduce_s(nbytes, parties, system.inter_link)


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
    assert plan.layout.context_parallel == 2 and plan.dp_overlap
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(ranked[0]["step_time_s"], rel=1e-12)
    proc = in_process.gpipe("train", "--plan", str(out))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "context_parallel" in proc.stderr


def test_simulate_runs_a_stage_over_two_nodes_and_names_them(capsys):
    flags = ["simulate", "--model", "transformer", *[f"--option={k}={v}" for k, v in LONG.items() if k != "precision"],
             "--precision", "bf16-model", "--hardware", "h100-nvlink", "--nodes", "2", "--tensor-parallel", "2",
             "--context-parallel", "8", "--stages", "1", "--batch", "2"]
    assert main([*flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"] == {"system": "h100-nvlink", "nodes": 2} and data["context_parallel"] == 8
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "h100-nvlink x2 node(s)" in out
    assert "each sequence split over 8 devices of 2 nodes, its ring on the inter-node link (16 per stage)" in out
