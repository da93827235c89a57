"""Human-readable summaries of simulation results and advice when a plan does not fit."""

from __future__ import annotations

import math

from sim.catalog.hardware import System
from sim.engine.engine import SimResult
from sim.engine.host import IDLE_S

GIB = 1 << 30


def gib(nbytes: float) -> str:
    return "unlimited" if math.isinf(nbytes) else f"{nbytes / GIB:.2f} GiB"


def format_summary(result: SimResult, system: System, precision: str) -> str:
    lines = [
        f"system       {system.name} x{system.nodes * system.nodes_per_device} node(s), device {system.device.name}",
        f"precision    {describe_precision(precision)}",
        f"partition    {','.join(map(str, result.partition))} layers per stage",
        f"micro-batch  {result.microbatches} of {result.microbatch_rows[0]} rows "
        f"(batch {result.batch_size}), {result.schedule}, checkpoint {result.checkpoint}",
        *_scale_out_lines(result),
        f"step time    {result.step_time_s * 1e3:.3f} ms",
        f"bubble       {result.bubble_fraction:.1%}",
        f"throughput   {result.throughput_samples_per_s:.2f} samples/s",
    ]
    # the warm-up after long waits (a CPU host's effect, sim.engine.host), part of busy time: shown where paid
    waits = any(s.host and s.host.warm_up_s for s in result.stages)
    lines.append(("device replica " if result.replicas > 1 else "") + "stage  layers  busy ms   "
                 + ("of it after waits   " if waits else "") + "activations   peak memory   capacity   fits")
    for s in result.stages:
        where = f"{s.device:>6} {s.replica:>7} " if result.replicas > 1 else ""
        after_waits = f"{(s.host.warm_up_s if s.host else 0.0) * 1e3:>17.3f}   " if waits else ""
        lines.append(f"{where}{s.stage:>5}  {s.layers:>6}  {s.busy_s * 1e3:>7.3f}   {after_waits}"
                     f"{gib(s.peak_activation_bytes):>11}   {gib(s.peak_memory_bytes):>11}   "
                     f"{gib(s.memory_capacity_bytes):>9}   {'yes' if s.fits else 'NO'}")
    if waits:
        lines.append(f"after waits: busy time the device runs slow after waiting {IDLE_S * 1e3:g} ms or more for "
                     "its input (the costs file's fitted warm-up; see docs/calibration.md)")
    return "\n".join(lines)


def _scale_out_lines(result: SimResult) -> list[str]:
    """Replicas and chunks, when there are any: one pipeline of one chunk per device says nothing."""
    lines = []
    if result.virtual_stages > 1:
        lines.append(f"chunks       {result.virtual_stages} virtual stages per device (partition lists V x K chunks)")
    if result.replicas > 1:
        rows = ",".join(map(str, result.replica_rows))
        lines.append(f"replicas     {result.replicas} x {len(result.partition) // result.virtual_stages} stages, "
                     f"{result.placement}, rows per replica {rows}, zero {result.zero}"
                     + (f", shard group {result.shard_group}" if result.shard_group else "")
                     + (f", gradients reduce-scattered per {_sync_words(result.gradient_sync)}"
                        if result.gradient_sync else ""))
    return lines


def _sync_words(gradient_sync: str) -> str:
    return "micro-batch" if gradient_sync == "microbatch" else "step"


def describe_precision(precision: str) -> str:
    """``precision`` as a reader needs it: what computes in which dtype."""
    if precision == "bf16":
        return "bf16 (autocast compute; fp32 master weights, gradients and optimizer state)"
    if precision == "bf16-model":
        return ("bf16-model (the trainers' mixed precision: bf16 weights, activations and compute; fp32 master "
                "weights and gradients)")
    return precision


def fit_advice(result: SimResult, system: System) -> str:
    """One line: which stage overflows, by how much, and what could make the plan fit."""
    worst = max(result.stages, key=lambda s: s.peak_memory_bytes - s.memory_capacity_bytes)
    over = worst.peak_memory_bytes - worst.memory_capacity_bytes
    hints = []
    if worst.static_bytes > worst.memory_capacity_bytes:
        hints.append("more stages (its weights and optimizer state alone do not fit)")
    else:
        if result.checkpoint != "always":
            hints.append("--checkpoint always")
        hints.append("more micro-batches (-M)")
        hints.append("more stages (-K)")
    where = f"device {worst.device} (stage {worst.stage})" if result.replicas > 1 else f"stage {worst.stage}"
    return (f"plan does not fit in memory: {where} needs {gib(worst.peak_memory_bytes)} "
            f"(weights+optimizer {gib(worst.static_bytes)}, activations {gib(worst.peak_activation_bytes)}) "
            f"of {gib(worst.memory_capacity_bytes)} on {system.device.name}, over by {gib(over)}; "
            f"try {', or '.join(hints)}")
