"""Where a run's first weights come from: the user's ``factory()``, seeded per layer, or a file.

Pipelined training must start where the user's own unpipelined training starts, so by default
(``--init factory``) every stage starts from exactly the values ``factory()`` gives after
``torch.manual_seed(--seed)``, bitwise, whatever its modules: constants, GPT-2's normal(0, 0.02), a
zeroed projection, weights loaded inside the factory. ``gpipe train`` (the launcher) builds the real
model once per node, writes every parameter and buffer (non-persistent ones too) to safetensors
files, one per layer with a Hugging Face index (:func:`save_factory_weights`), frees it, and every
worker reads only its own layers through the ``--init-from`` path (:mod:`executor.models.init_from`),
memory-mapped: a worker holds about its own share, the launcher the model once, briefly. The files
live in the run's temporary directory (under ``$TMPDIR``; put it on a disk, not a RAM file system,
for a large model) until the run ends. A model whose bytes (known on the meta device before
anything is allocated) exceed this host's available memory or the temporary directory's free disk
is refused in one line, naming the two ways out:

- ``--init meta``: the model is built on the meta device and each layer takes values from its
  modules' ``reset_parameters()`` seeded by (seed, layer) (:mod:`executor.models.materialize`): no process
  ever holds more than its stage, but the factory's own initialisation is not reproduced, and a
  module without ``reset_parameters()`` is refused.
- ``--init-from PATH``: weights saved beforehand.

In one process (:class:`executor.runtime.pipeline.LocalPipeline`, tests, calibration's profiler) the real
model is built once and each stage copies its layers from it (:class:`FromModel`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections import OrderedDict
from typing import Any, Protocol, Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from executor.models.init_from import INDEX_FILES, WeightFiles, check_file, every_tensor, first_names, load_values
from executor.models.materialize import check_initialisable, initialise_layer, materialise, to_empty
from executor.state.state_file import storage_free
from sim.errors import GpipeInputError

INIT_MODES = ("factory", "meta")
INDEX_FILE = INDEX_FILES[0]
WAYS_OUT = ("use --init meta (each layer from its modules' reset_parameters(), seeded per layer; no process "
            "holds more than its stage) or --init-from PATH (weights saved beforehand)")


def check_init(init: str) -> str:
    if init not in INIT_MODES:
        raise GpipeInputError(f"unknown --init {init!r}; choose factory (the values factory() gives, the default) "
                              "or meta (seeded per layer from reset_parameters())")
    return init


def indexed(model: nn.Sequential) -> nn.Sequential:
    """The same layers keyed "0", "1", ...: the names stages and weight files use (a factory may key
    its ``nn.Sequential`` otherwise)."""
    return nn.Sequential(*model)


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (shared ones once); exact on the meta device too."""
    return sum(tensor.numel() * tensor.element_size() for _, tensor, _ in every_tensor(model))


def available_memory_bytes() -> int:
    """Memory this host can give a new allocation without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB"


def check_buildable(meta: nn.Sequential, model: str, directory: str | None = None) -> None:
    """Refuse, in one line, a model this host cannot build whole in memory, or (``directory``) write there."""
    needed = model_bytes(meta)
    available = available_memory_bytes()
    if needed > available:
        raise GpipeInputError(f"building {model} whole to start from factory()'s values needs {_gib(needed)} but "
                              f"this host has {_gib(available)} available; {WAYS_OUT}")
    free = shutil.disk_usage(directory).free if directory else needed
    if needed > free:
        raise GpipeInputError(f"writing {model}'s initial weights needs {_gib(needed)} but {directory} has "
                              f"{_gib(free)} free; point TMPDIR at a larger disk, or {WAYS_OUT}")


def write_layers(model: nn.Sequential, directory: str) -> str:
    """Every parameter and buffer of ``model`` into ``directory``: a safetensors file per layer
    holding the tensors it is first to hold, named ``{layer}.{name in layer}``, and the index a
    Hugging Face folder has (:func:`executor.models.init_from.WeightFiles` reads it). Returns ``directory``."""
    os.makedirs(directory, exist_ok=True)
    weight_map: dict[str, str] = {}
    written: set[int] = set()
    for index, layer in enumerate(model):
        tensors = {}
        for name, tensor, _ in every_tensor(layer):
            if id(tensor) not in written:
                written.add(id(tensor))
                tensors[f"{index}.{name}"] = tensor
        if not tensors:
            continue
        file = f"layer-{index:05d}.safetensors"
        save_file(storage_free(tensors), os.path.join(directory, file))
        weight_map.update(dict.fromkeys(tensors, file))
    with open(os.path.join(directory, INDEX_FILE), "w") as handle:
        json.dump({"metadata": {"total_size": model_bytes(model), "layers": len(model)},
                   "weight_map": weight_map}, handle)
    return directory


def save_factory_weights(name: str, options: dict[str, Any], seed: int, meta: nn.Sequential,
                         directory: str) -> str:
    """Build ``factory()`` once (after a size check), write its values to ``directory``, free it."""
    from executor.models.build import build_model

    check_buildable(meta, name, os.path.dirname(os.path.abspath(directory)))
    return write_layers(indexed(build_model(name, options, seed)), directory)  # the model is freed on return


class WeightSource(Protocol):
    def layers(self, meta: nn.Sequential, indices: Sequence[int]) -> list[nn.Module]:
        """Real copies of layers ``indices`` of the meta model, with their first values."""


class FromModel:
    """Copies of a real model's layers (``factory()`` built in this process)."""

    def __init__(self, model: nn.Sequential) -> None:
        self.model = model

    def layers(self, meta: nn.Sequential, indices: Sequence[int]) -> list[nn.Module]:
        return copy.deepcopy([self.model[i] for i in indices])  # one memo: sharing inside the set is kept


