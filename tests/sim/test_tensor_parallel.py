"""Tensor and sequence parallelism in the simulator and planner: literal formulas, T = 1 unchanged,
the planner's layouts, and one line for what cannot be split."""

import json

import pytest

from gpipe.main import main
from sim.catalog.hardware import get_system
from sim.engine.allreduce import ring_allreduce_s
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.formats.plan import load_plan
from sim.workloads.models import get_workload
from sim.workloads.precision import FP32_BYTES
from sim.workloads.tensor_parallel import with_tensor_parallel
from sim.workloads.transformer import transformer_layers

GPT = {"layers": 4, "d_model": 512, "ff": 2048, "heads": 8, "seq": 256, "vocab": 8000}
ROWS = 4


def options(precision="bf16", dropout=0.0):
    return {**GPT, "precision": precision, "dropout": dropout}


def roofline(name, nodes=1):
    """The catalog system timed by the roofline, as before GPU kernels were fitted."""
    return get_system(name, nodes, fitted=False)


def block(tp, sp, precision="bf16", dropout=0.0, system="a100-nvlink"):
    workload, groups = with_tensor_parallel(get_workload("transformer", options(precision, dropout)),
                                            roofline(system), tp, sp)
    return workload.layer_costs(ROWS, groups.device)[1], workload.layers[1]


def test_one_device_is_todays_prediction():
    """Figures of the simulator before tensor parallelism existed, for the same command (since
    updated once, when the loss's passes over the logits joined the head's traffic)."""
    expected = {"a100-nvlink": 0.005422883844812816, "h100-nvlink": 0.0036169122366832497}
    for hardware, step_s in expected.items():
        workload = get_workload("transformer", {"layers": 6, "d_model": 512, "ff": 2048, "heads": 8, "seq": 256,
                                                "vocab": 8000, "precision": "bf16"})
        split, system = with_tensor_parallel(workload, roofline(hardware), 1, True)
        assert split is workload
        result = simulate(split, system, (4, 4), 16,
                          ParallelLayout.for_partition((4, 4), 4, checkpoint="always", replicas=2), record=False)
        assert result.step_time_s == step_s
        assert [s.peak_memory_bytes for s in result.stages] == [285048832, 295994368, 285048832, 295994368]


def collective_s(tp, sp, layer=1):
    """(forward, backward) seconds a layer's tensor-parallel collectives add: its costs with the
    node's link less its costs with none."""
    from sim.workloads.models import AnalyticWorkload

    system = roofline("a100-nvlink")
    with_link, _ = with_tensor_parallel(get_workload("transformer", options()), system, tp, sp)
    no_link = AnalyticWorkload("transformer", with_link.options, with_link.layers, tp, sp)
    a, b = with_link.layer_costs(ROWS, system.device)[layer], no_link.layer_costs(ROWS, system.device)[layer]
    assert a.recompute_s == a.forward_s  # a recompute runs the forward's collectives again
    return a.forward_s - b.forward_s, a.backward_s - b.backward_s


def ring_s(tp, tensor_bytes):
    link = roofline("a100-nvlink").intra_link
    return 2 * (tp - 1) / tp * tensor_bytes / link.bandwidth_bytes_per_s + 2 * (tp - 1) * link.latency_s


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_blocks_collectives_are_two_allreduces_each_way_on_nvlink(tp):
    """Megatron's f and g: two all-reduces of the (rows, seq, d) activation in bf16 forward, two
    backward; the ring puts 2(T-1)/T of the bytes on each device's NVLink, with 2(T-1) latencies.
    With sequence parallelism, all-gather and reduce-scatter pairs of the same volume, and backward
    a third (the all-gathers of the inputs kept split and of the row-parallel output gradients)."""
    tensor_bytes = ROWS * GPT["seq"] * GPT["d_model"] * 2
    assert ring_allreduce_s(tensor_bytes, tp, roofline("a100-nvlink").intra_link) == \
        pytest.approx(ring_s(tp, tensor_bytes), rel=1e-12)
    for sp in (False, True):
        forward, backward = collective_s(tp, sp)
        assert forward == pytest.approx(2 * ring_s(tp, tensor_bytes), rel=1e-9)
        assert backward == pytest.approx((3 if sp else 2) * ring_s(tp, tensor_bytes), rel=1e-9)


def test_the_embedding_and_head_collectives():
    """The vocabulary-parallel embedding sums its partial lookups (fp32) forward; the head
    all-reduces its input gradient backward; sequence parallelism turns the embedding's into a
    reduce-scatter forward and an all-gather backward and adds the head's all-gather forward."""
    fp32_bytes = ROWS * GPT["seq"] * GPT["d_model"] * 4
    bf16_bytes = fp32_bytes // 2
    assert collective_s(4, False, 0) == pytest.approx((ring_s(4, fp32_bytes), 0.0), rel=1e-9)
    assert collective_s(4, True, 0) == pytest.approx((ring_s(4, fp32_bytes) / 2, ring_s(4, fp32_bytes) / 2), rel=1e-9)
    assert collective_s(4, False, -1) == pytest.approx((0.0, ring_s(4, bf16_bytes)), rel=1e-9)
    assert collective_s(4, True, -1) == pytest.approx((ring_s(4, bf16_bytes) / 2, ring_s(4, bf16_bytes)), rel=1e-9)


