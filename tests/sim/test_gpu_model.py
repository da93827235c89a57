"""The GPU kernel model and its fit on the development set: literal formulas, Korthikanti's activation
memory, Megatron's bf16 model, the overlapped data-parallel reduction, and what the executor refuses."""

import json
import os
import shutil

import pytest

from sim.catalog.hardware import get_system
from sim.catalog.kernel_model import EFFICIENCY_FILE, KernelEfficiency, read_efficiencies
from sim.engine.allreduce import exposed_allreduce_s, ring_allreduce_s
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.errors import GpipeInputError
from sim.planner.search import search
from sim.workloads.models import get_workload
from sim.workloads.tensor_parallel import with_tensor_parallel
from tests.helpers import in_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV = os.path.join(ROOT, "benchmarks", "published_runs", "dev.json")
KERNELS = KernelEfficiency(matmul=0.7, attention=0.6, memory=0.8, collective=0.75, optimizer=0.5,
                           matmul_launch_s=8e-6)
# Korthikanti et al. 2022's 22B layer, with a small sequence so the test is quick to read
GPT = {"layers": 2, "d_model": 768, "ff": 3072, "heads": 16, "seq": 512, "vocab": 5000}


def block(tp, sp, rows=2, kernels=KERNELS, **options):
    system = get_system("a100-nvlink", 1, kernels)
    workload, groups = with_tensor_parallel(get_workload("transformer", {**GPT, **options}), system, tp, sp)
    return workload.layers[1], workload.layer_costs(rows, groups.device)[1], system


@pytest.mark.parametrize("attention", ["fused", "flash"])
@pytest.mark.parametrize("tp,sp", [(1, False), (4, False), (4, True)])
def test_a_layer_is_its_kernels_timed_by_kind(attention, tp, sp):
    """forward = matmuls at the matmul fraction + launches + attention + memory-bound bytes at the
    memory fraction + the forward collectives; backward twice the work, its collectives exposed only
    beyond the weight-gradient matmuls."""
    rows, peak, bandwidth = 2, 312e12, 2039e9
    spec, cost, system = block(tp, sp, rows, precision="bf16-model", attention=attention, dropout=0.1)
    attention_flops = 4 * GPT["seq"] ** 2 * GPT["d_model"] / tp * rows
    projections = spec.flops_per_row * rows - attention_flops
    assert spec.attention_flops_per_row * rows == pytest.approx(attention_flops)
    projection_s = projections / (peak * 0.7)
    flash = attention == "flash"
    attention_s = attention_flops / (peak * (0.6 if flash else 0.7))
    memory_s = (spec.traffic_bytes_per_row - spec.matmul_traffic_bytes_per_row) * rows / (bandwidth * 0.8)
    launches = (5 if flash else 6) * 8e-6
    one = ring_allreduce_s(spec.tp_allreduce_bytes_per_row * rows, tp, system.intra_link) if tp > 1 else 0.0
    assert system.intra_link.bandwidth_bytes_per_s == pytest.approx(300e9 * 0.75)  # NVLink 3 at the fitted fraction
    assert cost.forward_s == pytest.approx(projection_s + attention_s + launches + memory_s + 10e-6 + 2 * one)
    backward_attention = (2.5 if flash else 2) * attention_s  # flash recomputes QK^T: half the forward again
    waited = one if sp else 0.0  # the all-gathers of proj's and fc2's output gradients: their matmuls wait
    exposed = waited + max(0.0, (3 if sp else 2) * one - waited - projection_s)
    assert cost.backward_s == pytest.approx(2 * projection_s + backward_attention + 2 * launches + 2 * memory_s
                                            + 20e-6 + exposed)
    assert cost.recompute_s == cost.forward_s


