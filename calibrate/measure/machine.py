"""The stamp of where and with what a costs file was measured, and the cache key derived from it.

A costs file is only valid on the machine and library versions it came from: a different CPU, core
count or torch changes every timing. ``gpipe calibrate`` reuses a cached file only when the stamp's
identity fields and the model match exactly. The date is recorded but not part of the identity.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Any

IDENTITY_FIELDS = ("platform", "cpu_model", "cpu_cores", "python", "torch", "device", "accelerator")


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_stamp(device: str = "cpu") -> dict[str, Any]:
    """Platform, CPU model, cores, Python and torch versions, the accelerator, and the date."""
    import torch

    from executor.device import device_api

    accelerator = device_api(device).name()
    return {
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count() or 1,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": device,
        "accelerator": accelerator,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def same_machine(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two stamps describe the same machine and library versions (the date is ignored)."""
    return all(a.get(key) == b.get(key) for key in IDENTITY_FIELDS)
