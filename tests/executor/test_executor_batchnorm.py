"""Deferred batch norm: per-micro-batch normalisation, whole-mini-batch running statistics."""

import pytest
import torch
from torch import nn

from executor.config import RunConfig
from executor.models.build import build_model
from executor.runtime.batchnorm import DeferredBatchNorm, commit_all, recomputing
from executor.runtime.pipeline import LocalPipeline

CNN = {"layers": 2, "channels": 8, "image": 8}


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never", "full"])
@pytest.mark.parametrize("microbatches", [1, 3, 4])
def test_running_stats_equal_the_whole_mini_batch(checkpoint, microbatches):
    # The first BN sits right after the first conv, so its inputs equal the unpipelined run's.
    config = RunConfig.of(model="cnn", options=CNN, partition=(2, 2), batch_size=10, microbatches=microbatches,
                       checkpoint=checkpoint)
    pipe = LocalPipeline(config)
    inputs, targets = pipe.batch(0)
    pipe.run_step(0)
    reference = build_model("cnn", CNN, 0)
    reference.train()
    with torch.no_grad():
        reference[0](inputs)
    ours, theirs = pipe.stages[0].module[0][1], reference[0][1]
    assert isinstance(ours, DeferredBatchNorm)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=1e-5, atol=1e-6)
    assert int(ours.num_batches_tracked) == 1


def test_normalises_per_micro_batch_and_recompute_does_not_count():
    bn = DeferredBatchNorm.convert(nn.Sequential(nn.BatchNorm1d(3)))[0]
    x = torch.randn(8, 3) * 3 + 1
    out = bn(x[:4])
    torch.testing.assert_close(out, nn.functional.batch_norm(x[:4], None, None, training=True))
    with recomputing():
        bn(x[:4])
    bn(x[4:])
    commit_all(bn)
    plain = nn.BatchNorm1d(3)
    plain(x)
    torch.testing.assert_close(bn.running_mean, plain.running_mean)
    torch.testing.assert_close(bn.running_var, plain.running_var)


def test_cumulative_momentum_and_eval_mode():
    bn = DeferredBatchNorm(3, momentum=None)
    plain = nn.BatchNorm1d(3, momentum=None)
    for _ in range(2):
        x = torch.randn(6, 3)
        bn(x[:2]); bn(x[2:])
        commit_all(bn)
        plain(x)
    torch.testing.assert_close(bn.running_mean, plain.running_mean)
    bn.eval(); plain.eval()
    x = torch.randn(4, 3)
    torch.testing.assert_close(bn(x), plain(x))
