"""Version 1 of the costs file, read into the current record: every default of the files written before a field existed.

Version 1 grew field by field, and its reader guessed what an older file lacked. Those guesses live
here, each once, and a version 1 file comes out in the layout of :mod:`sim.formats.costs_v2`, so
the rest of gpipe reads one layout, and a version 1 file predicts exactly what the same data written
as version 2 does. What changed from 1 to 2 besides the defaults: the warm-up after waits moved from
``pipeline[K].warm_up_s`` into ``pipeline[K].host`` (a CPU host's effects, :mod:`sim.engine.host`).

The defaults, and the files that lack each:

- ``system`` "cpu", ``catalog_device`` the local CPU, ``machine`` {}: files from before those stamps;
- ``precision`` fp32, ``optimizer`` sgd with ``optimizer_slots`` 0, ``shared_parameters`` none,
  ``batch_size`` none: files from before each was recorded (all ran fp32, trained with SGD);
- ``pipeline`` none (the profile's times as they are): files from before the pipeline fits;
- ``pipeline[K].gap_after_s`` none, ``.replica_spread`` none, ``.first_input_s`` and
  ``.full_backward_per_layer_s`` 0 (a factor over the sum that some files kept instead is dropped:
  the sum as it is), ``.actions[kind].cold_start_s`` 0: files from before each was measured;
- ``pipeline[K].warm_up_s`` 0: files from before it was fitted; quick calibrations.
"""

from __future__ import annotations

import copy
from typing import Any

from sim.catalog.hardware import LOCAL_CPU
from sim.workloads.precision import DEFAULT_PRECISION

VERSION = 1

TOP_DEFAULTS: dict[str, Any] = {"system": "cpu", "catalog_device": LOCAL_CPU.name, "machine": {},
                                "precision": DEFAULT_PRECISION, "optimizer": "sgd", "optimizer_slots": 0,
                                "shared_parameters": [], "batch_size": None, "pipeline": {}}
FIT_DEFAULTS: dict[str, Any] = {"gap_after_s": {}, "replica_spread": [], "first_input_s": 0.0,
                                "full_backward_per_layer_s": 0.0}
ACTION_DEFAULTS: dict[str, Any] = {"cold_start_s": 0.0}


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A version 1 file's content (as JSON gave it) as a version 2 record; ``data`` is left as it was."""
    record = copy.deepcopy(data)
    for key, default in TOP_DEFAULTS.items():
        record.setdefault(key, copy.deepcopy(default))
    for fit in record["pipeline"].values():
        for key, default in FIT_DEFAULTS.items():
            fit.setdefault(key, copy.deepcopy(default))
        for line in fit["actions"].values():
            for key, default in ACTION_DEFAULTS.items():
                line.setdefault(key, default)
        fit["host"] = {"warm_up_s": float(fit.pop("warm_up_s", 0.0))}
    record["version"] = 2
    return record
