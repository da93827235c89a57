"""An all-gather of equal shards among ranks of one host through shared memory instead of gloo's TCP.

Why: ZeRO-2/3 gathers each unit's parameters from its shards once a step or more
(:mod:`executor.parallel.fully_sharded`); over gloo on loopback every byte crosses both kernels'
socket buffers, as the gradient sum's did (:mod:`executor.transport.shm_allreduce`). Ranks of one
host can instead write their shard once into shared pages and read the others' where they lie.

How: the file of a :class:`~executor.transport.shm_allreduce.SharedSum` of one shard's size (one input
region per rank, the same arrival counts), used differently. Gather g: wait until every rank has
finished copying gather g-1 out (its second arrival), write this rank's shard into its region,
arrive; once every rank has arrived, copy the D regions, in rank order, into the output and arrive a
second time. A rank writes its region again only after every rank's second arrival of the previous
gather, so no reader ever sees a half-written shard.

Limits: those of the gradient sum (ranks of one host, each with a core; x86's store order); the
file holds one copy of the gathered unit per group of ranks for the run.
"""

from __future__ import annotations

import os

import torch

from executor.transport.shm_allreduce import SharedSum


class SharedGather(SharedSum):
    """One unit's all-gather over ``ranks`` (all covered by ``links``), this rank's end; ``shapes``
    is the one shard's shape, the same on every rank."""

    def gather(self, shard: torch.Tensor, output: torch.Tensor) -> None:
        """``output`` (the D shards, flat, in rank order) from every rank's ``shard``."""
        self._mapped()
        if self.generation:
            self._wait_all(2 * self.generation)  # every rank has copied the previous gather out
            if self.generation == 1 and self.index == 0:
                os.unlink(self.path)  # every rank has it mapped: its pages go when the last one unmaps
        with torch.no_grad():
            self.inputs[self.index].copy_(shard.reshape(-1))
            self.generation += 1
            self._arrive(2 * self.generation - 1)
            self._wait_all(2 * self.generation - 1)
            flat, numel = output.view(-1), self.numel
            for rank, region in enumerate(self.inputs):
                flat[rank * numel:(rank + 1) * numel].copy_(region)
        self._arrive(2 * self.generation)
