"""Everything device-specific the executor and calibration do, behind one small interface.

``executor/`` and ``calibrate/`` ask :func:`device_api` for the run's device kind (``cpu`` or
``cuda``) and call nothing device-specific themselves (``tests/executor/test_device.py`` holds that with an
AST check): the collective backend, which device a rank computes on, waiting for queued work,
timing events, peak allocated memory and its reset, the accelerator's random generators, and how
many ranks a host runs one device each.

CPU: gloo; the host's allocator keeps freed memory for reuse; the host's clock times spans (no events); no allocator peak is tracked (the executor's
activation counter measures what it holds); the default generator is the only one. CUDA: NCCL, one
GPU per rank (``local_rank`` modulo the GPUs), CUDA events on the stream, the caching allocator's
peaks, the current GPU's generator besides the CPU's. :class:`CudaDevice` takes the ``torch.cuda``
module as an argument, so a stand-in can drive its logic where no GPU exists; none of it has run on
a GPU here.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from executor.transport.host_allocator import keep_freed_memory
from sim.errors import GpipeInputError


class CpuDevice:
    """The CPU: gloo, one rank per core, host timing."""

    type = "cpu"
    backend = "gloo"
    events = False  # spans are timed on the host's clock

    def check_available(self) -> None:
        return None

    def ranks_per_host(self) -> int:
        """Ranks this host runs one device (a core) each."""
        return os.cpu_count() or 1

    def select(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def prepare_process(self) -> bool:
        """Process-wide settings a rank computes with, set once before its first tensor: the host
        allocator keeps freed blocks for the next step (:mod:`executor.transport.host_allocator`). Profiling
        processes set the same, so that calibrated costs are those of the executor's processes."""
        return keep_freed_memory()

    def current(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self, device: torch.device | None = None) -> None:
        return None

    def event(self) -> Any:
        raise RuntimeError("the CPU has no timing events; time spans on the host's clock (events is False)")

    def peak_allocated_bytes(self, device: torch.device) -> int | None:
        return None

    def reset_peak(self, device: torch.device) -> None:
        return None

    def seed(self, seed: int) -> None:
        """Seed the generators a rank draws from (the CPU's default generator)."""
        torch.default_generator.manual_seed(seed)

    def rng_state(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), None

    def set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
        torch.set_rng_state(state[0])

    def all_rng_states(self) -> list[torch.Tensor] | None:
        """Every accelerator generator of the process, for a checkpoint (None: none)."""
        return None

    def set_all_rng_states(self, states: list[torch.Tensor] | None) -> None:
        return None

    def name(self) -> str:
        return ""


class CudaDevice(CpuDevice):
    """NVIDIA GPUs through ``cuda`` (``torch.cuda``, or a stand-in with its functions)."""

    type = "cuda"
    backend = "nccl"
    events = True

    def __init__(self, cuda: Any = None) -> None:
        self.cuda = cuda if cuda is not None else torch.cuda

    def check_available(self) -> None:
        if not self.cuda.is_available():
            raise GpipeInputError("--device cuda but this machine has no CUDA GPU; use --device cpu")

    def ranks_per_host(self) -> int:
        return self.cuda.device_count()

    def select(self, local_rank: int) -> torch.device:
        """This rank's GPU: ``local_rank`` modulo the GPUs, made the current one."""
        self.check_available()
        self.cuda.set_device(local_rank % self.cuda.device_count())
        return self.current()

    def current(self) -> torch.device:
        return torch.device("cuda", self.cuda.current_device())

    def synchronize(self, device: torch.device | None = None) -> None:
        if device is None:
            self.cuda.synchronize()
        else:
            self.cuda.synchronize(device)

    def event(self) -> Any:
        return self.cuda.Event(enable_timing=True)

    def peak_allocated_bytes(self, device: torch.device) -> int | None:
        return self.cuda.max_memory_allocated(device)

    def reset_peak(self, device: torch.device) -> None:
        self.cuda.reset_peak_memory_stats(device)

    def seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)
        self.cuda.manual_seed(seed)  # the current GPU's, which is this rank's

    def rng_state(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), self.cuda.get_rng_state(device)

    def set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            self.cuda.set_rng_state(state[1], device)

    def all_rng_states(self) -> list[torch.Tensor] | None:
        return self.cuda.get_rng_state_all() if self.cuda.is_available() else None

    def set_all_rng_states(self, states: list[torch.Tensor] | None) -> None:
        if states is not None and self.cuda.is_available():
            self.cuda.set_rng_state_all(states)

    def name(self) -> str:
        if not self.cuda.is_available():
            return ""
        return f"{self.cuda.get_device_name(0)} x {self.cuda.device_count()}"


DEVICES = {"cpu": CpuDevice, "cuda": CudaDevice}


def device_api(kind: str | torch.device) -> CpuDevice:
    """The interface for a device kind (``"cpu"``, ``"cuda"``, or a ``torch.device``)."""
    name = kind.type if isinstance(kind, torch.device) else kind
    if name not in DEVICES:
        raise GpipeInputError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    return DEVICES[name]()


def backend_device(backend: str) -> torch.device:
    """The device a collective on ``backend`` takes its tensors on (NCCL: the current GPU)."""
    api = next(api for api in (CpuDevice(), CudaDevice()) if api.backend == backend)
    return api.current()
