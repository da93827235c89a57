"""Each step's mini-batch for one rank, the next step's drawn (and split into micro-batches) while
this step waits on a receive.

Why: the first stage draws its batch between two steps, and there it is on the pipeline's critical
path: every other stage waits for the first stage's first forward. Drawing a batch of synthetic
data and splitting it into micro-batches (a copy each, :func:`executor.runtime.data.split`) is a
measurable share of a small model's step (docs/notes/2026-11-27-figures-behind-the-code.md). Every stage
of a pipeline waits on a receive at least once a step (its share of the bubble); drawing the next
batch then costs nothing. The last stage, which needs the targets, draws during a wait too.

Which wait: the one that was longest in the step before (:meth:`StepBatches.waited` hears how long
each of the rank's waits lasted, chores included), else, in the first steps, the first. Drawing is
one piece of work that cannot stop when the awaited message arrives; at the first wait it sat on the
critical path of the interleaved schedule (the first device's first wait, for its second chunk's
first forward, is shorter than the drawing).

A data function (``--data``) is called for step s+1 while step s runs: it must be a pure function of
``(batch_size, step, seed)``, as resuming already requires. A stage that never waits (one stage,
or a step that finds every message arrived) draws at the step's start as before. One batch ahead is
held: the inputs and targets of one extra mini-batch in memory on the first and last stage.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

from executor.config import RunConfig
from executor.runtime.data import MicroBatches, batch_for_step, micro_batches


class StepBatches:
    """``take(step)`` gives a step's ``(inputs, targets)``, each split into the run's micro-batches on
    ``device`` (:class:`executor.runtime.data.MicroBatches`; None, None on a stage that needs neither);
    :meth:`prefetch` draws the step after the one last taken, if there is one and it is not drawn yet."""

    def __init__(self, config: RunConfig, needs_data: bool, share: Callable[[Any], Any] | None = None,
                 device: torch.device = torch.device("cpu")) -> None:
        self.config = config
        self.needs_data = needs_data  # the first stage keeps the inputs, the last the targets
        self.share = share  # this replica's rows of a global batch (executor.parallel.replicas); None: all of it
        self.device = device
        self.step = -1  # the step last taken
        self._ahead: tuple[int, Any, Any] | None = None
        self._waits: dict[Hashable, float] = {}  # this step's waits: seconds idle at each
        self._longest: Hashable | None = None  # where last step waited longest: the place to draw

    def _draw(self, step: int) -> tuple[MicroBatches, MicroBatches]:
        c = self.config
        inputs, targets = batch_for_step(c.model, c.options, c.batch_size, c.seed, step, c.data or None)
        if self.share is not None:
            inputs, targets = self.share(inputs), self.share(targets)
        return (micro_batches(inputs, c.layout.microbatches, self.device),
                micro_batches(targets, c.layout.microbatches, self.device))

    def take(self, step: int) -> tuple[Any, Any]:
        self.step = step
        if self._waits:
            self._longest = max(self._waits, key=self._waits.__getitem__)
            self._waits = {}
        if not self.needs_data:
            return None, None
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            return ahead[1], ahead[2]
        return self._draw(step)

    def prefetch(self, wait: Hashable | None = None) -> None:
        """Draw the next step now, if this rank waits here: at ``wait`` (what names a wait of the
        step: the same each step), when last step waited longest there or there is no last step
        to go by; anywhere when ``wait`` is None."""
        following = self.step + 1
        if not self.needs_data or following >= self.config.steps or self._ahead is not None:
            return
        if wait is not None and self._longest is not None and wait != self._longest:
            return
        self._ahead = (following, *self._draw(following))

    def waited(self, wait: Hashable, seconds: float) -> None:
        """The rank was idle ``seconds`` at ``wait`` this step (from finding its message away to
        taking it)."""
        self._waits[wait] = self._waits.get(wait, 0.0) + seconds
        if wait == self._longest and self._ahead is None:
            self._longest = None  # found its message there this time: the next wait draws
