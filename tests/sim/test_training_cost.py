"""Days and dollars: the arithmetic, ranking by cost, and the flags' refusals."""

import json

import pytest

from gpipe.main import main
from sim.catalog.hardware import get_system
from sim.errors import GpipeInputError
from sim.planner.search import search
from sim.planner.training_cost import format_token_count, model_flops_per_token, parse_token_count, training_cost
from sim.workloads.models import get_workload

GPT = {"layers": 8, "d_model": 768, "ff": 3072, "heads": 16, "seq": 512, "vocab": 5000, "precision": "bf16"}


def test_the_arithmetic_of_days_and_dollars():
    """2M tokens per 4 s step on 64 devices of 1 PFLOP/s: 500k tokens/s; 1T tokens in 2e6 s."""
    cost = training_cost(step_s=4.0, tokens_per_step=2e6, devices=64, flops_per_token=6e10,
                         peak_flops_per_device=1e15, train_tokens=1e12, price_per_device_hour=2.5)
    assert cost.tokens_per_s == 500_000
    assert cost.mfu == pytest.approx(500_000 * 6e10 / 64e15)
    assert cost.days == pytest.approx(2e6 / 86_400)
    assert cost.device_hours == pytest.approx(2e6 / 3600 * 64)
    assert cost.cost == pytest.approx(2e6 / 3600 * 64 * 2.5)
    unpriced = training_cost(4.0, 2e6, 64, 6e10, 1e15, train_tokens=1e12)
    assert unpriced.cost is None and unpriced.days == cost.days


def test_palms_model_flops_per_token():
    """6N + 12 L d s, N without the token and position tables."""
    o = {**GPT, "kv_heads": 0}
    params = get_workload("transformer", o).parameter_count
    embedding = 5000 * 768 + 512 * 768
    assert model_flops_per_token(o, params) == 6 * (params - embedding) + 12 * 8 * 768 * 512


