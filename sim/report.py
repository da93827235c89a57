"""Human-readable summaries of simulation results and advice when a plan does not fit."""

from __future__ import annotations

import math

from sim.engine import SimResult
from sim.hardware import System

GIB = 1 << 30


def gib(nbytes: float) -> str:
    return "unlimited" if math.isinf(nbytes) else f"{nbytes / GIB:.2f} GiB"


def format_summary(result: SimResult, system: System, precision: str) -> str:
    lines = [
        f"system       {system.name} x{system.nodes} node(s), device {system.device.name}",
        f"precision    {describe_precision(precision)}",
        f"partition    {','.join(map(str, result.partition))} layers per stage",
        f"micro-batch  {result.microbatches} of {result.microbatch_rows[0]} rows "
        f"(batch {result.batch_size}), {result.schedule}, checkpoint {result.checkpoint}",
        f"step time    {result.step_time_s * 1e3:.3f} ms",
        f"bubble       {result.bubble_fraction:.1%}",
        f"throughput   {result.throughput_samples_per_s:.2f} samples/s",
        "stage  layers  busy ms   activations   peak memory   capacity   fits",
    ]
    for s in result.stages:
        lines.append(f"{s.stage:>5}  {s.layers:>6}  {s.busy_s * 1e3:>7.3f}   {gib(s.peak_activation_bytes):>11}"
                     f"   {gib(s.peak_memory_bytes):>11}   {gib(s.memory_capacity_bytes):>9}   "
                     f"{'yes' if s.fits else 'NO'}")
    return "\n".join(lines)


def describe_precision(precision: str) -> str:
    """``precision`` as a reader needs it: what computes in which dtype."""
    if precision == "bf16":
        return "bf16 (autocast compute; fp32 master weights, gradients and optimizer state)"
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
    return (f"plan does not fit in memory: stage {worst.stage} needs {gib(worst.peak_memory_bytes)} "
            f"(weights+optimizer {gib(worst.static_bytes)}, activations {gib(worst.peak_activation_bytes)}) "
            f"of {gib(worst.memory_capacity_bytes)} on {system.device.name}, over by {gib(over)}; "
            f"try {', or '.join(hints)}")
