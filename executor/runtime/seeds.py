"""Seeds derived from integers, so every random draw is a pure function of what it belongs to.

Data (seed, step), dropout masks (seed, step, stage, micro-batch) and initial weights (seed, layer)
each get their own stream: a resumed run, a recompute or another K draws exactly the same numbers.
"""

from __future__ import annotations

import hashlib


def mix_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers, e.g. (seed, step, stage, micro-batch)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
