"""Training state on disk: one shard per stage plus a manifest, each written atomically.

Layout under ``--checkpoint-dir``::

    step-000012/stage-0.safetensors ... stage-{K-1}.safetensors  # layers, optimizer, lr schedule, RNG
    manifest.json                                                 # {"step": 12, "stages": K, ...}

A shard is a safetensors file with the non-tensor state as JSON in its metadata
(:mod:`executor.state.state_file`): reading a checkpoint runs no code, and a shard that is not such a file
(a pickle put in its place) is refused in one line, by ``gpipe train --resume`` before any worker
starts.

Every file is written to a temporary name and renamed (``os.replace``), and the manifest is written
last, by rank 0, after every rank has finished its shard (a barrier). A kill at any moment leaves
either the previous manifest, which names a complete older step directory, or the new one: never a
half-written checkpoint. Older step directories are removed only after the new manifest is in
place. Data and dropout are pure functions of (seed, step), so the step number is the data position.

A shard holds the optimizer's state (adam's moments, step counts, the current learning rate) and the
schedule's position, so a resumed run takes the same steps. Resuming with other optimizer or schedule
settings than the checkpoint's would not (torch.optim would keep the checkpoint's rate and decay and
silently ignore the new ones): :func:`check_resumable` refuses it with one line.

With D data-parallel replicas the replicas hold the same values, so replica 0 of each stage writes
the stage's shard and every replica loads it; with ``--zero 1`` the shard holds the optimizer state
consolidated from the whole data-parallel group (:mod:`executor.parallel.replicas`). A resume with another
``--replicas`` or ``--zero`` is refused with one line: a consolidated ZeRO state is not a plain
optimizer's, and D changes the run's dropout draws, so neither would continue the same run exactly.
With ``--zero 2`` or ``3`` (:mod:`executor.parallel.fully_sharded`) every replica gathers its stage's
parameters and optimizer state from the shards and replica 0 writes them whole, a plain optimizer's
state in the model's own layout (with T > 1 gathered over the stage's D x T ranks): such a checkpoint
resumes at any D, ZeRO stage (0-3), K and T, and a plain (ZeRO-0) one resumes under ZeRO-2/3 at any D; the losses continue the uninterrupted run's to
float rounding (exactly the same draws only for a model without dropout).

With expert parallelism (:mod:`executor.parallel.expert_parallel`) a shard also holds every expert of its
stage, gathered from the E ranks of replica 0's expert group, the optimizer's state in the unsharded
model's order: it resumes at any E, or without expert parallelism, and each rank of a run under it takes
its own experts by name (:func:`repartitioned_state`), or its rows of a Hugging Face block's 3-D
expert tensors (:func:`executor.parallel.hf_experts.local_state`). Under ``--zero 1`` the experts'
optimizer state is first consolidated over their own replicas, the rest over all D
(:mod:`executor.parallel.expert_zero`): such a shard is a consolidated ZeRO-1 one, resumed at the same D
and partition, at any E.

With T tensor-parallel ranks per stage (:mod:`executor.parallel.tensor_parallel`) a shard still holds the
whole stage in the model's own layout: its T ranks gather their parts, rank 0 writes. So a run
saved at one T resumes at any other that divides the heads and FFN width (or at T = 1).

A run also resumes under another partition: another K, another number of virtual stages, another
split of the layers. Shards key every tensor by the model's own names (a stage's layers keep their
index in the whole model) and list, for each optimizer index, the names of its parameter, so a new
stage takes each layer's tensors from the shard that held the layer and each parameter's optimizer
state by name (:func:`repartitioned_state`); a parameter tied across stages has the same state on
every stage that holds it. What is guaranteed: at the same layout (partition, T) the continued
losses equal the uninterrupted run's exactly; under another partition or T the values and the
optimizer state are the same, and the losses equal the uninterrupted run's to float rounding
(gradient sums of tied parameters and of row-parallel shards add in another order).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from executor.device import device_api
from executor.models.loaded_types import is_sharded
from executor.parallel import hf_experts
from executor.parallel.expert_parallel import full_stage_state
from executor.runtime.stage import PipelineStage
from executor.state import state_file
from sim.errors import GpipeInputError
from sim.formats.timeline import write_json_atomic

MANIFEST = "manifest.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def save_shard(root: str, step: int, stage: PipelineStage, write: bool = True) -> None:
    """Write ``stage``'s state after completing ``step`` (0-based) to its shard, atomically.

    A tensor-parallel stage's state is gathered from its T ranks first, in the model's own layout
    (:mod:`executor.parallel.tensor_parallel`): every one of them calls this, one (``write``) writes it."""
    sharded = is_sharded(stage.module.parameters())
    if sharded:
        from executor.parallel import tensor_parallel

        module_state = tensor_parallel.full_state_dict(stage.module)
        optimizer_state = (tensor_parallel.full_optimizer_state(stage.module, stage.optimizer)
                           if stage.optimizer is not None else None)
    else:
        module_state = stage.module.state_dict()
        optimizer_state = stage.optimizer.state_dict() if stage.optimizer is not None else None
    # each optimizer index's parameter by its names in the model (several when tied in the stage),
    # so another partition's stages can find their parameters' state (:func:`load_shard`)
    names = param_names(stage.module, stage.optimizer) if stage.optimizer is not None else []
    # with expert parallelism, every expert gathered from the stage's expert group
    module_state, optimizer_state, names = full_stage_state(stage.module, module_state, optimizer_state, names)
    if not write:
        return
    directory = step_dir(root, step)
    os.makedirs(directory, exist_ok=True)
    state: dict[str, Any] = {
        "module": module_state,
        "optimizer": optimizer_state,
        "param_names": names,
        "scheduler": stage.scheduler.state_dict() if stage.scheduler is not None else None,
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": device_api(stage.device).all_rng_states(),  # the accelerator's generators (None on CPU)
    }
    state_file.save(shard_path(directory, stage.config.stage), state)


def shard_path(directory: str, stage: int) -> str:
    return os.path.join(directory, f"stage-{stage}.safetensors")


def check_shards(root: str, manifest: dict[str, Any]) -> None:
    """Every shard the manifest names is a state file (headers only); else one line naming it."""
    for stage in range(manifest["stages"]):
        state_file.check(shard_path(os.path.join(root, manifest["dir"]), stage))


def write_manifest(root: str, step: int, stages: int, losses: list[float], config: dict[str, Any],
                   grad_norms: list[float] | None = None) -> None:
    """Publish ``step`` as the latest checkpoint, then drop older step directories.

    Called by one rank (the last stage, which holds the losses and gradient norms so far) after a
    barrier that follows every rank's :func:`save_shard`.
    """
    write_json_atomic(os.path.join(root, MANIFEST), {
        "step": step, "stages": stages, "replicas": config.get("replicas", 1),
        "dir": os.path.basename(step_dir(root, step)),
        "losses": losses, "grad_norms": grad_norms or [], "config": config,
    })
    for name in os.listdir(root):
        if name.startswith("step-") and name[5:].isdigit() and int(name[5:]) < step:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_manifest(root: str) -> dict[str, Any] | None:
    path = os.path.join(root, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def param_names(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """For each parameter of ``optimizer`` in its state's index order, its names in ``module`` (the
    model's own names: a stage's layers are keyed by their index in the whole model)."""
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [names.get(id(p), []) for group in optimizer.param_groups for p in group["params"]]


def load_shard(root: str, manifest: dict[str, Any], stage: PipelineStage) -> None:
    """Restore ``stage`` from the checkpoint the manifest names: its own shard when the checkpoint's
    stage of the same index holds the same layers, else assembled from the shards that hold them
    (:func:`repartitioned_state`)."""
    directory = os.path.join(root, manifest["dir"])
    state = None
    if manifest["stages"] == stage.config.stages:
        state = state_file.load(shard_path(directory, stage.config.stage), stage.device)
        if set(state["module"]) != set(stage.module.state_dict()):
            state = None
    if state is None:
        state = repartitioned_state(directory, manifest, stage)
    # Hugging Face experts under expert parallelism: this rank's rows of the whole tensors saved
    names = param_names(stage.module, stage.optimizer) if stage.optimizer is not None else []
    state = hf_experts.local_state(stage.module, state, names)
    if is_sharded(stage.module.parameters()):  # the shard holds the whole stage: take this rank's part
        from executor.parallel import tensor_parallel

        tensor_parallel.load_full_state_dict(stage.module, state["module"])
        if stage.optimizer is not None and state["optimizer"] is not None:
            tensor_parallel.load_full_optimizer_state(stage.module, stage.optimizer, state["optimizer"])
    else:
        stage.module.load_state_dict(state["module"])
        if stage.optimizer is not None and state["optimizer"] is not None:
            stage.optimizer.load_state_dict(state["optimizer"])
    if stage.scheduler is not None and state.get("scheduler") is not None:
        stage.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["cpu_rng"])
    device_api(stage.device).set_all_rng_states(state.get("cuda_rng"))


def repartitioned_state(directory: str, manifest: dict[str, Any], stage: PipelineStage) -> dict[str, Any]:
    """``stage``'s state taken from a checkpoint of another partition (another K, V or split of the
    layers): each tensor of its layers from the shard that held that layer, each parameter's
    optimizer state by the parameter's names, the schedule's position from the first shard read.
    Refused in one line for a checkpoint whose shards do not name their parameters."""
    from sim.engine.stage_costs import stage_bounds

    wanted = list(stage.module.state_dict())
    layers = {int(key.split(".", 1)[0]) for key in wanted}
    saved = manifest.get("config", {}).get("partition")
    if not saved or len(saved) != manifest["stages"]:
        raise GpipeInputError(f"checkpoint in {directory!r} does not record its partition; resume with its own plan "
                              "or use a new --checkpoint-dir")
    sources = [state_file.load(shard_path(directory, j), stage.device)
               for j, (first, end) in enumerate(stage_bounds(saved)) if any(first <= i < end for i in layers)]
    module: dict[str, torch.Tensor] = {}
    for key in wanted:
        found = next((source["module"][key] for source in sources if key in source["module"]), None)
        if found is None:
            raise GpipeInputError(f"checkpoint in {directory!r} has no {key!r} for stage {stage.config.stage}; it "
                                  "was saved for another model: use a new --checkpoint-dir")
        module[key] = found
    state: dict[str, Any] = {"module": module, "optimizer": None, "scheduler": sources[0].get("scheduler"),
                             "cpu_rng": sources[0]["cpu_rng"], "cuda_rng": sources[0].get("cuda_rng")}
    if stage.optimizer is not None and sources[0].get("optimizer") is not None:
        by_name: dict[str, Any] = {}
        for source in sources:
            if "param_names" not in source:
                raise GpipeInputError(f"checkpoint in {directory!r} was saved with {manifest['stages']} stages by a "
                                      "gpipe that did not name the optimizer's parameters; resume with its own plan")
            for index, names in enumerate(source["param_names"]):
                for name in names:
                    by_name.setdefault(name, source["optimizer"]["state"].get(index))
        entries = {}
        for index, names in enumerate(param_names(stage.module, stage.optimizer)):
            entry = next((by_name[name] for name in names if by_name.get(name) is not None), None)
            if entry is not None:
                entries[index] = entry
        groups = [dict(group, params=list(range(len(stage.params)))) for group in sources[0]["optimizer"]["param_groups"]]
        state["optimizer"] = {"state": entries, "param_groups": groups}
    return state


# Settings whose state lives in a shard: a resumed run must use the checkpoint's.
OPTIMIZER_SETTINGS = {"optimizer": "--optimizer", "lr": "--lr", "weight_decay": "--weight-decay",
                      "lr_schedule": "--lr-schedule", "lr_warmup_steps": "--lr-warmup"}
# How the run is laid out over replicas: the shards are written for these (executor.parallel.replicas).
REPLICA_SETTINGS = {"replicas": "--replicas", "zero": "--zero"}


def resharded_freely(saved_zero: int, zero: int) -> bool:
    """Whether a checkpoint saved at ``saved_zero`` resumes at ``zero`` under any D: a ZeRO-2/3
    shard holds the stage's whole state, gathered from the shards (a plain optimizer's), which any
    replica count and ZeRO stage loads; a ZeRO-1 one holds a consolidated state for its own D."""
    return (saved_zero >= 2 and zero in (0, 1, 2, 3)) or (zero >= 2 and saved_zero == 0)


def check_resumable(manifest: dict[str, Any], config: dict[str, Any]) -> None:
    """Raise GpipeInputError naming the first optimizer, schedule or replica setting that differs from
    the checkpoint's (and ``--steps``, over which a cosine schedule decays), or another partition
    under ``--zero 1``."""
    saved = manifest.get("config", {})
    names = dict(OPTIMIZER_SETTINGS)
    if not resharded_freely(saved.get("zero", 0), config.get("zero", 0)):
        names.update(REPLICA_SETTINGS)
    if config.get("lr_schedule") == "cosine":
        names["steps"] = "--steps"
    for key, flag in names.items():
        if key in saved and saved[key] != config.get(key):
            raise GpipeInputError(f"the checkpoint was trained with {flag} {saved[key]} but this run asks for "
                                  f"{config.get(key)}; resume with {flag} {saved[key]} or use a new --checkpoint-dir")
    if saved.get("zero") == 1 and "partition" in saved and list(saved["partition"]) != list(config.get("partition") or []):
        raise GpipeInputError(f"the checkpoint was saved with --zero 1 on partition {list(saved['partition'])}, not "
                              f"{list(config.get('partition') or [])}; a consolidated ZeRO state resumes only on its own "
                              "partition: resume with it or use a new --checkpoint-dir")
