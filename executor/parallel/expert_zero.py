"""ZeRO-1 with expert parallelism (``--zero 1 --expert-parallel E``): two sharded optimizers behind one.

A stage's non-expert parameters are the same on all D replicas, its routed experts only on the D/E
replicas of their expert-data-parallel group (``edp``, :mod:`executor.parallel.expert_parallel`). So,
as Megatron-Core's distributed optimizer splits them, the non-expert parameters' optimizer state is
sharded over ``dp`` by one :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`, the experts'
over ``edp`` by another (with E = D, ``edp`` is one rank: a plain optimizer steps the rank's experts
whole); each broadcasts what it stepped only within its own group. :class:`ExpertShardedOptimizer`
shows them as one optimizer of one parameter group over the stage's parameters in their order, so
the learning-rate schedule, ``zero_grad``, the checkpoint's parameter names and its state (a plain
optimizer's, indexed in the stage's order) are as for any other stage. Gradients are summed before
the step as without ZeRO (the experts' over ``edp``) and the norm counts each expert once, so every
elementwise optimizer (SGD, Adam, AdamW) takes the steps one process takes.

Checkpoints: :func:`consolidate` gathers each sharded state onto its group's rank 0 (replica 0 for the
non-expert parameters, replicas 0..E-1 for their experts), so the E ranks of replica 0's expert group
hold the stage's state between them, which :func:`executor.parallel.expert_parallel.full_stage_state`
puts together. Such a checkpoint is a consolidated ZeRO-1 one, resumed under the same D, ZeRO stage and
partition (:mod:`executor.state.checkpoint`), at any E.

Limits: torch shards by whole parameters (largest first, each to the least loaded rank), so a rank's
share of the state equals 1/D (1/(D/E) of the experts') exactly only where the sizes allow it; the
simulator counts an even split.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from executor.models.loaded_types import is_zero_optimizer

HYPERPARAMETERS_SKIPPED = ("params",)


class ExpertShardedOptimizer(torch.optim.Optimizer):
    """``dense`` (the non-expert parameters') and ``experts`` (the routed experts') stepped as one
    optimizer over ``params``, the stage's parameters in their order; it holds no state of its own."""

    def __init__(self, params: Sequence[nn.Parameter], dense: torch.optim.Optimizer,
                 experts: torch.optim.Optimizer) -> None:
        self.parts = (dense, experts)
        defaults = {k: v for k, v in dense.param_groups[0].items() if k not in HYPERPARAMETERS_SKIPPED}
        super().__init__(list(params), defaults)
        index = {id(p): i for i, p in enumerate(self.param_groups[0]["params"])}
        # each part's parameters' positions among the stage's: how a state indexed by the stage's splits
        self.positions = [[index[id(p)] for group in part.param_groups for p in group["params"]] for part in self.parts]

    def _sync_hyperparameters(self) -> None:
        """The schedule's learning rate (and any other setting) set on this group, on each part's."""
        settings = {k: v for k, v in self.param_groups[0].items() if k not in HYPERPARAMETERS_SKIPPED}
        for part in self.parts:
            for group in part.param_groups:
                group.update(settings)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self._sync_hyperparameters()
        for part in self.parts:
            part.step()

    def consolidate(self) -> None:
        """Each sharded part's state onto its group's rank 0 (collective over both groups)."""
        for part in self.parts:
            if is_zero_optimizer(part):
                part.consolidate_state_dict(to=0)

    def state_dict(self) -> dict[str, Any]:
        """A plain optimizer's state over the stage's parameters: of each part whose consolidated
        state this rank holds (after :meth:`consolidate`), its parameters' entries."""
        state: dict[int, Any] = {}
        for part, positions in zip(self.parts, self.positions):
            if is_zero_optimizer(part) and part.rank != 0:
                continue
            for local, value in part.state_dict()["state"].items():
                state[positions[local]] = value
        group = {k: v for k, v in self.param_groups[0].items() if k not in HYPERPARAMETERS_SKIPPED}
        return {"state": dict(sorted(state.items())),
                "param_groups": [dict(group, params=list(range(len(self.param_groups[0]["params"]))))]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state indexed in the stage's order (each part takes its parameters' entries)."""
        saved = state_dict["param_groups"][0]
        self.param_groups[0].update({k: v for k, v in saved.items() if k not in HYPERPARAMETERS_SKIPPED})
        entries = state_dict["state"]
        for part, positions in zip(self.parts, self.positions):
            groups = [dict(saved, params=list(range(len(positions))))]
            part.load_state_dict({"state": {local: entries[i] for local, i in enumerate(positions) if i in entries},
                                  "param_groups": groups})
        self._sync_hyperparameters()


def held_states(optimizer: torch.optim.Optimizer | None) -> Iterable[dict[str, Any]]:
    """The per-parameter state dicts this rank holds: a ZeRO optimizer's shard's, both parts' of an
    :class:`ExpertShardedOptimizer`, a plain optimizer's whole."""
    if optimizer is None:
        return []
    if isinstance(optimizer, ExpertShardedOptimizer):
        return [state for part in optimizer.parts for state in held_states(part)]
    local = optimizer.optim if is_zero_optimizer(optimizer) else optimizer
    return list(local.state.values())


def consolidate(optimizer: torch.optim.Optimizer | None) -> None:
    """Before a checkpoint: a sharded optimizer's state gathered onto its group's rank 0 (collective
    over its groups); a no-op for a plain one."""
    if isinstance(optimizer, ExpertShardedOptimizer):
        optimizer.consolidate()
    elif is_zero_optimizer(optimizer):
        optimizer.consolidate_state_dict(to=0)  # type: ignore[union-attr]


def expert_sharded_optimizer(params: Sequence[nn.Parameter], expert_params: Sequence[nn.Parameter],
                             optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                             dense_group: dist.ProcessGroup,
                             expert_group: dist.ProcessGroup | None) -> ExpertShardedOptimizer:
    """The stage's optimizer over ``params``: the non-expert ones sharded over ``dense_group`` (dp), the
    ``expert_params`` over ``expert_group`` (edp; None: one rank, a plain optimizer)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # slow to import: ZeRO runs only

    expert_ids = {id(p) for p in expert_params}
    dense = [p for p in params if id(p) not in expert_ids]
    experts = [p for p in params if id(p) in expert_ids]
    dense_optimizer = ZeroRedundancyOptimizer(dense, optimizer_class=optimizer_class, process_group=dense_group,
                                              **kwargs)
    expert_optimizer: torch.optim.Optimizer = (
        optimizer_class(experts, **kwargs) if expert_group is None else
        ZeroRedundancyOptimizer(experts, optimizer_class=optimizer_class, process_group=expert_group, **kwargs))
    return ExpertShardedOptimizer(params, dense_optimizer, expert_optimizer)
