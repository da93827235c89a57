"""Tuples and dicts of tensors through a stage and across its boundaries, equal to the unpipelined model.

``tests.helpers.sample_models:several_tensors`` passes dicts and tuples holding per-row activations, a
fixed-shape table computed from parameters (its gradient crosses back), integer ids and a gate
computed from the data alone (no gradient). For K in {1, 2, 3, 6}, M in {1, 3, 4}, every policy and
both schedules, one in-process step equals one plain forward and backward of the whole model.
fp32; tolerances as in ``test_transparency.py`` (micro-batch sums reorder float additions).
"""

import itertools

import pytest
import torch

from executor.config import RunConfig
from executor.runtime.pipeline import LocalPipeline, prepare
from sim.errors import GpipeInputError
from tests.helpers.parity import check_step

MODEL = "tests.helpers.sample_models:several_tensors"
PARTITIONS = {1: (6,), 2: (2, 4), 3: (1, 2, 3), 6: (1, 1, 1, 1, 1, 1)}
GRID = list(itertools.product((1, 2, 3, 6), (1, 3, 4), ("always", "except_last", "never", "full"), ("gpipe", "1f1b")))


def config(stages, microbatches=4, checkpoint="except_last", schedule="gpipe", **overrides):
    return RunConfig.of(model=MODEL, partition=PARTITIONS[stages], batch_size=10, microbatches=microbatches,
                     checkpoint=checkpoint, schedule=schedule, loss="mse", **overrides)


@pytest.mark.parametrize("stages,microbatches,checkpoint,schedule", GRID)
def test_one_step_matches_unpipelined(stages, microbatches, checkpoint, schedule):
    check_step(config(stages, microbatches, checkpoint, schedule))


def test_boundaries_describe_every_leaf():
    boundaries = prepare(config(2)).boundaries
    cut = boundaries[1]  # after layer 1 (a dict -> tuple block): (hidden, scale, ids, gate)
    assert [(leaf.path, leaf.per_row, leaf.carries_grad, leaf.dtype) for leaf in cut.leaves] == [
        ("[0]", True, True, torch.float32), ("[1]", False, True, torch.float32),
        ("[2]", True, False, torch.int64), ("[3]", True, False, torch.float32)]
    assert cut.shapes(3) == [((3, 16), torch.float32), ((16,), torch.float32), ((3, 4), torch.int64),
                             ((3, 1), torch.float32)]
    assert cut.bytes(3) == 3 * 16 * 4 + 16 * 4 + 3 * 4 * 8 + 3 * 4


def test_losses_match_over_several_steps_with_sgd():
    pipes = {k: LocalPipeline(config(k, lr=0.1, optimizer="sgd")) for k in (1, 3)}
    losses = {k: [pipe.run_step(s) for s in range(3)] for k, pipe in pipes.items()}
    assert losses[3] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)


BAD_MODELS = '''
import torch
from torch import nn

class Pair(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.lin, self.extra = nn.Linear(4, 4), extra
    def forward(self, x):
        x = x[0] if isinstance(x, tuple) else x
        return self.lin(x), self.extra(x)

class First(nn.Module):
    def forward(self, x):
        return x[0] if isinstance(x, tuple) else x

def with_number():
    return nn.Sequential(Pair(lambda x: 3), First(), nn.Linear(4, 4))

def with_flat():
    return nn.Sequential(Pair(lambda x: x.reshape(-1)), First(), nn.Linear(4, 4))

def example_batch(rows):
    return torch.randn(rows, 4), torch.randn(rows, 4)
'''


@pytest.mark.parametrize("factory,partition,message", [
    ("with_number", (1, 2), "the output of stage 0 (layer 0) at [1] is a int; only tensors can cross a stage"),
    ("with_flat", (1, 2), "the output of stage 0 (layer 0) at [1] has shape [8] for 2 rows and [12] for 3"),
])
def test_what_cannot_cross_a_boundary_is_refused_in_one_line(tmp_path, monkeypatch, factory, partition, message):
    (tmp_path / "bad_boundaries.py").write_text(BAD_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(GpipeInputError) as info:
        prepare(RunConfig.of(model=f"bad_boundaries:{factory}", partition=partition, batch_size=4, microbatches=2))
    assert message in str(info.value) and "\n" not in str(info.value)
    # the same values are fine inside one stage
    prepare(RunConfig.of(model=f"bad_boundaries:{factory}", partition=(2, 1), batch_size=4, microbatches=2))
