"""The SimPy model of one replica's forwards and backwards: K devices walking their action lists.

Each device is a SimPy process walking its list from :func:`sim.schedules.schedule.build_schedule`. A forward
of virtual stage s waits for s-1's activation, a backward for s+1's gradient; a recompute waits for
nothing but the device, so it can run before the gradient arrives (the GPipe paper's observation).
Without interleaving, virtual stage and device are the same; with it, virtual stage s runs on device
s % K, so a micro-batch goes round the K devices V times and the hop from device K-1 back to device
0 between chunks is a transfer like any other. The V-shaped schedules (zbv, dualpipev) place chunk 1
back up the devices (:func:`sim.schedules.schedule.device_of_virtual_stage`): the hand-off between the chunks
stays on device K-1, in memory, and every other hop joins neighbouring devices.

An action that starts cold (:func:`sim.schedules.schedule.cold_starts`: the first of its device's list, the
step's first) takes the stage's ``cold_start_s`` for its kind on top of its work, as busy time. One
function prices every action (:meth:`ReplicaRun.action_s`), whichever walk asks: its work, its cold
start, and, only where the stage's costs turn them on, a CPU host's effects (:mod:`sim.engine.host`).

Between two of its actions a device spends the stage's ``gap_after_s`` for the kind of the first:
the executor's own time (its loop, freeing a backward's graph, posting receives, unpacking the next
message), which calibration measures from the timeline's gaps and the analytic models leave out. It
is neither busy time nor waiting: the timeline shows it as the space between two spans, as the
executor's does. So is the sender's own time in a send to another device (``activation_send_s`` after a forward,
``gradient_send_s`` after a backward or I: the copy into the message on the CPU, 0 in the analytic
models, whose sends are asynchronous), after which the message leaves on the link.

Finished activations and gradients travel over first-come-first-served link channels: a dedicated
one per device pair and direction, or, for PCIe through the host, one per node and direction that
every transfer on that node queues for (see :class:`Links`). Which link a hop crosses comes from the
replica's global devices (:mod:`sim.engine.placement`): the intra-node link inside a node, else the
inter-node link.

Where no span is recorded (the planner's many candidates) and no link is shared, the same walk runs
without the event loop (:meth:`ReplicaRun.walk`): each channel then has one sender, which books it in
its own program order, so every figure follows from the action lists alone; a test holds the two
equal to the bit.

This module stops at each device's last backward: what follows (the data-parallel all-reduce, the
shared-parameter reduction, the optimizer step) is a closed form in :mod:`sim.engine.engine`.
"""

from __future__ import annotations

import math
from typing import Sequence

import simpy

from sim.catalog.hardware import Link, System
from sim.engine.host import HostLedger, HostPaid
from sim.engine.stage_costs import StageCost, backward_time_s, held_sizes, input_grad_time_s, weight_grad_time_s
from sim.formats.timeline import (DP_ALL_GATHER, DP_REDUCE_SCATTER, EP_COMBINE, EP_DISPATCH, RECV_WAIT, SEND_ACTIVATION,
                                  SEND_GRADIENT)
from sim.schedules.schedule import Action, Kind, cold_starts, device_of_virtual_stage, receives_gradient, recomputes

GAP_INDEX = {kind: i for i, kind in enumerate(Kind)}  # StageCost.gap_after_s is in this order


def final_gradient_index(actions: Sequence[Action]) -> int:
    """Index of a device's last backward (or W) in ``actions``: the one whose ZeRO-2/3 reduce-scatter
    is the step's tail (:meth:`sim.engine.fsdp.FsdpPricing.tail_s`), not priced after it; -1 if none."""
    return max((i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD or a.kind is Kind.WEIGHT), default=-1)


