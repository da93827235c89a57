"""Numerics parity with the unpipelined model, as the executor's tests check it: one step's loss and
every gradient (fp32, and bf16 under the same autocast), AdamW steps with clipping and a learning-rate
schedule against torch alone, and the model whose embedding and head share a weight."""

from __future__ import annotations

import json

import pytest
import torch

from executor.config import RunConfig
from executor.models.build import build_model
from executor.runtime.data import split
from executor.runtime.pipeline import LocalPipeline
from executor.state import state_file

# the small mlp and transformer the parity grids train
OPTIONS = {"mlp": {"width": 32}, "transformer": {"layers": 2, "d_model": 32, "ff": 64, "seq": 8, "vocab": 64}}
TIED = "tests.helpers.sample_models:tied_lm"  # embedding, two blocks, a head sharing the embedding's weight
TIED_DATA = "tests.helpers.sample_models:tied_lm_data"
SEVERAL = "tests.helpers.sample_models:several_tensors"  # layers passing several tensors along
BF16_MICROBATCHES = 4  # the micro-batches the bf16 reference accumulates over, one after another
WHOLE_BATCH_GRAD_TOLERANCE = 1.5e-2  # of each gradient's largest element; see test_transparency_bf16.py


def reference(config: RunConfig, inputs, targets, loss_fn):
    model = build_model(config.model, config.options, config.seed)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.detach(), dict(model.named_parameters())


def check_step(config: RunConfig) -> None:
    pipe = LocalPipeline(config)
    inputs, targets = pipe.batch(0)
    loss = pipe.run_step(0, update=False)
    ref_loss, ref_params = reference(config, inputs, targets, pipe.prepared.loss_fn)
    torch.testing.assert_close(torch.tensor(loss), ref_loss, rtol=1e-6, atol=1e-6)
    params = dict(pipe.model().named_parameters())
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name].grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)


CLIP = {"mlp": 0.05, "transformer": 0.5}  # below every step's norm: each step clips


def torch_schedule(optimizer, schedule: str, warmup: int, total: int):
    """The learning-rate schedule from torch's stock schedulers (not gpipe's LambdaLR)."""
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

    parts = []
    if warmup:
        parts.append(LinearLR(optimizer, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup))
    if schedule == "cosine":
        parts.append(CosineAnnealingLR(optimizer, T_max=total - warmup))
    if not parts:
        return ConstantLR(optimizer, factor=1.0, total_iters=0)
    return parts[0] if len(parts) == 1 else SequentialLR(optimizer, parts, milestones=[warmup])


def check_adamw_steps(config: RunConfig) -> None:
    """``config`` (AdamW with weight decay and clipping, its learning-rate schedule) in process
    against torch alone on the same model: loss and global norm every step, each step clipped, then
    every parameter (:func:`assert_adam_close`)."""
    pipe = LocalPipeline(config)
    reference = build_model(config.model, config.options, 0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch_schedule(optimizer, config.lr_schedule, config.lr_warmup_steps, config.steps)
    near_zero = [torch.zeros_like(p, dtype=torch.bool) for p in reference.parameters()]
    for step in range(config.steps):
        inputs, targets = pipe.batch(step)
        loss = pipe.run_step(step)
        optimizer.zero_grad()
        ref = pipe.prepared.loss_fn(reference(inputs), targets)
        ref.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.clip_grad_norm)
        for mask, p in zip(near_zero, reference.parameters()):
            mask |= p.grad.abs() < NEAR_ZERO_GRADIENT
        optimizer.step()
        scheduler.step()
        torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")
        assert pipe.grad_norms[step] == pytest.approx(float(norm), rel=1e-5)
        assert pipe.grad_norms[step] > config.clip_grad_norm  # so this step clipped
    atol = 1e-5 if any(mask.any() for mask in near_zero) else 1e-6
    for (name, p), q, mask in zip(pipe.model().named_parameters(), reference.parameters(), near_zero):
        assert_adam_close(name, p, q, mask, config.lr * config.steps, atol)


# Adam's eps is 1e-8: an update g / (sqrt(v) + eps) of a gradient within 100 eps of zero depends on
# the gradient's rounding
NEAR_ZERO_GRADIENT = 1e-6


