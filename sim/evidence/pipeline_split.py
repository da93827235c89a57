"""A published run's pipeline split: the transformer layers each virtual stage held, as its trainer split them.

A runs file's optional ``pipeline_split`` key says how the run's trainer spread the transformer layers
over its K x V pipeline chunks (virtual stage c x K + d is chunk c of device d):

- ``"even"``: Megatron-Core's default, layers / (K x V) on every chunk, the embedding on the first and
  the multi-token prediction modules, the final norm and the output layer on the last (its
  ``num_layers_in_first_pipeline_stage``, ``num_layers_in_last_pipeline_stage`` and
  ``account_for_embedding/loss_in_pipeline_split`` all unset);
- a list of K x V counts: the layers of each chunk where the run's config sets them otherwise
  (DeepSeek-V3 on NeMo: ``num_layers_in_first_pipeline_stage`` 3, the last 2, 4 on each of the 14 between),
  the embedding again with the first and the modules after the last layer with the last;
- null, or left out: not stated. The replay then takes the split ``gpipe plan`` would, the one minimising
  the slowest chunk's time (:func:`sim.planner.partition.min_max_partition`), and says so in ``assumed``.

The simulator's partition counts the embedding and everything after the last transformer layer as
layers of their own (:mod:`sim.workloads.transformer`), so a stated split becomes one by adding them
to its first and last chunk. Limits: a split is taken as given, memory or not (the simulation reports
a chunk that overflows); trainers that split otherwise (by parameters, as DeepSpeed's
``partition_method="parameters"``) are given as a list.
"""

from __future__ import annotations

from typing import Any

from sim.errors import GpipeInputError

EVEN = "even"
_BLOCKS = ("block", "moe_block")


def transformer_layers(layer_names: list[str]) -> tuple[int, int, int]:
    """(units before the first transformer layer, transformer layers, units after the last) of a
    workload whose layers are named ``layer_names``; one line if the layers are not one run of blocks."""
    blocks = [i for i, name in enumerate(layer_names) if name in _BLOCKS]
    if not blocks or blocks != list(range(blocks[0], blocks[-1] + 1)):
        raise GpipeInputError("pipeline_split is given for a model without one run of transformer layers; "
                              "leave it out (null) to have the replay balance the layers")
    return blocks[0], len(blocks), len(layer_names) - blocks[-1] - 1


def stated_partition(run: dict[str, Any], layer_names: list[str], chunks: int) -> list[int] | None:
    """The simulator's partition (units per virtual stage, ``chunks`` = K x V of them) of ``run``'s
    ``pipeline_split``; None where it is null or left out. One line for a split that does not fit the
    model or the layout."""
    split = run.get("pipeline_split")
    if split is None:
        return None
    before, layers, after = transformer_layers(layer_names)
    if split == EVEN:
        if layers % chunks:
            raise GpipeInputError(f"pipeline_split \"even\": {layers} transformer layers do not split evenly over "
                                  f"K x V = {chunks} chunks; give the layers of each chunk as a list")
        counts = [layers // chunks] * chunks
    elif isinstance(split, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in split):
        if len(split) != chunks or sum(split) != layers:
            raise GpipeInputError(f"pipeline_split {split}: give K x V = {chunks} counts summing to the model's "
                                  f"{layers} transformer layers")
        counts = list(split)
    else:
        raise GpipeInputError(f"pipeline_split {split!r}; give \"even\", a list of layers per virtual stage, or null "
                              "where the source does not say")
    counts[0] += before
    counts[-1] += after
    if min(counts) < 1:
        raise GpipeInputError(f"pipeline_split {split}: every chunk must hold a layer, the embedding or the head")
    return counts


def split_line(run: dict[str, Any], chunks: int) -> str | None:
    """What the replay says of a null ``pipeline_split`` of a pipeline (the split itself is in the run's
    layout); nothing for a stated one or one chunk."""
    if chunks < 2 or run.get("pipeline_split") is not None:
        return None
    return "pipeline_split null: the layers balanced by their time (min-max), as gpipe plan splits them"
