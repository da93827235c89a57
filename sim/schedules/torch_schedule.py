"""Schedules in torch.distributed.pipelining's CSV format, read and written.

torch's pipeline schedules can dump their per-rank action lists as CSV (``_dump_csv``) and run one
loaded from CSV (``_load_csv``): one row per rank, one cell per action, written ``{stage}{kind}{micro-batch}``
with ``F`` the forward, ``B`` the full backward, ``I`` the backward for the input alone and ``W``
the one for the weights alone (``1F0``, ``3I2``, ``0W5``); an empty cell is an idle slot. The
``compute_comms`` form adds ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` (and ``UNSHARD``, ``RESHARD``,
``REDUCE_GRAD``) cells, and ``(a;b)OVERLAP_F_B`` pairs a forward with a backward.

:func:`read_schedule_csv` turns such a file into this project's per-device lists
(:class:`sim.schedules.schedule.Action`), so ``gpipe simulate --schedule-csv FILE`` predicts a schedule
written for torch: communication cells are left out (the simulator sends each output when its
action ends and starts an action when its input has arrived, as torch's lowering does), an overlapped
pair becomes its two actions in order, and the recompute GPipe's checkpoint policies need is put
before each micro-batch's first backward action. :func:`write_schedule_csv` writes this project's
lists in the compute-only form (``gpipe plan --schedule-csv-out``), which torch lowers to its
``compute_comms`` form itself; recompute actions are not written (torch has none: its stage
checkpoints inside the module).

Placements: stage s on rank s mod K (the "loop" of torch's interleaved schedules), or, with two
stages per rank, the V of ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (stages r and 2K-1-r
on rank r, :func:`sim.schedules.schedule.device_of_virtual_stage`); any other placement is refused in one line.
"""

from __future__ import annotations

import csv
import re
from typing import Sequence

from sim.errors import GpipeInputError
from sim.schedules.schedule import Action, Kind, device_of_virtual_stage, recomputes

_CELL = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_COMPUTE = {"F": Kind.FORWARD, "B": Kind.BACKWARD, "I": Kind.INPUT, "W": Kind.WEIGHT}
_WRITTEN = {kind: name for name, kind in _COMPUTE.items()}


def _cell_actions(cell: str, path: str, rank: int) -> list[Action]:
    """The compute actions of one cell (none for a communication or idle cell)."""
    cell = cell.strip()
    if not cell:
        return []
    if cell.startswith("("):
        inner, _, kind = cell[1:].partition(")")
        if kind != "OVERLAP_F_B":
            raise GpipeInputError(f"{path}: rank {rank}'s cell {cell!r} is not an action torch writes; expected e.g. "
                                  "'1F0', '0B2', '2I1', '3W0' or '(0F1;1B0)OVERLAP_F_B'")
        return [a for part in inner.split(";") for a in _cell_actions(part, path, rank)]
    match = _CELL.fullmatch(cell)
    if match is None or (match[2] in _COMPUTE and not match[3]):
        raise GpipeInputError(f"{path}: rank {rank}'s cell {cell!r} is not an action torch writes; expected e.g. "
                              "'1F0', '0B2', '2I1', '3W0' (stage, F/B/I/W, micro-batch)")
    if match[2] not in _COMPUTE:
        return []  # sends, receives, unshard/reshard and gradient reduction: the simulator's own
    return [Action(int(match[1]), _COMPUTE[match[2]], int(match[3]))]