def assert_adam_close(name: str, actual: torch.Tensor, expected: torch.Tensor, near_zero: torch.Tensor,
                      lr_sum: float, atol: float) -> None:
    """Parameters after Adam steps: rtol 1e-5 and ``atol``, except elements whose gradient was below
    :data:`NEAR_ZERO_GRADIENT` at some step (``near_zero``), which must only stay within Adam's
    bound on their movement (``lr_sum``, the learning rates added up, times 4).

    A gradient that small is the cancellation of terms a million times larger (the attention's key
    bias, which softmax ignores, has one of about 1e-10; a unit no sample of the batch activates, one
    of about 1e-8), so its rounding depends on the order of summation, which micro-batches change;
    Adam divides by sqrt(v) + eps and turns that rounding into steps of up to about lr whose size no
    two orders agree on. Each Adam step moves an element by at most (1 - beta1) / sqrt(1 - beta2),
    about 3.2, times lr. Such an element's divergence reaches the other parameters' gradients from
    the next step on, so where one occurred the rest is compared at atol 1e-5, else at 1e-6
    (:func:`check_adamw_steps`). Measured on the interleaved transformer K = 2, V = 2 case: 8.9e-6
    at most outside the key bias with torch's eps 1e-8, 2.0e-7 with eps 1e-5 on both sides. Losses
    and norms are compared at every step in full.
    """
    torch.testing.assert_close(actual[~near_zero], expected[~near_zero], rtol=1e-5, atol=atol, msg=name)
    if near_zero.any():
        assert float((actual[near_zero] - expected[near_zero]).detach().abs().max()) <= 4 * lr_sum, name


def unpipelined(config: RunConfig, inputs, targets, loss_fn, microbatches: int):
    """The whole model under CPU autocast on ``microbatches`` chunks in turn (1: the whole batch),
    each loss scaled to the mini-batch mean, gradients accumulated; (loss, named parameters)."""
    model = build_model(config.model, config.options, config.seed)
    total = torch.zeros(())
    for x, t in zip(split(inputs, microbatches), split(targets, microbatches)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        loss = loss_fn(y.float(), t) * (x.shape[0] / config.batch_size)
        loss.backward()
        total += loss.detach()
    return total, dict(model.named_parameters())


def pipelined(config: RunConfig):
    pipe = LocalPipeline(config)
    inputs, targets = pipe.batch(0)
    loss = pipe.run_step(0, update=False)
    return pipe, torch.tensor(loss), dict(pipe.model().named_parameters()), inputs, targets


def check_bf16_step(config: RunConfig) -> None:
    pipe, loss, params, inputs, targets = pipelined(config)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params.values())
    ref_loss, ref_params = unpipelined(config, inputs, targets, pipe.prepared.loss_fn, BF16_MICROBATCHES)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name].grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    whole_loss, whole_params = unpipelined(config, inputs, targets, pipe.prepared.loss_fn, 1)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=1e-6)
    for name, ref in whole_params.items():
        scale = float(ref.grad.abs().max())
        torch.testing.assert_close(params[name].grad, ref.grad, rtol=0.0,
                                   atol=WHOLE_BATCH_GRAD_TOLERANCE * scale, msg=name)


def check_tied_step(pipe: LocalPipeline) -> tuple[list, torch.nn.Module]:
    """One step of ``pipe`` (no update) against the tied model alone: the loss (rtol 1e-6) and every
    parameter's gradient (rtol 1e-5, atol 1e-6); the pipeline's layers and the reference model."""
    inputs, targets = pipe.batch(0)
    loss = pipe.run_step(0, update=False)
    model = build_model(TIED, {}, 0)
    ref = pipe.prepared.loss_fn(model(inputs), targets)
    ref.backward()
    torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-6, atol=1e-6)
    layers = list(pipe.model())
    for name, p in model.named_parameters():
        index, rest = name.split(".", 1)
        torch.testing.assert_close(layers[int(index)].get_parameter(rest).grad, p.grad, rtol=1e-5, atol=1e-6,
                                   msg=name)
    return layers, model


def checkpoint_parameters(root, chunks):
    """Every parameter a checkpoint under ``root`` holds, its ``chunks`` stage files read in turn."""
    manifest = json.loads((root / "manifest.json").read_text())
    values = {}
    for k in range(chunks):
        values.update(state_file.load(str(root / manifest["dir"] / f"stage-{k}.safetensors"))["module"])
    return values