class Links:
    """The links of one replica as FIFO channels, one per device pair and direction, or one per
    node and direction where the link is shared (PCIe through the host).

    A transfer occupies its channel for bytes / bandwidth, from the moment the channel is free; its
    latency is pipelined (it delays arrival, not the next transfer). Requests reach a channel in
    simulated-time order, so a first-come-first-served resource reduces to the time the channel
    next falls free: that closed form is what is kept, which saves most of SimPy's resource events.
    Replicas are simulated apart, so two replicas' transfers never queue on a shared channel.
    """

    def __init__(self, system: System, devices: Sequence[int], positions: Sequence[int]) -> None:
        self._free_at_s: dict[tuple, float] = {}
        # hop[(k, j)]: (link, channel key, free) for a send from pipeline position k to position j, for
        # each pair that consecutive virtual stages (``positions[s]``, ``positions[s+1]``) join, both ways
        self.hop: dict[tuple[int, int], tuple[Link, tuple, bool]] = {}
        for here, there in zip(positions, positions[1:]):
            if here == there:
                continue  # chunks of one device hand over in memory
            for k, j in ((here, there), (there, here)):
                source, target = devices[k], devices[j]
                link = system.link_between(source, target)
                key = ((system.node_of(min(source, target)), target > source) if link.shared
                       else (source, target))
                free = link.latency_s == 0.0 and math.isinf(link.point_to_point_bytes_per_s)
                self.hop[(k, j)] = (link, key, free)

    def reserve(self, link: Link, key: tuple, now_s: float, nbytes: int) -> tuple[float, float]:
        """Book a transfer of ``nbytes`` on channel ``key`` of ``link``: (start_s, arrival_s)."""
        start_s = max(now_s, self._free_at_s.get(key, 0.0))
        wire_s = 0.0 if math.isinf(link.point_to_point_bytes_per_s) else nbytes / link.point_to_point_bytes_per_s
        self._free_at_s[key] = start_s + wire_s
        return start_s, start_s + wire_s + link.latency_s


