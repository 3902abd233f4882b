"""Kept only for service/frontier_api.py, which imports `memory_lower_bound` from here: every bound
argument lives in planner.bounds. Remove once that caller computes `lower_bound(problem, ALL)`."""

from __future__ import annotations

from ..bounds import ALL, QUICK, lower_bound
from ..contract import Problem


def memory_lower_bound(problem: Problem) -> float:
    """The planner.bounds arguments that solve a program per device (0.0 when none applies)."""
    return lower_bound(problem, ALL - QUICK)
