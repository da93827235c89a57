"""How far a run's own rounds let its error move: their spread and the median's interval.

Limits: both treat the rounds as independent draws of one pace; rounds interleaved over a
validation's minutes see its slow and fast stretches, not how the machine moved between calibration
and validation, nor the calibration's own noise (:mod:`calibrate.validate.held_out`).
"""

from __future__ import annotations

import statistics
from typing import Sequence


def relative_spread(values: Sequence[float]) -> float:
    """Interquartile range over the median (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def median_interval(values: Sequence[float], confidence: float = 0.9) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics x(k) and
    x(n + 1 - k) with the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is at least
    ``confidence`` (with 15 rounds, the 4th and 12th of them: 96.5%); (min, max) where no k reaches it.

    Limits: it assumes the rounds independent draws of one pace. Rounds interleaved over a
    validation's minutes see its slow and fast stretches, so the interval covers how the machine moved
    while validating; not how it moved between calibration and validation (what the speed probe
    corrects, imperfectly), nor the calibration's own noise.
    """
    from scipy.stats import binom

    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("an interval needs at least one value")
    k = 1
    while k + 1 <= (n + 1) // 2 and 1.0 - 2.0 * binom.cdf(k, n, 0.5) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k]


def error_interval(predicted: float, rounds: Sequence[float]) -> tuple[float, float]:
    """(predicted - m) / m at both ends of the rounds' median interval, lower error first; (0, 0)
    without rounds."""
    if not rounds:
        return 0.0, 0.0
    low, high = median_interval(rounds)
    return ((predicted - high) / high if high else 0.0), ((predicted - low) / low if low else 0.0)
