"""The effects of a CPU host that a GPU does not have, fenced off: one record, off unless a costs file turns it on.

Why this exists: the product models GPUs, but the development machine is a CPU virtual machine whose
processes share a few noisy cores, and calibrating there measured effects no device of the catalog
has. They live here, in :class:`HostEffects`, carried on each stage's cost
(:attr:`sim.engine.stage_costs.StageCost.host`) from a costs file measured on a CPU host
(:mod:`sim.formats.costs`, ``pipeline[K].host``); everywhere else (the analytic and GPU models, a
costs file without them) the record is :data:`NO_HOST_EFFECTS` and the simulator's step is free of them.
What they add to a device's busy time is reported apart (:class:`HostPaid`, ``stages[i].host`` in
``gpipe simulate --json``), absent where they are off.

The one effect today, the warm-up after waits. On the 2-core machine an action that follows a wait of
several milliseconds for a neighbour's tensor runs slower, and so does the one after it: the
embedding stage of a [1,5] transformer under 1F1B waited 12-23 ms for each gradient, and its
backwards then took about twice their time after a backward, as did the forwards right after them.
Within one process and no pipeline, ``benchmarks/after_wait.py`` found nothing after a 1 ms wait and a
growing cost after 3 and 9 ms. An action's fitted line, the same for all actions of its kind, spreads
that time over every action, so a stage that waits before nearly every backward was predicted 10-21%
low without it.

Model: after a wait of at least :data:`IDLE_S` for its input, a device runs at half speed until the
lost time adds up to ``warm_up_s`` (fitted per K by calibration). An action then takes
``min(work, owed)`` more than its work, and what is still owed falls on the next actions. Half speed
is what the embedding stage showed; a larger stage pays the whole amount in its first action.

Limits: one amount whatever the wait's length beyond the threshold and whatever the stage's size;
its cause is not modelled, only its time (a pure spin loses as much as polling or sleeping, and
running the stage's own forward during the wait avoids nearly all of it, so it is what the stage uses
being displaced while the core runs other work); and its size at one moment, where it moves by a
factor of 3-4 within minutes (``gpipe validate`` probes it around each run,
:mod:`calibrate.noise.after_wait_probe`; the simulator has no way to know it). A wait shorter than
the threshold costs nothing, however many follow each other.

What is not here any more: processes that outnumber the cores sharing them. ``gpipe validate``
measured such runs but left their errors out of every summary, so the simulator no longer models it;
an oversubscribed run is predicted as if each process had a core (see :mod:`calibrate.validate.held_out`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

IDLE_S = 2e-3  # a wait of at least this long for an input leaves the device cold (1 ms: nothing measurable)
SLOWDOWN = 2.0  # how much longer work takes while the warm-up is owed: half speed


@dataclass(frozen=True)
class HostEffects:
    """What a CPU host adds to a device's actions (all zero: nothing, as on every GPU)."""

    # what a device loses after a wait of at least IDLE_S for its input, running at half speed until
    # it is paid: busy time
    warm_up_s: float = 0.0

    @property
    def on(self) -> bool:
        return self.warm_up_s > 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HostEffects":
        """From a costs file's ``host`` entry (checked by its reader): negative amounts are none."""
        return cls(max(0.0, float(data["warm_up_s"])))

    def to_dict(self) -> dict[str, float]:
        return {"warm_up_s": self.warm_up_s}


NO_HOST_EFFECTS = HostEffects()


@dataclass(frozen=True)
class HostPaid:
    """Of one device's busy time in a step, what the host effects added."""

    warm_up_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"warm_up_s": self.warm_up_s}


def owed_s(wait_s: float, still_owed_s: float, warm_up_s: float) -> float:
    """What a device owes before an action it waited ``wait_s`` for: the whole warm-up after a long
    wait (it does not add up over waits), else what it still owed after its last action."""
    return warm_up_s if wait_s >= IDLE_S else still_owed_s


def paid_s(work_s: float, owed: float) -> float:
    """What an action of ``work_s`` adds to its time while the device owes ``owed``: at half speed,
    as much as its work, until the debt is paid."""
    return min(work_s * (SLOWDOWN - 1.0), owed)


def measured_paid_s(warm_up_s: float, since_wait_s: float, measured_s: float) -> float:
    """What a measured action paid of a warm-up of ``warm_up_s``, given the measured time of the
    actions its device ran since its last long wait before it (``since_wait_s``; inf where none came
    in its step): the inverse of :func:`paid_s` on measured times, which calibration fits against.

    At half speed, an action that paid ``p`` of its work ``w`` took ``w + p``, so the actions before
    it paid half their time while the debt lasted, and this one at most half of its own."""
    if math.isinf(since_wait_s) or warm_up_s <= 0.0:
        return 0.0
    share = (SLOWDOWN - 1.0) / SLOWDOWN
    left = max(0.0, warm_up_s - since_wait_s * share)
    return min(measured_s * share, left)


class HostLedger:
    """Per device of one replica's walk, what it still owes of the host effects and what it paid."""

    def __init__(self, devices: int) -> None:
        self.owed_s = [0.0] * devices  # the warm-up each device still owes
        self.paid_s = [0.0] * devices  # of each device's busy time, the warm-up it paid

    def action_s(self, device: int, effects: HostEffects, wait_s: float, work_s: float) -> float:
        """``work_s`` of an action its device waited ``wait_s`` for its input before, with what it
        pays of the warm-up it owes after a long wait."""
        owed = owed_s(wait_s, self.owed_s[device], effects.warm_up_s)
        paid = paid_s(work_s, owed) if owed else 0.0
        self.owed_s[device] = owed - paid
        self.paid_s[device] += paid
        return work_s + paid

    def paid(self, device: int) -> HostPaid:
        return HostPaid(self.paid_s[device])


def any_on(effects: Sequence[HostEffects]) -> bool:
    """Whether any of ``effects`` adds anything."""
    return any(e.on for e in effects)
