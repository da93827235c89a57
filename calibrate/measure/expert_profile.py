"""The routed experts of every mixture-of-experts layer timed apart, per routed assignment, and fitted.

The layer profile (:mod:`calibrate.measure.profile`) times each block whole, router, routed and shared
experts together, as one process runs it. Expert parallelism (``--expert-parallel E``,
:mod:`executor.parallel.expert_exchange`) changes only part of that block on each rank:

- the routed experts: a rank runs its n/E experts over the assignments every rank of its group sends
  them, one call per (source rank, expert), so each call has the rows one process's call would have and
  a rank's mean work equals its own tokens x top_k assignments; what E adds is the most loaded rank's
  excess over that mean, which the others wait for at the combine;
- their weights, gradients and optimizer state, divided by E;
- the all-to-alls (priced from the costs file's ``expert_parallel`` entry, :mod:`calibrate.measure.ep_collectives`).

The router, the attention, the norms and the shared experts run as in one process. So this module
measures what the simulator needs to price the part E changes: each MoE layer's routed experts alone
(:meth:`executor.models.moe.MixtureOfExperts.routed`, the loop one process runs) on the tokens and routing
the block gives them, forward without grad (``F``), with grad (``R``) and its backward (``B``), per profiled
row count and thread count, at the run's precision; and a line per kind through those points in the
assignments routed (tokens x top_k): ``seconds = per_assignment_s x assignments + fixed_s``, fitted by
least squares on relative residuals (:func:`calibrate.fit.least_squares.fit_affine`). The simulator
prices a rank's excess as ``(load - 1) x per_assignment_s x assignments``
(:class:`sim.formats.measured_workload.MeasuredWorkload`). Each layer's routed experts' parameter bytes
are counted too: what E divides.

It lands in the costs file as ``experts``: ``{"layers": {index: {"param_bytes", "assignments",
"times_s": {threads: {kind: [per row count]}}, "fit": {threads: {kind: {"per_assignment_s", "fixed_s",
"worst_relative"}}}}}}``.

Limits: timed alone, after the block's own timing, without the speed probes that bracket the
profile's rounds; the routing is the one the block's router gives the profiled batch (a balanced
router's, at initialisation), so a slope fitted on it carries over to other routings only as far as a
call's time is linear in its rows.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
from torch import nn

from calibrate.measure.profile import Repeats, _timed, layer_inputs
from executor.models.moe import MixtureOfExperts
from executor.runtime.boundary import map_tensors
from executor.runtime.precision import autocast

ROUTED_KINDS = ("F", "R", "B")


def mixture_of(layer: nn.Module) -> MixtureOfExperts | None:
    """The layer's mixture-of-experts MLP, or None for a layer without one."""
    return next((m for m in layer.modules() if isinstance(m, MixtureOfExperts)), None)


def routed_param_bytes(moe: MixtureOfExperts) -> int:
    """The bytes of every routed expert's parameters (what expert parallelism divides by E)."""
    return sum(p.numel() * p.element_size() for p in moe.experts.parameters())


