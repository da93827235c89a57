"""``--init-from PATH``: start from saved weights, each process reading only its own stage's tensors.

PATH is a state dict saved with ``torch.save`` (``.pt``, ``.pth``, ``.bin``), a safetensors file, or a
folder holding either (a Hugging Face model folder: ``model.safetensors``, sharded
``model.safetensors.index.json``, or ``pytorch_model.bin``). Files are memory-mapped, so a stage
touches only the bytes of the tensors it holds: a process never reads the whole model.

Names are the model's own (``"3.attn.qkv.weight"`` for layer 3 of an ``nn.Sequential``) unless the
model supplies a ``rename`` from its names to the file's (Hugging Face models do). A parameter
several layers share is read once, under the name of the first layer holding it; files that store
it once (tied embeddings in Hugging Face checkpoints) need nothing more. Before anything trains,
:func:`check_file` compares every name and shape with the model (on the meta device) and names the
first missing or mis-shaped tensor in one line. Values are converted to the parameter's dtype.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from typing import Callable, Iterator

import torch
from torch import nn

from sim.errors import GpipeInputError

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
Rename = Callable[[str], str]


def _files(path: str) -> list[str]:
    """The weight files PATH stands for."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise GpipeInputError(f"--init-from {path!r} does not exist; give a state dict, a safetensors file or "
                              "a model folder")
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
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
    """One safetensors file, its header read and its data memory-mapped."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            self.header = {k: v for k, v in json.loads(handle.read(size)).items() if k != "__metadata__"}
            self.data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.offset = 8 + size

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def tensor(self, name: str) -> torch.Tensor:
        info = self.header[name]
        start, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        with warnings.catch_warnings():  # a read-only map: the tensor is only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.data, dtype=dtype, count=(end - start) // dtype.itemsize,
                                    offset=self.offset + start)
        return flat.reshape(self.shape(name))


class _TorchFile:
    """One ``torch.save`` state dict, loaded memory-mapped (tensors are read when touched)."""

    def __init__(self, path: str) -> None:
        try:
            self.state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise GpipeInputError(f"--init-from {path!r} is not a state dict torch can load ({str(exc).splitlines()[0]})"
                                  ) from None
        if not isinstance(self.state, dict):
            raise GpipeInputError(f"--init-from {path!r} holds a {type(self.state).__name__}, not a state dict")
        self.header = self.state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def tensor(self, name: str) -> torch.Tensor:
        return self.state[name]


def _open(path: str) -> list[_Safetensors | _TorchFile]:
    opened = []
    for file in _files(path):
        if file.endswith(".safetensors"):
            try:
                opened.append(_Safetensors(file))
            except (OSError, ValueError, struct.error) as exc:
                raise GpipeInputError(f"--init-from {file!r} is not a safetensors file ({exc})") from None
        else:
            opened.append(_TorchFile(file))
    return opened


def _home_names(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of ``module`` under its first name (shared ones once)."""
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _lookup(files, name: str):
    for file in files:
        if name in file.header:
            return file
    return None


def check_file(path: str, meta_model: nn.Module, rename: Rename | None = None) -> None:
    """Every tensor the model needs is in the file, with its shape; else one line naming it."""
    rename = rename or (lambda name: name)
    files = _open(path)
    for name, tensor in _home_names(meta_model):
        stored = rename(name)
        file = _lookup(files, stored)
        if file is None:
            raise GpipeInputError(f"--init-from {path!r} has no tensor {stored!r} (the model's {name!r}); "
                                  "save the same model's state dict or pick the matching --model")
        if file.shape(stored) != tuple(tensor.shape):
            raise GpipeInputError(f"--init-from {path!r}: {stored!r} has shape {list(file.shape(stored))} but the "
                                  f"model's {name!r} has {list(tensor.shape)}; pick the model options the file was "
                                  "saved with")


def first_names(meta_model: nn.Module) -> dict[str, str]:
    """Every state-dict name of the model -> the first name of the same tensor (shared ones differ)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(tensor), name)
            for name, tensor in meta_model.state_dict(keep_vars=True).items()}


def load_values(path: str, module: nn.Module, first_name: dict[str, str], rename: Rename | None = None) -> None:
    """Copy into ``module`` (one stage's layers, named as in the whole model) the values it holds; a
    shared tensor is read under its first name in the whole model (``first_name``, see
    :func:`first_names`) when the file does not hold it under this stage's name."""
    rename = rename or (lambda name: name)
    files = _open(path)
    with torch.no_grad():
        for name, tensor in _home_names(module):
            stored = rename(name)
            file = _lookup(files, stored)
            if file is None:
                stored = rename(first_name[name])
                file = _lookup(files, stored)
            if file is None:
                raise GpipeInputError(f"--init-from {path!r} has no tensor {stored!r}")
            tensor.copy_(file.tensor(stored))
