"""Users' models whose own initialisation matters, named ``tests.helpers.user_init_models:FACTORY``.

``custom_init``: constants, normal(0, 0.02), nanoGPT's scaled residual projections, a zeroed
projection, a gate without ``reset_parameters()`` and a head set from a tensor inside the factory,
and a non-persistent buffer computed in a constructor: a pipeline that starts anywhere but where
``factory()`` leaves it trains another model.

``gpt2_blocks``: a stack of Hugging Face ``GPT2Block``s (their ``Conv1D`` has no
``reset_parameters()``), with dropout as an option.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Residual(nn.Module):
    """x + proj(tanh(fc(x))) * scale; ``scale`` a non-persistent buffer the constructor computes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x))) * self.scale


class Gate(nn.Module):
    """x * (1 + gain): no ``reset_parameters()``, its value is whatever the factory sets."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + self.gain)


def custom_init(width: int = 16, blocks: int = 3) -> nn.Sequential:
    """Linear (0.1 everywhere), ``blocks`` residual blocks, a gate, a head: six layers by default."""
    first = nn.Linear(width, width)
    body = [Residual(width) for _ in range(blocks)]
    gate = Gate(width)
    head = nn.Linear(width, width)
    with torch.no_grad():
        nn.init.constant_(first.weight, 0.1)
        nn.init.constant_(first.bias, 0.1)
        for index, block in enumerate(body):
            nn.init.normal_(block.fc.weight, 0.0, 0.02)
            nn.init.zeros_(block.fc.bias)
            if index == 0:
                nn.init.zeros_(block.proj.weight)  # a zero-initialised projection
            else:
                nn.init.normal_(block.proj.weight, 0.0, 0.02 / math.sqrt(2 * blocks))  # nanoGPT's scaled init
        gate.gain.copy_(torch.linspace(-0.5, 0.5, width))
        head.weight.copy_(torch.arange(width * width, dtype=torch.float32).reshape(width, width) / (width * width))
        head.bias.zero_()
    return nn.Sequential(first, *body, gate, head)


def example_batch(rows: int, width: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, width), torch.randn(rows, width)


def gpt2_blocks(layers: int = 4, width: int = 32, heads: int = 4, dropout: float = 0.0) -> nn.Sequential:
    """``layers`` ``transformers`` ``GPT2Block``s: (rows, seq, width) -> (rows, seq, width), causal."""
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(n_embd=width, n_head=heads, n_layer=layers, n_positions=64,
                                     resid_pdrop=dropout, attn_pdrop=dropout, embd_pdrop=dropout)
    config._attn_implementation = "eager"
    return nn.Sequential(*[GPT2Block(config, layer_idx=i) for i in range(layers)])


def gpt2_data(batch_size: int, step: int, seed: int, width: int = 32, seq: int = 8):
    """``--data`` for ``gpt2_blocks``: a pure function of (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    return (torch.randn(batch_size, seq, width, generator=generator),
            torch.randn(batch_size, seq, width, generator=generator))
