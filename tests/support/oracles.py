"""An optimum that owes nothing to the memory-aware bounds, to check each of them against: CP-SAT
told only the memory-free bound (the solver otherwise gives its bounds to the model as the
makespan's floor and calls a plan meeting them optimal, so an oracle that knew a bound could not
catch it being too high). Used by the bound tests and bench/bounds.py."""

from __future__ import annotations

from pipeplan.planner.contract import Problem
from pipeplan.planner.solver import SolveResult, solve

BLIND = frozenset({"memory_free"})  # the planner.bounds arguments the oracle may assume


def blind_optimum(problem: Problem, seconds: float = 10.0) -> SolveResult:
    """One deterministic single-worker CP-SAT solve, blind to the memory-aware bounds."""
    return solve(problem, seconds, engine="cpsat", deterministic=True, workers=1, bounds=BLIND)
