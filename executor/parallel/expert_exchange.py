"""Each routed token's hidden state sent to the rank holding its expert and the output brought back:
two ``all_to_all_single`` calls over the expert-parallel group, with autograd through both.

A block's forward on every one of the E ranks of its expert-parallel group (:mod:`executor.parallel.expert_parallel`):

1. route its own tokens (the router is replicated); sort the (token, slot) assignments by expert, so
   each destination rank's are contiguous (rank j holds experts ``j x n/E`` to ``(j+1) x n/E - 1``);
2. exchange the per-expert counts (an all-to-all of n integers), then **dispatch**: the sorted
   assignments' hidden states, each rank's part to its rank (an all-to-all of uneven splits);
3. run each local expert over the rows each rank sent it (:class:`LocalExperts`);
4. **combine**: the outputs back to the ranks the rows came from (the reverse all-to-all), where each
   assignment's output is added to its token at its router weight, expert by expert in the order the
   one-process loop adds them (:mod:`executor.models.moe`).

Dropless: every assignment travels, however uneven the load. The backward runs the two all-to-alls
in reverse (:class:`AllToAll`): the gradients of the outputs go to the expert ranks, those of the hidden
states come back. Every rank of the group must run its blocks' exchanges in the same order: they walk
the same action list (one schedule, the same micro-batches), which the run's checks ensure.

Gradient weighting: a replica's loss is the mean over its own rows and its gradients are weighted by
``rows_d / B`` before the data-parallel sum (:mod:`executor.parallel.replicas`). An expert's weight
gradient sums every source's contribution here, in the backward, so each source scales the output
gradients it sends back by its own ``rows_d / B`` and unscales the hidden states' gradients that come
back (:class:`ScaleGradient`): an expert's gradient is then the weighted sum over its group's
replicas, and the expert-data-parallel sum adds the other groups' with weight 1.

Hidden states and outputs travel in fp32 (gloo's all-to-all; a bf16 value round-trips exactly).
Traced runs (``--trace``) record each all-to-all as a span of the kinds
:data:`~sim.formats.timeline.EP_DISPATCH` and :data:`~sim.formats.timeline.EP_COMBINE`, from issue to
completion, inside the F, R or B span that issued it (a backward's are its reverse all-to-alls).

Split backward (:mod:`executor.runtime.split_backward`): both reverse all-to-alls are on the path from
the stage's outputs to its inputs, so I runs them; W starts at the experts' own nodes (below the
dispatch's reverse) and reaches only weights, never an all-to-all. On the first stage, whose inputs
need no gradient, W is the whole backward and runs them. Either way every rank of a group runs them
in the same action of the one list its group walks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from sim.formats.timeline import EP_COMBINE, EP_DISPATCH


@dataclass
class Exchange:
    """One rank's end of its expert-parallel group: what a block's :attr:`exchange` needs."""

    group: dist.ProcessGroup  # the E ranks holding the stage's experts between them
    rank: int  # this rank's place in it: it holds experts rank x n/E .. (rank+1) x n/E - 1
    size: int  # E
    weight: float  # this replica's share of the global batch, rows_d / B
    recorder: Any = None  # traced runs: the stage's Recorder, whose spans the all-to-alls are
    microbatch: list[int] = field(default_factory=lambda: [-1])  # the action running now (traced runs)

    def span(self, kind: str) -> Callable[[], None] | None:
        return None if self.recorder is None else self.recorder.open_span(kind, self.microbatch[0])

    def __call__(self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, block: Any) -> torch.Tensor:
        return routed_output(self, tokens, weights, chosen, block)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of the rows of ``x`` (``sent`` rows to each rank, ``received`` from each);
    backward: the reverse exchange of the gradient. Collective over ``exchange.group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, received: list[int], sent: list[int], exchange: Exchange,
                kind: str) -> torch.Tensor:
        ctx.received, ctx.sent, ctx.exchange, ctx.kind = received, sent, exchange, kind
        return _all_to_all(x, received, sent, exchange, kind)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _all_to_all(grad, ctx.sent, ctx.received, ctx.exchange, ctx.kind), None, None, None, None


def _all_to_all(x: torch.Tensor, received: list[int], sent: list[int], exchange: Exchange, kind: str) -> torch.Tensor:
    out = x.new_empty((sum(received), *x.shape[1:]))
    close = exchange.span(kind)
    dist.all_to_all_single(out, x.contiguous(), received, sent, group=exchange.group)
    if close is not None:
        close()
    return out


class ScaleGradient(torch.autograd.Function):
    """``x`` unchanged; backward: its gradient times ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def exchange_counts(counts: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """(E, n/E): row s the assignments rank s sends to each of this rank's experts, from this rank's
    ``counts`` (n,) per expert. Collective over the group."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=exchange.group)  # n/E counts to each rank
    return received.view(exchange.size, -1)


class LocalExperts(nn.ModuleDict):
    """This rank's routed experts of one block, keyed by their index in the block (so their state-dict
    names stay those of the whole list), and callable: ``forward`` runs them over the rows the group
    sent (:func:`run_local_experts`). Being called once per forward makes them a module FSDP2 can
    shard as a unit of its own over their expert-data-parallel replicas (ZeRO-2/3,
    :mod:`executor.parallel.fully_sharded`): its hooks gather them before the call and before its
    backward."""

    def forward(self, received: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return run_local_experts(list(self.values()), received, counts)


def run_local_experts(local: list[nn.Module], received: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each of this rank's experts ``local`` (in index order) over the rows each rank sent it, one call
    per (rank, expert): the outputs (fp32) in the order the rows came (by source rank, then expert).
    ``counts`` (E, n/E) as :func:`exchange_counts` gives. One call per source, not one over every
    source's rows: so each weight gradient a call adds is one replica's micro-batch's, rounded as one
    process rounds it under bf16 autocast (each call casts the weights anew: autocast's cache would
    give the calls one bf16 copy, whose gradient would add theirs in bf16)."""
    outputs, first = [], 0
    with _uncached_autocast(received.device.type):
        for count, expert in zip(counts.reshape(-1).tolist(), local * counts.shape[0]):
            if count:
                outputs.append(expert(received[first:first + count]).float())
            first += count
    if not outputs:  # no row reached this rank's experts: still on the received rows' graph, so its
        return received[:0].float()  # backward runs the reverse all-to-alls its group runs, sending nothing
    return torch.cat(outputs)


