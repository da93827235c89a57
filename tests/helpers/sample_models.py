"""Models for the executor's tests, named ``tests.helpers.sample_models:FACTORY`` like any user's model.

``several_tensors``: layers pass dicts and tuples of tensors, with leaves of every kind a boundary
can carry: per-row activations that need a gradient, a fixed-shape table computed from parameters
(a gradient flows back through it), per-row integer ids and a per-row float gate computed from the
data alone (no gradient).
"""

from __future__ import annotations

import torch
from torch import nn


class Embed(nn.Module):
    """data {"x": (rows, width), "ids": (rows, 4) int64} -> the dict every later layer passes on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.table = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Called again on every layer built on the meta device (executor.models.materialize)."""
        with torch.no_grad():
            self.table.normal_(0.0, 0.1)

    def forward(self, data: dict) -> dict:
        return {"hidden": torch.tanh(self.inp(data["x"])), "scale": 1 + torch.tanh(self.table),
                "ids": data["ids"], "gate": (data["x"][:, :1] > 0).float()}


class DictBlock(nn.Module):
    """dict -> tuple (hidden, scale, ids, gate)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.ids = nn.Embedding(16, width)

    def forward(self, value: dict) -> tuple:
        h = value["hidden"]
        h = h + torch.tanh(self.lin(h) * value["scale"] + self.ids(value["ids"]).mean(1) * value["gate"])
        return h, value["scale"] * 0.9, value["ids"], value["gate"]


class TupleBlock(nn.Module):
    """tuple -> dict, with a None inside the tuple that never leaves the stage."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, value: tuple) -> dict:
        h, scale, ids, gate = value[:4]
        h = h + torch.tanh(self.lin(h) * scale) * (1 + gate)
        return {"hidden": h, "scale": scale, "ids": ids, "gate": gate}


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.out = nn.Linear(width, width)

    def forward(self, value) -> torch.Tensor:
        h = value["hidden"] if isinstance(value, dict) else value[0]
        return self.out(h)


def several_tensors(width: int = 16, blocks: int = 4) -> nn.Sequential:
    """Embed, ``blocks`` blocks alternating dict -> tuple and tuple -> dict, and a head."""
    layers = [DictBlock(width) if i % 2 == 0 else TupleBlock(width) for i in range(blocks)]
    return nn.Sequential(Embed(width), *layers, Head(width))


def example_batch(rows: int, width: int = 16) -> tuple[dict, torch.Tensor]:
    return ({"x": torch.randn(rows, width), "ids": torch.randint(0, 16, (rows, 4))},
            torch.randn(rows, width))


# ----------------------------------------------------------------------------- tied embeddings


class TokenEmbedding(nn.Module):
    """ids (rows, seq) -> (rows, seq, d_model)."""

    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


class Mixer(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.lin = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.ln(x)))


class TiedHead(nn.Module):
    """LayerNorm, then logits against the embedding's own weight (the usual tied layout)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(embedding.embedding_dim)
        self.weight = embedding.weight  # the same Parameter: registered here and in the embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x) @ self.weight.t()


def tied_lm(vocab: int = 32, d_model: int = 16, blocks: int = 2) -> nn.Sequential:
    """A GPT-style stack whose output head reuses the token embedding's weight."""
    embed = TokenEmbedding(vocab, d_model)
    return nn.Sequential(embed, *[Mixer(d_model) for _ in range(blocks)], TiedHead(embed.embedding))


def tied_lm_batch(rows: int, vocab: int = 32, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, vocab, (rows, seq)), torch.randint(0, vocab, (rows, seq))


def tied_lm_data(batch_size: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``--data`` for ``tied_lm``: a pure function of (seed, step)."""
    torch.manual_seed(seed * 1000 + step)
    return tied_lm_batch(batch_size)


class SplitMixer(nn.Module):
    """A residual MLP with its own tensor-parallel plan (executor.parallel.tensor_parallel's hook): the first
    linear column-parallel, the second row-parallel."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, 2 * d_model)
        self.down = nn.Linear(2 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.ln(x))))

    def tensor_parallel_plan(self, parts: int) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"up": ColwiseParallel(), "down": RowwiseParallel()}


class Replicated(nn.Module):
    """Marks a wrapped layer as replicated over a stage's tensor-parallel ranks."""

    def tensor_parallel_plan(self, parts: int) -> dict:
        return {}


class ReplicatedEmbedding(TokenEmbedding, Replicated):
    pass


class ReplicatedTiedHead(TiedHead, Replicated):
    pass


def tied_split_lm(vocab: int = 32, d_model: int = 16, blocks: int = 2) -> nn.Sequential:
    """``tied_lm`` whose blocks split over tensor-parallel ranks by their own plan."""
    embed = ReplicatedEmbedding(vocab, d_model)
    return nn.Sequential(embed, *[SplitMixer(d_model) for _ in range(blocks)], ReplicatedTiedHead(embed.embedding))


class ScalarGain(nn.Module):
    """A linear layer times a learned scalar: a parameter of no dimension, which FSDP cannot shard."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain


def scalar_gain_mlp(width: int = 16, layers: int = 2) -> nn.Sequential:
    """``layers`` of :class:`ScalarGain` on (rows, width) inputs (the built-in mlp's data)."""
    return nn.Sequential(*[ScalarGain(width) for _ in range(layers)])
