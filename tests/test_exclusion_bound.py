"""exclusion_lower_bound (planner/solver/exclusion_bound.py): never above an optimum found without
it, never above a simulated valid plan, and stronger than the other bounds where a heavy last stage
shares a device with the first (V placement)."""

from __future__ import annotations

import random
from unittest.mock import patch

import pytest
from core_schedules import make_problem, plan_of, problem_doc, serialized
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import blind_optimum
from pipeplan.planner.bounds import lower_bound, min_memory
from pipeplan.planner.contract import Problem
from pipeplan.planner.solver import memory_bound, solve
from pipeplan.planner.solver.exclusion_bound import _Job, exclusion_lower_bound, jackson_preemptive
from pipeplan.planner.solver.memory_bound import count_lower_bound, memory_lower_bound
from pipeplan.planner.solver.occupancy_bound import occupancy_lower_bound


def other_bounds(problem: Problem) -> float:
    """Every bound but this one: planner.bounds' and memory_bound's other two arguments, without the
    several-stage warm-up (chunk_warmup.py), which meets or beats this one on heavy_head
    (tests/test_chunk_warmup.py)."""
    with patch.object(memory_bound, "chunked_warmup_waste", lambda problem, d: 0.0):
        return max(lower_bound(problem), count_lower_bound(problem), occupancy_lower_bound(problem))


def heavy_head(m: int, p: int = 3) -> Problem:
    """V placement: device 0 holds a light embedding stage (150 MiB, weight gradient 120) and a heavy
    last stage (300 MiB, 180 until its W); 320 MiB free there. Two head windows, or a head window and
    an embedding activation, never fit together."""
    doc = problem_doc(p=p, m=m, chunks=2, placement="v", recompute=True, checkpoint_mib=5.0)
    doc["stages"][0].update(activation_mib=150.0, weight_grad_mib=120.0, forward_ms=0.5,
                            backward_input_ms=0.5, backward_weight_ms=0.5)
    doc["stages"][-1].update(activation_mib=300.0, weight_grad_mib=180.0, forward_ms=2.0,
                             backward_input_ms=2.0, backward_weight_ms=2.0)
    doc["devices"][0]["memory_limit_mib"] = 320.0
    return Problem.model_validate(doc)


def test_jackson_preemptive_hand_values():
    assert jackson_preemptive([]) == 0.0
    assert jackson_preemptive([_Job(1.0, 2.0, 3.0)]) == pytest.approx(6.0)
    # the long-tail job preempts the running one at its release: 0..1 a, 1..3 b (+5 = 8), 3..5 a (+1)
    assert jackson_preemptive([_Job(0.0, 3.0, 1.0), _Job(1.0, 2.0, 5.0)]) == pytest.approx(8.0)


def test_heavy_head_hand_value():
    """M=2: the head's first window (F+B+W = 6) must end before the second starts at 4.5 + 6, whose
    B then needs the backward chain (4.5) and W(0) (0.5): 4.5 + 6 + 4 + 5 = 19.5."""
    problem = heavy_head(2)
    assert exclusion_lower_bound(problem) == pytest.approx(19.5)
    # planner.bounds.arrival_bound: device 0 waits for the head's first forward (4.5) with 1 ms of
    # embedding forwards to run, then the head's, 3.5 idle before its first backward at 6.5
    assert other_bounds(problem) == pytest.approx(18.5)
    assert memory_lower_bound(problem) == pytest.approx(19.5)  # memory_bound includes it
    # room for two head windows: nothing to say beyond the critical path
    doc = problem.model_dump()
    doc["devices"][0]["memory_limit_mib"] = 700.0
    assert exclusion_lower_bound(Problem.model_validate(doc)) <= lower_bound(problem)
    # no limit anywhere: 0
    doc["devices"][0]["memory_limit_mib"] = None
    assert exclusion_lower_bound(Problem.model_validate(doc)) == 0.0


@pytest.mark.parametrize("m, optimum, stronger", [(2, 19.5, True), (3, 27.0, False)])
def test_heavy_head_is_stronger_and_below_the_optimum(m, optimum, stronger):
    """At M=3 the arrival bound meets it (25.5 both) and the several-stage warm-up reaches the optimum."""
    problem = heavy_head(m)
    result = blind_optimum(problem)
    assert result.status == "optimal"
    assert result.plan.makespan_ms == pytest.approx(optimum)
    bound = exclusion_lower_bound(problem)
    assert (bound > other_bounds(problem) + 1e-9) is stronger
    assert bound <= result.plan.makespan_ms + 1e-9


def random_problem(rng: random.Random) -> Problem:
    """bench/bounds.py's family, with a heavier last stage half the time (the shape this bound is for)."""
    doc = problem_doc(p=rng.choice([2, 3]), m=rng.choice([2, 3, 4]), chunks=rng.choice([1, 2, 2]),
                      placement=rng.choice(["loop", "v"]), split=rng.random() < 0.8,
                      b=rng.choice([1.0, 1.5]), w=rng.choice([0.5, 1.0, 2.0]),
                      weight_grad_mib=rng.choice([0.0, 50.0, 100.0]), p2p=rng.choice([0.0, 0.1]),
                      offload=rng.random() < 0.4, recompute=rng.random() < 0.4)
    if rng.random() < 0.5:
        doc["stages"][-1].update(activation_mib=rng.choice([150.0, 250.0]), forward_ms=rng.choice([1.0, 2.0]),
                                 backward_input_ms=2.0, weight_grad_mib=rng.choice([60.0, 120.0]))
    need = max(min_memory(Problem.model_validate(doc)))
    for dev in doc["devices"]:
        dev["memory_limit_mib"] = need * rng.choice([1.0, 1.2, 1.5])
    return Problem.model_validate(doc)


@pytest.mark.parametrize("seed", range(6))
def test_never_above_a_blind_optimum(seed):
    """Random small problems where the bound says something: CP-SAT blind to it proves an optimum,
    and the bound is not above it."""
    rng = random.Random(seed)
    for _ in range(50):
        problem = random_problem(rng)
        if exclusion_lower_bound(problem) > 0.0:
            break
    result = blind_optimum(problem, seconds=8.0)
    if result.status != "optimal":
        pytest.skip("no proven optimum within the time")
    assert exclusion_lower_bound(problem) <= result.plan.makespan_ms + 1e-9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6))
def test_never_above_a_simulated_plan(seed):
    """Every heuristic's valid plan (and the serialized one) is at least the memory bound, which takes
    the largest of this one, the several-stage warm-up (tests/test_chunk_warmup.py) and the rest."""
    from pipeplan.planner.baselines import NAMES, DoesNotFit, NotApplicable, run_baseline

    problem = random_problem(random.Random(seed))
    bound = memory_lower_bound(problem)
    assert bound >= exclusion_lower_bound(problem)
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
    assert exclusion_lower_bound(make_problem(p=3, m=4, chunks=2, placement="v")) == 0.0
