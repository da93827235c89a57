"""Byte-level text for the language models: ``--data text`` (the shipped Shakespeare) or ``text:PATH``.

Synthetic tokens are uniform noise, so a model trained on them cannot do better than ln(vocab) and
its loss never falls; a real text gives a loss curve that shows the model learning. Each byte is
a token (vocabulary 256, no tokenizer to install or ship), so any model with a vocabulary of 256 or
more reads it. Row r of mini-batch ``step`` is the window of ``seq + 1`` bytes at an offset drawn
from ``(seed, step)``; the inputs are its first ``seq`` bytes and the targets the next byte at every
position (next-token prediction, which the causal transformer and the Hugging Face decoders train
on). Batches stay a pure function of (seed, step), as :mod:`executor.runtime.data` requires, so a resumed
run sees the data an uninterrupted one sees.

Limits: windows are sampled with replacement and may overlap; there is no held-out split, so the
printed loss is the training loss; the whole file is held in memory (the shipped one is 195 KiB).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from executor.models import hf
from executor.models.build import resolve_options
from executor.runtime.seeds import mix_seed
from sim.errors import GpipeInputError

TEXT_DATA = "text"  # --data text: the shipped text; --data text:PATH: any file, read as bytes
SHIPPED_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "texts", "tiny_shakespeare.txt")
BYTE_VOCAB = 256


def is_text_data(data: str | None) -> bool:
    """True for ``text`` and ``text:PATH`` (a ``package.module:function`` never starts so)."""
    return bool(data) and (data == TEXT_DATA or data.startswith(TEXT_DATA + ":"))  # type: ignore[union-attr]


def text_path(data: str) -> str:
    """The file ``data`` names: the shipped text for ``text``, else the path after ``text:``."""
    path = data.partition(":")[2]
    return os.path.abspath(path) if path else SHIPPED_TEXT


@functools.lru_cache(maxsize=4)
def text_bytes(path: str) -> torch.Tensor:
    """The file's bytes as int64 token ids, read once per process."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise GpipeInputError(f"--data text:{path}: cannot read it ({exc.strerror or exc}); give a readable "
                              "text file") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def sequence_and_vocab(model: str, options: dict[str, Any]) -> tuple[int, int]:
    """(tokens per row, vocabulary) of a language model; one line for models that read no tokens."""
    if hf.is_hf(model):
        return int(options.get("seq", hf.OUR_OPTIONS["seq"])), int(hf.config_of(model, options).vocab_size)
    if model == "transformer":
        opts = resolve_options(model, options)
        return int(opts["seq"]), int(opts["vocab"])
    raise GpipeInputError(f"--data text feeds token ids to a language model, and {model!r} is not one; use "
                          "--model transformer or an hf: model, or drop --data for synthetic data")


def text_batch(data: str, model: str, options: dict[str, Any], rows: int, seed: int,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (rows, seq) and next-byte targets (rows, seq) of mini-batch ``step``."""
    seq, vocab = sequence_and_vocab(model, options)
    if vocab < BYTE_VOCAB:
        raise GpipeInputError(f"--data text feeds bytes (token ids 0-255) but the model's vocabulary is {vocab}; "
                              f"give it a vocabulary of {BYTE_VOCAB} or more (--vocab {BYTE_VOCAB})")
    tokens = text_bytes(text_path(data))
    if len(tokens) < seq + 1:
        raise GpipeInputError(f"--data {data}: the text has {len(tokens)} bytes, fewer than one row of "
                              f"{seq + 1}; give a longer text or a shorter --seq")
    generator = torch.Generator().manual_seed(mix_seed(seed, step))
    starts = torch.randint(0, len(tokens) - seq, (rows,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(seq + 1)]  # (rows, seq + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
