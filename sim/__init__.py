"""The GPipe pipeline simulator and the pieces every part of the project shares.

The simulator (:mod:`sim.engine`) predicts one step of D data-parallel replicas of a K-stage
pipeline, each device running V chunks under the interleaved schedule: one replica's forwards and
backwards are a SimPy model (:mod:`sim.replica_run`), transfers crossing the links between the
devices :mod:`sim.placement` gives each stage, and each stage's data-parallel all-reduce
(:mod:`sim.allreduce`), the shared-parameter reduction and the optimizer step follow in closed form.
The planner (:mod:`sim.planner`, bounds in :mod:`sim.plan_bounds`) searches replicas x stages x
virtual stages x M x policy x schedule x placement within the system's devices, best-first on
lower bounds that never exceed the simulated step, so its ranking is exact.

Shared pieces (imported by the executor and calibration too): :mod:`sim.schedule` (per-stage action
lists), :mod:`sim.plan` (the plan file), :mod:`sim.timeline` (the timeline format) and
:mod:`sim.costs` (the costs file calibration writes and the simulator reads).

Nothing under ``sim`` imports torch, :mod:`executor` or :mod:`calibrate`, lazily or not, except the
command-line modules (``*cli``), which are the composition root: :mod:`sim.workload_cli` hands a
``package.module:factory`` model to :mod:`calibrate.meta_profile` for measuring on the meta device,
and the results come back as a torch-free :class:`sim.meta_workload.MetaWorkload`.
"""
