"""An optimum that owes nothing to the memory-aware bounds, to check each of them against: CP-SAT
told only planner.bounds' memory-free bound (the solver otherwise gives its bounds to the model as
the makespan's floor and calls a plan meeting them optimal, so an oracle that knew a bound could not
catch it being too high). Used by the bound tests and bench/bounds.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest.mock import patch

from pipeplan.planner import simulator
from pipeplan.planner.bounds import free_lower_bound
from pipeplan.planner.contract import Problem
from pipeplan.planner.solver import SolveResult, api, incumbent, solve


@contextmanager
def blind_to_memory_bounds() -> Iterator[None]:
    """solve() and CP-SAT see free_lower_bound only: no warm-up, exclusive or memory_bound bound."""
    with ExitStack() as stack:
        stack.enter_context(patch.object(incumbent, "combined_lower_bound", free_lower_bound))
        stack.enter_context(patch.object(api, "memory_lower_bound", lambda problem: 0.0))
        stack.enter_context(patch.object(api, "lower_bound", free_lower_bound))
        stack.enter_context(patch.object(simulator, "lower_bound", free_lower_bound))
        yield


def blind_optimum(problem: Problem, seconds: float = 10.0) -> SolveResult:
    """One deterministic single-worker CP-SAT solve, blind to the memory-aware bounds."""
    with blind_to_memory_bounds():
        return solve(problem, seconds, engine="cpsat", deterministic=True, workers=1)
