"""``--init-from PATH``: start from saved weights, each process reading only its own stage's tensors.

PATH is a safetensors file, a state dict saved with ``torch.save`` (``.pt``, ``.pth``, ``.bin``), or a
folder holding either (a Hugging Face model folder: ``model.safetensors``, sharded
``model.safetensors.index.json``, or ``pytorch_model.bin``). safetensors files are read through the
``safetensors`` library and ``torch.save`` files with ``weights_only=True``, both memory-mapped, so a
stage touches only the bytes of the tensors it holds and no file can run code.

Names are the model's own (``"3.attn.qkv.weight"`` for layer 3 of an ``nn.Sequential``) unless the
model supplies a ``rename`` from its names to the file's (Hugging Face models do). A tensor several
layers share is read once, under the name of the first layer holding it; files that store it once
(tied embeddings in Hugging Face checkpoints) need nothing more. Before anything trains,
:func:`check_file` compares every name and shape with the model (on the meta device) and names the
first missing or mis-shaped tensor in one line. Values are converted to the tensor's dtype.

Non-persistent buffers (rotary tables, masks: not in a state dict) are read when the file has them
(the files ``gpipe train`` writes of ``factory()``'s values do, :mod:`executor.models.initial_weights`);
otherwise the module holding one must set it in ``reset_parameters()``, run seeded per layer as
``--init meta`` runs it, before the file's values are copied in.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from sim.errors import GpipeInputError

Rename = Callable[[str], str]
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _files(path: str) -> list[str]:
    """The weight files PATH stands for."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise GpipeInputError(f"--init-from {path!r} does not exist; give a state dict, a safetensors file or "
                              "a model folder")
    for index in INDEX_FILES:
        index_path = os.path.join(path, index)
        if os.path.exists(index_path):
            with open(index_path) as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
            return [os.path.join(path, shard) for shard in shards]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if os.path.exists(os.path.join(path, single)):
            return [os.path.join(path, single)]
    raise GpipeInputError(f"--init-from {path!r} holds no model.safetensors, model.safetensors.index.json or "
                          "pytorch_model.bin; point it at the weights file itself")


class _Safetensors:
    """One safetensors file, memory-mapped by the safetensors library."""

    def __init__(self, path: str) -> None:
        try:
            self.file = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise GpipeInputError(f"--init-from {path!r} is not a safetensors file ({exc})") from None
        self.names = set(self.file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.file.get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self.file.get_tensor(name)


class _TorchFile:
    """One ``torch.save`` state dict, loaded memory-mapped with ``weights_only`` (tensors are read
    when touched; a pickled object is refused)."""

    def __init__(self, path: str) -> None:
        try:
            self.state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise GpipeInputError(f"--init-from {path!r} is not a state dict torch can load with weights_only "
                                  f"({str(exc).strip().splitlines()[0]})") from None
        if not isinstance(self.state, dict):
            raise GpipeInputError(f"--init-from {path!r} holds a {type(self.state).__name__}, not a state dict")
        self.names = set(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def tensor(self, name: str) -> torch.Tensor:
        return self.state[name]


class WeightFiles:
    """Every file PATH stands for, looked up by tensor name."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = [_Safetensors(file) if file.endswith(".safetensors") else _TorchFile(file)
                      for file in _files(path)]

    def find(self, name: str) -> "_Safetensors | _TorchFile | None":
        return next((file for file in self.files if name in file.names), None)

    def __contains__(self, name: str) -> bool:
        return self.find(name) is not None


def every_tensor(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(first name, tensor, in the state dict) of every parameter and buffer of ``module``, shared
    ones once; non-persistent buffers have ``False``."""
    persistent = set(module.state_dict(keep_vars=True))
    seen: set[int] = set()
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor, name in persistent


def first_names(meta_model: nn.Module) -> dict[str, str]:
    """Every parameter and buffer name of the model -> the first name of the same tensor (shared
    ones differ)."""
    first: dict[int, str] = {}
    named = [*meta_model.named_parameters(remove_duplicate=False),
             *meta_model.named_buffers(remove_duplicate=False)]
    return {name: first.setdefault(id(tensor), name) for name, tensor in named}


def check_file(path: str, meta_model: nn.Module, rename: Rename | None = None) -> set[str]:
    """Every state-dict tensor the model needs is in the file, with its shape; else one line naming
    it. Returns the names of the non-persistent buffers the file does not hold."""
    rename = rename or (lambda name: name)
    files = WeightFiles(path)
    absent: set[str] = set()
    for name, tensor, persistent in every_tensor(meta_model):
        stored = rename(name)
        file = files.find(stored)
        if file is None:
            if not persistent:
                absent.add(name)
                continue
            raise GpipeInputError(f"--init-from {path!r} has no tensor {stored!r} (the model's {name!r}); "
                                  "save the same model's state dict or pick the matching --model")
        if file.shape(stored) != tuple(tensor.shape):
            raise GpipeInputError(f"--init-from {path!r}: {stored!r} has shape {list(file.shape(stored))} but the "
                                  f"model's {name!r} has {list(tensor.shape)}; pick the model options the file was "
                                  "saved with")
    return absent


def load_values(files: WeightFiles, module: nn.Module, first_name: dict[str, str],
                rename: Rename | None = None) -> None:
    """Copy into ``module`` (one stage's layers, named as in the whole model) every value the files
    hold for it; a shared tensor is read under its first name in the whole model (``first_name``,
    see :func:`first_names`) when the file does not hold it under this stage's name. A state-dict
    tensor the files lack is an error; a non-persistent buffer they lack keeps its value."""
    rename = rename or (lambda name: name)
    with torch.no_grad():
        for name, tensor, persistent in every_tensor(module):
            stored = rename(name)
            file = files.find(stored)
            if file is None:
                stored = rename(first_name[name])
                file = files.find(stored)
            if file is not None:
                tensor.copy_(file.tensor(stored))
            elif persistent:
                raise GpipeInputError(f"--init-from {files.path!r} has no tensor {stored!r}")
