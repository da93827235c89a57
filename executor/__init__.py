"""The real GPipe executor: one process per stage on torch.distributed, or all stages in one process.

Modules: models (torch models), data (batches per step, micro-batch split), stage (one stage's
actions), transport (point-to-point), pipeline (setup and the in-process pipeline), worker (a rank's
entry point), launch and rank_process (starting the ranks), cli (``gpipe train``). Importing this package does not import torch.
"""
