"""The routed experts timed apart (calibrate.measure.expert_profile), and the held-out expert-parallel run
they let validation price: each rank's parameter, gradient and optimizer bytes exact."""

from __future__ import annotations

import pytest
import torch

from calibrate.fit.design import RunSpec, run_config
from calibrate.measure.expert_profile import fit_routed, mixture_of, profile_experts, routed_param_bytes
from calibrate.measure.profile import Repeats, profile_model
from calibrate.validate.comparison import compare
from calibrate.validate.held_out_design import validation_design
from executor.models.build import build_model, default_loss, example_batch, loss_function
from tests.helpers.costs import profile_record

OPTIONS = {"layers": 2, "d_model": 16, "ff": 32, "heads": 2, "seq": 8, "vocab": 32, "experts": 4, "top_k": 2,
           "expert_ff": 16}
QUICK = Repeats(warmup=1, min_runs=2, max_runs=3, budget_s=0.0, rounds=1, probe_budget_s=0.005, split=False)
ROWS = [1, 2, 4]


def batch(rows):
    return example_batch("transformer", OPTIONS, rows, seed=1)


def test_each_mixture_of_experts_block_has_its_routed_experts_timed_and_counted_apart():
    """Only the blocks with a mixture: their routed experts' bytes (every expert), the assignments routed
    (rows x seq x top_k) and a line per pass through the times, its slope per assignment at least 0."""
    model = build_model("transformer", OPTIONS, seed=0)
    entry = profile_experts(model, batch, ROWS, [1], torch.device("cpu"), QUICK)
    moe_layers = [i for i, layer in enumerate(model) if mixture_of(layer) is not None]
    assert moe_layers and sorted(int(i) for i in entry["layers"]) == moe_layers
    for i in moe_layers:
        layer = entry["layers"][str(i)]
        experts = mixture_of(model[i]).experts
        assert layer["param_bytes"] == sum(p.numel() * 4 for p in experts.parameters()) == \
            routed_param_bytes(mixture_of(model[i]))
        assert layer["assignments"] == [r * 8 * 2 for r in ROWS]
        for kind in ("F", "R", "B"):
            assert len(layer["times_s"]["1"][kind]) == len(ROWS) and min(layer["times_s"]["1"][kind]) > 0
            assert layer["fit"]["1"][kind]["per_assignment_s"] >= 0 and layer["fit"]["1"][kind]["fixed_s"] >= 0
    assert all(p.grad is None for p in model.parameters())  # the timing leaves no gradient behind
    assert profile_experts(build_model("transformer", {**OPTIONS, "experts": 0, "top_k": 0, "expert_ff": 0}, 0),
                           batch, ROWS, [1], torch.device("cpu"), QUICK) is None


def test_the_routed_line_is_a_least_squares_line_in_the_assignments():
    line = fit_routed([16, 32, 64], [1e-4 + 2e-6 * a for a in (16, 32, 64)])
    assert abs(line["per_assignment_s"] - 2e-6) < 1e-9 and abs(line["fixed_s"] - 1e-4) < 1e-8
    assert line["worst_relative"] < 1e-6


def test_validation_holds_out_an_expert_parallel_run_only_for_a_mixture_profiled_apart():
    assert not any(s.layout.expert_parallel > 1 for s in validation_design(4, 8))
    held_out = validation_design(4, 8, experts=True)
    assert held_out[-1].layout.expert_parallel == 2 and held_out[-1].layout.replicas == 2 and held_out[-1].stages == 1
    assert held_out[-1].label() == "D=2 E=2 K=1 M=4 [4] never gpipe"
    assert [s for s in validation_design(4, 8, max_replicas=1, experts=True) if s.layout.expert_parallel > 1] == []
    assert run_config("transformer", OPTIONS, held_out[-1], steps=2).layout.expert_parallel == 2


@pytest.mark.slow
def test_an_expert_parallel_runs_state_bytes_are_predicted_rank_by_rank_exactly():
    """E = 2 over D = 2 replicas of one stage: the simulator, from a profile with the routed experts counted
    apart, gives each rank the bytes the executor counts (its stage's non-expert parameters whole and half
    its routed experts, a gradient each, AdamW's two moments); one launch of two ranks."""
    from calibrate.measure.runs import run_configs

    model = build_model("transformer", OPTIONS, seed=0)
    profile = profile_model(model, batch, loss_function(default_loss("transformer")), ROWS, [1],
                            torch.device("cpu"), QUICK)
    experts = profile_experts(model, batch, ROWS, [1], torch.device("cpu"), QUICK)
    data = profile_record(model={"name": "transformer", "options": OPTIONS, "num_layers": len(model)},
                          profile=profile.to_dict(), experts=experts, optimizer="adamw", optimizer_slots=2)
    spec = RunSpec.of((len(model),), 2, "never", "gpipe", 4, replicas=2, expert_parallel=2)
    [report] = run_configs([run_config("transformer", OPTIONS, spec, 2, optimizer="adamw")])
    comparison = compare(data, spec, [report])
    assert len(comparison.measured_sharded_bytes) == 2
    assert comparison.predicted_sharded_bytes == comparison.measured_sharded_bytes
    routed = sum(layer["param_bytes"] for layer in experts["layers"].values())
    whole = sum(p.numel() * 4 for p in model.parameters())
    # parameters, their gradients, AdamW's two state tensors: 1 + 1 + 2 copies of what the rank holds
    held = whole - routed // 2
    assert comparison.measured_sharded_bytes == [{"parameter_bytes": held, "gradient_bytes": held,
                                                  "optimizer_state_bytes": 2 * held}] * 2


def test_gpipe_validate_measures_the_expert_parallel_run_of_a_mixture_profiled_apart(monkeypatch):
    """validate() asks the executor for the E = 2 run where the costs file timed the routed experts apart,
    and not where it did not (the runs are not started: the launch is stood in for)."""
    import calibrate.measure.runs
    from calibrate.validate.held_out import validate
    from tests.helpers.costs import moe_costs

    class Launched(Exception):
        pass

    asked = []

    def launch(configs, progress=None):
        asked.extend(configs)
        raise Launched

    monkeypatch.setattr(calibrate.measure.runs, "run_configs", launch)
    for experts, expected in ((True, [2]), (False, [])):
        asked.clear()
        with pytest.raises(Launched):
            validate(moe_costs(experts), rounds=1, progress=lambda _: None)
        assert [c.layout.expert_parallel for c in asked if c.layout.expert_parallel > 1] == expected
