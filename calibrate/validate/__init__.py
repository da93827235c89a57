"""Predictions against measured runs the fit never saw, and the spread across calibrations."""
