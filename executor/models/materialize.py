"""``--init meta``: build a model on the meta device and give only the layers a process needs values
of their own, seeded per layer (the default start, ``factory()``'s values, is
:mod:`executor.models.initial_weights`).

Nothing of the whole model is ever allocated: it is built under ``torch.device("meta")`` (shapes,
no storage), and a process materialises the layers of its own stage on its device. Values are a
pure function of (seed, layer): before initialising layer ``i`` the generator is seeded with
``mix_seed(seed, i)`` and every module in it that has ``reset_parameters()`` runs it (children
before parents), so the same
layer gets the same values whichever stage, process or K it lands on. A parameter several layers
share takes the value its first layer gives it, on every stage that holds a copy.

Layers are materialised from a deep copy of the meta layers, so the meta model stays a pristine
description (every in-process stage gets copies of its own, as separate processes do) and a
parameter shared by layers of one stage stays one parameter.

Refused, with one line, before anything runs: a parameter or buffer that no module on its path
inside its layer can initialise (no ``reset_parameters()``); built on the meta device its values
would be garbage. Give the module holding it a ``reset_parameters()`` method.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from executor.runtime.seeds import mix_seed
from sim.errors import GpipeInputError


def build_meta(factory: Callable[[], nn.Sequential]) -> nn.Sequential:
    """``factory()`` under the meta device: the structure, no storage."""
    with torch.device("meta"):
        return factory()


def _owners(layer: nn.Module) -> Iterable[tuple[list[nn.Module], dict, str]]:
    """(modules from the layer down to the holder, the holder's table, name) of every parameter and
    buffer in ``layer``, each holder visited once."""
    def walk(module: nn.Module, path: list[nn.Module], seen: set[int]):
        if id(module) in seen:
            return
        seen.add(id(module))
        path = [*path, module]
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    yield path, table, name
        for child in module.children():
            yield from walk(child, path, seen)

    yield from walk(layer, [], set())


def _can_reset(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


def check_initialisable(model: nn.Sequential, only: set[int] | None = None,
                        why: str = "after a meta-device build", alternative: str = "") -> None:
    """Refuse a model with a parameter or buffer no ``reset_parameters()`` on its path can set, in
    the first layer holding it (later layers sharing it take that layer's value); ``only``: the
    ``id``s of the tensors to check (default all). ``why`` ends the message's first clause,
    ``alternative`` its last."""
    home = first_layer_of(model)
    for index, layer in enumerate(model):
        for path, table, name in _owners(layer):
            tensor = table[name]
            if only is not None and id(tensor) not in only:
                continue
            if home[id(tensor)] == index and not any(_can_reset(module) for module in path):
                holder = type(path[-1]).__name__
                raise GpipeInputError(
                    f"{name!r} of {holder} in layer {index} ({type(layer).__name__}) has no reset_parameters() "
                    f"to initialise it {why}; give {holder} a reset_parameters() method that sets it{alternative}")


def first_layer_of(model: nn.Sequential) -> dict[int, int]:
    """``id(tensor)`` -> the first layer holding it, for every parameter and buffer of the model."""
    home: dict[int, int] = {}
    for index, layer in enumerate(model):
        for _, table, name in _owners(layer):
            home.setdefault(id(table[name]), index)
    return home


def to_empty(layers: Sequence[nn.Module], device: torch.device) -> None:
    """Storage for every parameter and buffer of ``layers``, one per tensor however often it is held."""
    memo: dict[int, torch.Tensor] = {}
    for layer in layers:
        for _, table, name in _owners(layer):
            old = table[name]
            new = memo.get(id(old))
            if new is None:
                empty = torch.empty_like(old, device=device)
                new = nn.Parameter(empty, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else empty
                memo[id(old)] = new
            table[name] = new


def initialise_layer(layer: nn.Module, index: int, seed: int) -> None:
    """Seed with (seed, layer), then ``reset_parameters()`` children before parents, as
    ``nn.Module.apply`` visits them: a module that sets up its whole subtree has the last word."""
    def visit(module: nn.Module, seen: set[int]) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child, seen)
        if _can_reset(module):
            module.reset_parameters()

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(mix_seed(seed, index))
    with torch.no_grad():
        visit(layer, set())
    torch.random.set_rng_state(generator_state)


def materialise(meta: nn.Sequential, indices: Sequence[int], seed: int,
                device: torch.device = torch.device("cpu")) -> list[nn.Module]:
    """Real copies of layers ``indices`` of the meta model ``meta``, initialised from ``seed``.

    Layers are initialised last to first, so a tensor several of them share ends with the value its
    first layer gives it; one whose first layer is outside ``indices`` takes that layer's value from
    a copy of it initialised on its own.
    """
    home = first_layer_of(meta)
    layers = copy.deepcopy([meta[i] for i in indices])  # one memo: sharing inside the set is kept
    to_empty(layers, device)
    for index, layer in sorted(zip(indices, layers), key=lambda pair: pair[0], reverse=True):
        initialise_layer(layer, index, seed)
    inside, copied = set(indices), set()
    for index, layer in zip(indices, layers):
        for (_, table, name), (_, meta_table, meta_name) in zip(_owners(layer), _owners(meta[index])):
            original = meta_table[meta_name]
            first = home[id(original)]
            if first not in inside and id(table[name]) not in copied:
                copied.add(id(table[name]))
                with torch.no_grad():
                    table[name].copy_(_value_in_layer(meta, first, original, seed, device))
    return layers


def _value_in_layer(meta: nn.Sequential, index: int, original: torch.Tensor, seed: int,
                    device: torch.device) -> torch.Tensor:
    """The value layer ``index`` gives the meta tensor ``original`` when initialised on its own."""
    layer = copy.deepcopy(meta[index])
    to_empty([layer], device)
    initialise_layer(layer, index, seed)
    for (_, table, name), (_, meta_table, meta_name) in zip(_owners(layer), _owners(meta[index])):
        if meta_table[meta_name] is original:
            return table[name]
    raise RuntimeError(f"layer {index} does not hold the shared tensor it was said to")
