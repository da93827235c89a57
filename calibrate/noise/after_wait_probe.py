"""How much a device loses right after a wait, probed beside the speed: the warm-up at a run's moment.

Why: the costs file holds one warm-up per K (:mod:`sim.engine.host`), fitted on the calibration's
minutes, but what a device loses after a wait moves more than its speed does. Within four minutes
the embedding's forward after a 9 ms wait lost 114-368 us on this 2-core machine while its warm time
moved by a fraction of that (``benchmarks/after_wait.py --probes``), and a third to nearly half of
the predicted busy time of a one-layer stage that waits before each backward is that loss. Over those
twelve moments the forward's loss after the wait correlated 0.98 with the backward's after the same
wait and 0.97 with the forward's after that backward: timing one small forward after a wait says how
large the warm-up is at that moment.

What it times: the forward without gradients of the model's first layer (a one-layer stage's work,
in eval mode so that it draws no random numbers and leaves batch-norm statistics alone) after a sleep of :data:`WAIT_S`, minus the same forward run again at once, the median over
``repeats`` pairs. Pairs cancel the machine's drift; a pair costs the wait and two small forwards
(about 0.15 s for 15 pairs here). :func:`warm_up_factor` divides a run's probes by the calibration's
median, as :func:`calibrate.noise.speed.speed_factor` divides paces. Calibration scales what each design
run's actions paid of the warm-up by its run's factor, so the fitted warm-up is the one at the
calibration's median probe (:func:`calibrate.fit.observations.collect`); ``gpipe validate`` scales each
stage's predicted warm-up by its run's factor and shows the busy error so corrected beside the one
without.

Limits: one layer's loss after one wait length stands for every stage's after any long wait; the
three-block stage's loss in the same twelve moments correlated only 0.65 with the embedding's. A
sleeping probe with every rank probing at once is not a pipeline's wait, where a neighbour's work runs
on the core meanwhile. A median of 15 pairs has noise of its own (here a 60-100 us interquartile
range between pairs). On a device without the effect the loss is near zero and the factor is left
at 1 (:data:`SMALLEST_REFERENCE_S`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

WAIT_S = 9e-3  # the wait before the timed forward: a 1F1B stage's wait for a gradient, well past sim.engine.host.IDLE_S
REPEATS = 15  # pairs per probe
SMALLEST_REFERENCE_S = 5e-6  # a calibration's median loss below this: nothing to scale (factor 1)


class AfterWaitProbe:
    """Times the first layer of a :class:`calibrate.noise.speed.SpeedProbe`'s model after a wait.

    The layer is the module's first child where the module is a sequence of layers (every model
    :func:`executor.models.build.build_model` makes), else the whole module.
    """

    def __init__(self, speed_probe: Any) -> None:
        import torch

        self.torch = torch
        self.speed_probe = speed_probe
        module = speed_probe.module
        self.layer = module[0] if isinstance(module, torch.nn.Sequential) and len(module) else module
        self.inputs = speed_probe.inputs
        self.measure(repeats=1, wait_s=0.0)  # once, so the first pair does not pay for the first call

    def _forward(self) -> float:
        """Seconds of one forward of the layer, without gradients, synchronised on the device."""
        self.speed_probe._sync()
        start = time.perf_counter()
        with self.torch.no_grad():
            self.layer(self.inputs)
        self.speed_probe._sync()
        return time.perf_counter() - start

    def measure(self, repeats: int = REPEATS, wait_s: float = WAIT_S) -> float:
        """Median over ``repeats`` pairs of (the forward right after sleeping ``wait_s``) minus (the
        same forward at once after it): the seconds a wait costs the next action at this moment."""
        if repeats < 1:
            raise ValueError(f"an after-wait probe needs at least one pair, not {repeats}")
        losses = []
        training = self.layer.training
        self.layer.eval()  # no dropout drawing on the random stream, no batch-norm statistics touched
        try:
            for _ in range(repeats):
                time.sleep(wait_s)
                after_wait = self._forward()
                losses.append(after_wait - self._forward())
        finally:
            self.layer.train(training)
        return statistics.median(losses)


def run_after_wait_probes(report: dict[str, Any]) -> list[float]:
    """Every after-wait probe an executor run's report holds (all ranks, before and after); [] if none."""
    return [loss for rank in report.get("after_wait_probe_s") or [] for loss in rank]


def after_wait_reference_s(costs: dict[str, Any], processes: int) -> float | None:
    """The calibration's after-wait loss for runs of ``processes`` processes (D x K x T) in the costs
    file ``costs``; None where it has none (written before the probe, or no design run of that many)."""
    return costs.get("speed", {}).get("after_wait_reference_s", {}).get(str(processes))


def report_warm_up_factor(report: dict[str, Any], costs: dict[str, Any], processes: int) -> float:
    """:func:`warm_up_factor` of one executor run's report against the calibration's reference for its
    number of processes (1.0 without either)."""
    return warm_up_factor(run_after_wait_probes(report), after_wait_reference_s(costs, processes))


def warm_up_factor(probes: Sequence[float], reference_s: float | None) -> float:
    """(after-wait loss around a run) / (the calibration's median): the median of the run's probes
    over the reference, never below 0; 1.0 without probes or without a reference of at least
    :data:`SMALLEST_REFERENCE_S` (costs files from before the probe, devices without the effect)."""
    if not probes or not reference_s or reference_s < SMALLEST_REFERENCE_S:
        return 1.0
    return max(0.0, statistics.median(probes) / reference_s)
