"""The built-in transformer with experts trains in the pipeline as one process trains it.

One process here is the whole model on the mini-batch's micro-batches in turn, each loss and each
router's load-balancing loss weighted by its micro-batch's share of the rows
(:mod:`tests.helpers.moe_parity`): the auxiliary loss is a function of a micro-batch's tokens, so the
pipeline reproduces accumulation over the same micro-batches. One step (no update): the loss, the
auxiliary loss (summed over stages and micro-batches) and every gradient at the transparency tests'
tolerances (rtol 1e-5, atol 1e-6), over every schedule and re-materialization policy, top-1 and top-2,
shared expert on and off. AdamW with clipping, and bf16, over three steps: losses, auxiliary losses and
norms rtol 1e-5, parameters as :func:`tests.helpers.parity.assert_adam_close` holds them.
"""

import pytest
import torch

from executor.config import RunConfig
from executor.models.build import build_model, resolve_options
from executor.models.moe_aux_loss import take_aux_loss
from executor.runtime.pipeline import LocalPipeline
from sim.errors import GpipeInputError
from tests.helpers.moe_parity import MOE, accumulate, assert_parameters_equal, one_process

GRID = [  # schedule, partition, virtual stages, checkpoint, top_k, shared experts, activation
    ("gpipe", (4,), 1, "never", 1, 0, "gelu"),
    ("gpipe", (2, 2), 1, "always", 2, 1, "swiglu"),
    ("1f1b", (2, 2), 1, "full", 1, 1, "swiglu"),
    ("1f1b", (1, 3), 1, "selective", 2, 0, "gelu"),
    ("interleaved", (1, 1, 1, 1), 2, "except_last", 2, 1, "swiglu"),
    ("zb-h1", (2, 2), 1, "never", 2, 1, "gelu"),
]


