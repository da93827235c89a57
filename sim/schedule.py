"""The pipeline schedule as data: one ordered list of actions per stage.

Both the simulator and the executor walk these lists, so what is predicted is what runs. Sends and
receives are implied: a forward of micro-batch m on stage k needs stage k-1's forward output of m,
and a backward needs stage k+1's input gradient of m. A recompute needs only the stage's own stashed
input, so it may start before the gradient arrives (as the GPipe paper notes).

Timing diagram of ``gpipe`` (fill and drain), K=3, M=4, ``never``::

    stage 0: F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0
    stage 1: .. F0 F1 F2 F3 .. .. B3 B2 B1 B0 ..
    stage 2: .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. ..

Backward runs in reverse micro-batch order, so under ``except_last`` the last micro-batch, whose
activations are still live when backward starts, is the one not recomputed. ``1f1b`` interleaves one
forward with one backward after a warm-up of K-k-1 forwards on stage k and runs backwards in
micro-batch order; it bounds the number of micro-batches in flight per stage by K-k.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from sim.errors import GpipeInputError, require_positive

SCHEDULES = ("gpipe", "1f1b")
CHECKPOINT_POLICIES = ("always", "except_last", "never")


class Kind(str, enum.Enum):
    """What a stage does with one micro-batch."""

    FORWARD = "F"
    RECOMPUTE = "R"
    BACKWARD = "B"


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``stage`` runs ``kind`` on micro-batch ``microbatch`` (all 0-based)."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"1F3"`` is stage 1, forward, micro-batch 3."""
        match = re.fullmatch(r"(\d+)([FRB])(\d+)", text.strip())
        if match is None:
            raise GpipeInputError(f"bad action {text!r}; expected e.g. '1F3' (stage, F/R/B, micro-batch)")
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


def check_schedule_name(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise GpipeInputError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    return schedule


def check_checkpoint_policy(checkpoint: str) -> str:
    if checkpoint not in CHECKPOINT_POLICIES:
        raise GpipeInputError(
            f"unknown checkpoint policy {checkpoint!r}; choose one of {', '.join(CHECKPOINT_POLICIES)}"
        )
    return checkpoint


def recomputes(checkpoint: str, microbatch: int, microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` is re-materialized (forward run again before backward)."""
    if checkpoint == "always":
        return True
    if checkpoint == "except_last":
        return microbatch != microbatches - 1
    return False


def _backward_with_recompute(stage: int, microbatch: int, microbatches: int, checkpoint: str) -> list[Action]:
    actions = []
    if recomputes(checkpoint, microbatch, microbatches):
        actions.append(Action(stage, Kind.RECOMPUTE, microbatch))
    actions.append(Action(stage, Kind.BACKWARD, microbatch))
    return actions


def _stage_gpipe(stage: int, microbatches: int, checkpoint: str) -> list[Action]:
    actions = [Action(stage, Kind.FORWARD, m) for m in range(microbatches)]
    for m in reversed(range(microbatches)):
        actions += _backward_with_recompute(stage, m, microbatches, checkpoint)
    return actions


def _stage_1f1b(stage: int, stages: int, microbatches: int, checkpoint: str) -> list[Action]:
    warmup = min(stages - stage - 1, microbatches)
    actions = [Action(stage, Kind.FORWARD, m) for m in range(warmup)]
    next_backward = 0
    for m in range(warmup, microbatches):
        actions.append(Action(stage, Kind.FORWARD, m))
        actions += _backward_with_recompute(stage, next_backward, microbatches, checkpoint)
        next_backward += 1
    for m in range(next_backward, microbatches):
        actions += _backward_with_recompute(stage, m, microbatches, checkpoint)
    return actions


def build_schedule(stages: int, microbatches: int, schedule: str = "gpipe",
                   checkpoint: str = "except_last") -> list[list[Action]]:
    """Each stage's ordered actions for one mini-batch: ``result[k]`` is stage k's list."""
    require_positive("stages (K)", stages, "use --stages 1 or more")
    require_positive("micro-batches (M)", microbatches, "use --microbatches 1 or more")
    check_schedule_name(schedule)
    check_checkpoint_policy(checkpoint)
    return [stage_actions(k, stages, microbatches, schedule, checkpoint) for k in range(stages)]


def stage_actions(stage: int, stages: int, microbatches: int, schedule: str = "gpipe",
                  checkpoint: str = "except_last") -> list[Action]:
    """Stage ``stage``'s list of :func:`build_schedule`, without building the others' (unchecked)."""
    if schedule == "gpipe":
        return _stage_gpipe(stage, microbatches, checkpoint)
    return _stage_1f1b(stage, stages, microbatches, checkpoint)


def format_grid(per_stage: list[list[Action]], highlight: Action | None = None) -> str:
    """One line per stage, actions in order, for error messages and debugging.

    ``highlight`` is wrapped in brackets, e.g. the action a failing rank was running.
    """
    lines = []
    for k, actions in enumerate(per_stage):
        cells = [f"[{a}]" if a == highlight else str(a) for a in actions]
        lines.append(f"stage {k}: " + " ".join(cells))
    return "\n".join(lines)
