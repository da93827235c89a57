"""Fitting the simulator's costs on what was measured: least squares, the calibration, checks."""
