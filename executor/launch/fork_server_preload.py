"""What the launcher's fork server loads once for every rank it forks (see :mod:`executor.launch.agent`).

The executor's modules, and the part of torch that a rank only loads at its first meta-device operation:
the dry run that checks the stage boundaries (:mod:`executor.runtime.shapes`) calls operators whose meta
kernels torch registers in Python, and the first such call imports about 800 modules
(``torch._meta_registrations`` and, through it, ``sympy``, ``torch._dynamo`` and more): over a second of
a core in every rank (docs/notes/2026-11-26-launch-time.md). One meta operation here does that import in
the fork server instead; it allocates no memory and starts no threads, so forking afterwards stays safe.
"""

from __future__ import annotations

import torch

import executor.launch.worker  # noqa: F401  (loaded for the ranks)

torch.arange(2, device="meta").remainder(2)  # loads torch's Python meta kernels (see above)
