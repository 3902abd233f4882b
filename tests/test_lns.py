"""LNS step budgets: a step gets enough time that building and presolving the model (measured as the
time to its first solution, the hint) is a small part of it."""

from __future__ import annotations

from core_schedules import make_problem
from pipeplan.planner.baselines import best_heuristic
from pipeplan.planner.solver import cpsat, lns
from pipeplan.planner.solver.convert import ticks_of_plan
from pipeplan.planner.solver.incumbent import Incumbent
from pipeplan.planner.solver.scaling import scale_for


def test_step_budget_covers_the_measured_overhead_within_a_cap():
    assert lns.step_budget(3.0, 0.0) == 3.0  # nothing measured yet: the base
    assert lns.step_budget(3.0, 0.2) == 3.0  # cheap model: the base
    assert lns.step_budget(3.0, 1.5) == lns.OVERHEAD_FACTOR * 1.5  # presolve half a base step: more
    assert lns.step_budget(3.0, 60.0) == lns.MAX_STEP_FACTOR * 3.0  # never unbounded


def test_a_step_reports_when_its_first_solution_came():
    """The overhead the LNS adapts to: a hinted step's first solution is the hint, after the model
    is built and presolved, so it comes within the step and before its end."""
    problem = make_problem(p=4, m=8, limit=250.0, offload=True, recompute=True, weight_grad_mib=100.0,
                           f=1.0137, b=1.2291, w=0.8113, offload_ms=0.9173, p2p=0.0531)
    scale = scale_for(problem)
    seed = best_heuristic(problem)
    inc = Incumbent(problem, problem.key(), None)
    assert inc.offer(seed)
    base = ticks_of_plan(problem, seed, scale)
    free = {(k, i) for k in range(problem.num_stages) for i in range(2)}
    out = cpsat.run(problem, inc, scale, 2.0, None, 1, free=free, method="cp-sat lns", base=base)
    assert out.solution is not None
    assert out.first_s is not None and 0.0 < out.first_s <= out.wall_s