def test_sequence_parallel_backward_waits_for_one_all_reduce_volume_and_hides_the_rest():
    """Korthikanti's 22B layer (TP 8, micro-batch 4): the weight-gradient matmuls outlast every
    backward collective, so without sequence parallelism none is exposed, and with it exactly the
    all-gathers the row-parallel layers' input gradients wait for (one all-reduce's volume)."""
    shape = {"layers": 1, "d_model": 6144, "ff": 24576, "heads": 64, "seq": 2048, "vocab": 51200,
             "precision": "bf16-model", "attention": "fused"}
    system = get_system("a100-nvlink", 1, KERNELS)
    backward = {}
    for sp in (False, True):
        workload, groups = with_tensor_parallel(get_workload("transformer", shape), system, 8, sp)
        spec, cost = workload.layers[1], workload.layer_costs(4, groups.device)[1]
        one = ring_allreduce_s(spec.tp_allreduce_bytes_per_row * 4, 8, system.intra_link)
        projection_s = (spec.flops_per_row - spec.attention_flops_per_row) * 4 / (312e12 * 0.7)
        assert 3 * one < projection_s  # every collective fits beside the weight gradients
        memory_s = (spec.traffic_bytes_per_row - spec.matmul_traffic_bytes_per_row) * 4 / (2039e9 * 0.8)
        backward[sp] = cost.backward_s - 2 * memory_s
        assert spec.tp_allreduces_backward_waited == (1.0 if sp else 0.0)
        exposed = backward[sp] - (2 * projection_s + 2 * spec.attention_flops_per_row * 4 / (312e12 * 0.7)
                                  + 12 * 8e-6 + 20e-6)
        assert exposed == pytest.approx(one if sp else 0.0, abs=1e-9)


def test_a_small_matmul_runs_further_from_peak():
    from sim.catalog.kernel_model import achieved_matmul_fraction

    big, small = (achieved_matmul_fraction(KERNELS, flops, 312e12) for flops in (1e12, 1e9))
    assert big == pytest.approx(0.7 * 1e12 / (1e12 + 312e12 * 0.7 * 8e-6))
    assert small < big / 2


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_memory_is_korthikantis(tp, sp):
    """Korthikanti et al. 2022, eq. 2 and 4 (16-bit, attention and hidden dropout): per layer
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) with tensor parallelism, s*b*h*(34 + 5*a*s/h)/t with sequence
    parallelism as well; ours adds the layer norms' fp32 mean and rstd (16 bytes per token, split
    with the sequence), which their count leaves out."""
    s, h, a, b = GPT["seq"], GPT["d_model"], GPT["heads"], 3
    spec, cost, _ = block(tp, sp, b, precision="bf16-model", attention="fused", dropout=0.1)
    statistics = 16 * s * b / (tp if sp else 1)
    if sp:
        expected = s * b * h * (34 + 5 * a * s / h) / tp
    else:
        expected = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    assert cost.saved_bytes == round(expected + statistics)


def test_a_bf16_model_keeps_bf16_weights_fp32_gradients_and_an_fp32_master_copy():
    _, cost, _ = block(1, False, precision="bf16-model")
    _, autocast, _ = block(1, False, precision="bf16")
    params = autocast.param_bytes // 4
    assert (cost.param_bytes, cost.grad_bytes, cost.optimizer_bytes) == (2 * params, 4 * params, 3 * 4 * params)


