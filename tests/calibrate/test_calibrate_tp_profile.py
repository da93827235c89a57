"""The layers profiled split over two tensor-parallel ranks (two processes, as the executor's): each
rank's share of the weights, and saved bytes that predict a T = 2 run's exact activation count."""

from __future__ import annotations

import pytest
import torch

from calibrate.fit.design import RunSpec, run_config
from calibrate.fit.step_fit import predict
from calibrate.measure.profile import Repeats, profile_model
from calibrate.measure.runs import run_configs
from calibrate.measure.tp_profile import profile_tensor_parallel, thread_counts
from tests.helpers.costs import profile_record
from executor.models.build import build_model, example_batch, loss_function

MODEL = "transformer"
OPTIONS = {"layers": 2, "d_model": 16, "ff": 32, "heads": 2, "seq": 8, "vocab": 32, "dropout": 0.0}
BATCH = 8
ROWS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def profiles():
    threads = torch.get_num_threads()
    try:
        whole = profile_model(build_model(MODEL, OPTIONS, seed=0), lambda r: example_batch(MODEL, OPTIONS, r, seed=1),
                              loss_function("cross_entropy"), ROWS, [1], torch.device("cpu"),
                              Repeats(warmup=1, min_runs=2, max_runs=2, budget_s=0.0, rounds=1))
    finally:
        torch.set_num_threads(threads)
    split = profile_tensor_parallel(MODEL, OPTIONS, BATCH, ROWS, [1], parties=2, quick=True)
    return whole.to_dict(), split


def test_each_rank_holds_its_share_of_the_split_layers_and_all_of_the_others(profiles):
    whole, split = profiles
    d, ff = OPTIONS["d_model"], OPTIONS["ff"]
    # a block: qkv (3d x d + 3d), attention out (d x d + d), fc1 (ff x d + ff), fc2 (d x ff + d), two norms
    sharded = 3 * d * d + 3 * d + d * d + ff * d + ff + d * ff
    replicated = d + d + 4 * d  # the row-parallel biases and the norms
    for w, s in zip(whole["memory"], split["memory"]):
        if w["name"] == "Block":
            assert w["param_bytes"] == 4 * (sharded + replicated)
            assert s["param_bytes"] == 4 * (sharded // 2 + replicated)
            assert 0 < s["own_bytes"][-1] < w["own_bytes"][-1]  # half the heads' scores, half the FFN units
            assert 0 < s["core_bytes"][-1] < w["core_bytes"][-1]
        else:  # the embedding and the head are replicated
            assert s["param_bytes"] == w["param_bytes"]
    times = split["times_s"]["1"]
    assert set(times) == {"F", "R", "B", "C", "I", "W"}  # the split backward timed on the split layers too
    assert all(v > 0 for kind in "FRBW" for row in times[kind] for v in row)


def test_the_split_profile_predicts_the_executors_t2_activation_memory_exactly(profiles):
    """Every checkpoint policy, one stage of two tensor-parallel ranks, run by calibration's own
    launcher (one torchrun of two processes, as gpipe validate runs them)."""
    whole, split = profiles
    data = profile_record(model={"name": MODEL, "options": OPTIONS, "num_layers": 4}, batch_size=BATCH,
                          profile=whole, tensor_parallel_profile={"2": split})
    specs = [RunSpec.of((4,), 2, checkpoint, schedule, BATCH, 1, 2)
             for checkpoint, schedule in [("never", "gpipe"), ("always", "1f1b"), ("except_last", "gpipe"),
                                          ("full", "gpipe"), ("selective", "1f1b")]]
    reports = run_configs([run_config(MODEL, OPTIONS, spec, 2) for spec in specs])
    for spec, report in zip(specs, reports):
        assert report["config"]["tensor_parallel"] == 2
        predicted = [s.peak_activation_bytes for s in predict(data, spec).stages]
        assert predicted == [s["peak_activation_bytes"] for s in report["stages"]], spec.label()


def test_threads_per_rank_share_the_cores_among_k_x_t_processes():
    assert thread_counts(2, [1, 2], 2) == [1]
    assert thread_counts(2, [1, 2], 8) == [4, 2]


def test_which_split_a_calibration_profiles(monkeypatch):
    """Asked for: checked against the model's plan in one line. By default: T = 2 in a full
    calibration where two ranks fit and the model has a plan; none with --quick."""
    from calibrate.fit.calibration import split_profile_parts
    from executor.device import CpuDevice
    from sim.errors import GpipeInputError

    monkeypatch.setattr(CpuDevice, "ranks_per_host", lambda self: 2)
    assert split_profile_parts(MODEL, OPTIONS, "cpu", quick=False, asked=None) == 2
    assert split_profile_parts(MODEL, OPTIONS, "cpu", quick=True, asked=None) == 1
    assert split_profile_parts(MODEL, OPTIONS, "cpu", quick=True, asked=2) == 2
    assert split_profile_parts(MODEL, OPTIONS, "cpu", quick=False, asked=1) == 1
    assert split_profile_parts("mlp", {"layers": 2, "width": 8}, "cpu", quick=False, asked=None) == 1
    with pytest.raises(GpipeInputError, match="has no tensor-parallel plan"):
        split_profile_parts("mlp", {"layers": 2, "width": 8}, "cpu", quick=False, asked=2)
    with pytest.raises(GpipeInputError, match="does not divide heads=2"):
        split_profile_parts(MODEL, OPTIONS, "cpu", quick=False, asked=4)
    monkeypatch.setattr(CpuDevice, "ranks_per_host", lambda self: 1)
    assert split_profile_parts(MODEL, OPTIONS, "cpu", quick=False, asked=None) == 1
