"""One device module: executor/ and calibrate/ reach the device only through executor/device.py.

The CUDA implementation's logic runs here through a stand-in for ``torch.cuda`` that records what
is called; where a GPU exists, the same calls run for real (skipped cleanly without one).
"""

import ast
import pathlib

import pytest
import torch

from executor.device import CpuDevice, CudaDevice, backend_device, device_api
from sim.errors import GpipeInputError

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEVICE_MODULE = ROOT / "executor" / "device.py"


def device_specific_uses(path: pathlib.Path) -> list[str]:
    """``x.cuda`` attribute chains (``torch.cuda.synchronize``, ``tensor.cuda()``) and the NCCL
    backend named as a string: what only the device module may do."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "cuda":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .cuda")
        if isinstance(node, ast.Constant) and node.value == "nccl":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} 'nccl'")
    return found


def test_only_the_device_module_calls_the_device():
    paths = [p for folder in ("executor", "calibrate") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert DEVICE_MODULE in paths
    uses = [use for path in paths if path != DEVICE_MODULE for use in device_specific_uses(path)]
    assert uses == []
    assert device_specific_uses(DEVICE_MODULE)  # the check sees the calls where they are


class StandInCuda:
    """What CudaDevice calls of torch.cuda, recorded; two GPUs, the current one settable."""

    def __init__(self, available=True, count=2):
        self.available, self.count, self.current = available, count, 0
        self.calls = []

    def is_available(self):
        return self.available

    def device_count(self):
        return self.count if self.available else 0

    def set_device(self, index):
        self.calls.append(("set_device", index))
        self.current = index

    def current_device(self):
        return self.current

    def synchronize(self, device=None):
        self.calls.append(("synchronize", device))

    def Event(self, enable_timing=False):  # noqa: N802 (torch.cuda's name)
        self.calls.append(("Event", enable_timing))
        return object()

    def max_memory_allocated(self, device):
        self.calls.append(("max_memory_allocated", device))
        return 1234

    def reset_peak_memory_stats(self, device):
        self.calls.append(("reset_peak_memory_stats", device))

    def manual_seed(self, seed):
        self.calls.append(("manual_seed", seed))

    def get_rng_state(self, device):
        return torch.tensor([7], dtype=torch.uint8)

    def set_rng_state(self, state, device):
        self.calls.append(("set_rng_state", int(state[0]), device))

    def get_rng_state_all(self):
        return [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]

    def set_rng_state_all(self, states):
        self.calls.append(("set_rng_state_all", len(states)))

    def get_device_name(self, index):
        return "Stand-in GPU"


def test_the_cuda_implementation_through_a_stand_in():
    cuda = StandInCuda()
    api = CudaDevice(cuda)
    assert (api.type, api.backend, api.events) == ("cuda", "nccl", True)
    assert api.ranks_per_host() == 2
    assert api.select(3) == torch.device("cuda", 1)  # local rank 3 of 2 GPUs: the second
    assert cuda.calls[-1] == ("set_device", 1)
    device = api.current()
    api.synchronize(device)
    api.event()
    assert api.peak_allocated_bytes(device) == 1234
    api.reset_peak(device)
    api.seed(42)
    assert torch.initial_seed() == 42  # the CPU's generator too
    state = api.rng_state(device)
    api.set_rng_state(state, device)
    api.set_all_rng_states(api.all_rng_states())
    assert api.name() == "Stand-in GPU x 2"
    assert cuda.calls[1:] == [("synchronize", device), ("Event", True), ("max_memory_allocated", device),
                              ("reset_peak_memory_stats", device), ("manual_seed", 42),
                              ("set_rng_state", 7, device), ("set_rng_state_all", 2)]


def test_no_gpu_is_one_line_and_the_cpu_needs_nothing():
    with pytest.raises(GpipeInputError, match="--device cuda but this machine has no CUDA GPU; use --device cpu"):
        CudaDevice(StandInCuda(available=False)).select(0)
    cpu = device_api("cpu")
    assert isinstance(cpu, CpuDevice) and cpu.backend == "gloo" and not cpu.events
    assert cpu.select(5) == torch.device("cpu") and cpu.peak_allocated_bytes(torch.device("cpu")) is None
    assert cpu.all_rng_states() is None and backend_device("gloo") == torch.device("cpu")
    assert device_api(torch.device("cpu")).type == "cpu"
    with pytest.raises(GpipeInputError, match="unknown device 'tpu'"):
        device_api("tpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_the_cuda_implementation_on_a_real_gpu():
    api = device_api("cuda")
    device = api.select(0)
    x = torch.ones(1 << 20, device=device)
    api.reset_peak(device)
    start, end = api.event(), api.event()
    start.record()
    y = x * 2
    end.record()
    api.synchronize(device)
    assert start.elapsed_time(end) >= 0 and api.peak_allocated_bytes(device) >= y.numel() * 4
    state = api.rng_state(device)
    a = torch.rand(4, device=device)
    api.set_rng_state(state, device)
    assert torch.equal(a, torch.rand(4, device=device))
