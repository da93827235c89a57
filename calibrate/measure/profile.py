"""Measure every layer of a model on the device it will train on: times per row count, exact bytes.

Times, per layer and micro-batch size (rows), for the three passes the executor runs:
  * ``F``: forward under ``no_grad`` (a re-materialized micro-batch's first forward);
  * ``R``: forward with grad, counting saved tensors through ``saved_tensors_hooks`` as the
    executor's :class:`executor.runtime.memory.ActivationCounter` does (a recompute, or a ``never`` forward);
  * ``B``: backward of that forward from a random output gradient;
  * ``C``: for a layer with an attention core :mod:`executor.runtime.selective` can drop (``--checkpoint
    selective``), what its backward takes beyond ``B`` when the core was dropped in the forward and
    is rerun inside the backward: the median over runs of the two backwards' difference, each run
    timing both back to back (0 for every other layer).
The model's last layer is timed together with the loss, since the last stage computes it. At
``precision`` bf16 every layer runs under autocast and the loss in fp32, as in the executor
(:mod:`executor.runtime.precision`), and each layer is fed the input it gets there (bf16 after a matmul). Each
figure is the median of repeated runs after warm-up runs that are discarded; repetitions continue
until a time budget or a cap is reached, so small layers get many runs and large ones at least a few.
Small micro-batches use the hardware less well, so times are kept per row count (a table), never
scaled linearly from one size; :mod:`sim.formats.costs` interpolates between the measured sizes.
On CPU the table is measured once per thread count, since a K-stage run gives each of its K
processes cores/K threads.

Bytes, per layer and row count, exactly as the executor counts them (distinct storages, weights and
buffers excluded): what the layer saves for backward apart from its input and output storages
(``own_bytes``), whether it saves its input and its output, the sizes of both, and what it saves less
with its attention core dropped (``core_bytes``). These are enough to compute the exact union a stage of
consecutive layers holds (:meth:`sim.formats.costs.MeasuredWorkload.stage_saved_bytes`).

Every (layer, rows) is timed in several rounds, each round bracketed by the speed probe of
:mod:`calibrate.noise.speed`; each round is put at the reference pace and the median over rounds kept.

Limits: layers are timed one at a time, so the pipeline's per-action overheads (seeding, recording,
sends) are fitted later from executor runs; the timings are only as quiet as the machine is, less
the drift the probes see.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from executor.device import device_api
from executor.runtime.boundary import map_tensors, tensors
from executor.runtime.memory import local_tensor, storage_key
from executor.runtime.precision import autocast
from executor.runtime.selective import recompute_attention_core
from executor.runtime.split_backward import PendingWeights, WeightEdges, input_gradients, weight_gradients
from sim.views.progress import phase

# F: forward without grad; R: forward with grad (a recompute); B: the whole backward; C: what dropping
# the attention core adds to the backward (selective); I and W: the backward split as the zero-bubble
# schedules run it (executor.runtime.split_backward), the input gradient then the weight gradients
KINDS = ("F", "R", "B", "C", "I", "W")


@dataclass
class LayerMemory:
    """One layer's saved-for-backward accounting at each profiled row count."""

    name: str
    param_bytes: int
    own_bytes: list[int]  # saved storages other than the layer's input and output, per row count
    input_bytes: list[int]
    output_bytes: list[int]
    saves_input: bool
    saves_output: bool
    # saved bytes the layer's attention core holds, dropped under --checkpoint selective, per row count
    # (empty in a profile from before selective was measured)
    core_bytes: list[int] = field(default_factory=list)


