"""Parameters shared across stages (a tied embedding and head) train exactly as without a pipeline.

``tests.helpers.sample_models:tied_lm``: embedding, two blocks and a head that multiplies by the
embedding's own weight. Every stage holding the weight keeps a copy; after the last backward the
copies' gradients are summed over the owners, so each copy sees the unpipelined gradient and the
copies stay equal. fp32; tolerances as in ``test_transparency.py``: one step's losses rtol 1e-6,
gradients rtol 1e-5 / atol 1e-6 (micro-batch sums reorder float additions); several optimizer
steps rtol 1e-5 on losses and parameters.
"""

import itertools

import pytest
import torch

from executor.config import RunConfig
from executor.models.build import build_model
from executor.runtime.pipeline import LocalPipeline, prepare
from sim.errors import GpipeInputError
from tests.helpers.parity import TIED, TIED_DATA, check_tied_step

MODEL, DATA = TIED, TIED_DATA
PARTITIONS = {1: (4,), 2: (2, 2), 3: (1, 2, 1), 4: (1, 1, 1, 1)}
GRID = list(itertools.product((1, 2, 3, 4), (1, 3, 4), ("always", "except_last", "never", "full"), ("gpipe", "1f1b")))


def config(stages, microbatches=4, checkpoint="except_last", schedule="gpipe", **overrides):
    return RunConfig.of(model=MODEL, data=DATA, loss="cross_entropy", partition=PARTITIONS[stages], batch_size=10,
                     microbatches=microbatches, checkpoint=checkpoint, schedule=schedule, **overrides)


@pytest.mark.parametrize("stages,microbatches,checkpoint,schedule", GRID)
def test_one_step_matches_unpipelined(stages, microbatches, checkpoint, schedule):
    layers, model = check_tied_step(LocalPipeline(config(stages, microbatches, checkpoint, schedule)))
    head_copy = layers[-1].weight
    torch.testing.assert_close(head_copy.grad, model[0].embedding.weight.grad, rtol=1e-5, atol=1e-6)
    assert (head_copy is layers[0].embedding.weight) == (stages == 1)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_training_follows_the_unpipelined_model_step_after_step(optimizer, stages):
    """The case that drifted when each stage updated its own copy unsummed."""
    pipe = LocalPipeline(config(stages, lr=0.05, optimizer=optimizer))
    model = build_model(MODEL, {}, 0)
    make = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    reference = make(model.parameters(), lr=0.05)
    for step in range(4):
        inputs, targets = pipe.batch(step)
        loss = pipe.run_step(step)
        reference.zero_grad()
        ref = pipe.prepared.loss_fn(model(inputs), targets)
        ref.backward()
        reference.step()
        torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-5, atol=1e-6)
    layers = list(pipe.model())
    for name, p in model.named_parameters():
        index, rest = name.split(".", 1)
        torch.testing.assert_close(layers[int(index)].get_parameter(rest), p, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(layers[-1].weight, layers[0].embedding.weight, rtol=0, atol=0)


def test_the_groups_name_each_owner_and_skip_parameters_one_stage_holds():
    groups = prepare(config(3)).shared
    assert [(g.owners, g.names) for g in groups] == [((0, 2), {0: "0.embedding.weight", 2: "3.weight"})]
    assert prepare(config(1)).shared == []


SHARING = '''
import torch
from torch import nn

def shared_buffer():
    a, b = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    b.running_mean = a.running_mean
    return nn.Sequential(a, nn.Linear(4, 4), b)

def shared_module():
    lin = nn.Linear(4, 4)
    return nn.Sequential(lin, nn.Tanh(), lin)

def shared_activation():
    act = nn.Tanh()
    return nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act)

def example_batch(rows):
    return torch.randn(rows, 4), torch.randn(rows, 4)
'''


@pytest.mark.parametrize("factory,message", [
    ("shared_buffer", "buffer 'running_mean' of layer 2 (stage 1) is also buffer 'running_mean' of layer 0"),
    ("shared_module", "layer 2 (stage 1) contains a Linear that layer 0 (stage 0) contains too"),
])
def test_sharing_that_cannot_be_kept_equal_is_refused(tmp_path, monkeypatch, factory, message):
    (tmp_path / "sharing_models.py").write_text(SHARING)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(GpipeInputError) as info:
        prepare(RunConfig.of(model=f"sharing_models:{factory}", partition=(2, 1), batch_size=4, microbatches=2))
    assert message in str(info.value) and "\n" not in str(info.value)
    prepare(RunConfig.of(model=f"sharing_models:{factory}", partition=(3,), batch_size=4, microbatches=2))


def test_a_shared_module_without_parameters_is_fine(tmp_path, monkeypatch):
    (tmp_path / "sharing_models.py").write_text(SHARING)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert prepare(RunConfig.of(model="sharing_models:shared_activation", partition=(2, 2), batch_size=4,
                             microbatches=2)).shared == []


@pytest.mark.parametrize("stages", [2, 4])
def test_global_clipping_counts_a_shared_parameter_once(stages):
    """AdamW with a clip norm small enough to clip every step: the norm over all stages' gradients
    must equal the unpipelined model's, where the tied weight is one parameter."""
    pipe = LocalPipeline(config(stages, lr=0.01, optimizer="adamw", weight_decay=0.1, clip_grad_norm=0.05))
    model = build_model(MODEL, {}, 0)
    reference = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(3):
        inputs, targets = pipe.batch(step)
        loss = pipe.run_step(step)
        reference.zero_grad()
        ref = pipe.prepared.loss_fn(model(inputs), targets)
        ref.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        reference.step()
        assert norm > 0.05  # clipping happened
        assert pipe.grad_norms[-1] == pytest.approx(float(norm), rel=1e-5)
        torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-5, atol=1e-6)
    layers = list(pipe.model())
    torch.testing.assert_close(layers[-1].weight, layers[0].embedding.weight, rtol=0, atol=0)
