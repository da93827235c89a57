"""The GPipe pipeline simulator and the pieces every part of the project shares.

Shared pieces (imported by the executor and calibration too): :mod:`sim.schedule` (per-stage action
lists), :mod:`sim.plan` (the plan file), :mod:`sim.timeline` (the timeline format). Nothing under
``sim`` imports torch unless a torch model or measured costs are asked for.
"""