class Seeded:
    """``--init meta``: each layer from its modules' ``reset_parameters()``, seeded by (seed, layer)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def layers(self, meta: nn.Sequential, indices: Sequence[int]) -> list[nn.Module]:
        return materialise(meta, indices, self.seed)


class FromFile:
    """Values read from weight files (``--init-from``, or the launcher's :func:`save_factory_weights`);
    a layer holding a non-persistent buffer the files lack is first initialised as ``--init meta``
    does, then overwritten with every value the files hold."""

    def __init__(self, path: str, meta: nn.Sequential, seed: int, rename=None) -> None:
        self.files = WeightFiles(path)
        self.seed, self.rename = seed, rename
        whole = indexed(meta)
        self.first_name = first_names(whole)
        self.reset_layers = {int(name.split(".", 1)[0]) for name, _, persistent in every_tensor(whole)
                             if not persistent and (rename(name) if rename else name) not in self.files}

    def layers(self, meta: nn.Sequential, indices: Sequence[int]) -> list[nn.Module]:
        layers = copy.deepcopy([meta[i] for i in indices])
        to_empty(layers, torch.device("cpu"))
        for index, layer in zip(indices, layers):
            if index in self.reset_layers:
                initialise_layer(layer, index, self.seed)
        module = nn.Sequential(OrderedDict((str(i), layer) for i, layer in zip(indices, layers)))
        load_values(self.files, module, self.first_name, self.rename)
        return layers


def check_source(meta: nn.Sequential, init: str, init_from: str, rename=None) -> None:
    """Before anything runs, one line for a source that cannot give every tensor a value: a file
    lacking a tensor or a shape (:func:`check_file`), a non-persistent buffer neither the file nor a
    ``reset_parameters()`` sets, or ``--init meta`` on a module without ``reset_parameters()``."""
    if init_from:
        absent = check_file(init_from, indexed(meta), rename)
        if absent:
            named = dict(indexed(meta).named_buffers(remove_duplicate=False))
            check_initialisable(meta, only={id(named[name]) for name in absent},
                                why=f"(a non-persistent buffer --init-from {init_from!r} does not hold)")
    elif init == "meta":
        check_initialisable(meta, why="under --init meta",
                            alternative=", or drop --init meta to start from factory()'s values")


def weight_source(config: Any, meta: nn.Sequential, rename=None) -> WeightSource:
    """Where ``config``'s run takes its first weights from, in this process: the user's file, the
    launcher's file of ``factory()``'s values, seeded per layer, or ``factory()`` built here."""
    if config.init_from:
        return FromFile(config.init_from, meta, config.seed, rename)
    if config.factory_weights:
        return FromFile(config.factory_weights, meta, config.seed)
    if config.init == "meta":
        return Seeded(config.seed)
    from executor.models.build import build_model

    check_buildable(meta, config.model)
    return FromModel(indexed(build_model(config.model, config.options, config.seed)))
