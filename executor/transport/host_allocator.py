"""Keep freed host memory in the process instead of handing it back to the kernel after every step.

Why: glibc's malloc serves a large block (above ``M_MMAP_THRESHOLD``, 128 KiB at first, raised
adaptively) with its own ``mmap`` and unmaps it when it is freed, and gives the top of its heap back
to the kernel once more than ``M_TRIM_THRESHOLD`` is free there. A training step frees and allocates
the same large tensors every step (gradients, a matmul's output, weight-sized temporaries), so each
step's first touch of them faults every page back in: about 2,400 page faults per step for an
8 x 1024 MLP stage of four layers on this project's 2-core VM, 15% of its compute (measured with
``getrusage`` minor faults: 22 ms a step without them, 26 ms with). GPUs have PyTorch's caching
allocator for this; on the host, the same effect comes from two ``mallopt`` settings: blocks up to
32 MiB (glibc's largest threshold on 64-bit hosts) come from the heap, and the heap is never
trimmed, so a freed block is reused by the next step's allocation of its size.

Limits: only glibc exposes these settings (elsewhere nothing changes and :func:`keep_freed_memory`
returns False); blocks larger than 32 MiB are still mapped and unmapped each time (their page
faults are a smaller share of the work on them); the process's resident memory stays at its peak
until it ends, as a GPU's caching allocator holds its peak.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
NEVER_TRIM_BYTES = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Set this process's malloc to keep freed blocks up to 32 MiB for reuse; True if it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 where the library ignores the parameter (musl, say)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                      NEVER_TRIM_BYTES))
