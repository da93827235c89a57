import torch
from hypothesis import given
from hypothesis import strategies as st

from executor.runtime.data import batch_for_step, mix_seed, split, split_rows


@given(st.integers(1, 200), st.integers(1, 40))
def test_split_rows_is_torch_chunk(batch, microbatches):
    expected = [c.shape[0] for c in torch.chunk(torch.empty(batch), microbatches)]
    assert split_rows(batch, microbatches) == expected
    assert [c.shape[0] for c in split(torch.empty(batch, 2), microbatches)] == expected


def test_documented_uneven_splits():
    assert split_rows(10, 4) == [3, 3, 3, 1]
    assert split_rows(2, 4) == [1, 1]


def test_batches_are_a_pure_function_of_seed_and_step():
    a = batch_for_step("mlp", {"width": 8}, 4, seed=1, step=5)
    b = batch_for_step("mlp", {"width": 8}, 4, seed=1, step=5)
    c = batch_for_step("mlp", {"width": 8}, 4, seed=1, step=6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert mix_seed(1, 2, 3) != mix_seed(1, 3, 2)
