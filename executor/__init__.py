"""The real GPipe executor: one process per stage on torch.distributed, or all stages in one process.

The rooms: :mod:`executor.runtime` (a stage's actions, the schedule's loop, data, memory, the
report), :mod:`executor.transport` (point-to-point sends, shared memory), :mod:`executor.parallel`
(replicas, tensor parallelism, shared parameters), :mod:`executor.models` (the torch models),
:mod:`executor.state` (checkpoints) and :mod:`executor.launch` (starting the ranks); at the top,
:mod:`executor.config` (a run's configuration) and :mod:`executor.device` (the one module that
touches the device). Importing this package does not import torch.
"""
