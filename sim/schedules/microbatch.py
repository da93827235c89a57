"""How a mini-batch splits into micro-batches: exactly like ``torch.chunk`` along rows.

``torch.chunk`` takes chunks of ceil(N/M) rows, so the last chunk is smaller and there may be fewer
than M chunks (N=10, M=4 gives 3,3,3,1; N=2, M=4 gives 1,1). The simulator and the executor must
agree on this, since the schedule is built for the number of chunks that actually exist.
"""

from __future__ import annotations

from sim.errors import require_positive


def split_rows(batch_size: int, microbatches: int) -> list[int]:
    """Rows in each micro-batch of a ``batch_size`` mini-batch split into ``microbatches``."""
    require_positive("batch size", batch_size, "use --batch 1 or more")
    require_positive("micro-batches (M)", microbatches, "use --microbatches 1 or more")
    chunk = -(-batch_size // microbatches)
    sizes = [chunk] * (batch_size // chunk)
    if batch_size % chunk:
        sizes.append(batch_size % chunk)
    return sizes