def read_schedule_csv(path: str, checkpoint: str = "never") -> tuple[list[list[Action]], int, int]:
    """``(per-device lists, micro-batches M, virtual stages V)`` of the CSV at ``path``, with the
    recomputes ``checkpoint`` asks for; one-line errors for a file this cannot run."""
    try:
        with open(path, newline="") as handle:
            rows = [row for row in csv.reader(handle)]
    except OSError as exc:
        raise GpipeInputError(f"--schedule-csv {path}: {exc.strerror or exc}; give a CSV written by torch's "
                              "_dump_csv or by gpipe plan --schedule-csv-out") from None
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    if not rows:
        raise GpipeInputError(f"--schedule-csv {path} holds no actions; give one row of actions per rank")
    per_rank = [[a for cell in row for a in _cell_actions(cell, path, rank)] for rank, row in enumerate(rows)]
    devices = len(per_rank)
    stages = 1 + max((a.stage for actions in per_rank for a in actions), default=-1)
    placement = "zbv" if _v_placed(per_rank, stages // devices) else "interleaved"
    for rank, actions in enumerate(per_rank):
        for action in actions:
            expected = device_of_virtual_stage(action.stage, devices, placement)
            if expected != rank:
                raise GpipeInputError(f"{path}: stage {action.stage} runs on rank {rank}, not rank {expected}: "
                                      "only the loop placement (stage s on rank s mod K) and, with two stages per "
                                      "rank, the V (stages r and 2K-1-r on rank r) are modelled")
    if stages % devices:
        raise GpipeInputError(f"{path}: {stages} stages on {devices} ranks; give V x K stages, V per rank")
    microbatches = 1 + max(a.microbatch for actions in per_rank for a in actions)
    _check_complete(per_rank, stages, microbatches, path)
    _check_runs(per_rank, stages, path)
    return [_with_recompute(actions, checkpoint, microbatches) for actions in per_rank], microbatches, stages // devices


def _check_complete(per_rank: Sequence[Sequence[Action]], stages: int, microbatches: int, path: str) -> None:
    """Every stage runs each micro-batch's forward once and its backward once (B, or I then W)."""
    seen: dict[tuple[int, int], list[Kind]] = {}
    for actions in per_rank:
        for action in actions:
            seen.setdefault((action.stage, action.microbatch), []).append(action.kind)
    for s in range(stages):
        for m in range(microbatches):
            kinds = sorted(k.value for k in seen.get((s, m), []))
            if kinds not in (["B", "F"], ["F", "I", "W"]):
                raise GpipeInputError(f"{path}: stage {s}, micro-batch {m} has actions {kinds or 'none'}; each needs "
                                      "F and B, or F, I and W, once")


def _check_runs(per_rank: Sequence[Sequence[Action]], stages: int, path: str) -> None:
    """Walk the lists as the devices would (an action runs once its input has been produced); one line
    naming where each stuck rank waits when they cannot all finish."""
    from sim.schedules.schedule import walk_in_rounds

    done: set[tuple[int, Kind, int]] = set()

    def run(_rank: int, action: Action) -> bool:
        s, m, kind = action.stage, action.microbatch, action.kind
        if kind is Kind.FORWARD and s > 0:
            ready = (s - 1, Kind.FORWARD, m) in done
        elif kind in (Kind.BACKWARD, Kind.INPUT):  # after its own forward, and the next stage's gradient
            ready = (s, Kind.FORWARD, m) in done and (
                s == stages - 1 or (s + 1, Kind.BACKWARD, m) in done or (s + 1, Kind.INPUT, m) in done)
        elif kind is Kind.WEIGHT:
            ready = (s, Kind.INPUT, m) in done
        else:
            ready = True
        if ready:
            done.add((s, kind, m))
        return ready

    reached = walk_in_rounds(per_rank, run)
    stuck = [f"rank {r} at {actions[i]}" for r, (actions, i) in enumerate(zip(per_rank, reached)) if i < len(actions)]
    if stuck:
        raise GpipeInputError(f"{path}: the schedule deadlocks: every rank waits for an input no rank produces "
                              f"({', '.join(stuck)})")


def _with_recompute(actions: Sequence[Action], checkpoint: str, microbatches: int) -> list[Action]:
    out: list[Action] = []
    for action in actions:
        if action.kind in (Kind.BACKWARD, Kind.INPUT) and recomputes(checkpoint, action.microbatch, microbatches):
            out.append(Action(action.stage, Kind.RECOMPUTE, action.microbatch))
        out.append(action)
    return out


def _v_placed(per_device: Sequence[Sequence[Action]], virtual_stages: int) -> bool:
    """Two chunks per device, device 0 running the last stage: the V of ZB-V and DualPipeV."""
    return virtual_stages == 2 and any(a.stage == 2 * len(per_device) - 1 for a in per_device[0])


def schedule_shape(per_device: Sequence[Sequence[Action]], virtual_stages: int) -> str:
    """The named schedule whose placement, checks and labels fit these lists: for two chunks in a V
    (device 0 runs the last stage), zbv where every backward is split, else dualpipev; interleaved for
    other V > 1; zb-h1 where the backward is split, else 1f1b."""
    kinds = {a.kind for actions in per_device for a in actions}
    split = bool(kinds & {Kind.INPUT, Kind.WEIGHT})
    if _v_placed(per_device, virtual_stages):
        return "dualpipev" if Kind.BACKWARD in kinds else "zbv"
    if virtual_stages > 1:
        return "interleaved"
    return "zb-h1" if split else "1f1b"


def write_schedule_csv(per_device: Sequence[Sequence[Action]], path: str) -> None:
    """Write the lists in torch's compute-only CSV form (recomputes left out, see the module)."""
    from sim.formats.timeline import write_atomic

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            for actions in per_device:
                writer.writerow([f"{a.stage}{_WRITTEN[a.kind]}{a.microbatch}" for a in actions
                                 if a.kind is not Kind.RECOMPUTE])

    write_atomic(path, write)
