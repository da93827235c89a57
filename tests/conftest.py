"""Shared fixtures: small workloads with distinct stash and saved sizes, and one quick calibration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pytest

from sim.catalog.hardware import Device
from sim.workloads.workload import LayerCost


@dataclass(frozen=True)
class ListWorkload:
    """Layers with the given forward times; backward twice forward; memory per layer from args."""

    forward_s: Sequence[float]
    saved_bytes: int = 10
    input_bytes: int = 1
    param_bytes: int = 100
    name: str = "list"

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    def layer_costs(self, rows: int, device: Device) -> list[LayerCost]:
        return [LayerCost(name=f"layer{i}", forward_s=f * rows, backward_s=2 * f * rows, recompute_s=f * rows,
                          saved_bytes=self.saved_bytes * rows, output_bytes=self.input_bytes * rows,
                          input_bytes=self.input_bytes * rows, param_bytes=self.param_bytes,
                          grad_bytes=self.param_bytes, optimizer_bytes=0)
                for i, f in enumerate(self.forward_s)]

    def describe(self) -> dict:
        return {"name": self.name, "options": {}, "num_layers": self.num_layers, "parameter_count": 0}


@pytest.fixture
def list_workload():
    return ListWorkload


@pytest.fixture(scope="session")
def tiny_quick_costs(tmp_path_factory):
    """One quick calibration of the tiny transformer (``tests.test_calibrate_validate.TINY``), shared
    by the tests that validate against it (a calibration is the slowest launch there is): the costs
    file's path and what the command printed."""
    import contextlib
    import io

    from gpipe.main import main
    from tests.test_calibrate_validate import TINY

    path = tmp_path_factory.mktemp("tiny_quick") / "costs.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["calibrate", *TINY, "--out", str(path), "--quick", "--steps", "3"]) == 0
    return str(path), printed.getvalue()
