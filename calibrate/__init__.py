"""Calibration: measure this machine, fit the simulator's costs, and check them on held-out runs.

The rooms: :mod:`calibrate.measure` (per-layer profiles, links, collectives, executor runs and the
machine's stamp), :mod:`calibrate.fit` (least-squares fits and the calibration that puts the pieces
together), :mod:`calibrate.validate` (held-out predictions against measurements),
:mod:`calibrate.report` (the run report) and :mod:`calibrate.noise` (the CPU host's quirks: its
speed drift and what a device loses after a wait); :mod:`calibrate.goals` says how close is close
enough. Importing this package does not import torch.
"""
