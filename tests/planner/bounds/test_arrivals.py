"""The arrival argument (planner/bounds/arrivals.py): a device's idle before its first backward,
forced by how fast forwards reach it, is part of every makespan; proven against CP-SAT optima found
without it."""

from __future__ import annotations

import random

import pytest
from core_schedules import problem_doc, uneven_forwards
from pipeplan.planner.bounds import lower_bound
from pipeplan.planner.bounds.arrivals import arrival_bound, forward_arrivals
from pipeplan.planner.bounds.memory_free import memory_free_bound
from pipeplan.planner.contract import Problem
from support.oracles import blind_optimum


def slow_head(m: int) -> Problem:
    """P=2, two chunks in loop: stage 0's forward takes 3 ms, every other 1 ms. Device 1 (stages 1 and
    3) gets a stage-1 forward only every 3 ms, so before its first backward can start (at 6 ms) it has
    2 ms of forwards to fill the 3 ms since its start: 1 ms idle beyond head + work."""
    doc = problem_doc(p=2, m=m, chunks=2, b=1.0, w=1.0)
    doc["stages"][0].update(forward_ms=3.0, backward_input_ms=0.5, backward_weight_ms=0.0)
    doc["stages"][2].update(backward_input_ms=0.5, backward_weight_ms=0.0)
    return Problem.model_validate(doc)


def test_arrivals_follow_the_slowest_stage_before():
    arrivals = forward_arrivals(slow_head(3))
    assert arrivals[0] == [0.0, 3.0, 6.0]
    assert arrivals[1] == [3.0, 6.0, 9.0]  # as fast as stage 0 ends them, not every 1 ms
    assert arrivals[3] == [5.0, 8.0, 11.0]


@pytest.mark.parametrize(("m", "optimum"), [(2, 16.0), (3, 22.0), (4, 28.0)])
def test_hand_values_are_the_optima(m, optimum):
    """Device 1: start 3 + work 6m + 1 idle; the memory-free bound misses the idle. CP-SAT blind to
    the bound proves the same optimum."""
    problem = slow_head(m)
    assert memory_free_bound(problem) == pytest.approx(optimum - 1.0)
    assert arrival_bound(problem) == pytest.approx(optimum)
    assert lower_bound(problem) == pytest.approx(optimum)
    result = blind_optimum(problem, seconds=10.0)
    assert result.status == "optimal"
    assert result.plan.makespan_ms == pytest.approx(optimum)


@pytest.mark.parametrize("seed", range(8))
def test_never_above_a_blind_optimum(seed):
    """Random problems where the bound beats the memory-free one: never above the optimum CP-SAT
    proves without it (more: `bench/bounds.py --family uneven`)."""
    rng = random.Random(seed)
    for _ in range(200):
        problem = uneven_forwards(rng)
        if arrival_bound(problem) > memory_free_bound(problem) + 1e-9:
            break
    else:
        pytest.fail("no problem where the bound says something")
    result = blind_optimum(problem, seconds=8.0)
    assert result.status == "optimal"
    assert arrival_bound(problem) <= result.plan.makespan_ms + 1e-9
