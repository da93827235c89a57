"""How much later than the typical replica the slowest of D data-parallel replicas finishes.

The data-parallel all-reduce of a stage starts when the last of its D replicas has finished its
last backward. Identical replicas would all finish together; measured ones do not: a process's
compute in one step varies (caches, the scheduler, on a shared CPU the cores' other work, on GPUs
clocks and kernel timing), and the all-reduce waits for whichever replica drew the slowest step.
With each replica's compute in a step ``busy x (1 + e)``, the deviations ``e`` drawn independently
from one distribution, the slowest of D is ``busy x E[max of D draws]`` past the typical one.

The distribution is calibration's (``replica_spread`` in a pipeline fit, :mod:`calibrate.fit.calibration`):
quantiles of the independent part of a process's deviation, from pairs of stages of one pipeline
in the same step. Limits: deviations of different replicas are taken as independent and alike
(a machine-wide slow moment moves every replica and is no straggling; a replica whose device is
steadily slower is straggling the distribution may not hold); the same excess is charged to every
stage's all-reduce; analytic models and what-if devices have no distribution, so no straggling.
"""

from __future__ import annotations

from typing import Sequence


def expected_max(deviations: Sequence[float], count: int) -> float:
    """E[max of ``count`` independent draws] from the equally weighted sample ``deviations``: with
    the sample sorted, its i-th value (1-based, of n) is the largest of the draws with probability
    (i/n)^count - ((i-1)/n)^count."""
    values = sorted(deviations)
    n = len(values)
    if n == 0 or count < 1:
        return 0.0
    return sum(v * (((i + 1) / n) ** count - (i / n) ** count) for i, v in enumerate(values))


def straggle_fraction(deviations: Sequence[float], replicas: int) -> float:
    """How far past the typical replica's compute the slowest of ``replicas`` finishes, as a fraction
    of that compute: E[max of D deviations] less the typical (mean) deviation; 0 for one replica or
    no measured deviations."""
    if replicas < 2 or not deviations:
        return 0.0
    return max(0.0, expected_max(deviations, replicas) - sum(deviations) / len(deviations))
