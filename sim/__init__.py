"""The GPipe pipeline simulator and the pieces every part of the project shares.

The simulator (:mod:`sim.engine.engine`) predicts one step of D data-parallel replicas of a K-stage
pipeline, each device running V chunks under the interleaved schedule: one replica's forwards and
backwards are a SimPy model (:mod:`sim.engine.replica_run`), transfers crossing the links between
the devices :mod:`sim.engine.placement` gives each stage, and each stage's data-parallel all-reduce
(:mod:`sim.engine.allreduce`), the shared-parameter reduction and the optimizer step follow in
closed form. The planner (:mod:`sim.planner.search`, bounds in :mod:`sim.planner.bounds`) searches
replicas x stages x virtual stages x M x policy x schedule x placement within the system's devices,
best-first on lower bounds that never exceed the simulated step, so its ranking is exact.

The rooms: :mod:`sim.formats` (the plan file, the timeline, the costs file: shared by the executor
and calibration too), :mod:`sim.schedules` (per-stage action lists), :mod:`sim.engine` (the SimPy
step), :mod:`sim.workloads` (what is trained), :mod:`sim.catalog` (hardware), :mod:`sim.planner`,
:mod:`sim.evidence` (published runs replayed) and :mod:`sim.views` (figures, reports, progress).

Nothing under ``sim`` imports torch, :mod:`executor`, :mod:`calibrate` or the commands (:mod:`gpipe`),
lazily or not. The commands are the composition root: :mod:`gpipe.workload_flags` hands a
``package.module:factory`` model to :mod:`calibrate.measure.meta_profile` for measuring on the meta
device, and the results come back as a torch-free :class:`sim.workloads.meta_workload.MetaWorkload`.
"""