@pytest.mark.parametrize("command,message", [
    (["simulate", "--model", "mlp", "--hardware", "ideal", "--precision", "bf16-model"], "built-in transformer only"),
    (["train", "--model", "transformer", "--stages", "2", "--precision", "bf16-model"], "planning option"),
    (["train", "--model", "transformer", "--stages", "2", "--option", "attention=fused"], "planning option"),
    (["simulate", "--model", "transformer", "--hardware", "a100-nvlink", "--precision", "fp8"],
     "device A100-SXM-80GB has no fp8 units"),
    (["simulate", "--model", "mlp", "--hardware", "h100-nvlink", "--precision", "fp8"], "built-in transformer only"),
    (["train", "--model", "transformer", "--stages", "2", "--precision", "fp8"], "precision fp8 is a planning option"),
])
def test_what_only_the_planner_models_is_refused_in_one_line(command, message):
    proc = in_process.gpipe(*command)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_the_overlapped_reduction_leaves_what_outlasts_the_last_backward():
    assert exposed_allreduce_s(0.0, 1.0, 4) == 0.0
    assert exposed_allreduce_s(3.0, 1.0, 4) == pytest.approx(2.0)
    assert exposed_allreduce_s(1.0, 3.0, 4) == pytest.approx(0.25)  # the last layer's bucket
    workload = get_workload("transformer", {**GPT, "precision": "bf16"})
    system = get_system("h100-nvlink", 2)
    after = simulate(workload, system, (2, 2), 32,
                     ParallelLayout.for_partition((2, 2), 4, checkpoint="full", schedule="1f1b", replicas=4), record=False)
    overlapped = simulate(workload, system, (2, 2), 32,
                          ParallelLayout.for_partition((2, 2), 4, checkpoint="full", schedule="1f1b", replicas=4), record=False, dp_overlap=True)
    assert overlapped.step_time_s < after.step_time_s
    assert [s.peak_memory_bytes for s in overlapped.stages] == [s.peak_memory_bytes for s in after.stages]


def test_the_planner_with_an_overlapped_reduction_finds_the_exhaustive_best():
    workload = get_workload("transformer", {**GPT, "layers": 8, "precision": "bf16"})
    system = get_system("a100-nvlink", 2)
    kwargs = dict(replica_options=[1, 2, 4], zero_options=[0, 1], dp_overlap=True)
    pruned = search(workload, system, 32, [1, 2, 4], [1, 2, 4, 8], **kwargs, top=1)
    everything = search(workload, system, 32, [1, 2, 4], [1, 2, 4, 8], **kwargs, top=10_000)
    assert pruned.best.step_time_s == pytest.approx(everything.best.step_time_s, rel=1e-12)
    assert pruned.simulated < everything.simulated


def test_the_committed_fractions_are_the_fit_of_the_development_set_alone(tmp_path):
    """gpipe fit-gpu on a copy of dev.json, in a folder holding no other runs file, writes what the
    simulator reads: nothing was tuned by hand, nothing but the development set was seen."""
    copy = tmp_path / "dev.json"
    shutil.copy(DEV, copy)
    out = tmp_path / "efficiency.json"
    from gpipe.main import main

    assert main(["fit-gpu", str(copy), "--out", str(out)]) == 0
    refit, committed = read_efficiencies(str(out)), read_efficiencies(EFFICIENCY_FILE)
    assert set(refit) == set(committed) == {"A100-SXM-80GB", "H100-SXM-80GB", "B200-SXM-180GB", "B200-in-GB200-186GB",
                                            "H100 SXM 96GB HBM2e (500 W)"}
    # The fit's valley is flat: the same code and libraries on two machines' CPUs landed 0.1-0.6%
    # apart on the fractions while no development row's prediction moved by 0.07%. Hand tuning of
    # any consequence moves more than either tolerance.
    for name in committed:
        for key in ("matmul", "attention", "memory", "collective", "optimizer", "matmul_launch_s"):
            assert getattr(refit[name], key) == pytest.approx(getattr(committed[name], key), rel=1e-2, abs=1e-9)
    rows = json.loads(out.read_text())["development_rows"]
    with open(EFFICIENCY_FILE) as handle:
        committed_rows = {r["id"]: r for r in json.load(handle)["development_rows"]}
    for row in rows:
        assert row["predicted_s"] == pytest.approx(committed_rows[row["id"]]["predicted_s"], rel=1e-3), row["id"]
    assert {r["id"].split(":")[0] for r in rows} == {r["id"] for r in json.loads(copy.read_text())["runs"]} | {
        r["id"] for r in json.loads(copy.read_text())["layer_times"]}


def test_a_broken_efficiency_file_is_one_line(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"devices": {"A100-SXM-80GB": {"matmul": 1.7, "attention": 0.5, "memory": 0.5,
                                                                "collective": 0.5, "optimizer": 0.5,
                                                                "matmul_launch_s": 0}}}))
    with pytest.raises(GpipeInputError, match="matmul=1.7 is not a fraction"):
        read_efficiencies(str(path))


