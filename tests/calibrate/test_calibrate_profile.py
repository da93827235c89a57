"""The layer profile: every pass timed, and saved bytes that predict the executor's exact count."""

from __future__ import annotations

import pytest
import torch

from calibrate.measure.profile import Repeats, pool_identical, profile_model
from executor.config import RunConfig
from executor.models.build import build_model, example_batch, loss_function
from executor.runtime.pipeline import LocalPipeline
from sim.catalog.hardware import get_system
from sim.engine.engine import simulate
from sim.formats.layout import ParallelLayout
from sim.formats.costs import MeasuredWorkload
from tests.helpers.costs import profile_record

MODEL = "transformer"
OPTIONS = {"layers": 2, "d_model": 16, "ff": 32, "heads": 2, "seq": 8, "vocab": 32, "dropout": 0.0}
BATCH = 8
FAST = Repeats(warmup=1, min_runs=2, max_runs=2, budget_s=0.0)


def _profile(precision: str):
    torch.manual_seed(0)
    model = build_model(MODEL, OPTIONS, seed=0)
    threads = torch.get_num_threads()
    try:
        return profile_model(model, lambda r: example_batch(MODEL, OPTIONS, r, seed=1),
                             loss_function("cross_entropy"), [1, 2, 4, 8], [1], torch.device("cpu"), FAST,
                             precision=precision)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def profile():
    return _profile("fp32")


@pytest.fixture(scope="module")
def profile_bf16():
    return _profile("bf16")


def _costs(profile, precision: str = "fp32") -> dict:
    return profile_record(machine={"cpu_cores": 1, "device": "cpu"},
                          model={"name": MODEL, "options": OPTIONS, "num_layers": 4}, batch_size=BATCH,
                          precision=precision, profile=profile.to_dict())


def test_every_layer_pass_and_row_count_is_timed(profile):
    times = profile.times_s[1]
    assert set(times) == {"F", "R", "B", "C", "I", "W"}
    for kind in "FRBIW":
        assert len(times[kind]) == 4
        assert all(len(row) == 4 and all(t > 0 for t in row) for row in times[kind])
    # the attention core's rerun inside the backward: timed for the two blocks, nothing elsewhere
    assert [any(row) for row in times["C"]] == [False, True, True, False]
    assert all(t >= 0 for row in times["C"] for t in row)
    assert profile.repetitions[1] == 4 * 4 * 2 * FAST.rounds
    assert profile.speed_reference_s[1] > 0


def test_the_split_backward_is_timed_as_the_executor_splits_it(profile):
    """I and W of each layer as a stage that is not the first runs them: the blocks' input gradient
    and weight gradients both take time; the embedding's integer input needs no gradient, so its I
    does nothing and its W is the whole backward. A measured stage prices W from the profile and the
    split's cost from I + W beyond B."""
    times = profile.times_s[1]
    for block in (1, 2):
        assert all(t > 0 for t in times["I"][block]) and all(t > 0 for t in times["W"][block])
    assert all(i < 0.5 * w for i, w in zip(times["I"][0], times["W"][0]))
    workload = MeasuredWorkload(_costs(profile))
    cost = workload.stage_cost(8, 1, 3, get_system("cpu").device)
    slope = workload.fit.actions["B"].slope
    weight = sum(workload.profiled_s("W", i, 8) for i in (1, 2))
    assert cost.weight_grad_s == pytest.approx(slope * weight)
    split = sum(workload.profiled_s(kind, i, 8) for kind in "IW" for i in (1, 2))
    assert cost.split_overhead_s == pytest.approx(slope * max(0.0, split - sum(workload.profiled_s("B", i, 8)
                                                                                for i in (1, 2))))


def test_identical_blocks_share_one_time_and_other_layers_keep_theirs(profile):
    times = profile.times_s[1]
    for kind in "FRB":
        assert times[kind][1] == times[kind][2]  # the two transformer blocks
        assert times[kind][0] != times[kind][1] and times[kind][3] != times[kind][1]


def test_pool_identical_takes_the_median_per_row_count():
    times = {"F": [[1.0, 10.0], [3.0, 30.0], [2.0, 50.0], [7.0, 70.0]]}
    pooled = pool_identical(times, ["block", "block", "block", "head"])
    assert pooled["F"] == [[2.0, 30.0], [2.0, 30.0], [2.0, 30.0], [7.0, 70.0]]
    assert times["F"][0] == [1.0, 10.0]  # the input is left as it was


def test_saved_bytes_grow_with_rows_and_weights_are_excluded(profile):
    block = profile.memory[1]
    assert block.saves_input  # LayerNorm saves the block's input
    assert block.own_bytes[3] > block.own_bytes[0] > 0
    # the core's probabilities (softmax's output, which attention over V saves too: (rows, heads,
    # seq, seq) floats) and its (seq, seq) boolean mask, gone under selective
    assert [bool(m.core_bytes[0]) for m in profile.memory] == [False, True, True, False]
    per_row = OPTIONS["heads"] * OPTIONS["seq"] ** 2 * 4
    assert block.core_bytes == [OPTIONS["seq"] ** 2 + per_row * r for r in (1, 2, 4, 8)]
    assert block.param_bytes == sum(p.numel() * 4 for p in build_model(MODEL, OPTIONS)[1].parameters())


def test_bf16_profile_saves_casts_and_weight_copies(profile, profile_bf16):
    """Under autocast the block keeps fp32 inputs (its LayerNorm runs fp32 on the fp32 residual
    stream) and saves less of its own per row, plus a bf16 copy of its weights per micro-batch;
    the head's logits are bf16."""
    fp32, bf16 = profile.memory[1], profile_bf16.memory[1]
    assert bf16.input_bytes == fp32.input_bytes and bf16.saves_input
    copies = 2 * sum(p.numel() for name, p in build_model(MODEL, OPTIONS)[1].named_parameters()
                     if p.dim() == 2)  # the four weight matrices
    per_row = [b - copies for b in bf16.own_bytes]
    assert per_row[3] - per_row[2] < fp32.own_bytes[3] - fp32.own_bytes[2]
    slope = (per_row[3] - per_row[0]) // (8 - 1)  # affine in rows once the copies are taken out
    assert per_row == [per_row[0] + slope * (r - 1) for r in (1, 2, 4, 8)]
    assert profile_bf16.memory[-1].output_bytes[0] * 2 == profile.memory[-1].output_bytes[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never", "full", "selective"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_predicted_peak_activation_matches_the_executor(profile, profile_bf16, checkpoint, schedule, precision):
    partition, microbatches = (1, 2, 1), 3
    config = RunConfig.of(model=MODEL, options=OPTIONS, partition=partition, batch_size=BATCH,
                       microbatches=microbatches, checkpoint=checkpoint, schedule=schedule, steps=1,
                       precision=precision)
    pipeline = LocalPipeline(config)
    pipeline.run_step(0)
    measured = [stage.counter.peak_bytes for stage in pipeline.stages]
    cpu = get_system("cpu", nodes=3)  # three stages, one per core of up to three machines
    measured_profile = profile if precision == "fp32" else profile_bf16
    workload, system = MeasuredWorkload(_costs(measured_profile, precision)).bind(cpu, 3, checkpoint, microbatches)
    result = simulate(workload, system, partition, BATCH,
                      ParallelLayout.for_partition(partition, microbatches, checkpoint=checkpoint,
                                                   schedule=schedule))
    predicted = [s.peak_activation_bytes for s in result.stages]
    assert predicted == measured  # every stage exact: each micro-batch owns its rows in both
