"""Published GPU runs replayed: each run's predicted step time against the one its source measured.

Our machines have no GPU, so published measurements of real runs are the GPU truth. A runs file
(``benchmarks/published_runs/dev.json`` is the development set) holds one object per run in a fixed
schema, so that other files can be fed to the same command::

    {"runs": [{"id": "korth-22b-full", "source": "Korthikanti et al. 2022, Table 5",
      "hardware": "a100-nvlink", "nodes": 1, "model": "transformer",
      "options": {"layers": 48, "d_model": 6144, "ff": 24576, "heads": 64, "seq": 2048, "vocab": 51200},
      "tensor_parallel": 8, "pipeline_stages": 1, "replicas": 1, "context_parallel": 1,
      "virtual_stages": null, "microbatch_size": 4, "global_batch": 4, "checkpoint": "full",
      "sequence_parallel": false, "precision": "bf16", "attention": "fused", "compile": null, "zero": null,
      "measured_step_s": 1.42}]}

``model`` is any ``--model`` value and ``options`` its ``--option`` keys. The words mean what the
trainers that ran the published runs mean by them (Megatron-LM, NeMo, torchtitan):

- ``precision``: ``bf16`` is their mixed precision (bf16 weights, activations and compute; fp32 master
  weights and gradient reduction; ``bf16-model`` is a synonym), ``fp8`` Transformer Engine's fp8
  matmuls in it, ``bf16-autocast`` torch's autocast as ``gpipe train`` runs it
  (:mod:`sim.workloads.precision`).
- ``attention`` (optional): ``flash``, ``fused`` (a fused softmax over materialised scores, as
  Megatron-LM's) or ``eager``, for any model with attention (the built-in transformer and the models
  planned by its shape; the transformer's option of the same name may say it instead).
- ``compile`` (optional): true prices torch.compile's fused elementwise regions
  (:func:`sim.workloads.transformer.transformer_layers`), false or null eager kernels.
- ``zero`` (optional): 0, 1 for a distributed optimizer (ZeRO-1), 2 for gradients sharded too with
  parameters kept whole from a unit's forward to its backward (FSDP's ``reshard_after_forward=False``,
  Llama 3 405B's setting), 3 for parameters sharded and gathered again for the backward (FSDP's
  default, ZeRO-3); priced as FSDP2 runs them (:mod:`sim.engine.fsdp`), with expert parallelism the
  routed experts sharded over their expert-data-parallel group (HSDP with it: not modelled).
- ``shard_group`` (optional, with ``zero`` 2 or 3): HSDP, sharded within groups of this many
  replicas and replicated across them; null shards over all replicas.
- ``gradient_sync`` (optional, with ``zero`` 2 or 3): ``step`` where the gradients of a step's
  micro-batches accumulate unsharded and are reduce-scattered once after the last, ``microbatch``
  where each micro-batch's are reduce-scattered after its backward into the sharded gradient; null
  is the trainers' default, ``microbatch`` with one stage (FSDP2, DeepSpeed), ``step`` with a
  pipeline (torch's pipeline schedules); under Megatron-FSDP ``microbatch`` with any K.
- ``use_megatron_fsdp`` (optional): true where the run sharded with Megatron-Core's own FSDP
  (Megatron-FSDP, its ``data_parallel_sharding_strategy`` written as ``zero``), whose gradient
  sync a null ``gradient_sync`` then takes (:mod:`sim.evidence.megatron_fsdp`); false or null:
  FSDP2's and torch's defaults.
- ``expert_parallel``, ``expert_tensor_parallel`` (optional, a mixture of experts): E ranks each MoE
  layer's routed experts are split over and the experts' own TP degree
  (:mod:`sim.workloads.moe.expert_parallel`); null searched (E among the divisors of the experts whose
  E x ETP divides T x C x D, ETP among 1 and T); left out on a model without experts: 1.
- ``moe_capacity_factor`` (optional, a mixture of experts): token dropping at this capacity factor with each
  expert padded to its capacity (Megatron-Core's ``moe_expert_capacity_factor`` with
  ``moe_pad_expert_input_to_capacity``, NeMo's ``MegatronTokenDropCallback``), priced as the model's
  ``capacity_factor`` option; null dropless.
- ``moe_a2a_overlap`` (optional, a mixture of experts): true where the trainer overlaps one micro-batch's
  expert all-to-alls with an adjacent one's compute (Megatron-Core's ``overlap_moe_expert_parallel_comm``),
  priced as DualPipe's overlap (:mod:`sim.workloads.moe.expert_parallel`); null off, the default.
- ``moe_dispatcher`` (optional, a mixture of experts): how the trainer sends tokens to their experts' ranks,
  ``alltoall`` (Megatron-Core's default) or its ``flex`` dispatcher's backends ``flex/deepep`` and
  ``flex/hybridep`` (also ``deepep``, ``hybridep``: one copy of a token per destination node across the
  network), priced as the model's ``dispatcher`` option; null the all-to-all, said in ``assumed``.
- ``cuda_graphs`` (optional, a mixture of experts): true where the trainer captures CUDA graphs, which
  removes the MoE layers' fixed per-pass time (the model's ``cuda_graphs`` option); null or false not.
- ``pipeline_split`` (optional): the transformer layers of each virtual stage as the trainer split them,
  ``"even"`` (Megatron-Core's default) or a list (:mod:`sim.evidence.pipeline_split`); null balanced by
  time as ``gpipe plan`` splits them.

``null`` (or a left-out optional key) means the source does not say. ``attention`` is then flash
on a GPU trainers run it on (eager elsewhere), ``compile`` false, and ``checkpoint``,
``sequence_parallel``, ``virtual_stages``, ``microbatch_size`` and ``zero`` are searched within
the stated layout, the fastest plan that fits memory taken as the trainer would have tuned it
(:mod:`sim.evidence.replay_search`); ``assumed`` names every value chosen. Unknown keys (a note, a
confidence) are ignored. A run the simulator cannot model (a layout more devices than the hardware
has, an option the model does not know) is listed as not modelled, with the reason in one line,
never dropped; a run without a key of the schema refuses the file in one line. ``error`` is
predicted / measured - 1.

``hardware`` is a catalog name or a system object, ``{"base": "h100-nvlink", "memory_gib": 96, ...}``
(:mod:`sim.catalog.user_systems`); an optional ``gpus`` counts the devices the run used where
``nodes`` x devices per node would count more (a partial NVL72 rack), spread evenly over the nodes.

The data-parallel all-reduce is bucketed inside each stage's last backward, as Megatron-LM runs it
(``dp_overlap`` of :func:`sim.engine.engine.simulate`). A device with fractions fitted on the development
set (:mod:`sim.catalog.kernel_model`, ``gpipe fit-gpu``) is timed kernel by kind; any other keeps the
catalog's assumed efficiency, and ``assumed`` says which.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from sim.catalog.kernel_model import KernelEfficiency
from sim.catalog.user_systems import fitted_name, fractions_from, run_system
from sim.errors import GpipeInputError
from sim.formats.timeline import read_json
from sim.workloads.precision import trainers_precision
from sim.workloads.workload import Workload

REQUIRED = ("id", "hardware", "nodes", "model", "options", "tensor_parallel", "pipeline_stages", "replicas",
            "context_parallel", "virtual_stages", "microbatch_size", "global_batch", "checkpoint",
            "sequence_parallel", "precision", "measured_step_s")
# keys a run may leave out, which then mean null
OPTIONAL = ("attention", "compile", "zero", "shard_group", "gradient_sync", "use_megatron_fsdp", "expert_parallel",
            "expert_tensor_parallel", "pipeline_split", "moe_capacity_factor", "moe_a2a_overlap", "moe_dispatcher",
            "cuda_graphs")
# Every run: what the simulator takes that the source's trainer does differently
ALWAYS_ASSUMED = ("data-parallel all-reduce bucketed inside each stage's last backward, as Megatron-LM runs it; "
                  "a distributed optimizer taken as ZeRO-1",)


@dataclass
class Replayed:
    id: str
    modelled: bool
    measured_step_s: float
    predicted_step_s: float | None = None
    error: float | None = None  # predicted / measured - 1
    assumed: list[str] = field(default_factory=list)
    reason: str = ""  # why a run is not modelled
    layout: dict[str, Any] = field(default_factory=dict)  # what was simulated: T, D, K, V, M, partition

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_runs(path: str) -> list[dict[str, Any]]:
    """The runs of a runs file, each with every key of the schema; one line naming what is wrong."""
    data = read_json(path, "runs file", "give a JSON file like benchmarks/published_runs/dev.json")
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise GpipeInputError(f"runs file {path!r} has no \"runs\" list; see benchmarks/published_runs/dev.json")
    for index, run in enumerate(data["runs"]):
        if not isinstance(run, dict):
            raise GpipeInputError(f"run {index} of {path!r} is not an object")
        missing = [key for key in REQUIRED if key not in run]
        if missing:
            raise GpipeInputError(f"run {run.get('id', index)!r} of {path!r} has no {', '.join(missing)}; every run "
                                  f"gives {', '.join(REQUIRED)} (null where the source does not say; "
                                  f"{', '.join(OPTIONAL)} may be left out)")
        if not isinstance(run["options"], dict):
            raise GpipeInputError(f"run {run['id']!r}: options must be an object of the model's options, got "
                                  f"{run['options']!r}")
        if not isinstance(run["measured_step_s"], (int, float)) or run["measured_step_s"] <= 0:
            raise GpipeInputError(f"run {run['id']!r}: measured_step_s must be a positive number of seconds, got "
                                  f"{run['measured_step_s']!r}")
    return data["runs"]


Resolve = Callable[[str, dict[str, Any]], Workload]


def replay(run: dict[str, Any], resolve: Resolve, kernels: dict[str, KernelEfficiency] | None = None) -> Replayed:
    """Predict one run; ``resolve(model, options)`` gives its workload (the composition root
    supplies one that can measure torch models); ``kernels`` (per hardware name) replaces the fitted
    fractions, as ``gpipe fit-gpu`` does while it fits."""
    out = Replayed(run["id"], False, float(run["measured_step_s"]), assumed=list(ALWAYS_ASSUMED))
    try:
        _predict(run, resolve, out, (kernels or {}).get(fitted_name(run["hardware"])))
    except GpipeInputError as exc:
        out.reason = str(exc)
        return out
    out.modelled = True
    out.error = out.predicted_step_s / out.measured_step_s - 1  # type: ignore[operator]
    return out


def _predict(run: dict[str, Any], resolve: Resolve, out: Replayed, kernels: KernelEfficiency | None) -> None:
    from sim.evidence.megatron_fsdp import sync_lines
    from sim.evidence.pipeline_split import split_line
    from sim.evidence.replay_search import (chosen_lines, count_of, expert_lines, expert_options, fastest_fitting,
                                            modelled_experts, space_of)
    from sim.schedules.microbatch import split_rows
    from sim.workloads.tensor_parallel import check_context_parallel, check_tensor_parallel

    # the stated layout; a null degree is 1 (as before nulls were searched: not a field the replay tunes)
    tensor, stages, replicas, context = (count_of(run, key) or 1 for key in (
        "tensor_parallel", "pipeline_stages", "replicas", "context_parallel"))
    batch = count_of(run, "global_batch")
    if batch is None:
        raise GpipeInputError("global_batch null: the replay needs the batch the run trained on")
    system = run_system(run["hardware"], run["nodes"], run.get("gpus"), kernels, f"run {run['id']!r}")
    fitted = system.device.kernels
    out.assumed.append(f"{system.device.name}: kernels timed by kind at the fractions fitted for "
                       f"{fractions_from(run['hardware']) or system.device.name} on the development set"
                       if fitted is not None else
                       f"{system.device.name}: efficiency assumed ({system.device.efficiency:.0%} of peak FLOP/s), "
                       "not fitted")
    workload = resolve(run["model"], _model_options(run, system.device, out))
    shaped = workload.assumed  # a Hugging Face model priced by its structure: what it leaves out
    source = workload.planned_from
    if shaped is not None:
        out.assumed.extend(shaped)
    elif source is not None:
        out.assumed.append(f"{source}: planned by its config's shape as the built-in transformer (its norms, "
                           "biases and positions the built-in's)")
    space = space_of(run, workload, stages, replicas, tensor)
    check_tensor_parallel(tensor, workload, system)
    check_context_parallel(context, workload, system, tensor)
    system.check_fits(stages, replicas, tensor * context)
    experts = modelled_experts(space, expert_options(run, workload, tensor, context, replicas), replicas)
    found = fastest_fitting(workload, system, batch, stages, replicas, tensor, context, space, experts)
    out.assumed += chosen_lines(run, found, batch, stages, replicas, tensor)
    out.assumed += expert_lines(run, workload, found)
    split = split_line(run, stages * found.candidate.virtual_stages)
    if split is not None:
        out.assumed.append(split)
    out.assumed += sync_lines(run, found.candidate.zero)
    if not found.fits:
        peak = max(s.peak_memory_bytes for s in found.result.stages)
        out.assumed.append(f"does not fit the simulated memory ({peak / 2**30:.1f} GiB on the fullest device): "
                           "timed all the same")
    candidate = found.candidate
    out.predicted_step_s = found.result.step_time_s
    out.layout = {"tensor_parallel": tensor, "sequence_parallel": found.sequence_parallel and tensor > 1,
                  "context_parallel": context, "replicas": replicas, "pipeline_stages": stages,
                  "virtual_stages": candidate.virtual_stages, "microbatches": candidate.microbatches,
                  "zero": candidate.zero, **({"shard_group": candidate.shard_group} if candidate.shard_group else {}),
                  **({"gradient_sync": candidate.resolved_gradient_sync} if candidate.zero >= 2 else {}),
                  "microbatch_rows": split_rows(batch // replicas, candidate.microbatches)[0],
                  "checkpoint": candidate.checkpoint, "schedule": candidate.schedule,
                  "partition": list(found.partition),
                  **({"expert_parallel": found.experts[0], "expert_tensor_parallel": found.experts[1]}
                     if workload.has_experts else {})}


def chooses_kernels(model: str) -> bool:
    """Whether ``model`` is priced with an attention kernel and compilation to choose: the built-in
    transformer and the models planned by its shape (named and Hugging Face ones)."""
    from sim.workloads.named_models import is_named

    return model == "transformer" or is_named(model) or model.startswith(("hf:", "hf-config:"))


def _model_options(run: dict[str, Any], device: Any, out: Replayed) -> dict[str, Any]:
    """The run's model options with its precision, attention kernel and compilation as its trainer
    meant them (see the module); what a null took is said in ``out.assumed``."""
    from sim.workloads.moe.config import names_experts

    options = {**run["options"], "precision": trainers_precision(run["precision"])}
    experts = names_experts(str(run["model"]), run["options"])
    capacity = run.get("moe_capacity_factor")
    if capacity is not None:
        if not experts:
            raise GpipeInputError(f"moe_capacity_factor {capacity!r} for {run['model']}, which has no experts; "
                                  "leave it out (or null)")
        given = options.get("capacity_factor")
        if given is not None and given != capacity:
            raise GpipeInputError(f"moe_capacity_factor is {capacity!r} but the options' capacity_factor {given!r}; "
                                  "give one")
        options["capacity_factor"] = capacity  # the MoE pricing's option
    options.update(_dispatcher_option(run, experts, out))
    if run.get("cuda_graphs") and experts:
        options["cuda_graphs"] = True  # the MoE layers' host-side fixed time gone (sim.workloads.moe.options)
    model = run["model"]
    attention = _one_of(run, "attention")
    compiled = _one_of(run, "compile")
    if not chooses_kernels(model):
        if compiled:
            raise GpipeInputError(f"compile is modelled for the built-in transformer and the models planned by its "
                                  f"shape, not {model}")
        if attention is not None:
            out.assumed.append(f"attention {attention} not applied: {model} is priced as its own layers run")
        return options
    if attention is None:
        attention = "flash" if device.flash_attention else "eager"
        out.assumed.append(f"attention null: flash, as trainers run it on {device.name}" if device.flash_attention
                           else f"attention null: eager, {device.name} runs no flash kernel")
    if compiled is None:
        out.assumed.append("compile null: not compiled, every elementwise op's memory traffic counted")
    return {**options, "attention": attention, "compile": False if compiled is None else compiled}


def _dispatcher_option(run: dict[str, Any], experts: bool, out: Replayed) -> dict[str, str]:
    """A mixture of experts' (``experts``) ``moe_dispatcher`` as the model's ``dispatcher`` option (none for a
    dense model)."""
    from sim.workloads.moe.options import DISPATCHERS

    given = run.get("moe_dispatcher")
    if not experts:
        if given is not None:
            raise GpipeInputError(f"moe_dispatcher {given!r} for {run['model']}, which has no experts; leave it out "
                                  "(or null)")
        return {}
    if given is None:
        if (expert_parallel := run.get("expert_parallel")) is None or expert_parallel > 1:
            out.assumed.append("moe_dispatcher null: alltoall, one copy of a token per assignment "
                               "(Megatron-Core's default)")
        return {}
    name = str(given).removeprefix("flex/")
    if name not in DISPATCHERS:
        raise GpipeInputError(f"moe_dispatcher {given!r}; use alltoall, flex/deepep or flex/hybridep (or null)")
    return {"dispatcher": name}


def _one_of(run: dict[str, Any], key: str) -> Any:
    """The run's ``key`` at its top level or among its options; one line if the two disagree."""
    top, inner = run.get(key), run["options"].get(key)
    if top is not None and inner is not None and top != inner:
        raise GpipeInputError(f"{key} is {top!r} at the top of the run but {inner!r} in its options; give one")
    return top if top is not None else inner


def summary(results: list[Replayed]) -> dict[str, Any]:
    """The JSON ``gpipe replay --json`` prints: every run, and the median and worst absolute error
    over the modelled ones (None when none is)."""
    errors = [abs(r.error) for r in results if r.modelled and r.error is not None]
    return {"runs": [r.to_dict() for r in results],
            "median_abs_error": statistics.median(errors) if errors else None,
            "worst_abs_error": max(errors) if errors else None}
