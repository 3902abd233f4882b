"""Optimizers of pipeline schedules: CP-SAT (default), large-neighbourhood search over CP-SAT for big
problems, and an OptPipe-style MILP for comparison. `solve` is the one entry point."""

from .api import ENGINES, SolveResult, solve

__all__ = ["ENGINES", "SolveResult", "solve"]
