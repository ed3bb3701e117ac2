"""Convergence gate: metric readers, checks, calibration, operator numerics, reports."""
