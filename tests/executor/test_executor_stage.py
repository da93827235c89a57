"""The stage's schedule walk: dropout replay under recompute, seeds, memory accounting, shape checks."""

import pytest
import torch
from torch import nn

from executor.config import RunConfig
from executor.runtime.memory import ActivationCounter
from executor.runtime.pipeline import LocalPipeline, prepare
from sim.errors import GpipeInputError

DROPOUT = {"layers": 2, "d_model": 32, "ff": 64, "seq": 8, "vocab": 64, "dropout": 0.3}


def one_step(checkpoint, schedule="gpipe", seed=0, microbatches=3):
    config = RunConfig.of(model="transformer", options=DROPOUT, partition=(2, 2), batch_size=10,
                       microbatches=microbatches, checkpoint=checkpoint, schedule=schedule, seed=seed)
    pipe = LocalPipeline(config)
    loss = pipe.run_step(0, update=False)
    return loss, {n: p.grad.clone() for n, p in pipe.model().named_parameters()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "full"])
def test_dropout_recompute_replays_the_masks(checkpoint, schedule):
    loss, grads = one_step(checkpoint, schedule)
    ref_loss, ref_grads = one_step("never", schedule)
    assert loss == ref_loss
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_dropout_is_reproducible_from_the_seed_and_depends_on_it():
    assert one_step("always", seed=5) [0] == one_step("always", seed=5)[0]
    assert one_step("always", seed=5)[0] != one_step("always", seed=6)[0]


def test_loss_does_not_depend_on_the_number_of_microbatches():
    base = dict(model="mlp", options={"width": 16}, partition=(4, 4), batch_size=12)
    losses = [LocalPipeline(RunConfig.of(microbatches=m, **base)).run_step(0) for m in (1, 2, 5, 12)]
    for loss in losses[1:]:
        assert abs(loss - losses[0]) < 1e-6


def test_rematerialization_lowers_the_counted_peak():
    base = dict(model="mlp", options={"width": 16}, partition=(4, 4), batch_size=16, microbatches=4)
    peaks = {}
    for policy in ("always", "except_last", "never"):
        pipe = LocalPipeline(RunConfig.of(checkpoint=policy, **base))
        pipe.run_step(0)
        peaks[policy] = [s.counter.peak_bytes for s in pipe.stages]
    for k in range(2):
        assert peaks["always"][k] <= peaks["except_last"][k] < peaks["never"][k]


def test_counter_counts_each_storage_once_and_excludes_parameters():
    layer = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    counter = ActivationCounter(list(layer.parameters()))
    x = torch.randn(8, 4, requires_grad=True)
    counter.stash(0, x)
    with counter.saving(0):
        y = layer(x)
    # saved: x (stash, also saved by the first Linear), the ReLU output (saved by ReLU and by the
    # second Linear: one storage); the weights are excluded.
    assert counter.sample() == 2 * 8 * 4 * 4
    y.sum().backward()
    counter.release(0)
    assert counter.sample() == 0 and counter.peak_bytes == 2 * 8 * 4 * 4


def test_gpipe_never_holds_every_microbatch_at_once():
    base = dict(model="mlp", options={"width": 16, "layers": 2}, partition=(1, 1), batch_size=8,
                checkpoint="never")
    one = LocalPipeline(RunConfig.of(microbatches=1, **base))
    four = LocalPipeline(RunConfig.of(microbatches=4, **base))
    one.run_step(0)
    four.run_step(0)
    # Fill-and-drain without recompute keeps all four micro-batches' activations: the same bytes as
    # one micro-batch of the whole batch.
    assert four.stages[0].counter.peak_bytes == one.stages[0].counter.peak_bytes


def test_bad_partition_and_broken_layer_fail_before_training(tmp_path, monkeypatch):
    with pytest.raises(GpipeInputError, match="sums to 7 layers but the model has 8"):
        prepare(RunConfig.of(model="mlp", partition=(3, 4)))
    (tmp_path / "broken_models.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(5, 2))\n"
        "def example_batch(rows):\n    return torch.randn(rows, 4), torch.randn(rows, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(GpipeInputError) as info:
        prepare(RunConfig.of(model="broken_models:build", partition=(2, 1)))
    message = str(info.value)
    assert "layer 2 (Linear, stage 1)" in message and "[2, 8]" in message and "\n" not in message


@pytest.mark.parametrize("schedule, partition, virtual", [("zb-h1", [3, 3], 1), ("zbv", [2, 2, 1, 1], 2)])
def test_the_running_count_equals_the_union_of_what_each_microbatch_holds(monkeypatch, schedule, partition, virtual):
    """The counter keeps its total as entries come and go; after every action it must equal the union
    of the entries' storages. The split backward frees part of a micro-batch's graph at I and keeps
    the rest to W, so another micro-batch's forward reuses those addresses at other sizes."""
    from executor.runtime import memory

    sample = memory.ActivationCounter.sample
    checked = []

    def union_checked(self):
        union = {}
        for storages in self._live.values():
            union.update(storages)
        checked.append(sum(union.values()) == sample(self))
        return self.current_bytes

    monkeypatch.setattr(memory.ActivationCounter, "sample", union_checked)
    config = RunConfig.of(model="transformer", options={"layers": 4, "d_model": 32, "ff": 64, "heads": 2, "seq": 8,
                                                      "vocab": 32},
                       partition=partition, batch_size=16, microbatches=8, schedule=schedule, checkpoint="never",
                       steps=2, virtual_stages=virtual)
    pipe = LocalPipeline(config)
    for step in range(2):
        pipe.run_step(step)
    assert len(checked) > 50 and all(checked)


def test_what_a_backward_leaves_is_freed_in_the_next_wait_and_at_the_latest_at_the_steps_end():
    """Stage 0 of two (gpipe, M=2): its first backward's output outlives the backward (freeing it
    between two actions would delay the next one) and is gone once the second backward has waited
    for its gradient; stage 1 never waits in an in-process pipeline and frees at the end of its step."""
    import weakref

    config = RunConfig.of(model="mlp", options={"width": 16}, partition=(4, 4), batch_size=8, microbatches=2,
                       checkpoint="never")
    pipe = LocalPipeline(config)
    first, last = pipe.stages
    second = [a for a in first.actions if a.kind.value == "B"][1]
    answers = iter([True, False, False])  # the walk sees it, then the stage's own looks find it away

    def ready(channel, microbatch, plain=first.transport.ready):
        if (channel, microbatch) == ("grad", second.microbatch) and plain(channel, microbatch):
            return next(answers, True)  # once it is there: as if it arrived during the wait's chores
        return plain(channel, microbatch)

    first.transport.ready = ready
    kept = []
    run = first.run

    def observed(action):
        if action == second:
            kept.extend(weakref.ref(t) for t in first._finished if isinstance(t, torch.Tensor))
        run(action)

    first.run = observed
    pipe.run_step(0)
    assert kept and all(ref() is None for ref in kept)  # kept past the first backward, freed in the wait
    assert first._finished and not last._finished  # the second's leftovers wait for the next step's wait
