"""The backward split into I (input gradients) and W (weight gradients) gives the full backward's
gradients, and W does not run the path to the inputs again."""

import copy

import pytest
import torch
from torch import nn

from executor.models.build import build_model
from executor.runtime.split_backward import input_gradients, weight_gradients


class CountingIdentity(torch.autograd.Function):
    """The identity, counting how often its backward runs."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        CountingIdentity.calls += 1
        return grad


class Counted(nn.Module):
    def forward(self, x):
        return CountingIdentity.apply(x)


def _grads(module):
    return [p.grad.clone() if p.grad is not None else None for p in module.parameters()]


def _split(module, inputs, grad_out=None, loss=False):
    out = module(*inputs)
    roots = [out.square().mean()] if loss else [out]
    pending = input_gradients(roots, None if loss else [grad_out], inputs, list(module.parameters()))
    return pending


def _full(module, inputs, grad_out=None, loss=False):
    out = module(*inputs)
    if loss:
        out.square().mean().backward()
    else:
        out.backward(grad_out)
    return [x.grad for x in inputs]


def _leaf(shape, seed, grad=True):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_(grad)


def test_mlp_gradients_equal_the_full_backward_and_w_skips_the_input_path():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Counted(), nn.Linear(16, 16), nn.Tanh(), Counted(),
                           nn.Linear(16, 4))
    reference = copy.deepcopy(module)
    x, grad_out = _leaf((5, 8), 1), _leaf((5, 4), 2, grad=False)
    expected_dx = _full(reference, [x.detach().clone().requires_grad_()], grad_out)[0]

    CountingIdentity.calls = 0
    (dx,), pending = _split(module, [x], grad_out)
    assert CountingIdentity.calls == 2  # I ran the path to the input once
    assert all(p.grad is None for p in module.parameters())  # and no weight gradient
    weight_gradients(pending)
    assert CountingIdentity.calls == 2  # W did not run it again
    assert torch.allclose(dx, expected_dx, rtol=0, atol=1e-6)
    for got, want in zip(_grads(module), _grads(reference)):
        assert torch.allclose(got, want, rtol=0, atol=1e-6)


def test_two_microbatches_interleaved_accumulate_as_one_backward_each():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 3))
    reference = copy.deepcopy(module)
    xs = [_leaf((4, 6), seed) for seed in (1, 2)]
    grads = [_leaf((4, 3), seed, grad=False) for seed in (3, 4)]
    for x, g in zip(xs, grads):
        _full(reference, [x.detach().clone().requires_grad_()], g)
    pending = [_split(module, [x], g)[1] for x, g in zip(xs, grads)]  # I0, I1
    for p in pending:  # then W0, W1
        weight_gradients(p)
    for got, want in zip(_grads(module), _grads(reference)):
        assert torch.allclose(got, want, rtol=0, atol=1e-6)


def test_a_weight_used_twice_and_a_second_input_without_gradient():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(5, 5)
            self.scale = nn.Parameter(torch.ones(5))

        def forward(self, x, mask):
            return self.linear(torch.relu(self.linear(x)) * mask) * self.scale

    torch.manual_seed(0)
    module = Twice()
    reference = copy.deepcopy(module)
    x, mask, grad_out = _leaf((3, 5), 1), _leaf((3, 5), 2, grad=False), _leaf((3, 5), 3, grad=False)
    expected_dx = _full(reference, [x.detach().clone().requires_grad_(), mask], grad_out)[0]
    (dx, dmask), pending = _split(module, [x, mask], grad_out)
    assert dmask is None
    weight_gradients(pending)
    assert torch.allclose(dx, expected_dx, rtol=0, atol=1e-6)
    for got, want in zip(_grads(module), _grads(reference)):
        assert torch.allclose(got, want, rtol=0, atol=1e-6)


def test_first_stage_inputs_without_gradient_leave_the_whole_backward_to_w():
    torch.manual_seed(0)
    module = build_model("transformer", {"layers": 1, "d_model": 16, "ff": 32, "heads": 2, "seq": 8, "vocab": 32}, 0)
    first = module[:2]  # embedding and one block
    reference = copy.deepcopy(first)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    grad_out = _leaf((2, 8, 16), 2, grad=False)
    _full(reference, [tokens], grad_out)
    (dtokens,), pending = _split(first, [tokens], grad_out)
    assert dtokens is None and all(p.grad is None for p in first.parameters())
    weight_gradients(pending)
    for got, want in zip(_grads(first), _grads(reference)):
        assert torch.allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_transformer_stage_with_a_loss_under_autocast(dtype):
    torch.manual_seed(0)
    model = build_model("transformer", {"layers": 2, "d_model": 16, "ff": 32, "heads": 2, "seq": 8, "vocab": 32}, 0)
    stage = model[2:]  # the second block and the head
    reference = copy.deepcopy(stage)
    x = _leaf((2, 8, 16), 1)

    def run(fn, module, inputs):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return fn(module, inputs, loss=True)

    expected_dx = run(_full, reference, [x.detach().clone().requires_grad_()])[0]
    (dx,), pending = run(_split, stage, [x])
    weight_gradients(pending)
    tolerance = 1e-6 if dtype is None else 1e-2
    assert torch.allclose(dx, expected_dx, rtol=0, atol=tolerance)
    for got, want in zip(_grads(stage), _grads(reference)):
        assert torch.allclose(got, want, rtol=tolerance, atol=tolerance)


def test_a_zb_h1_step_leaves_no_graph_behind():
    """The graph kept from I to W is freed after W: the activation counter's saved-tensor hooks once
    kept each saved output with its own node, a cycle that a kept graph never broke (30 MB a step)."""
    import gc

    from executor.config import RunConfig
    from executor.runtime.pipeline import LocalPipeline

    options = {"layers": 2, "d_model": 16, "ff": 32, "heads": 2, "seq": 8, "vocab": 32}
    pipe = LocalPipeline(RunConfig.of(model="transformer", options=options, partition=(2, 2), batch_size=8,
                                   microbatches=4, schedule="zb-h1", checkpoint="never"))
    for step in range(2):
        pipe.run_step(step)
    gc.collect()
    nodes = [o for o in gc.get_objects() if type(o).__name__.endswith("Backward0")]
    assert nodes == []
