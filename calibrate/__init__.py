"""Calibration: measure this machine, fit the simulator's costs, and check them on held-out runs.

Modules: machine (the stamp a costs file carries), profile (per-layer times and exact saved bytes),
link (ping-pong between two ranks), runs (a design of executor runs in torchrun workers), fit
(pure least-squares fits), costs (the costs file and the measured Workload), calibration (the
pieces put together), validate (held-out predictions against measurements), demo (the main job).
Importing this package does not import torch.
"""