def _uncached_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast as the stage runs it, without its cache of cast weights (nothing where autocast is off)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)


def routed_output(exchange: Exchange, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                  block: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The routed experts' weighted sum for ``tokens`` (tokens, d_model) as the one-process loop gives
    it, the experts run on the ranks holding them: added in ``dtype`` (the built-in's loop adds in
    fp32; transformers' adds in the hidden states' dtype, each weighted output cast to it first).
    Collective over the group."""
    experts, top_k = block.num_experts, chosen.shape[1]
    assigned = chosen.reshape(-1)
    order = torch.argsort(assigned, stable=True)  # by expert; within one, by (token, slot) as torch.where
    rows = torch.div(order, top_k, rounding_mode="floor")
    counts = torch.bincount(assigned, minlength=experts)
    received_counts = exchange_counts(counts, exchange)
    sent = counts.view(exchange.size, -1).sum(dim=1).tolist()
    received = received_counts.sum(dim=1).tolist()
    hidden = ScaleGradient.apply(tokens[rows].float(), 1.0 / exchange.weight)
    arrived = AllToAll.apply(hidden, received, sent, exchange, EP_DISPATCH).to(tokens.dtype)
    outputs = block.experts(arrived, received_counts)  # LocalExperts
    back = ScaleGradient.apply(AllToAll.apply(outputs, sent, received, exchange, EP_COMBINE), exchange.weight)
    scaled = back * weights.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros(tokens.shape, dtype=dtype, device=tokens.device)
    first = 0
    for count in counts.tolist():  # expert by expert, as the one-process loop adds them
        if count:
            out = out.index_add(0, rows[first:first + count], scaled[first:first + count].to(dtype))
        first += count
    return out