class ReplicaRun:
    """One replica's step up to each device's last backward: busy time, memory and spans.

    ``costs[rows][s]`` is virtual stage s's cost for a micro-batch of ``rows``; ``devices[k]`` is
    the global device of pipeline position k. Records name the position k and the virtual stage;
    the engine turns them into :class:`sim.formats.timeline.Record`.
    """

    def __init__(self, system: System, devices: Sequence[int], virtual_stages: int, rows: list[int],
                 costs: dict[int, list[StageCost]], checkpoint: str, record: bool,
                 positions: Sequence[int] | None = None) -> None:
        self.stages = len(devices)
        self.virtual = virtual_stages * self.stages
        # the pipeline position of each virtual stage (sim.schedules.schedule.device_of_virtual_stage); loop placement by default
        self.position = (list(positions) if positions is not None
                         else [device_of_virtual_stage(s, self.stages) for s in range(self.virtual)])
        self.rows = rows
        self.costs = costs
        self.checkpoint = checkpoint
        self.record = record
        self.links = Links(system, devices, self.position)
        self.busy_s = [0.0] * self.stages
        self.held_bytes = [0] * self.stages
        self.peak_bytes = [0] * self.stages
        # (position k, kind, micro-batch, start_s, end_s, virtual stage): tuples are cheaper in the hot loop
        self.records: list[tuple] = []
        self.memory: list[tuple] = []  # MemorySample fields
        self.last_backward_s = [0.0] * self.stages
        # what a CPU host's effects add, where the costs turn them on (sim.engine.host); None: off
        self.host = (HostLedger(self.stages)
                     if any(cost.host.on for row in costs.values() for cost in row) else None)
        self._gathered: set[int] = set()  # virtual stages whose once-per-step gather was paid (ZeRO-2/3, K > 1)

    def run(self, per_device_actions: Sequence[Sequence[Action]]) -> "ReplicaRun":
        """Walk every device's list: as SimPy processes, or, where no spans are recorded and no link
        is shared, in the closed form of :meth:`walk`, which gives the same figures."""
        if not self.record and not any(link.shared for link, _key, _free in self.links.hop.values()):
            return self.walk(per_device_actions)
        self.env = simpy.Environment()
        m = len(self.rows)
        # activation_in[s][m]: virtual stage s has micro-batch m's input; gradient_in[s][m]: its output grad
        self.activation_in = [[self.env.event() for _ in range(m)] for _ in range(self.virtual)]
        self.gradient_in = [[self.env.event() for _ in range(m)] for _ in range(self.virtual)]
        for k in range(self.stages):
            self.env.process(self.device_process(k, per_device_actions[k]))
        self.env.run()
        return self

    def host_paid(self, device: int) -> HostPaid | None:
        """What the host effects added to ``device``'s busy time; None where they are off."""
        return self.host.paid(device) if self.host is not None else None

    def walk(self, per_device_actions: Sequence[Sequence[Action]]) -> "ReplicaRun":
        """The SimPy processes' busy time, peak memory and last backward without the event loop.

        Exact where every link channel has one sender (no shared link): a device's sends then book
        their channel in its own program order, which is simulated-time order, so each action starts
        at max(device free, its input's arrival) and each device can be walked as far as its inputs
        are known, round by round, with no global event queue. Spans are not recorded (``run`` uses
        SimPy for timelines)."""
        virtual, last, stages = self.virtual, self.virtual - 1, self.stages
        m_count = len(self.rows)
        # arrival_s[forward][s][m]: when virtual stage s has micro-batch m's input (True) or gradient (False)
        arrival_s = {True: [[None] * m_count for _ in range(virtual)],
                     False: [[None] * m_count for _ in range(virtual)]}
        now_s = [0.0] * stages
        position = [0] * stages
        lengths = [len(actions) for actions in per_device_actions]
        cold = [cold_starts(actions) for actions in per_device_actions]
        final = [final_gradient_index(actions) for actions in per_device_actions]
        sizes = {rows: [held_sizes(cost, self.checkpoint) for cost in row] for rows, row in self.costs.items()}
        remaining = sum(lengths)
        while remaining:
            advanced = 0
            for device in range(stages):
                actions, i, t = per_device_actions[device], position[device], now_s[device]
                while i < lengths[device]:
                    action = actions[i]
                    m, s, kind = action.microbatch, action.stage, action.kind
                    cost = self.costs[self.rows[m]][s]
                    free_s = t + cost.gap_after_s[GAP_INDEX[actions[i - 1].kind]] if i and cost.gap_after_s else t
                    if kind is Kind.FORWARD and s > 0:
                        ready_s = arrival_s[True][s][m]
                    elif receives_gradient(kind) and s < last:
                        ready_s = arrival_s[False][s][m]
                    else:
                        ready_s = free_s
                    if ready_s is None:
                        break
                    duration = self.action_s(device, cost, kind, s, cold[device][i], ready_s - free_s)
                    t = ready_s if ready_s > free_s else free_s
                    gather_s, reduce_s = self.communication_s(cost, kind, s)
                    if gather_s > 0:  # as the SimPy walk's timeout adds it
                        t += gather_s
                    held = sizes[self.rows[m]][s]
                    if kind is Kind.BACKWARD and held[2]:
                        self._hold(device, held[2])
                    if duration > 0:
                        t += duration
                    self.busy_s[device] += duration
                    message = self._finish(device, kind, s, cost, held, m)
                    if message is not None:
                        target, nbytes, forward, own_s = message
                        if own_s:
                            t += own_s
                        arrival_s[forward][target][m] = self._arrival_s(device, target, t, nbytes)
                    if reduce_s > 0 and i != final[device]:  # after the send, before the next action
                        t += reduce_s
                    i += 1
                advanced += i - position[device]
                position[device], now_s[device] = i, t
            if not advanced:
                raise RuntimeError("the schedule waits for an input no device sends; it cannot finish")
            remaining -= advanced
        self.last_backward_s = now_s
        return self

    def _arrival_s(self, device: int, target: int, now_s: float, nbytes: int) -> float:
        """When a send from ``device`` at ``now_s`` reaches virtual stage ``target`` (:meth:`_send`'s timing)."""
        position = self.position[target]
        if position == device:  # chunks of one device hand over in memory
            return now_s
        link, key, free = self.links.hop[(device, position)]
        if free:
            return now_s
        arrival_s = self.links.reserve(link, key, now_s, nbytes)[1]
        return now_s + (arrival_s - now_s)  # as SimPy times the arrival: a timeout of the difference

    def action_s(self, device: int, cost: StageCost, kind: Kind, virtual_stage: int, cold: bool,
                 wait_s: float) -> float:
        """Seconds one action of ``kind`` takes on ``device``, a stage of ``cost``: the one price
        both walks use. Its work; its stage's ``cold_start_s`` for its kind when it starts ``cold``
        (:func:`sim.schedules.schedule.cold_starts`); and, only where the stage's costs turn them on,
        what the host adds after its device waited ``wait_s`` for its input (:mod:`sim.engine.host`)."""
        seconds = self._work_s(cost, kind, virtual_stage)
        if cold and cost.cold_start_s:
            seconds += cost.cold_start_s[GAP_INDEX[kind]]
        if self.host is not None and cost.host.on:  # (no ledger: no stage's costs turn any on)
            seconds = self.host.action_s(device, cost.host, wait_s, seconds)
        return seconds

    def communication_s(self, cost: StageCost, kind: Kind, virtual_stage: int) -> tuple[float, float]:
        """(gather, reduction) seconds ZeRO-2/3 leaves exposed around an action (:mod:`sim.engine.fsdp`):
        before it, a forward's gathers (the chunk's first forward alone pays the once-per-step gather)
        or a backward's or W's; after a backward or W, its reduce-scatters (gradient sync microbatch;
        the walks leave out the device's last, which the step's tail prices); (0, 0) without sharding."""
        if kind is Kind.FORWARD:
            gather_s = cost.fsdp_forward_gather_s
            if cost.fsdp_first_forward_gather_s and virtual_stage not in self._gathered:
                self._gathered.add(virtual_stage)
                gather_s += cost.fsdp_first_forward_gather_s
            return gather_s, 0.0
        if kind is Kind.BACKWARD or kind is Kind.WEIGHT:
            return cost.fsdp_backward_gather_s, cost.fsdp_backward_reduce_s
        return 0.0, 0.0

    def _finish(self, device: int, kind: Kind, virtual_stage: int, cost: StageCost, held: tuple[int, int, int],
                microbatch: int) -> tuple[int, int, bool, float] | None:
        """What an action leaves held, and what it sends: both walks' end of an action.

        Held, of its stage's (stash, saved, transient) bytes (:func:`sim.engine.stage_costs.held_sizes`):
        a forward its saved tensors (or only its stash, where the micro-batch is recomputed), a
        recompute the rest, a backward (or W) frees them all (while a backward runs it also holds its
        ``transient``: under ``full``, the layer it recomputes). Sent: (the virtual stage it goes to,
        its bytes, whether it is an activation, the sender's own seconds before it leaves: 0 within a
        device); None for an action that sends nothing."""
        stash, saved, transient = held
        if kind is Kind.FORWARD:
            self._hold(device, stash if recomputes(self.checkpoint, microbatch, len(self.rows)) else saved)
            if virtual_stage == self.virtual - 1:
                return None
            target, nbytes, forward, own_s = virtual_stage + 1, cost.output_bytes, True, cost.activation_send_s
        elif kind is Kind.RECOMPUTE:
            self._hold(device, saved - stash)
            return None
        else:
            if kind is not Kind.INPUT:  # B, or W: the micro-batch's tensors are freed
                self._hold(device, -saved - transient)
            if kind is Kind.WEIGHT or virtual_stage == 0:
                return None
            # B, or I: the gradient of the stage's input
            target, nbytes, forward, own_s = virtual_stage - 1, cost.stash_bytes, False, cost.gradient_send_s
        return target, nbytes, forward, own_s if self.position[target] != device else 0.0

    def _work_s(self, cost, kind, virtual_stage: int) -> float:
        """Seconds one action of ``kind`` takes on a stage of ``cost``, warm."""
        if kind is Kind.FORWARD:
            return cost.forward_s
        if kind is Kind.RECOMPUTE:
            return cost.recompute_s
        if kind is Kind.INPUT:
            return input_grad_time_s(cost, self.checkpoint, virtual_stage == 0)
        if kind is Kind.WEIGHT:
            return weight_grad_time_s(cost, self.checkpoint, virtual_stage == 0)
        return backward_time_s(cost, self.checkpoint)

    def _hold(self, device: int, delta: int) -> None:
        self.held_bytes[device] += delta
        if self.held_bytes[device] > self.peak_bytes[device]:
            self.peak_bytes[device] = self.held_bytes[device]
        if self.record:
            self.memory.append((device, self.env.now, self.held_bytes[device]))

    def device_process(self, device: int, actions: Sequence[Action]):
        """The SimPy process of ``device`` walking ``actions``: the twin of :meth:`walk` that records spans."""
        env = self.env
        last = self.virtual - 1
        if self.record:
            self.memory.append((device, 0.0, 0))
        cold = cold_starts(actions)
        final = final_gradient_index(actions)
        for i, action in enumerate(actions):
            m, s, kind = action.microbatch, action.stage, action.kind
            cost = self.costs[self.rows[m]][s]
            if i and cost.gap_after_s:  # the executor's own time between two actions
                yield env.timeout(cost.gap_after_s[GAP_INDEX[actions[i - 1].kind]])
            waiting_on = None
            if kind is Kind.FORWARD and s > 0:
                waiting_on = self.activation_in[s][m]
            elif receives_gradient(kind) and s < last:
                waiting_on = self.gradient_in[s][m]
            wait_start = env.now
            if waiting_on is not None and not waiting_on.processed:
                yield waiting_on
                if self.record and env.now > wait_start:
                    self.records.append((device, RECV_WAIT, m, wait_start, env.now, s))
            duration = self.action_s(device, cost, kind, s, cold[i], env.now - wait_start)
            gather_s, reduce_s = self.communication_s(cost, kind, s)
            if gather_s > 0:
                if self.record:
                    self.records.append((device, DP_ALL_GATHER, m, env.now, env.now + gather_s, s))
                yield env.timeout(gather_s)
            held = held_sizes(cost, self.checkpoint)
            if kind is Kind.BACKWARD and held[2]:
                self._hold(device, held[2])  # the layer being recomputed, on top of what is held
            start = env.now
            if duration > 0:
                yield env.timeout(duration)
            self.busy_s[device] += duration
            if self.record:
                self.records.append((device, kind.value, m, start, env.now, s))
                self._record_all_to_alls(device, cost, kind, m, start, env.now, s)
            message = self._finish(device, kind, s, cost, held, m)
            if message is not None:
                target, nbytes, forward, own_s = message
                if own_s:
                    yield env.timeout(own_s)  # the sender's own time
                self._send(device, target, m, nbytes, forward)
            if reduce_s > 0 and i != final:  # after the send, before the next action
                if self.record:
                    self.records.append((device, DP_REDUCE_SCATTER, m, env.now, env.now + reduce_s, s))
                yield env.timeout(reduce_s)
        self.last_backward_s[device] = env.now

    def _record_all_to_alls(self, device: int, cost: StageCost, kind: Kind, microbatch: int, start_s: float,
                            end_s: float, virtual_stage: int) -> None:
        """Expert parallelism's exposed all-to-alls inside the action that issued them: the dispatch
        opening it, the combine closing it, half each (:mod:`sim.workloads.moe.expert_parallel`); a
        forward's (or recompute's) in F and R, a backward's in B and in I, which runs the exchange's
        reverse on the input-gradient path, except on virtual stage 0, whose input needs no gradient:
        there W is the whole backward (:func:`sim.engine.stage_costs.weight_grad_time_s`), as the
        executor runs it."""
        backward_half = Kind.WEIGHT if virtual_stage == 0 else Kind.INPUT
        if kind is Kind.FORWARD or kind is Kind.RECOMPUTE:
            seconds = cost.ep_forward_s
        elif kind is Kind.BACKWARD or kind is backward_half:
            seconds = cost.ep_backward_s
        else:
            return
        if seconds <= 0:
            return
        half = min(seconds, end_s - start_s) / 2
        self.records.append((device, EP_DISPATCH, microbatch, start_s, start_s + half, virtual_stage))
        self.records.append((device, EP_COMBINE, microbatch, end_s - half, end_s, virtual_stage))

    def _send(self, device: int, target: int, microbatch: int, nbytes: int, forward: bool) -> None:
        """Hand virtual stage ``target`` its input (or gradient) of ``microbatch``."""
        arrived = (self.activation_in if forward else self.gradient_in)[target][microbatch]
        position = self.position[target]
        if position == device:  # chunks on one device hand over in memory
            arrived.succeed()
            return
        link, key, free = self.links.hop[(device, position)]
        if free:
            arrived.succeed()
            return
        now = self.env.now
        start, arrival = self.links.reserve(link, key, now, nbytes)
        if self.record:
            source = target - 1 if forward else target + 1
            self.records.append((device, SEND_ACTIVATION if forward else SEND_GRADIENT, microbatch, start, arrival,
                                 source))
        self.env.timeout(arrival - now).callbacks.append(lambda _event: arrived.succeed())
