"""The optimizer ZeRO-1 uses under expert parallelism (:mod:`executor.parallel.expert_zero`), in one
process: two parts behind one optimizer step as one AdamW over the same parameters, follow its
learning-rate schedule, and save and load a plain optimizer's state in the stage's order. (Its sharded
parts, ZeroRedundancyOptimizers over dp and edp, are held to one process by
tests/executor/test_expert_parallel_zero1.py; here both parts are plain.)"""

import copy

import torch
from torch import nn

from executor.parallel.expert_zero import ExpertShardedOptimizer, held_states
from executor.runtime.optim import OptimSettings, make_scheduler

SETTINGS = OptimSettings(optimizer="adamw", lr=0.01, weight_decay=0.1, lr_schedule="cosine", lr_warmup_steps=1,
                         total_steps=4)


def params(seed):
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(shape)) for shape in ((3, 4), (5,), (4, 4), (2,))]


def composite(values, experts=(1, 3)):
    parts = (torch.optim.AdamW([p for i, p in enumerate(values) if i not in experts], lr=0.01, weight_decay=0.1),
             torch.optim.AdamW([p for i, p in enumerate(values) if i in experts], lr=0.01, weight_decay=0.1))
    return ExpertShardedOptimizer(values, *parts)


def train(values, optimizer, steps, seed=1):
    scheduler = make_scheduler(SETTINGS, optimizer)
    torch.manual_seed(seed)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for i, p in enumerate(values):
            if not (step == 0 and i == 3):  # a parameter without a gradient in a step is skipped
                p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
    return scheduler


def test_two_parts_step_save_and_load_as_one_adamw():
    ours, theirs = params(0), params(0)
    optimizer = composite(ours)
    plain = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1)
    train(ours, optimizer, 3)
    train(theirs, plain, 3)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    saved, expected = optimizer.state_dict(), plain.state_dict()
    assert saved["param_groups"][0]["params"] == expected["param_groups"][0]["params"]
    assert saved["param_groups"][0]["lr"] == expected["param_groups"][0]["lr"]
    assert sorted(saved["state"]) == sorted(expected["state"])
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(saved["state"][index][key], value, rtol=0, atol=0)
    assert sum(1 for _ in held_states(optimizer)) == len(ours)
    # a plain optimizer's state loads into the two parts, each taking its parameters' entries
    resumed = params(0)
    with torch.no_grad():
        for a, b in zip(resumed, theirs):
            a.copy_(b)
    loaded = composite(resumed)
    loaded.load_state_dict(copy.deepcopy(plain.state_dict()))  # its own tensors, as read from a file
    assert loaded.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
    for part in loaded.parts:
        assert part.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
    torch.manual_seed(7)
    grads = [torch.randn_like(p) for p in theirs]
    for values, opt in ((resumed, loaded), (theirs, plain)):
        for p, g in zip(values, grads):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(resumed, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
