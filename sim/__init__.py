"""The GPipe pipeline simulator and the pieces every part of the project shares.

Shared pieces (imported by the executor and calibration too): :mod:`sim.schedule` (per-stage action
lists), :mod:`sim.plan` (the plan file), :mod:`sim.timeline` (the timeline format) and
:mod:`sim.costs` (the costs file calibration writes and the simulator reads).

Nothing under ``sim`` imports torch, :mod:`executor` or :mod:`calibrate`, lazily or not, except the
command-line modules (``*cli``), which are the composition root: :mod:`sim.workload_cli` hands a
``package.module:factory`` model to :mod:`calibrate.meta_profile` for measuring on the meta device,
and the results come back as a torch-free :class:`sim.meta_workload.MetaWorkload`.
"""
