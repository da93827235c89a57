"""A measured step against its own compute: the schedule's critical path, walked two ways.

``compute_bound_s``: the step the executor would take if everything but its measured compute were
free. The step's own F, R and B durations (from the run's report) are placed on the schedule's
dependency graph (:func:`sim.schedules.schedule.build_schedule`: each device runs its list in order; a forward
needs the previous virtual stage's forward of that micro-batch, a backward the next virtual stage's
backward), every device starting at 0, with hand-offs taking no time; the bound is the latest
device's end plus its measured optimizer step. Contention between stages is in it (the durations
are measured while the other stages ran), so the bound is what this machine's compute allows, and
the gap to the measured step is the executor's own: sends, receives, Python between actions, the
chores between steps.

``breakdown``: where that gap sits on the measured step's critical path. Walking back from the
last device's optimizer, each action's predecessor is whichever of its dependencies ended last;
the time between them is ``send`` (the predecessor's call that hands its output to the transport),
then ``handoff`` (the predecessor ran on another device: the message's way and the receive) or
``between_actions`` (the same device: bookkeeping, posting receives); the time from the previous step's end to the path's first action is
``between_steps`` (end-of-step phases, drawing data, posting receives). Limits: one pipeline (D = 1,
T = 1, several chunks per device allowed); the step's "end" is the last span any device recorded,
as the executor's report counts steps.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from sim.schedules.schedule import Action, Kind, build_schedule, walk_in_rounds

COMPUTE = {"F", "R", "B", "I", "W"}
SENDS = {"send_act": Kind.FORWARD, "send_grad": Kind.BACKWARD}  # the span after the action that sends


def _dependency(action: Action, virtual_stages: int) -> Action | None:
    """The action on another (virtual) stage that ``action`` waits for, if any: a forward the previous
    stage's forward; a backward, or its input gradient (I), the next stage's gradient, which that stage's
    B or I sends (named here as B; :func:`_sender` finds which). W waits for its own I, on its device."""
    if action.kind == Kind.FORWARD and action.stage > 0:
        return Action(action.stage - 1, Kind.FORWARD, action.microbatch)
    if action.kind in (Kind.BACKWARD, Kind.INPUT) and action.stage < virtual_stages - 1:
        return Action(action.stage + 1, Kind.BACKWARD, action.microbatch)
    return None


def _sender(dependency: Action | None, known: Any) -> Action | None:
    """The action in ``known`` that sends ``dependency``'s tensor: itself, or the I of a split backward."""
    if dependency is None or dependency in known or dependency.kind is not Kind.BACKWARD:
        return dependency
    return Action(dependency.stage, Kind.INPUT, dependency.microbatch)


def _as_sender(action: Action) -> Action:
    """The key of ``action``'s send span: an I's gradient is filed as its backward's."""
    return Action(action.stage, Kind.BACKWARD, action.microbatch) if action.kind is Kind.INPUT else action


def _step_spans(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per step: each action's (start, end) by Action, each device's optimizer seconds, the step's end."""
    steps: dict[int, dict[str, Any]] = defaultdict(lambda: {"actions": {}, "optimizer": defaultdict(float), "end": 0.0,
                                                           "sends": {}})
    for r in report["timeline"]["records"]:
        if r.get("replica", 0) or r.get("tp", 0):
            continue
        step = steps[r["step"]]
        step["end"] = max(step["end"], r["end_s"])
        stage = r.get("virtual_stage", r["stage"])
        stage = r["stage"] if stage is None else stage
        if r["kind"] in SENDS and r["microbatch"] >= 0:
            step["sends"][Action(stage, SENDS[r["kind"]], r["microbatch"])] = r["end_s"] - r["start_s"]
        if r["kind"] in COMPUTE:
            step["actions"][Action(stage, Kind(r["kind"]), r["microbatch"])] = (r["start_s"], r["end_s"], r["stage"])
        elif r["kind"] == "optimizer":
            step["optimizer"][r["stage"]] += r["end_s"] - r["start_s"]
    return steps


def _lists(report: dict[str, Any]) -> tuple[list[list[Action]], int]:
    meta, config = report["timeline"]["meta"], report["config"]
    virtual = config.get("virtual_stages", 1)
    devices = len(meta["partition"]) // virtual
    lists = build_schedule(devices, meta["microbatches"], meta["schedule"], meta["checkpoint"], virtual)
    return lists, devices * virtual


def compute_bound_s(actions: dict[Action, tuple[float, float, int]], optimizer: dict[int, float],
                    lists: list[list[Action]], virtual_stages: int) -> float:
    """The step with its measured compute durations on the schedule's graph and free hand-offs."""
    end: dict[Action, float] = {}
    clock = [0.0] * len(lists)

    def run(device: int, action: Action) -> bool:
        dep = _sender(_dependency(action, virtual_stages), actions)
        if dep is not None and dep not in end:
            return False
        start = max(clock[device], end[dep] if dep is not None else 0.0)
        first, last, _ = actions[action]
        end[action] = clock[device] = start + (last - first)
        return True

    if walk_in_rounds(lists, run) != [len(items) for items in lists]:
        raise RuntimeError("the schedule's graph has a cycle")
    return max(clock[d] + optimizer.get(d, 0.0) for d in range(len(lists)))


def breakdown(actions: dict[Action, tuple[float, float, int]], lists: list[list[Action]], virtual_stages: int,
              step_end: float, previous_end: float, sends: dict[Action, float] | None = None) -> dict[str, float]:
    """Seconds of the measured step's critical path by kind: compute, optimizer, hand-offs, gaps.
    With ``sends`` (each action's send span), the part of a gap that its predecessor spent sending
    is counted as ``send`` instead."""
    sends = sends or {}
    device_before = {}
    for items in lists:
        for before, action in zip(items, items[1:]):
            device_before[action] = before
    last_of = {d: items[-1] for d, items in enumerate(lists)}
    device = max(last_of, key=lambda d: actions[last_of[d]][1])  # the device whose actions end last
    parts = {"compute": 0.0, "send": 0.0, "handoff": 0.0, "between_actions": 0.0, "between_steps": 0.0,
             "optimizer_and_end": step_end - actions[last_of[device]][1]}
    current = last_of[device]
    while True:
        start, stop, _ = actions[current]
        parts["compute"] += stop - start
        candidates = [(a, "between_actions") for a in [device_before.get(current)] if a is not None]
        dep = _sender(_dependency(current, virtual_stages), actions)
        if dep is not None:
            candidates.append((dep, "handoff"))
        if not candidates:
            parts["between_steps"] += start - previous_end
            return parts
        before, kind = max(candidates, key=lambda c: actions[c[0]][1])
        gap = start - actions[before][1]
        sending = min(max(gap, 0.0), sends.get(_as_sender(before), 0.0))
        parts["send"] += sending
        parts[kind] += gap - sending
        current = before


def analyse(report: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Per measured step: the compute bound and the critical path's parts; their medians."""
    lists, virtual_stages = _lists(report)
    steps = _step_spans(report)
    ordered = sorted(steps)
    rows = []
    for previous, step in zip(ordered, ordered[1:]):
        if step < warmup:
            continue
        spans = steps[step]
        period = spans["end"] - steps[previous]["end"]
        bound = compute_bound_s(spans["actions"], spans["optimizer"], lists, virtual_stages)
        parts = breakdown(spans["actions"], lists, virtual_stages, spans["end"], steps[previous]["end"],
                          spans["sends"])
        rows.append({"step_s": period, "compute_bound_s": bound, "overhead": (period - bound) / period, **parts})
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    return {"median": median, "steps": rows}
