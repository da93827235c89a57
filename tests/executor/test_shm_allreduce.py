"""The data-parallel gradient sum through shared memory: every rank gets the weighted sum, summed in
rank order and bit for bit the same on each, step after step; absent gradients are left alone; a
rank that never comes is named after the timeout."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from executor.transport.shm_allreduce import SharedSum, share_bounds
from executor.transport.shm_transport import HostLinks, shared_directory


@pytest.mark.parametrize("numel,parties", [(1, 2), (16, 2), (100, 3), (4096 + 7, 4)])
def test_the_shares_cover_every_element_once_in_whole_cache_lines(numel, parties):
    bounds = [share_bounds(numel, parties, i) for i in range(parties)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, end), (start, _) in zip(bounds, bounds[1:]):
        assert end == start and start % 16 == 0


def run_ranks(parties, body, timeout_s=5.0):
    """``body(rank, links)`` on one thread per rank over one shared directory; the exceptions raised."""
    errors: dict[int, BaseException] = {}
    with shared_directory() as directory:
        links = [HostLinks(directory, r, list(range(parties)), timeout_s=timeout_s) for r in range(parties)]

        def main(rank):
            try:
                body(rank, links[rank])
            except BaseException as exc:  # reported to the test
                errors[rank] = exc

        threads = [threading.Thread(target=main, args=(r,)) for r in range(parties)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for link in links:
            link.socket.close()
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rank_gets_the_weighted_sum_in_rank_order_bit_for_bit_each_step(dtype):
    parties, shapes, steps = 3, [(3, 5), (7,), (2, 2, 2)], 3
    weights = [0.5, 0.25, 0.25]
    given = {(r, s): [torch.randn(shape, generator=torch.Generator().manual_seed(100 * r + 10 * s + i)).to(dtype)
                      for i, shape in enumerate(shapes)] for r in range(parties) for s in range(steps)}
    results: dict[tuple[int, int], list[torch.Tensor]] = {}

    def body(rank, links):
        shared = SharedSum(links, list(range(parties)), shapes, dtype, "test")
        for step in range(steps):
            grads = [g.clone() for g in given[(rank, step)]]
            if step == 1:
                grads[1] = None  # absent on every rank this step
            shared.launch(grads, weights[rank])
            shared.finish(grads)
            results[(rank, step)] = grads

    assert run_ranks(parties, body) == {}
    for step in range(steps):
        for i in range(len(shapes)):
            if step == 1 and i == 1:
                assert all(results[(r, step)][i] is None for r in range(parties))
                continue
            expected = given[(0, step)][i] * weights[0] + given[(1, step)][i] * weights[1]
            expected = expected + given[(2, step)][i] * weights[2]
            for rank in range(parties):
                assert torch.equal(results[(rank, step)][i], expected), (rank, step, i)


def test_sums_made_one_after_another_each_have_a_file_of_their_own_gone_after_the_first_step():
    """As calibration runs configurations one after another in one launch: same ranks, same shapes."""
    seen: dict[int, list[torch.Tensor]] = {}
    paths: dict[int, list[str]] = {}

    def body(rank, links):
        for run in range(3):
            shared = SharedSum(links, [0, 1], [(40,)], torch.float32, "same")
            for _ in range(2):
                grads = [torch.full((40,), float(rank + run))]
                shared.launch(grads, 1.0)
                shared.finish(grads)
                if rank == 0:  # the maker removes the name once every rank has mapped it
                    assert not os.path.exists(shared.path)
            seen.setdefault(rank, []).append(grads[0])
            paths.setdefault(rank, []).append(shared.path)

    assert run_ranks(2, body) == {}
    assert paths[0] == paths[1] and len(set(paths[0])) == 3
    for run in range(3):
        assert torch.equal(seen[0][run], torch.full((40,), float(1 + 2 * run)))
        assert torch.equal(seen[1][run], seen[0][run])


def test_a_rank_that_never_comes_is_named_after_the_timeout():
    def body(rank, links):
        if rank == 1:
            return  # never reaches the sum
        shared = SharedSum(links, [0, 1], [(4,)], torch.float32, "late")
        grads = [torch.ones(4)]
        shared.launch(grads, 0.5)
        shared.finish(grads)

    errors = run_ranks(2, body, timeout_s=0.3)
    assert list(errors) == [0]
    assert "ranks [1] did not reach the data-parallel gradient sum" in str(errors[0])