@pytest.mark.parametrize("tp", [2, 8])
def test_weights_and_flops_split_as_megatron_splits_them(tp):
    d, f, V = GPT["d_model"], GPT["ff"], GPT["vocab"]
    workload, _ = with_tensor_parallel(get_workload("transformer", options()), get_system("a100-nvlink"), tp)
    embed, block_spec, head = workload.layers[0], workload.layers[1], workload.layers[-1]
    # QKV, proj and fc1, fc2 weights and the QKV and fc1 biases split; the norms and the row-parallel biases not
    assert block_spec.params == (4 * d * d + 2 * d * f + 3 * d + f) // tp + 6 * d
    assert embed.params == V // tp * d + GPT["seq"] * d  # vocabulary-parallel; positions replicated
    assert head.params == 2 * d + V // tp * d + V // tp
    whole = get_workload("transformer", options())
    assert block_spec.flops_per_row == whole.layers[1].flops_per_row / tp
    assert workload.parameter_count == whole.parameter_count  # the plan counts the whole model


@pytest.mark.parametrize("precision,dropout", [("bf16", 0.1), ("fp32", 0.0)])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallel_divides_every_saved_tensor_by_t(tp, precision, dropout):
    """Korthikanti et al. 2022: with sequence parallelism a layer's activations are sbh(34 + 5as/h)/t;
    without it the residual stream, the LN outputs feeding QKV and fc1, the LN statistics and the
    dropout masks stay whole on every device (their 10sbh of eq. 2), the rest is split."""
    s, d = GPT["seq"], GPT["d_model"]
    whole = block(1, False, precision, dropout)[1].saved_bytes_per_row
    assert block(tp, True, precision, dropout)[1].saved_bytes_per_row == pytest.approx(whole / tp, rel=1e-12)
    c = 2 if precision == "bf16" else 4
    replicated = s * d * (2 * FP32_BYTES + 2 * c) + 4 * 4 * s + (dropout > 0) * 2 * s * d
    split = whole - replicated
    assert block(tp, False, precision, dropout)[1].saved_bytes_per_row == pytest.approx(replicated + split / tp,
                                                                                     rel=1e-12)


def test_grouped_query_attention_has_fewer_qkv_weights_and_flops_and_splits_them():
    d, s = GPT["d_model"], GPT["seq"]
    e = 2 * d // GPT["heads"]  # two key/value heads
    grouped = get_workload("transformer", {**options(), "kv_heads": 2}).layers[1]
    full = get_workload("transformer", options()).layers[1]
    assert full.params - grouped.params == 2 * d * (d - e) + 2 * (d - e)
    assert full.flops_per_row - grouped.flops_per_row == 2 * s * 2 * d * (d - e)
    assert grouped.saved_bytes_per_row == full.saved_bytes_per_row
    split, _ = with_tensor_parallel(get_workload("transformer", {**options(), "kv_heads": 2}),
                                    get_system("a100-nvlink"), 2)
    assert split.layers[1].params == (d * (d + 2 * e) + d * d + 2 * d * GPT["ff"] + d + 2 * e + GPT["ff"]) // 2 + 6 * d


def test_the_pipeline_sees_groups_of_t_devices():
    workload, groups = with_tensor_parallel(get_workload("transformer", options()), get_system("a100-nvlink", 2), 4)
    assert groups.devices_per_node == 2 and groups.total_devices == 4
    result = simulate(workload, groups, (2, 2, 1, 1), 16,
                      ParallelLayout.for_partition((2, 2, 1, 1), 4, checkpoint="always", replicas=1), record=False)
    assert len(result.stages) == 4 and result.stages[2].device == 2  # stage 2 on node 1's first group


def run_cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("args,message", [
    (["--tensor-parallel", "3", "--stages", "1"], "--tensor-parallel 3 does not divide a100-nvlink's 8 devices"),
    (["--tensor-parallel", "16", "--stages", "1", "--nodes", "2"], "--tensor-parallel 16 spans more than a node"),
    (["--tensor-parallel", "0"], "--tensor-parallel must be a positive integer, got 0"),
    (["--heads", "4", "--tensor-parallel", "8", "--stages", "1"], "--tensor-parallel 8 does not divide heads=4"),
    (["--heads", "8", "--option", "kv_heads=2", "--tensor-parallel", "4", "--stages", "1"],
     "--tensor-parallel 4 does not divide kv_heads=2"),
    (["--tensor-parallel", "4", "--stages", "4"], "4 stages x 4 tensor-parallel devices need 16 devices"),
    (["--model", "mlp", "--tensor-parallel", "2", "--stages", "1"], "modelled for the built-in transformer only"),
])
def test_what_cannot_be_split_is_one_line(capsys, args, message):
    base = ["simulate", "--hardware", "a100-nvlink"] + ([] if "--model" in args else ["--model", "transformer"])
    code, _, err = run_cli(capsys, *base, *args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_planner_searches_t_and_every_plan_fits_the_devices(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    code, out, _ = run_cli(capsys, "plan", "--model", "transformer", "--layers", "8", "--d-model", "1024", "--ff",
                           "4096", "--heads", "16", "--seq", "512", "--vocab", "8000", "--batch", "32", "--hardware",
                           "a100-nvlink", "--tensor-parallel-options", "1,2,4,8", "--microbatch-options", "1,4,8",
                           "--json", "--quiet", "--top", "30", "--out", str(plan_path))
    assert code == 0
    ranked = json.loads(out)["ranked"]
    assert {o["tensor_parallel"] for o in ranked} > {1}
    for option in ranked:
        assert option["replicas"] * option["pipeline_stages"] * option["tensor_parallel"] <= 8
        assert option["sequence_parallel"] == (option["tensor_parallel"] > 1)
    plan = load_plan(plan_path)
    assert plan.layout.tensor_parallel == ranked[0]["tensor_parallel"]
    code, out, _ = run_cli(capsys, "simulate", "--plan", str(plan_path), "--json")
    assert code == 0
    again = json.loads(out)
    assert again["step_time_s"] == pytest.approx(ranked[0]["step_time_s"], rel=1e-12)
    assert again["tensor_parallel"] == plan.layout.tensor_parallel
