"""The pairwise exclusion argument (planner/bounds/pairwise_exclusion.py): never above an optimum
found without it, never above a simulated valid plan, and stronger than the other bounds where a
heavy last stage shares a device with the first (V placement)."""

from __future__ import annotations

import random

import pytest
from core_schedules import make_problem, plan_of, serialized
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeplan.planner.bounds import ALL, QUICK, lower_bound
from pipeplan.planner.bounds.pairwise_exclusion import _Job, jackson_preemptive, pairwise_exclusion_bound
from pipeplan.planner.bounds.stage_tail import stage_tail_bound
from pipeplan.planner.contract import Problem
from pipeplan.planner.solver import solve
from support.bound_cases import heavy_head, other_bounds, random_problem
from support.oracles import blind_optimum


def test_jackson_preemptive_hand_values():
    assert jackson_preemptive([]) == 0.0
    assert jackson_preemptive([_Job(1.0, 2.0, 3.0)]) == pytest.approx(6.0)
    # the long-tail job preempts the running one at its release: 0..1 a, 1..3 b (+5 = 8), 3..5 a (+1)
    assert jackson_preemptive([_Job(0.0, 3.0, 1.0), _Job(1.0, 2.0, 5.0)]) == pytest.approx(8.0)


def test_heavy_head_hand_value():
    """M=2: the head's first window (F+B+W = 6) must end before the second starts at 4.5 + 6, whose
    B then needs the backward chain (4.5) and W(0) (0.5): 4.5 + 6 + 4 + 5 = 19.5."""
    problem = heavy_head(2)
    assert pairwise_exclusion_bound(problem) == pytest.approx(19.5)
    # the arrival argument: device 0 waits for the head's first forward (4.5) with 1 ms of
    # embedding forwards to run, then the head's, 3.5 idle before its first backward at 6.5
    assert lower_bound(problem, QUICK - {"stage_tail"}) == pytest.approx(18.5)
    # the stage tail reaches 19.5 by another road: the head's two F's and B's from 4.5 on and one of
    # its W's (memory lets only one wait past its last B), then the chain below it (4.5) and W(0)
    assert stage_tail_bound(problem) == pytest.approx(19.5)
    assert lower_bound(problem, ALL) == pytest.approx(19.5)  # the bound every solve assumes
    # room for two head windows: nothing to say beyond the critical path
    doc = problem.model_dump()
    doc["devices"][0]["memory_limit_mib"] = 700.0
    assert pairwise_exclusion_bound(Problem.model_validate(doc)) <= lower_bound(problem)
    # no limit anywhere: 0
    doc["devices"][0]["memory_limit_mib"] = None
    assert pairwise_exclusion_bound(Problem.model_validate(doc)) == 0.0


@pytest.mark.parametrize("m, optimum", [(2, 19.5), (3, 27.0)])
def test_heavy_head_is_met_by_another_argument_and_below_the_optimum(m, optimum):
    """At M=2 the stage tail meets it (19.5 both), at M=3 the arrival bound (25.5 both), and the
    several-stage warm-up reaches the optimum there."""
    problem = heavy_head(m)
    result = blind_optimum(problem)
    assert result.status == "optimal"
    assert result.plan.makespan_ms == pytest.approx(optimum)
    bound = pairwise_exclusion_bound(problem)
    assert bound <= other_bounds(problem) + 1e-9
    assert bound <= result.plan.makespan_ms + 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_never_above_a_blind_optimum(seed):
    """Random small problems where the bound says something: CP-SAT blind to it proves an optimum,
    and the bound is not above it."""
    rng = random.Random(seed)
    for _ in range(50):
        problem = random_problem(rng)
        if pairwise_exclusion_bound(problem) > 0.0:
            break
    result = blind_optimum(problem, seconds=8.0)
    assert result.status == "optimal"
    assert pairwise_exclusion_bound(problem) <= result.plan.makespan_ms + 1e-9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6))
def test_never_above_a_simulated_plan(seed):
    """Every heuristic's valid plan (and the serialized one) is at least every argument together, this
    one and the several-stage warm-up (test_chunk_warmup.py) among them."""
    from pipeplan.planner.baselines import NAMES, DoesNotFit, NotApplicable, run_baseline

    problem = random_problem(random.Random(seed))
    bound = lower_bound(problem, ALL)
    assert bound >= pairwise_exclusion_bound(problem)
    assert plan_of(problem, serialized(problem)).makespan_ms >= bound - 1e-9
    for name in NAMES:
        try:
            plan = run_baseline(problem, name)
        except (NotApplicable, DoesNotFit):
            continue
        assert plan.makespan_ms >= bound - 1e-9, name


def test_solve_reports_it():
    """solve() carries the bound: on the M=2 case its plan is proven optimal at 19.5."""
    result = solve(heavy_head(2), 5.0, workers=1, deterministic=True)
    assert result.plan.makespan_ms == pytest.approx(19.5)
    assert max(result.lower_bound_ms, result.solver_bound_ms or 0.0) == pytest.approx(19.5)
    assert result.status == "optimal"


def test_no_limit_no_bound():
    assert pairwise_exclusion_bound(make_problem(p=3, m=4, chunks=2, placement="v")) == 0.0
