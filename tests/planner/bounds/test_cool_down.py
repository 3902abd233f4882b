"""The ends argument (planner/bounds/cool_down.py): memory x time less what the warm-up and the
cool-down cannot use. Hand values of both ramps, a case where it is the strongest argument and the
blind optimum is just above it, and random problems where it beats every other argument and is
never above the optimum CP-SAT proves without it (the test that fails if it over-claims)."""

from __future__ import annotations

import random

import pytest
from core_schedules import make_problem
from pipeplan.planner.bounds import ALL, prove
from pipeplan.planner.bounds.arrivals import forward_arrivals
from pipeplan.planner.bounds.cool_down import cool_down_bound, cool_down_loss, down_mib, warm_up_loss
from pipeplan.planner.bounds.occupancy import occupancy_bound
from support.bound_cases import others, random_problem
from support.oracles import blind_optimum


def two_activations():
    """P=4, M=8, unit costs, device 0 holds two activations (200 MiB), weight gradients free: each
    microbatch holds 100 MiB there for F + the 6-ms round trip + B = 8 ms, 6,400 MiB·ms in all, so
    occupancy alone says 6,400 / 200 = 32."""
    return make_problem(p=4, m=8, limit=200.0)


def test_the_ramps_by_hand():
    """Warm-up: the second forward starts at 1 at the earliest, so 100 MiB·ms are lost. Cool-down,
    x ms before the end: no B is pending below x = 1 (W(0) follows the last B), one fits below 2,
    and below 3 the B+W work that fits in x + 1 ms caps the memory at 50 (x + 1): 200 + 100 + 25 =
    325 MiB·ms lost. (6,400 + 425) / 200 = 34.125."""
    problem = two_activations()
    assert warm_up_loss(problem, [0], forward_arrivals(problem), 200.0, 0.0) == (1.0, 100.0)
    assert down_mib(problem, [0], 0.5) == 0.0
    assert down_mib(problem, [0], 1.5) == pytest.approx(100.0)
    assert down_mib(problem, [0], 2.5) == pytest.approx(175.0)
    assert down_mib(problem, [0], 3.0) == pytest.approx(200.0)
    length, lost = cool_down_loss(problem, [0], 200.0)
    assert length == pytest.approx(3.0, abs=1e-6)
    assert 0.99 * 325.0 < lost <= 325.0  # sampled at each step's right end: never more than the truth


def test_it_is_the_strongest_argument_and_below_the_blind_optimum():
    problem = two_activations()
    assert occupancy_bound(problem) == pytest.approx(32.0)
    proof = prove(problem, ALL)
    assert proof.tight == "cool_down"
    assert proof.ms == pytest.approx(34.125, abs=0.01)
    assert others(proof.values, "cool_down") == pytest.approx(32.0)
    result = blind_optimum(problem, 20.0)
    assert result.status == "optimal" and result.plan.makespan_ms == pytest.approx(35.0)


def test_without_a_limit_or_with_room_for_everything_it_says_nothing():
    assert cool_down_bound(make_problem(p=4, m=8)) == 0.0
    assert cool_down_bound(make_problem(p=4, m=8, limit=800.0)) == 0.0


def test_never_above_a_blind_optimum_where_it_beats_every_other_argument():
    """The bound tests' random family (offload, recompute, split or not, 1-2 chunks, limits 1-1.5x
    the least memory, a heavy last stage half the time): the first five problems where the ends
    argument is the strongest and the blind solve proves its optimum (about one in ten problems;
    `bench/bounds.py` runs hundreds)."""
    rng = random.Random(1)
    checked = tried = 0
    while checked < 5:
        tried += 1
        assert tried < 200, "the argument should beat the others on about one problem in ten"
        problem = random_problem(rng)
        proof = prove(problem, ALL)
        if proof.values["cool_down"] <= others(proof.values, "cool_down") + 1e-6:
            continue
        result = blind_optimum(problem, 5.0)
        if result.status != "optimal":
            continue
        assert proof.values["cool_down"] <= result.plan.makespan_ms + 1e-9, problem.model_dump_json()
        checked += 1