def routed_inputs(layer: nn.Module, moe: MixtureOfExperts, x: Any, device: torch.device,
                  precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, router weights, chosen experts) the layer's mixture gets for input ``x``, by a no-grad
    pass of the layer with a hook on the mixture's input, at ``precision``."""
    seen: list[torch.Tensor] = []
    handle = moe.register_forward_pre_hook(lambda _module, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad(), autocast(precision, device.type):
            layer(x)
            tokens = seen[0].reshape(-1, seen[0].shape[-1])
            weights, chosen, _ = moe.route(tokens)
    finally:
        handle.remove()
    return tokens, weights, chosen


def time_routed(moe: MixtureOfExperts, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                device: torch.device, precision: str, repeats: Repeats) -> dict[str, float]:
    """Median seconds of the routed experts' forward without grad, with grad, and backward, on ``tokens``
    routed as ``weights`` and ``chosen`` say; warm-up runs dropped, runs added up to the budget."""
    samples: dict[str, list[float]] = {kind: [] for kind in ROUTED_KINDS}
    grad = None
    spent, runs = 0.0, 0

    def with_grad() -> torch.Tensor:  # the tokens' and the router weights' gradients too, as in the block
        leaf, scores = tokens.detach().requires_grad_(True), weights.detach().requires_grad_(True)
        with torch.enable_grad(), autocast(precision, device.type):
            return moe.routed(leaf, scores, chosen)

    while runs < repeats.warmup + repeats.max_runs:
        with torch.no_grad(), autocast(precision, device.type):
            f_s, _ = _timed(lambda: moe.routed(tokens, weights, chosen), device)
        r_s, out = _timed(with_grad, device)
        if grad is None:
            grad = torch.randn_like(out)
        b_s, _ = _timed(lambda: out.backward(grad), device)
        del out
        runs += 1
        if runs <= repeats.warmup:
            continue
        for kind, value in zip(ROUTED_KINDS, (f_s, r_s, b_s)):
            samples[kind].append(value)
        spent += f_s + r_s + b_s
        if runs - repeats.warmup >= repeats.min_runs and spent >= repeats.budget_s:
            break
    moe.zero_grad(set_to_none=True)
    return {kind: statistics.median(values) for kind, values in samples.items()}


def fit_routed(assignments: list[int], seconds: list[float]) -> dict[str, float]:
    """The line ``seconds = per_assignment_s x assignments + fixed_s`` (both at least 0) through one
    kind's points, with its worst relative residual."""
    from calibrate.fit.least_squares import fit_affine

    line = fit_affine(assignments, [max(s, 1e-9) for s in seconds], slope_bounds=(0.0, float("inf")),
                      intercept_bounds=(0.0, float("inf")))
    return {"per_assignment_s": line.slope, "fixed_s": line.intercept, "worst_relative": line.worst_relative}


def profile_experts(model: nn.Sequential, batch: Callable[[int], tuple[Any, Any]], rows: list[int],
                    threads: list[int], device: torch.device, repeats: Repeats = Repeats(),
                    precision: str = "fp32") -> dict[str, Any] | None:
    """The costs file's ``experts`` entry for ``model`` (module docstring); None for a model without experts.

    ``batch(rows)`` gives (inputs, targets) as for :func:`calibrate.measure.profile.profile_model`; on CUDA
    ``threads`` is ignored beyond its first entry."""
    mixtures = {i: moe for i, layer in enumerate(model) if (moe := mixture_of(layer)) is not None}
    if not mixtures:
        return None
    model = model.to(device)
    model.train()
    inputs = {}
    for r in rows:
        x, _ = batch(r)
        inputs[r] = layer_inputs(model, map_tensors(lambda t: t.to(device), x), precision)
    thread_counts = threads if device.type == "cpu" else threads[:1]
    entry: dict[str, Any] = {}
    for i, moe in mixtures.items():
        routed = [routed_inputs(model[i], moe, inputs[r][i], device, precision) for r in rows]
        assignments = [int(chosen.numel()) for _, _, chosen in routed]
        times: dict[str, dict[str, list[float]]] = {}
        fits: dict[str, dict[str, dict[str, float]]] = {}
        for t in thread_counts:
            if device.type == "cpu":
                torch.set_num_threads(t)
            points = [time_routed(moe, *args, device, precision, repeats) for args in routed]
            times[str(t)] = {kind: [p[kind] for p in points] for kind in ROUTED_KINDS}
            fits[str(t)] = {kind: fit_routed(assignments, times[str(t)][kind]) for kind in ROUTED_KINDS}
        entry[str(i)] = {"param_bytes": routed_param_bytes(moe), "assignments": assignments, "times_s": times,
                         "fit": fits}
    return {"layers": entry, "rows": list(rows)}
