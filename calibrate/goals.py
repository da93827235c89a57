"""The goals held-out errors are judged by, and when an error misses one by more than noise allows.

Goals (docs/calibration.md): each stage's busy time within 5%, every run's step within 10% (the
median over runs within 5%), every run's bubble within 3 points, all at the reference speed.

An error is *past* a goal beyond noise when its whole interval (where the rounds put it,
:func:`calibrate.validate.intervals.median_interval`) lies beyond the goal: one that still reaches inside is
one the machine's round-to-round noise can explain. Several calibrations of one machine judge the
same measurement (:mod:`calibrate.noise.across_calibrations`); an error past its goal by one calibration
and not by another is one the moment of calibration explains. Limits: the interval is about the
measurement's rounds alone, so one calibration's miss counts even where that calibration was taken
at an unlucky moment; with two calibrations, "by every calibration" is by both.
"""

from __future__ import annotations

from typing import Sequence

BUSY_GOAL = 0.05
STEP_GOAL = 0.10
BUBBLE_GOAL_POINTS = 3.0


def past(bounds: Sequence[float], goal: float) -> bool:
    """Whether an interval (low, high) lies wholly beyond +-``goal``."""
    return bounds[0] > goal or bounds[1] < -goal


def past_by_every(intervals: Sequence[Sequence[float]], goal: float) -> bool:
    """Whether every calibration's interval of one error lies wholly beyond +-``goal`` (False for none)."""
    return bool(intervals) and all(past(bounds, goal) for bounds in intervals)
