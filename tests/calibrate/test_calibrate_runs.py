"""Executor runs for calibration: one launch of D x K ranks per (replicas, stages), ranks in placement order."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from calibrate.fit.design import RunSpec, run_config
from calibrate.measure import runs
from executor.launch import agent as launch
from executor.launch.agent import LaunchOutcome


def _config(partition, replicas=1):
    return run_config("mlp", {"layers": 4, "width": 8}, RunSpec.of(partition, 2, "never", "gpipe", 8, replicas), 2)


def test_each_replicas_and_stages_pair_gets_one_launch_of_d_times_k_ranks(monkeypatch):
    launches = []

    def fake_launch(module, argv, ranks, env, timeout_s):
        assert module == "calibrate.measure.runs"
        configs_path, directory = argv
        with open(configs_path) as handle:
            configs = json.load(handle)
        launches.append((ranks, env["OMP_NUM_THREADS"], [(c["replicas"], tuple(c["partition"])) for c in configs]))
        for position, config in enumerate(configs):
            with open(os.path.join(directory, f"report-{position}.json"), "w") as handle:
                json.dump({"replicas": config["replicas"], "partition": config["partition"]}, handle)
        return LaunchOutcome(), ""

    monkeypatch.setattr(launch, "launch_captured", fake_launch)
    monkeypatch.setattr(runs.os, "cpu_count", lambda: 8)
    configs = [_config((2, 2), 2), _config((4,)), _config((4,), 2), _config((2, 2)), _config((4,), 2)]
    reports = runs.run_configs(configs)
    assert [(r["replicas"], tuple(r["partition"])) for r in reports] == [
        (2, (2, 2)), (1, (4,)), (2, (4,)), (1, (2, 2)), (2, (4,))]  # in the order given
    assert launches == [(1, "8", [(1, (4,))]), (2, "4", [(2, (4,)), (2, (4,))]),
                        (2, "4", [(1, (2, 2))]), (4, "2", [(2, (2, 2))])]


def test_payloads_are_ordered_by_replica_then_stage_as_placed():
    ranks = [f"rank {r}" for r in range(6)]
    config = _config((2, 2), 3)
    assert runs.by_replica_and_stage(config, ranks) == ranks  # stages_adjacent: rank d*K + k
    config.layout = replace(config.layout, placement="replicas_adjacent")  # rank k*D + d
    assert runs.by_replica_and_stage(config, ranks) == ["rank 0", "rank 3", "rank 1", "rank 4", "rank 2", "rank 5"]
    assert runs.by_replica_and_stage(_config((1, 1, 2)), ranks[:3]) == ranks[:3]
