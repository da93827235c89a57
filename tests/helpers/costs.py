"""Costs files and calibrations the tests share: a synthetic costs file, design runs, a tiny model."""

from __future__ import annotations

import json

from sim.catalog.hardware import LOCAL_CPU

# the tiny transformer the slow calibration tests calibrate and validate on (flags of gpipe calibrate)
TINY = ["--model", "transformer", "--layers", "2", "--d-model", "16", "--ff", "32", "--heads", "2",
        "--seq", "8", "--vocab", "32", "--batch", "8"]

ROWS = [1, 2, 4]  # the row counts the synthetic profile measured


def affine_times(per_row_s: float, fixed_s: float) -> list[float]:
    """A time per row count of :data:`ROWS`: ``fixed_s`` plus ``per_row_s`` a row."""
    return [fixed_s + per_row_s * r for r in ROWS]


def synthetic_costs() -> dict:
    """Three mlp layers whose times and bytes are affine in rows (so interpolation is exact), as a
    costs record of the current version (sim.formats.costs_v2)."""
    memory = [
        {"name": "a", "param_bytes": 1000, "own_bytes": [10 * r for r in ROWS], "input_bytes": [4 * r for r in ROWS],
         "output_bytes": [8 * r for r in ROWS], "saves_input": True, "saves_output": True},
        {"name": "b", "param_bytes": 2000, "own_bytes": [0 for r in ROWS], "input_bytes": [8 * r for r in ROWS],
         "output_bytes": [16 * r for r in ROWS], "saves_input": False, "saves_output": False},
        {"name": "c", "param_bytes": 3000, "own_bytes": [5 * r for r in ROWS], "input_bytes": [16 * r for r in ROWS],
         "output_bytes": [2 * r for r in ROWS], "saves_input": True, "saves_output": False},
    ]
    times = {kind: [affine_times(1e-3 * (i + 1), 1e-4) for i in range(3)] for kind in "FRB"}
    times["B"] = [affine_times(2e-3 * (i + 1), 2e-4) for i in range(3)]
    fit = {"threads": 1, "actions": {k: {"slope": 1.5, "intercept": 1e-4, "cold_start_s": 0.0} for k in "FRB"},
           "send": {"slope": 1e-9, "intercept": 2e-5}, "optimizer": {"slope": 1e-8, "intercept": 1e-5},
           "step_overhead_s": 5e-4, "gap_after_s": {}}
    return {"machine": {"cpu_cores": 2, "device": "cpu"}, "system": "cpu", "catalog_device": LOCAL_CPU.name,
            "model": {"name": "mlp", "options": {"layers": 3, "width": 8}, "num_layers": 3},
            "batch_size": 8, "precision": "fp32", "optimizer": "sgd", "optimizer_slots": 0, "shared_parameters": [],
            "profile": {"rows": ROWS, "times_s": {"1": times, "2": times}, "memory": memory},
            "pipeline": {"1": {**fit, "threads": 2}, "2": fit},
            "link": {"name": "gloo", "latency_s": 3e-5, "bandwidth_bytes_per_s": 1e9},
            "allreduce": {"backend": "gloo", "parties": [2], "sizes_bytes": [4096, 65536],
                          "measured_s": [[4.4e-5, 1.71e-4]], "latency_s": 2e-5, "bandwidth_bytes_per_s": 5e8,
                          "points": 2, "worst_relative": 0.0},
            "efficiency": {"efficiency": 0.25, "bandwidth_efficiency": 0.5}}


MOE_OPTIONS = {"layers": 3, "experts": 4, "top_k": 2, "seq": 8, "d_model": 16}
MOE_ROUTED_BYTES = 1600  # of layer 1's 2000 parameter bytes
MOE_SLOPES = {"F": 1e-6, "R": 2e-6, "B": 3e-6}  # seconds per routed assignment
MOE_A2A = {"latency_s": 5e-5, "bytes_per_s": 2e8}


def moe_costs(experts: bool = True) -> dict:
    """The synthetic costs file above with layer 1 a mixture of 4 experts, top-2, seq 8:
    its routed experts profiled apart (fits at both thread counts) and the all-to-all fitted."""
    data = synthetic_costs()
    data["model"] = {**data["model"], "options": MOE_OPTIONS}
    data["optimizer"], data["optimizer_slots"] = "adamw", 2
    fit = {kind: {"per_assignment_s": slope, "fixed_s": 1e-5, "worst_relative": 0.0}
           for kind, slope in MOE_SLOPES.items()}
    if experts:
        data["experts"] = {"rows": [1, 2, 4], "layers": {"1": {
            "param_bytes": MOE_ROUTED_BYTES, "assignments": [16, 32, 64], "times_s": {},
            "fit": {"1": fit, "2": fit}}}}
    data["expert_parallel"] = {"backend": "gloo", "parties": [2], "all_to_all": {**MOE_A2A, "measured": []}}
    return data


def design_runs(errors: list[float]) -> dict:
    """A costs file's summary fields with one design run per relative error in ``errors``."""
    return {"model": {"name": "mlp", "options": {}}, "batch_size": 8,
            "design": [{"run": f"run {i}", "measured_step_s": 0.1, "predicted_step_s": 0.1 * (1 + e)}
                       for i, e in enumerate(errors)]}


def with_split_profile(data: dict) -> dict:
    """``data`` with a profile of its layers split over two ranks: half the parameter bytes, three
    times the time (what DTensor's dispatch and the waits cost a small layer), own bytes less 2/row."""
    split = json.loads(json.dumps(data["profile"]))
    for memory in split["memory"]:
        memory["param_bytes"] //= 2
        memory["own_bytes"] = [max(0, b - 2 * r) for b, r in zip(memory["own_bytes"], ROWS)]
    split["times_s"] = {"1": {kind: [[3 * v for v in row] for row in table]
                              for kind, table in data["profile"]["times_s"]["1"].items()}}
    return {**data, "tensor_parallel_profile": {"2": split}}


def profile_record(**fields) -> dict:
    """A costs record of the current version that holds ``fields`` (a model and its profile, say) and
    what a calibration that fitted nothing else writes beside them: no pipeline fits, fp32, SGD."""
    return {"machine": {"cpu_cores": 2, "device": "cpu"}, "system": "cpu", "catalog_device": LOCAL_CPU.name,
            "batch_size": 8, "precision": "fp32", "optimizer": "sgd", "optimizer_slots": 0, "shared_parameters": [],
            "pipeline": {}, **fields}


def write_v1_costs(data: dict, path) -> None:
    """``data`` as a version 1 costs file, the format written before version 2 (read with its defaults)."""
    with open(path, "w") as handle:
        json.dump({"kind": "gpipe-costs", "version": 1, **data}, handle)
