"""Optimizers, the learning-rate schedule and clipping of executor.runtime.optim, against torch's own."""

import math

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from executor.runtime.optim import OptimSettings, clip_coefficient, make_optimizer, make_scheduler, scale_, squared_norm
from sim.errors import GpipeInputError


def rates(settings: OptimSettings, scheduler_factory=None) -> list[float]:
    """The learning rate each of the run's steps uses, read from the optimizer as it steps."""
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=settings.lr)
    scheduler = (scheduler_factory or (lambda o: make_scheduler(settings, o)))(optimizer)
    seen = []
    for _ in range(settings.total_steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_cosine_with_warmup_rates_are_the_closed_form():
    # warm-up (s+1)/(N+1) for N = 2, then (1 + cos(pi * (s-2)/4)) / 2 over the remaining 4 steps
    settings = OptimSettings(lr=1.0, lr_schedule="cosine", lr_warmup_steps=2, total_steps=6)
    expected = [1 / 3, 2 / 3, 1.0, 0.8535533905932737, 0.5, 0.14644660940672627]
    assert rates(settings) == pytest.approx(expected, rel=1e-15, abs=1e-15)
    assert [settings.lr_at(s) for s in range(6)] == rates(settings)


def test_constant_with_warmup_and_without():
    assert rates(OptimSettings(lr=0.3, lr_warmup_steps=3, total_steps=6)) == pytest.approx(
        [0.075, 0.15, 0.225, 0.3, 0.3, 0.3], rel=1e-15)
    assert rates(OptimSettings(lr=0.3, total_steps=3)) == [0.3, 0.3, 0.3]
    assert rates(OptimSettings(lr=1.0, lr_schedule="cosine", total_steps=4)) == pytest.approx(
        [1.0, 0.8535533905932737, 0.5, 0.14644660940672627], rel=1e-15)


@pytest.mark.parametrize("warmup,total", [(1, 5), (3, 10), (4, 5)])
def test_cosine_equals_torchs_sequential_linear_then_cosine(warmup, total):
    settings = OptimSettings(lr=0.02, lr_schedule="cosine", lr_warmup_steps=warmup, total_steps=total)

    def stock(optimizer):
        return SequentialLR(optimizer, [
            LinearLR(optimizer, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup),
            CosineAnnealingLR(optimizer, T_max=total - warmup)], milestones=[warmup])

    assert rates(settings) == pytest.approx(rates(settings, stock), rel=1e-12)


@pytest.mark.parametrize("name,kind", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                                       ("adamw", torch.optim.AdamW)])
def test_optimizers_are_torchs_with_the_weight_decay_asked_for(name, kind):
    optimizer = make_optimizer(OptimSettings(optimizer=name, lr=0.5, weight_decay=0.25), [nn.Parameter(torch.ones(2))])
    assert type(optimizer) is kind
    assert optimizer.param_groups[0]["lr"] == 0.5 and optimizer.param_groups[0]["weight_decay"] == 0.25


def test_clipping_two_parts_by_their_joint_norm_equals_clip_grad_norm():
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
    reference = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(reference, grads):
        p.grad = g.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm=1.5)
    ours = [g.clone() for g in grads]
    parts = [ours[:2], ours[2:]]  # two stages
    total = math.sqrt(sum(float(squared_norm(part, torch.device("cpu"))) for part in parts))
    assert total == pytest.approx(float(expected_norm), rel=1e-6)
    coefficient = clip_coefficient(total, 1.5)
    assert coefficient < 1.0
    for part in parts:
        scale_(part, coefficient)
    for g, p in zip(ours, reference):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)


def test_no_clipping_below_the_norm_or_without_a_max():
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(50.0, None) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6))
    assert float(squared_norm([], torch.device("cpu"))) == 0.0


@pytest.mark.parametrize("settings,message", [
    (OptimSettings(weight_decay=-0.1), "--weight-decay must be 0 or more, got -0.1"),
    (OptimSettings(clip_grad_norm=0.0), "--clip-grad-norm must be positive, got 0.0"),
    (OptimSettings(clip_grad_norm=-1.0), "--clip-grad-norm must be positive, got -1.0"),
    (OptimSettings(optimizer="lamb"), "unknown optimizer 'lamb'; choose one of sgd, adam, adamw"),
    (OptimSettings(lr_schedule="linear"), "unknown --lr-schedule 'linear'; choose one of constant, cosine"),
    (OptimSettings(lr_warmup_steps=-1), "--lr-warmup must be 0 or more steps, got -1"),
    (OptimSettings(lr_schedule="cosine", lr_warmup_steps=4, total_steps=4), "leaves no step of the 4"),
    (OptimSettings(lr=0.0), "learning rate must be positive"),
    (OptimSettings(weight_decay=float("nan")), "--weight-decay must be 0 or more"),
])
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(GpipeInputError, match=message) as info:
        settings.validate()
    assert "\n" not in str(info.value)


def test_constant_schedule_allows_a_warmup_longer_than_the_run():
    OptimSettings(lr_warmup_steps=10, total_steps=4).validate()
