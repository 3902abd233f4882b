"""The solver's memory-aware lower bound: never above a proven optimum, often above planner.bounds'."""

from __future__ import annotations

import random

import pytest
from core_schedules import make_problem, problem_doc

from planner.bounds import lower_bound, min_memory
from planner.contract import Problem
from planner.solver import solve
from planner.solver.memory_bound import memory_lower_bound


@pytest.mark.parametrize("kw", [
    {"p": 3, "m": 3, "limit": 200.0, "weight_grad_mib": 100.0, "b": 1.5},
    {"p": 4, "m": 6, "limit": 300.0, "weight_grad_mib": 50.0},
    {"p": 3, "m": 4, "split": False, "limit": 200.0, "f": 1.0, "b": 2.0, "w": 0.5},
])
def test_memory_bound_is_below_the_proven_optimum(kw):
    problem = make_problem(**kw)
    result = solve(problem, 3.0, engine="cpsat", deterministic=True)
    assert result.status == "optimal"
    assert memory_lower_bound(problem) <= result.plan.makespan_ms + 1e-9


def test_memory_bound_beats_the_plain_bound_and_holds_on_random_small_problems():
    rng = random.Random(3)
    stronger = 0
    for _ in range(8):
        doc = problem_doc(p=rng.choice([2, 3]), m=rng.choice([2, 3, 4]), chunks=rng.choice([1, 2]),
                          split=rng.random() < 0.7, b=rng.choice([1.0, 1.5]), w=rng.choice([0.5, 1.0]),
                          weight_grad_mib=rng.choice([0.0, 50.0, 100.0]), p2p=rng.choice([0.0, 0.1]),
                          offload=rng.random() < 0.3, recompute=rng.random() < 0.3)
        need = max(min_memory(Problem.model_validate(doc)))
        for dev in doc["devices"]:
            dev["memory_limit_mib"] = need * rng.choice([1.0, 1.5])
        problem = Problem.model_validate(doc)
        bound = memory_lower_bound(problem)
        result = solve(problem, 2.0, engine="cpsat", deterministic=True)
        if result.status == "optimal":
            assert bound <= result.plan.makespan_ms + 1e-9
        stronger += bound > lower_bound(problem) + 1e-9
    assert stronger >= 2


def test_memory_bound_needs_a_limit():
    assert memory_lower_bound(make_problem(p=3, m=4)) == 0.0