def megatron_flops_per_token(o):
    """Megatron-LM's ``num_floating_point_operations`` over one token (no MoE, full attention)."""
    L, h, s, a, V, f = o["layers"], o["d_model"], o["seq"], o["heads"], o["vocab"], o["ff"]
    q = a * (o.get("head_dim") or h // a)
    groups = o.get("kv_heads") or a
    gated = 3 / 2 if o.get("activation") == "swiglu" else 1
    return 12 * L * h * h * ((1 + groups / a + s / h) * q / h + f / h * gated + V / (2 * L * h))


@pytest.mark.parametrize("tied", [False, True])
def test_model_flops_per_token_are_megatrons_for_a_rotary_tied_or_wide_headed_decoder(tied):
    """No position table to leave out with rotary positions, the head's weight counted where it is
    the token table, and the attention term over heads x head_dim: Megatron-LM's count, but for the
    norms' few parameters."""
    o = {"layers": 4, "d_model": 512, "ff": 1536, "heads": 8, "kv_heads": 2, "head_dim": 128, "seq": 1024,
         "vocab": 32000, "activation": "swiglu", "positions": "rotary", "norm": "rmsnorm", "biases": "none",
         "tied": tied, "precision": "bf16", "attention": "flash"}
    params = get_workload("transformer", o).parameter_count
    norms = o["layers"] * 2 * 512 + 512
    assert model_flops_per_token(o, params) == pytest.approx(megatron_flops_per_token(o) + 6 * norms, rel=1e-12)


@pytest.mark.parametrize("text,tokens,short", [("15T", 15e12, "15T"), ("300B", 300e9, "300B"), ("2e12", 2e12, "2T"),
                                               ("1500000", 1.5e6, "1.5M")])
def test_token_counts(text, tokens, short):
    assert parse_token_count(text) == tokens
    assert format_token_count(tokens) == short


@pytest.mark.parametrize("text", ["", "lots", "-3T", "0"])
def test_bad_token_counts_are_one_line(text):
    with pytest.raises(GpipeInputError, match="not a positive number of tokens"):
        parse_token_count(text)


def test_ranking_by_cost_is_the_exhaustive_cheapest():
    """Steps weighed by devices x price inside the bounded search find what simulating every
    candidate finds, having simulated fewer."""
    workload = get_workload("transformer", GPT)
    system = get_system("a100-nvlink", 2)

    def weight(c):
        return c.stages * c.replicas * 3.0

    kwargs = dict(replica_options=[1, 2, 4], weight=weight)
    pruned = search(workload, system, 32, [1, 2, 4], [1, 2, 4, 8], **kwargs, top=1)
    everything = search(workload, system, 32, [1, 2, 4], [1, 2, 4, 8], **kwargs, top=10_000)
    cheapest = min(everything.ranked, key=lambda o: o.step_time_s * weight(o.candidate))
    assert pruned.best.score == pytest.approx(cheapest.score, rel=1e-12)
    assert pruned.simulated < everything.simulated
    fastest = search(workload, system, 32, [1, 2, 4], [1, 2, 4, 8], replica_options=[1, 2, 4], top=1).best
    assert fastest.step_time_s <= pruned.best.step_time_s  # the cheapest is never faster than the fastest


def test_plan_over_several_systems_with_a_price(capsys):
    args = ["plan", "--model", "transformer", *[f"--option={k}={v}" for k, v in GPT.items() if k != "precision"],
            "--hardware", "a100-nvlink,h100-nvlink", "--max-devices", "16", "--batch", "32", "--train-tokens", "1B",
            "--price-per-device-hour", "2", "--rank-by", "cost", "--top", "3", "--quiet", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rank_by"] == "cost" and set(data["hardware"]) == {"a100-nvlink", "h100-nvlink"}
    costs = [row["training"]["cost"] for row in data["ranked"]]
    assert costs == sorted(costs)
    for row in data["ranked"]:
        training = row["training"]
        assert training["devices"] <= 16
        assert training["cost"] == pytest.approx(training["device_hours"] * 2)
        assert training["tokens_per_s"] == pytest.approx(32 * 512 / row["step_time_s"])
    assert main(args[:-1]) == 0
    table = capsys.readouterr().out
    assert "cost $" in table and "efficiency fitted on published runs" in table


@pytest.mark.parametrize("flags,message", [
    (["--max-cost", "100"], "--max-cost needs --train-tokens"),
    (["--train-tokens", "1B", "--price-per-device-hour", "0.01", "--max-cost", "0.0001"],
     "no plan trains 1B tokens in at most $0.0001: the fastest, T="),
    (["--train-tokens", "1B", "--price-per-device-hour", "0.01", "--max-cost", "0.0001"],
     "; the cheapest, T=1 D=1 K=1 V=1 M=1 on a100-nvlink, costs $0."),
    (["--train-tokens", "1B", "--max-days", "1e-9"], "no plan trains 1B tokens in at most 1e-09 days: the fastest"),
    (["--max-days", "3"], "--max-days needs --train-tokens"),
    (["--train-tokens", "1B", "--max-days", "-1"], "--max-days -1.0 is not a positive number of days"),
    (["--hardware", "a100-nvlink,warp-drive"], "unknown hardware 'warp-drive'"),
    (["--train-tokens", "many"], "--train-tokens 'many' is not a positive number of tokens"),
    (["--max-devices", "0"], "--max-devices"),
])
def test_days_and_dollars_flags_refuse_in_one_line(flags, message, capsys):
    args = ["plan", "--model", "transformer", *[f"--option={k}={v}" for k, v in GPT.items() if k != "precision"],
            "--batch", "32", "--quiet", *flags]
    if "--hardware" not in flags:
        args += ["--hardware", "a100-nvlink"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_step_limit_keeps_the_ranking_exact_among_the_plans_within_it():
    """What the bounded search ranks under a per-candidate step limit is what simulating every
    candidate and dropping those over the limit gives."""
    workload = get_workload("transformer", GPT)
    system = get_system("a100-nvlink", 2)
    kwargs = dict(replica_options=[1, 2, 4], weight=lambda c: c.stages * c.replicas * 3.0)
    everything = search(workload, system, 32, [1, 2, 4], [1, 2, 4, 8], **kwargs, top=10_000).ranked
    fastest = min(o.step_time_s for o in everything)

    def limit(c):  # more devices may take less time each: a limit like a budget's
        return 1.5 * fastest * 8 / (c.stages * c.replicas)

    within = [o for o in everything if o.step_time_s <= limit(o.candidate)]
    assert 0 < len(within) < len(everything)
    limited = search(workload, system, 32, [1, 2, 4], [1, 2, 4, 8], **kwargs, top=3, step_limit_s=limit)
    assert [o.score for o in limited.ranked] == pytest.approx(sorted(o.score for o in within)[:3], rel=1e-12)
    assert limited.over_limit > 0


def _plan_json(capsys, *flags):
    args = ["plan", "--model", "transformer", *[f"--option={k}={v}" for k, v in GPT.items() if k != "precision"],
            "--hardware", "a100-nvlink", "--nodes", "2", "--batch", "32", "--train-tokens", "20B", "--quiet",
            "--json", *flags]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_the_cheapest_plan_within_a_number_of_days(capsys):
    free = _plan_json(capsys, "--rank-by", "cost", "--top", "1")
    cheapest, fastest = free["cheapest"]["training"], free["fastest"]["training"]
    assert fastest["days"] < cheapest["days"]
    days = (fastest["days"] + cheapest["days"]) / 2
    limited = _plan_json(capsys, "--rank-by", "cost", "--top", "5", "--max-days", str(days))
    assert limited["limits"]["max_days"] == days and limited["limits"]["over_limit"] > 0
    assert all(row["training"]["days"] <= days for row in limited["ranked"])
    assert limited["ranked"][0]["training"]["cost"] >= cheapest["cost"]  # the limit costs something
    assert limited["fastest"]["training"]["days"] == pytest.approx(fastest["days"])  # the fastest is within it


def test_the_fastest_plan_within_a_budget(capsys):
    free = _plan_json(capsys, "--top", "1")
    cheapest, fastest = free["cheapest"]["training"], free["fastest"]["training"]
    assert fastest["cost"] > cheapest["cost"]
    budget = (fastest["cost"] + cheapest["cost"]) / 2
    limited = _plan_json(capsys, "--top", "5", "--max-cost", str(budget))
    assert all(row["training"]["cost"] <= budget for row in limited["ranked"])
    assert limited["ranked"][0]["training"]["days"] >= fastest["days"]
