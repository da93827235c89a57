"""Cores that more processes share than there are of them: the operating system's processor sharing.

A CPU run may start more processes than the machine has cores (2 replicas x 2 stages on 2 cores):
the executor then waits in gloo's blocking calls, which sleep, so only processes with work to do
take a core, and the scheduler shares the cores among them. The model is processor sharing: while
``n`` processes compute on ``c`` cores, each advances at ``min(1, c / n)`` of its own speed, so an
action of ``work_s`` seconds alone lasts longer by however many others ran beside it. A device that
stands for T tensor-parallel processes (one stage split over T ranks) counts T times.

Limits: the share is equal and instant (no time slices, no cache lost on a switch, no priority for
a process just woken: in the D = 2 x K = 2 run on two cores a send held its stage 13-18 ms, most
likely a sender that lost its core to the receiver it woke, and the step measured 21-27% longer than
this model predicts); a process waiting for a message uses no core (true of the blocking waits the
executor uses when ranks outnumber cores, not of a polling transport); threads inside a process are
not modelled, a process counts once whatever its thread count (the executor gives each one thread
when ranks outnumber cores).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import simpy

from sim.errors import GpipeInputError

# a job this close to done (seconds of its own work) is done: what float rounding leaves of a finish
FINISHED_S = 1e-12


@dataclass(frozen=True)
class CoreSharing:
    """A run's processes on ``cores`` cores; each simulated device is ``processes_per_device``
    processes (T, with a stage split over T tensor-parallel ranks)."""

    cores: int
    processes_per_device: int = 1

    def __post_init__(self) -> None:
        for name in ("cores", "processes_per_device"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GpipeInputError(f"{name} must be a positive integer, got {value!r}")

    def oversubscribed(self, devices: int) -> bool:
        """Whether ``devices`` devices' processes outnumber the cores."""
        return devices * self.processes_per_device > self.cores

    def everyone_s(self, seconds: float, devices: int) -> float:
        """``seconds`` of one process's work while all ``devices``' processes work at once."""
        return seconds * max(1.0, devices * self.processes_per_device / self.cores)


class SharedCores:
    """``cores`` cores shared equally by the compute of all processes of one SimPy environment."""

    def __init__(self, env: simpy.Environment, cores: int) -> None:
        if cores < 1:
            raise ValueError(f"cores must be 1 or more, got {cores}")
        self.env = env
        self.cores = cores
        self._jobs: dict[int, list] = {}  # id -> [work left in seconds alone, processes, done event]
        self._ids = itertools.count()
        self._updated_s = 0.0
        self._generation = 0  # a finish timer of an older generation was superseded by a later change

    def compute(self, work_s: float, processes: int = 1) -> simpy.Event:
        """An event that fires when ``work_s`` seconds of one process's compute alone are done,
        sharing the cores from now on; ``processes`` > 1 for a device standing for several."""
        done = self.env.event()
        if work_s <= 0:
            done.succeed()
            return done
        self._advance()
        self._jobs[next(self._ids)] = [work_s, processes, done]
        self._schedule()
        return done

    def speed(self) -> float:
        """The share of its own speed each computing process gets now."""
        demand = sum(processes for _, processes, _ in self._jobs.values())
        return 1.0 if demand <= self.cores else self.cores / demand

    def _advance(self) -> None:
        elapsed_s = self.env.now - self._updated_s
        if elapsed_s > 0 and self._jobs:
            progress_s = elapsed_s * self.speed()
            for job in self._jobs.values():
                job[0] -= progress_s
        self._updated_s = self.env.now

    def _schedule(self) -> None:
        self._generation += 1
        if not self._jobs:
            return
        generation = self._generation
        first_s = min(job[0] for job in self._jobs.values())
        timer = self.env.timeout(max(0.0, first_s) / self.speed())
        timer.callbacks.append(lambda _event: self._finish(generation))

    def _finish(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._advance()
        for key in [key for key, job in self._jobs.items() if job[0] <= FINISHED_S]:
            self._jobs.pop(key)[2].succeed()
        self._schedule()
