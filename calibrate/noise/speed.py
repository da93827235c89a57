"""A speed reference: how fast this machine runs a fixed piece of work right now.

A shared virtual machine does not run at one speed. On a 2-core cloud VM the same single-thread
matrix multiply took 25-45% longer in some 3-second windows than in others, and its 10-second
medians strayed by 6% (median) to 15% (p90) over three minutes (``benchmarks/machine_noise.py``
measures this); no cost model can predict that from a calibration taken minutes earlier. So calibration and validation time a
fixed reference -- one forward and backward of the calibrated model itself on a fixed number of
rows -- next to every measurement, and express measurements at a *reference speed*: the median of
the probes taken while calibrating.

:func:`speed_factor` turns probes into the ratio (machine now) / (reference); a measurement divided
by it is what the same work would have taken at the reference speed. Validation publishes both the
raw error and the error at the reference speed (the simulator's own error, with the machine's drift
taken out); the probe never looks at the run it corrects.

Limits: one pass at one size stands for all of a model's work; a slowdown that hits only memory
bandwidth, or only the network, is tracked only as far as the probe feels it. Probes taken just
before and just after a run cannot see a change that comes and goes inside it, and a probe has
noise of its own, so on a calm machine the correction can add a little scatter. The model probe is
a second copy of the model in each rank's memory.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

WIDTH = 256
ROWS = 64


def probe_rows(batch_size: int) -> int:
    """Rows of the model probe: an eighth of the batch, the size of a mid-range micro-batch."""
    return max(1, batch_size // 8)


class SpeedProbe:
    """Times one forward and backward of fixed work; its median seconds is the machine's pace.

    The work is either a fixed MLP block (:meth:`block`, the same on every machine) or the model
    being calibrated at a fixed number of rows (:meth:`model`): the model's own operators feel a
    slowdown as the runs do (a 2-thread matrix multiply of 64 rows can slow down twice as much as
    the model's mix of small operators), so calibration uses the model probe.
    """

    def __init__(self, module: object, inputs: object, loss: Callable[[object, object], object] | None,
                 targets: object, device: object) -> None:
        import torch

        from executor.runtime.boundary import map_tensors

        self.torch = torch
        self.device = torch.device(device)  # type: ignore[arg-type]
        self.module = module.to(self.device)  # type: ignore[attr-defined]
        self.inputs = map_tensors(lambda t: t.to(self.device), inputs)  # a tensor, or a tuple or dict of them
        self.targets = map_tensors(lambda t: t.to(self.device), targets)
        self.loss = loss
        for _ in range(2):
            self._once()

    @classmethod
    def block(cls, device: object = "cpu") -> "SpeedProbe":
        import torch
        from torch import nn

        with torch.random.fork_rng(devices=[]):  # leave the caller's random stream as it was
            torch.manual_seed(0)
            block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.LayerNorm(WIDTH),
                                  nn.Linear(WIDTH, WIDTH))
            inputs = torch.randn(ROWS, WIDTH)
        return cls(block, inputs, None, None, device)

    @classmethod
    def model(cls, name: str, options: dict, batch_size: int, loss: str = "",
              device: object = "cpu") -> "SpeedProbe":
        import torch

        from executor.runtime.batchnorm import DeferredBatchNorm
        from executor.models.build import build_model, default_loss, example_batch, loss_function

        rows = probe_rows(batch_size)
        with torch.random.fork_rng(devices=[]):
            module = DeferredBatchNorm.convert(build_model(name, options, seed=0))
            inputs, targets = example_batch(name, options, rows, seed=0)
        return cls(module, inputs, loss_function(loss or default_loss(name)), targets, device)

    def _once(self) -> None:
        from executor.runtime.batchnorm import recomputing

        with recomputing():  # deferred batch norm statistics stay untouched
            out = self.module(self.inputs)  # type: ignore[operator]
            value = self.loss(out, self.targets) if self.loss is not None else out.sum()  # type: ignore[attr-defined]
            value.backward()  # type: ignore[attr-defined]
        self.module.zero_grad(set_to_none=True)  # type: ignore[attr-defined]

    def _sync(self) -> None:
        from executor.device import device_api

        device_api(self.device).synchronize(self.device)

    def measure(self, budget_s: float = 0.05, min_runs: int = 3, max_runs: int = 400) -> float:
        """Median seconds of one pass, timed for about ``budget_s`` (at least ``min_runs`` passes)."""
        samples: list[float] = []
        spent = 0.0
        while len(samples) < max_runs and (len(samples) < min_runs or spent < budget_s):
            self._sync()
            start = time.perf_counter()
            self._once()
            self._sync()
            elapsed = time.perf_counter() - start
            samples.append(elapsed)
            spent += elapsed
        return statistics.median(samples)


def model_probe_description(name: str, batch_size: int) -> str:
    return f"forward and backward of the whole {name} model on {probe_rows(batch_size)} rows"


def run_probes(report: dict) -> list[float]:
    """Every probe an executor run's report holds (all ranks, before and after); [] if none."""
    return [pace for rank in report.get("speed_probe_s") or [] for pace in rank]


def reference_s(probes: Sequence[float]) -> float:
    """The reference pace: the median of the probes taken while calibrating."""
    if not probes:
        raise ValueError("a reference needs at least one probe")
    return statistics.median(probes)


def speed_factor(probes: Sequence[float], reference: float | None) -> float:
    """(pace around a measurement) / (reference pace): above 1 when the machine ran slow.

    1.0 when there is no reference or no probe (costs files written before probes existed).
    """
    if not reference or not probes:
        return 1.0
    return statistics.mean(probes) / reference