@pytest.mark.parametrize("schedule,partition,virtual,checkpoint,top_k,shared,activation", GRID)
def test_one_step_with_experts_matches_one_process(schedule, partition, virtual, checkpoint, top_k, shared,
                                                   activation):
    options = {**MOE, "top_k": top_k, "shared_experts": shared, "activation": activation}
    microbatches = 4 if schedule == "interleaved" else 3  # batch 10: micro-batches of 3,3,3,1 or 4,4,2
    config = RunConfig.of(model="transformer", options=options, partition=partition, batch_size=10,
                       microbatches=microbatches, schedule=schedule, checkpoint=checkpoint, virtual_stages=virtual)
    pipe = LocalPipeline(config)
    inputs, targets = pipe.batch(0)
    take_aux_loss()
    loss = pipe.run_step(0, update=False)
    aux = take_aux_loss()
    model = build_model("transformer", options, config.seed)
    ref_loss, ref_aux = accumulate(model, inputs, targets, pipe.prepared.loss_fn, microbatches)
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    assert aux == pytest.approx(ref_aux, rel=1e-5) and aux > 0
    params = dict(pipe.model().named_parameters())
    for name, ref in model.named_parameters():
        torch.testing.assert_close(params[name].grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_auxiliary_loss_reaches_the_router_and_only_it():
    """With the coefficient at 0 every router's gradient changes, the last block's experts' do not (the
    auxiliary loss flows back through the routers' inputs into every earlier layer, not forward)."""
    config = RunConfig.of(model="transformer", options=MOE, partition=(4,), batch_size=8, microbatches=2)
    inputs, targets = LocalPipeline(config).batch(0)
    grads = []
    for coef in (MOE["aux_loss_coef"], 0.0):
        model = build_model("transformer", {**MOE, "aux_loss_coef": coef})
        accumulate(model, inputs, targets, LocalPipeline(config).prepared.loss_fn, 2)
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        if name.startswith("2.mlp.experts") or name.startswith("3."):  # the last block's experts, the head
            torch.testing.assert_close(grad, grads[1][name], msg=name)
    assert all(not torch.equal(grads[0][n], grads[1][n]) for n in grads[0] if "router" in n)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_adamw_with_clipping_trains_as_one_process(precision):
    options = {**MOE, "shared_experts": 1, "activation": "swiglu"}
    config = RunConfig.of(model="transformer", options=options, partition=(2, 2), batch_size=8, microbatches=4,
                       schedule="1f1b", checkpoint="except_last", optimizer="adamw", lr=0.01, weight_decay=0.1,
                       clip_grad_norm=0.5, steps=3, precision=precision)
    pipe = LocalPipeline(config)
    take_aux_loss()
    losses, auxes = [], []
    for step in range(3):
        losses.append(pipe.run_step(step))
        auxes.append(take_aux_loss())
    ref_losses, ref_auxes, norms, model, near_zero = one_process(config, pipe.batch, pipe.prepared.loss_fn, 4, 3)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert auxes == pytest.approx(ref_auxes, rel=1e-5)
    assert pipe.grad_norms == pytest.approx(norms, rel=1e-5) and min(norms) > 0.5  # every step clipped
    assert_parameters_equal(dict(pipe.model().named_parameters()), model, near_zero, 0.03, 1e-5)


@pytest.mark.parametrize("options,message", [
    ({"experts": 4, "top_k": 5}, "top_k=5 is above experts=4"),
    ({"experts": 4}, "experts=4 without top_k"),
    ({"top_k": 2}, "top_k given without experts"),
    ({"shared_experts": 1, "expert_ff": 8}, "expert_ff, shared_experts given without experts"),
    ({"experts": -1, "top_k": 1}, "experts=-1 for model transformer; use a non-negative integer"),
    ({"experts": 4, "top_k": 2, "aux_loss_coef": "x"}, "aux_loss_coef='x'"),
])
def test_bad_expert_options_are_one_line_in_both_halves(options, message):
    from sim.workloads.moe.workload import builtin_workload

    for check in (lambda o: resolve_options("transformer", o), lambda o: builtin_workload("transformer", o)):
        with pytest.raises(GpipeInputError, match=message):
            check(options)


def test_dense_options_are_unchanged_and_experts_are_priced_as_the_moe_workload():
    from sim.workloads.moe.workload import MoEWorkload, builtin_workload

    assert "experts" not in resolve_options("transformer", {})
    assert not isinstance(builtin_workload("transformer", {"experts": 0}), MoEWorkload)
    options = {"layers": 2, "d_model": 32, "ff": 64, "heads": 4, "seq": 8, "vocab": 64, "experts": 4, "top_k": 2,
               "expert_ff": 32, "shared_experts": 1, "activation": "swiglu"}
    workload = builtin_workload("transformer", options)
    assert isinstance(workload, MoEWorkload)
    o = workload.options
    assert (o["experts"], o["top_k"], o["expert_ff"], o["shared_ff"], o["moe_layers"]) == (4, 2, 32, 32, "0,1")
    model = build_model("transformer", options)
    blocks = sum(p.numel() for p in model[1:3].parameters())
    assert workload.parameter_counts()["total"] == pytest.approx(sum(p.numel() for p in model.parameters()), rel=0.05)
    assert blocks > 0


@pytest.mark.parametrize("flags,message", [
    (["--option", "experts=4", "--option", "top_k=5"], "top_k=5 is above experts=4"),
    (["--option", "experts=4"], "experts=4 without top_k"),
    (["--option", "experts=4", "--option", "top_k=2", "--option", "expert_ff=50", "--tensor-parallel", "4"],
     "--tensor-parallel 4 does not divide expert_ff=50"),
    (["--option", "experts=4", "--option", "top_k=2", "--tensor-parallel", "2", "--sequence-parallel"],
     "--sequence-parallel with experts"),
])
def test_bad_expert_settings_are_one_line_before_any_worker(capsys, flags, message):
    from gpipe.main import main

    assert main(["train", "--model", "transformer", *flags, "--stages", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and message in err, err