@dataclass
class Profile:
    """Per-layer measurements of one model on one device."""

    rows: list[int]
    # times_s[threads][kind][layer][row index], seconds
    times_s: dict[int, dict[str, list[list[float]]]] = field(default_factory=dict)
    memory: list[LayerMemory] = field(default_factory=list)
    repetitions: dict[int, int] = field(default_factory=dict)  # threads -> total timed runs
    speed_reference_s: dict[int, float] = field(default_factory=dict)  # threads -> reference pace
    # threads -> each round's speed factor, as applied: bounded (calibrate.fit.design_checks)
    speed_factors: dict[int, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "times_s": {str(t): kinds for t, kinds in self.times_s.items()},
            "memory": [vars(m) for m in self.memory],
            "repetitions": {str(t): n for t, n in self.repetitions.items()},
            "speed_reference_s": {str(t): v for t, v in self.speed_reference_s.items()},
            "speed_factors": {str(t): v for t, v in self.speed_factors.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        return cls(rows=list(data["rows"]),
                   times_s={int(t): kinds for t, kinds in data["times_s"].items()},
                   memory=[LayerMemory(**m) for m in data["memory"]],
                   repetitions={int(t): n for t, n in data.get("repetitions", {}).items()},
                   speed_reference_s={int(t): v for t, v in data.get("speed_reference_s", {}).items()},
                   speed_factors={int(t): v for t, v in data.get("speed_factors", {}).items()})


class _SavedSet:
    """Distinct storages saved for backward inside :meth:`hooks`, weights excluded."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.saved: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            ptr, nbytes = storage_key(tensor)
            if ptr and ptr not in self.excluded:
                self.saved[ptr] = nbytes
        # detached (same storage and version counter), as the executor's counter packs: a saved output
        # kept with its own grad_fn is a reference cycle the graph kept from I to W never breaks
        return tensor.detach()

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def _sync(device: torch.device) -> None:
    device_api(device).synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


@dataclass(frozen=True)
class Repeats:
    """How long to time each (layer, rows): warm-up runs dropped, then up to a budget."""

    warmup: int = 2
    min_runs: int = 5
    max_runs: int = 40
    budget_s: float = 0.05  # stop adding runs once this much time was spent timing
    rounds: int = 3  # passes over every (layer, rows), bracketed by speed probes; medians kept
    probe_budget_s: float = 0.05
    split: bool = True  # also time the backward split into I and W (a quick calibration leaves it out)

    @property
    def kinds(self) -> tuple[str, ...]:
        return KINDS if self.split else tuple(k for k in KINDS if k not in ("I", "W"))


class LayerRunner:
    """Runs one layer's F, R and B passes (the loss included for the model's last layer)."""

    def __init__(self, layer: nn.Module, excluded: set[int], loss: Callable | None,
                 target: torch.Tensor | None, device: torch.device, precision: str = "fp32") -> None:
        self.layer = layer
        self.has_core = False  # an attention core --checkpoint selective drops (set from the memory table)
        self.excluded = excluded
        self.loss = loss
        self.target = target
        self.device = device
        self.precision = precision
        self.weights = WeightEdges(list(layer.parameters()))  # the split backward's, found once as a stage does

    def _out(self, x: Any) -> Any:
        with autocast(self.precision, self.device.type):
            y = self.layer(x)
        if self.loss is not None:
            return self.loss(y.float(), self.target) * 0.5  # the executor scales by rows / batch rows
        return y

    def forward(self, x: Any) -> None:
        with torch.no_grad():
            self._out(x)

    def forward_grad(self, x: Any, drop_core: bool = False) -> tuple[Any, Any, _SavedSet]:
        """A forward with grad, counting what it saves; ``drop_core``: as ``--checkpoint selective``
        runs it, the attention core keeping only its inputs."""
        leaf = map_tensors(lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t, x)
        saved = _SavedSet(self.excluded)
        with torch.enable_grad(), saved.hooks(), recompute_attention_core(drop_core):
            out = self._out(leaf)
        return leaf, out, saved

    def backward(self, out: Any, grad: list[torch.Tensor] | None) -> None:
        """Backward from ``out`` (the loss on the last layer), ``grad`` one gradient per tensor of
        ``out`` that requires one."""
        roots = [t for t in tensors(out) if t.requires_grad]
        if roots:
            torch.autograd.backward(roots, None if self.loss is not None else grad)

    def input_gradient(self, leaf: Any, out: Any, grad: list[torch.Tensor] | None) -> PendingWeights | None:
        """I: the gradient of the layer's input alone, as a stage that is not the first computes it
        (the layer's floating-point input needs one); what W needs after (None: nothing to do)."""
        roots = [t for t in tensors(out) if t.requires_grad]
        if not roots:
            return None
        inputs = [t for t in tensors(leaf) if t.requires_grad]
        return input_gradients(roots, None if self.loss is not None else grad, inputs, self.weights)[1]


def time_layer(runner: LayerRunner, x: Any, repeats: Repeats) -> tuple[dict[str, float], int]:
    """Median seconds of each of :data:`KINDS` for one layer on input ``x``, and how many runs were timed."""
    device = runner.device
    samples: dict[str, list[float]] = {kind: [] for kind in repeats.kinds}
    grad = None
    spent = 0.0
    runs = 0
    while runs < repeats.warmup + repeats.max_runs:
        f_s, _ = _timed(lambda: runner.forward(x), device)
        r_s, (leaf, out, _) = _timed(lambda: runner.forward_grad(x), device)
        if grad is None and runner.loss is None:
            grad = [torch.randn_like(t) for t in tensors(out) if t.requires_grad]
        b_s, _ = _timed(lambda: runner.backward(out, grad), device)
        del leaf, out
        i_s = w_s = 0.0
        if repeats.split:
            leaf, out, _ = runner.forward_grad(x)
            i_s, pending = _timed(lambda: runner.input_gradient(leaf, out, grad), device)
            w_s, _ = _timed(lambda: weight_gradients(pending) if pending is not None else None, device)
            del leaf, out, pending
            spent += r_s + i_s + w_s
        c_s = 0.0
        if runner.has_core:
            leaf, out, _ = runner.forward_grad(x, drop_core=True)
            selective_s, _ = _timed(lambda: runner.backward(out, grad), device)
            del leaf, out
            c_s = selective_s - b_s
            spent += selective_s
        runs += 1
        if runs <= repeats.warmup:
            continue
        for kind, value in zip(KINDS, (f_s, r_s, b_s, c_s, i_s, w_s)):
            if kind in samples:
                samples[kind].append(value)
        spent += f_s + r_s + b_s
        if runs - repeats.warmup >= repeats.min_runs and spent >= repeats.budget_s:
            break
    medians = {kind: statistics.median(values) for kind, values in samples.items()}
    medians["C"] = max(0.0, medians["C"])  # a core too small to time against the noise costs nothing
    return medians, runs - repeats.warmup


def layer_inputs(model: nn.Sequential, inputs: Any, precision: str = "fp32") -> list[Any]:
    """The input of every layer for ``inputs`` (each tensor a fresh contiguous storage), by a no-grad
    pass at ``precision``; an input may be a tensor or a tuple or dict of them."""
    xs = []
    x = inputs
    device_type = tensors(inputs)[0].device.type
    with torch.no_grad(), autocast(precision, device_type):
        for layer in model:
            xs.append(map_tensors(lambda t: t.clone().contiguous(), x))
            x = layer(x)
    return xs


def measure_memory(runner: LayerRunner, x: Any, drop_core: bool = False) -> tuple[int, int, int, bool, bool]:
    """(own, input, output bytes, saves input, saves output) of one grad forward on ``x``
    (``drop_core``: with the attention core dropped, as ``--checkpoint selective`` runs it).

    With several tensors in or out, input and output bytes count their distinct storages, and the
    input (output) counts as saved when any of its tensors is; that overstates a stage's saved bytes
    when a layer saves only some of the tensors it passes on.
    """
    _, out, saved = runner.forward_grad(x, drop_core)
    if runner.loss is not None:
        with autocast(runner.precision, runner.device.type):
            y = runner.layer(map_tensors(torch.Tensor.detach, x))
    else:
        y = out
    ins = dict(storage_key(t) for t in tensors(x))
    outs = dict(storage_key(t) for t in tensors(y))
    own = sum(n for ptr, n in saved.saved.items() if ptr not in ins and ptr not in outs)
    return (own, sum(ins.values()), sum(outs.values()), any(p in saved.saved for p in ins),
            any(p in saved.saved for p in outs))


def profile_model(model: nn.Sequential, batch: Callable[[int], tuple[Any, Any]],
                  loss: Callable, rows: list[int], threads: list[int], device: torch.device,
                  repeats: Repeats = Repeats(),
                  progress: Callable[[str], None] | None = None, probe: Any = None,
                  precision: str = "fp32") -> Profile:
    """Time and size every layer of ``model`` at each of ``rows`` and each thread count.

    ``batch(rows)`` returns (inputs, targets) of that many rows; ``loss(output, target)`` is the
    training loss. On CUDA ``threads`` is ignored beyond its first entry. ``probe`` is the
    :class:`calibrate.noise.speed.SpeedProbe` the rounds are bracketed with (default: the fixed block).
    """
    from calibrate.noise.speed import SpeedProbe

    from executor.runtime.batchnorm import DeferredBatchNorm, recomputing

    device_api(device).prepare_process()  # the allocator setting the executor's ranks run with
    model = DeferredBatchNorm.convert(model).to(device)
    model.train()
    excluded = {storage_key(t)[0] for t in list(model.parameters()) + list(model.buffers())}
    last = len(model) - 1
    probe = probe if probe is not None else SpeedProbe.block(device)
    profile = Profile(rows=sorted(set(rows)))
    data = {}
    for r in profile.rows:
        inputs, targets = batch(r)
        to_device = partial(map_tensors, lambda t: t.to(device))
        data[r] = (layer_inputs(model, to_device(inputs), precision), to_device(targets))
    runners = {r: [LayerRunner(layer, excluded, loss if i == last else None,
                               data[r][1] if i == last else None, device, precision)
                   for i, layer in enumerate(model)] for r in profile.rows}
    thread_counts = threads if device.type == "cpu" else threads[:1]
    with recomputing(), phase("profiling layers", total=len(thread_counts) * repeats.rounds * len(model),
                              unit="layer") as bar:  # deferred batch norm must not accumulate while profiling
        profile.memory = _memory_table(model, runners, data, profile.rows)
        for t in thread_counts:
            if device.type == "cpu":
                torch.set_num_threads(t)
            times, profile.repetitions[t], profile.speed_reference_s[t], profile.speed_factors[t] = _time_rounds(
                model, runners, data, profile.rows, repeats, progress, t, probe, bar)
            profile.times_s[t] = pool_identical(times, layer_signatures(model, data, profile.rows))
    return profile


def _time_rounds(model: nn.Sequential, runners: dict[int, list[LayerRunner]], data: dict[int, Any],
                 rows: list[int], repeats: Repeats, progress: Callable[[str], None] | None,
                 threads: int, probe: Any, bar: Any = None) -> tuple[dict, int, float, list[float]]:
    """Every (layer, rows) timed in ``repeats.rounds`` rounds, each bracketed by speed probes.

    Each round's medians are divided by that round's speed factor (:mod:`calibrate.noise.speed`) and the
    table keeps the median over rounds: the profile is at the reference pace (the median probe),
    and a slow moment of the machine touches one round of every layer instead of every round of one.
    A factor is held inside :data:`calibrate.fit.design_checks.SPEED_FACTOR_BOUNDS` (a probe tens of
    times off would otherwise scale a whole round by as much); the factors applied come back last.
    """
    from calibrate.fit.design_checks import SPEED_FACTOR_BOUNDS
    from calibrate.noise.speed import speed_factor

    rounds: list[dict[str, list[list[float]]]] = []
    paces: list[list[float]] = []
    total = 0
    for number in range(repeats.rounds):
        before = probe.measure(repeats.probe_budget_s)
        table: dict[str, list[list[float]]] = {kind: [] for kind in repeats.kinds}
        for i in range(len(model)):
            per_rows: dict[str, list[float]] = {kind: [] for kind in repeats.kinds}
            for r in rows:
                medians, runs = time_layer(runners[r][i], data[r][0][i], repeats)
                total += runs
                for kind in repeats.kinds:
                    per_rows[kind].append(medians[kind])
            for kind in repeats.kinds:
                table[kind].append(per_rows[kind])
            if bar is not None:
                bar.update(1)
        paces.append([before, probe.measure(repeats.probe_budget_s)])
        rounds.append(table)
        if progress is not None:
            progress(f"round {number + 1}/{repeats.rounds}: {len(model)} layers timed at {threads} thread(s)")
    reference = statistics.median(p for pair in paces for p in pair)
    low, high = SPEED_FACTOR_BOUNDS
    factors = [min(max(speed_factor(pair, reference), low), high) for pair in paces]
    merged = {kind: [[statistics.median(table[kind][i][j] / f for table, f in zip(rounds, factors))
                      for j in range(len(rows))] for i in range(len(model))] for kind in repeats.kinds}
    return merged, total, reference, factors


def layer_signatures(model: nn.Sequential, data: dict[int, Any], rows: list[int]) -> list[str]:
    """A key per layer that is equal for layers doing the same work: the module's printed form,
    its parameters' shapes and dtypes, its input's shape and dtype at every row count, and whether
    the loss is timed with it (the last layer)."""
    keys = []
    last = len(model) - 1
    for i, layer in enumerate(model):
        params = [(tuple(p.shape), str(p.dtype)) for p in layer.parameters()]
        inputs = [[(tuple(t.shape), str(t.dtype)) for t in tensors(data[r][0][i])] for r in rows]
        keys.append(repr((repr(layer), params, inputs, i == last)))
    return keys


def pool_identical(times: dict[str, list[list[float]]], signatures: list[str]) -> dict[str, list[list[float]]]:
    """Give layers with the same signature the median of their times, per kind and row count.

    The blocks of a transformer are the same work, yet timed one after another on a shared machine they
    come out apart by more than a stage's busy-time goal
    (docs/notes/2026-11-27-figures-behind-the-code.md); a stage of blocks 1-2 and one of blocks 3-4 would
    then be predicted to differ by that much. Pooling gives every copy the same, better-measured time.
    Limits: two layers that print, hold and take the same yet compute differently (a flag kept as a plain
    attribute that changes the work) would wrongly be pooled.
    """
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(signatures):
        groups.setdefault(key, []).append(i)
    pooled = {kind: [list(row) for row in table] for kind, table in times.items()}
    for members in groups.values():
        if len(members) < 2:
            continue
        for kind, table in times.items():
            columns = len(table[members[0]])
            shared = [statistics.median(table[i][j] for i in members) for j in range(columns)]
            for i in members:
                pooled[kind][i] = list(shared)
    return pooled


def _memory_table(model: nn.Sequential, runners: dict[int, list[LayerRunner]],
                  data: dict[int, Any], rows: list[int]) -> list[LayerMemory]:
    table = []
    for i, layer in enumerate(model):
        own, ins, outs, core, saves_in, saves_out = [], [], [], [], False, False
        for r in rows:
            o, a, b, si, so = measure_memory(runners[r][i], data[r][0][i])
            dropped = measure_memory(runners[r][i], data[r][0][i], drop_core=True)
            if dropped[1:] != (a, b, si, so):
                raise RuntimeError(f"layer {i} ({type(layer).__name__}) saves its input or output differently "
                                   "with its attention core dropped; the profile cannot describe it")
            own.append(o)
            ins.append(a)
            outs.append(b)
            core.append(o - dropped[0])
            saves_in, saves_out = saves_in or si, saves_out or so
        params = sum(local_tensor(p).numel() * p.element_size() for p in layer.parameters())  # this rank's shard
        table.append(LayerMemory(type(layer).__name__, params, own, ins, outs, saves_in, saves_out, core))
        for r in rows:
            runners[r][i].has_core = any(core)
    return table
