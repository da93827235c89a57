"""A device that waited for its input runs slow for a while after: the warm-up the simulator charges.

Why: on this 2-core machine an action that follows a wait of several milliseconds for a neighbour's
tensor runs slower, and so does the one after it. In a pipeline, the embedding stage of a [1,5]
transformer under 1F1B waits 12-23 ms for each gradient; its backwards then took 221-265 us and the
forwards right after them 212-249 us, against 96-123 us for a forward after a forward in the same
runs. A three-layer stage under 1F1B paid about the same time: 196 us on a backward after a 6 ms
wait and 92 us on the forward after it. Within one process and no pipeline, ``after_wait.py``
(benchmarks/README.md) found nothing after a 1 ms wait and a growing cost after 3 and 9 ms. An
action's fitted line, the same for all actions of its kind, spreads that time over every action: a
stage that waits before nearly every backward (the embedding stage above) was predicted 10-21% low.

Model: after a wait of at least :data:`IDLE_S` for its input, a device runs at half speed until the
lost time adds up to ``warm_up_s`` (fitted per K by calibration, 0 where a design never waited that
long or on the analytic models). An action then takes ``min(work, owed)`` more than its work, and
what is still owed falls on the next actions. Half speed is what the embedding stage showed (both
its backward and the forward after it took twice their warm time); a larger stage pays the whole
amount in its first action.

Limits: one amount whatever the wait's length beyond the threshold (the one-process measurement
grows from 3 to 9 ms) and whatever the stage's size; its cause is not modelled, only its time
(``after_wait.py --ways``: a pure spin loses as much as polling or sleeping, and running the stage's
own forward during the wait avoids nearly all of it, so it is what the stage uses being displaced
while the core runs other work); and its size at one moment: within four minutes a one-layer stage's
loss after a 9 ms wait moved by a factor of 3-4 (``--probes``), where the costs file holds the
calibration's (``gpipe validate`` probes the loss around each run and shows the busy errors with the
warm-up scaled to it, :mod:`calibrate.noise.after_wait_probe`; the simulator itself has no way to know
it). A wait shorter than the threshold costs nothing, however many follow each other.
"""

from __future__ import annotations

import math

IDLE_S = 2e-3  # a wait of at least this long for an input leaves the device cold (1 ms: nothing measurable)
SLOWDOWN = 2.0  # how much longer work takes while the warm-up is owed: half speed


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