def test_attention_defaults_to_flash_on_gpus_that_run_it(capsys):
    """The built-in transformer's attention is flash on the A100/H100 unless asked otherwise, and
    the output says so; the TPU, the CPU and an explicit kernel are left as they are."""
    from gpipe.main import main

    def simulated(*flags):
        assert main(["simulate", "--model", "transformer", "--stages", "2", "--microbatches", "2", "--batch", "4",
                     *flags, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["model"]["options"].get("attention")

    assert simulated("--hardware", "a100-nvlink") == "flash"
    assert simulated("--hardware", "h100-nvlink") == "flash"
    assert simulated("--hardware", "h100-nvlink", "--option", "attention=eager") == "eager"
    assert simulated("--hardware", "tpu-v3") == "eager"
    assert simulated("--hardware", "cpu") == "eager"
    assert main(["simulate", "--model", "transformer", "--stages", "2", "--microbatches", "2", "--batch", "4",
                 "--hardware", "a100-nvlink"]) == 0
    assert "attention: flash, the default on A100-SXM-80GB" in capsys.readouterr().out


def test_fp8_runs_the_projections_at_the_fp8_peak_and_keeps_bf16_models_memory():
    """fp8 (Transformer Engine): the four projections at the fp8 peak, their inputs cast (read 2
    bytes, write 1), flash attention at the bf16 peak; memory as bf16-model's."""
    shape = {**GPT, "attention": "flash", "dropout": 0.0}
    system = get_system("h100-nvlink", 1, KERNELS)
    costs = {}
    for precision in ("bf16-model", "fp8"):
        workload, groups = with_tensor_parallel(get_workload("transformer", {**shape, "precision": precision}),
                                                system, 2, True)
        costs[precision] = (workload.layers[1], workload.layer_costs(2, groups.device)[1])
    (plain_spec, plain), (spec, fp8) = costs["bf16-model"], costs["fp8"]
    s, d, f, t = GPT["seq"], GPT["d_model"], GPT["ff"], 2
    assert spec.traffic_bytes_per_row - plain_spec.traffic_bytes_per_row == 3 * (2 * s * d + s * d / t + s * f / t)
    projections = (spec.flops_per_row - spec.attention_flops_per_row) * 2
    saved_s = projections / (989.4e12 * 0.7) - projections / (1978.9e12 * 0.7)
    cast_s = 3 * (2 * s * d + s * d / t + s * f / t) * 2 / (3350e9 * 0.8)
    assert plain.forward_s - fp8.forward_s == pytest.approx(saved_s - cast_s, rel=1e-9)
    assert (fp8.saved_bytes, fp8.param_bytes, fp8.optimizer_bytes) == \
        (plain.saved_bytes, plain.param_bytes, plain.optimizer_bytes)



def test_a_variant_is_found_however_its_name_is_spelt():
    """A hardware object naming a fitted variant in another case and punctuation is priced at that
    variant's fractions, not at its base's, and the replay says whose fractions it used."""
    from sim.catalog.hardware import fitted_device_named
    from sim.catalog.user_systems import fractions_from, resolve_system

    variant = "H100 SXM 96GB HBM2e (500 W)"
    assert fitted_device_named("h100-sxm-96gb-hbm2e-500w") == variant
    assert fitted_device_named("h100-sxm-96gb") is None
    as_written = {"base": "h100-nvlink", "name": variant, "memory_gib": 96, "memory_bandwidth_tb_s": 2.4}
    respelt = dict(as_written, name="h100-sxm-96gb-hbm2e-500w")
    unfitted = dict(as_written, name="h100-96gb")
    written, other, plain = (resolve_system(ref).device.kernels for ref in (as_written, respelt, unfitted))
    assert other == written and plain != written
    assert plain == resolve_system("h100-nvlink").device.kernels
    assert fractions_from(respelt) == variant and fractions_from(unfitted) == "H100-SXM-80GB"
