"""Where the ranks of D data-parallel replicas of a K-stage pipeline sit: one rank per device.

Two placements differ once a system has several nodes:

- ``stages_adjacent``: replica d's stages are consecutive devices (device = d*K + k). The pipeline's
  hops stay inside a node where K devices fit in one; a stage's data-parallel group spans nodes.
- ``replicas_adjacent``: the D copies of stage k are consecutive devices (device = k*D + d). A
  stage's gradient all-reduce stays inside a node where D devices fit in one; pipeline hops cross
  nodes.

Both the executor (which global rank runs which replica and stage) and the simulator (which links a
transfer or an all-reduce crosses) take the layout from here, so what is predicted is what runs.
Devices are numbered node by node: device i is on node i // devices_per_node.
"""

from __future__ import annotations

from sim.errors import GpipeInputError

PLACEMENTS = ("stages_adjacent", "replicas_adjacent")
DEFAULT_PLACEMENT = "stages_adjacent"


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise GpipeInputError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    return placement


def device_of(replica: int, stage: int, replicas: int, stages: int, placement: str = DEFAULT_PLACEMENT) -> int:
    """The device (global rank) that runs ``stage`` of ``replica``."""
    if placement == "stages_adjacent":
        return replica * stages + stage
    return stage * replicas + replica


def replica_and_stage(device: int, replicas: int, stages: int,
                      placement: str = DEFAULT_PLACEMENT) -> tuple[int, int]:
    """Inverse of :func:`device_of`: (replica, stage) of global rank ``device``."""
    if placement == "stages_adjacent":
        return divmod(device, stages)
    stage, replica = divmod(device, replicas)
    return replica, stage
