"""Training state on disk without pickle: tensors in a safetensors file, the rest as JSON beside them.

A checkpoint shard holds a nested structure (the module's state dict, the optimizer's with its
integer-keyed state and parameter groups, the schedule's position, RNG states). :func:`save`
stores every tensor in a safetensors file and the structure, with each tensor replaced by its key,
as JSON in the file's own metadata; :func:`load` reads both back. Nothing in the file is executed
when it is read, so a tampered checkpoint directory cannot run code on the ranks that resume from
it (``torch.load`` without ``weights_only`` would unpickle whatever it finds); a file that is not
such a shard is refused in one line (:func:`check`).

JSON keeps what a state dict holds: strings, numbers (inf and nan too), booleans, None, lists;
tuples and dicts with non-string keys are tagged so they come back as they were.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from sim.errors import GpipeInputError
from sim.formats.timeline import write_atomic

METADATA_KEY = "gpipe_state"


def storage_free(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors, contiguous and on the CPU, each on storage of its own (safetensors refuses views
    of one storage); a tensor overlapping one taken before is copied."""
    taken: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in taken:
            tensor = tensor.clone()
        taken.add(pointer)
        out[name] = tensor
    return out


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value
        return {"$tensor": key}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(item, tensors) for item in value]}
    if isinstance(value, list):
        return [_encode(item, tensors) for item in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {key: _encode(item, tensors) for key, item in value.items()}
        return {"$dict": [[_encode(key, tensors), _encode(item, tensors)] for key, item in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint shard")


def _decode(value: Any, tensors: Any) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return tensors.get_tensor(value["$tensor"])
    if "$tuple" in value:
        return tuple(_decode(item, tensors) for item in value["$tuple"])
    if "$dict" in value:
        return {_decode(key, tensors): _decode(item, tensors) for key, item in value["$dict"]}
    return {key: _decode(item, tensors) for key, item in value.items()}


def save(path: str, state: Any) -> None:
    """Write ``state`` to ``path`` atomically (:func:`sim.formats.timeline.write_atomic`)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(_encode(state, tensors))
    write_atomic(path, lambda tmp: save_file(storage_free(tensors), tmp, metadata={METADATA_KEY: skeleton}))


def _open(path: str, device: str = "cpu"):
    """The file open, and its structure; one line when it is not a shard this module wrote."""
    refusal = (f"checkpoint file {path} is not a gpipe state file (safetensors with its state as JSON); it may "
               "have been replaced or written by another program: restore it or use a new --checkpoint-dir")
    if not os.path.exists(path):
        raise GpipeInputError(f"checkpoint file {path} is missing; restore it or use a new --checkpoint-dir")
    try:
        handle = safe_open(path, framework="pt", device=device)
        skeleton = json.loads((handle.metadata() or {})[METADATA_KEY])
    except (SafetensorError, OSError, ValueError, KeyError):
        raise GpipeInputError(refusal) from None
    return handle, skeleton


def check(path: str) -> None:
    """Refuse, in one line, a file :func:`load` would not read (its header only is read)."""
    _open(path)


def load(path: str, device: torch.device | str = "cpu") -> Any:
    """The state :func:`save` wrote to ``path``, its tensors on ``device``."""
    handle, skeleton = _open(path, str(device))
    return _decode(skeleton, handle)
