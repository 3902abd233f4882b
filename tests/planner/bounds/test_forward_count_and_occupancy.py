"""The forward-count (head, drain, tail) and occupancy arguments, the ones that solve a program per
device: never above a proven optimum, often above the quick arguments every plan carries.

The optima come from CP-SAT told only the quick arguments: the solver normally hands every argument
to the model as the makespan's floor and calls a plan that meets it optimal, so an oracle that knew
them could not catch one that is too high.
"""

from __future__ import annotations

import random

import pytest
from core_schedules import make_problem, problem_doc
from pipeplan.planner.bounds import ALL, QUICK, lower_bound, min_memory
from pipeplan.planner.bounds.forward_count import _whole_knapsack, forward_count_bound
from pipeplan.planner.bounds.memory_free import memory_free_bound
from pipeplan.planner.bounds.occupancy import occupancy_bound
from pipeplan.planner.bounds.pairwise_exclusion import pairwise_exclusion_bound
from pipeplan.planner.bounds.stage_tail import stage_tail_bound
from pipeplan.planner.bounds.warmup import warmup_waste
from pipeplan.planner.contract import Problem
from pipeplan.planner.solver import solve


def memory_lower_bound(problem: Problem) -> float:
    """The arguments that solve a program per device."""
    return lower_bound(problem, ALL - QUICK)


def blind_solve(problem: Problem, seconds: float):
    """A deterministic CP-SAT solve told only the quick arguments."""
    return solve(problem, seconds, engine="cpsat", deterministic=True, bounds=QUICK)


@pytest.mark.parametrize("kw", [
    {"p": 3, "m": 3, "limit": 200.0, "weight_grad_mib": 100.0, "b": 1.5},
    {"p": 4, "m": 6, "limit": 300.0, "weight_grad_mib": 50.0},
    {"p": 3, "m": 4, "split": False, "limit": 200.0, "f": 1.0, "b": 2.0, "w": 0.5},
])
def test_memory_bound_is_below_the_proven_optimum(kw):
    problem = make_problem(**kw)
    result = blind_solve(problem, 3.0)
    assert result.status == "optimal"
    assert memory_lower_bound(problem) <= result.plan.makespan_ms + 1e-9


@pytest.mark.parametrize("limit", [200.0, 250.0])
def test_tail_bound_is_tight_where_pending_weight_gradients_fill_memory(limit):
    """P=4, M=4, two activations of memory, fast offload: after the last device's last B only two
    W's can follow, then three B's and a W run down the pipeline: 17, not the other quick arguments'
    15 (the stage tail, quick, says 17 too: the last stage's last B, then the chain). With two and a
    half weight gradients of memory still only two whole W's are pending (counting the half gave
    16.5)."""
    problem = make_problem(p=4, m=4, limit=limit, weight_grad_mib=100.0, offload=True, offload_ms=1.0,
                           offloadable_mib=100.0)
    assert lower_bound(problem, QUICK - {"stage_tail"}) == 15.0
    assert stage_tail_bound(problem) == pytest.approx(17.0)
    assert memory_lower_bound(problem) == pytest.approx(17.0)
    result = blind_solve(problem, 10.0)
    assert result.status == "optimal" and result.plan.makespan_ms == pytest.approx(17.0)
    assert solve(problem, 10.0, engine="cpsat", deterministic=True).plan.gap == 0.0


def test_drain_bound_is_tight_at_one_f_one_b_memory():
    """het P=4, M=8 at 1F1B's memory: idle before the first free (the head) and between the last
    forward and its backward (the drain, capped by the pending work memory holds) add up to the
    optimum, which no search could improve on (the P=8 and P=32 benchmark cases are the same)."""
    problem = make_problem(p=4, m=8, limit=400.0, weight_grad_mib=100.0, b=1.2, w=0.8, p2p=0.05)
    assert memory_lower_bound(problem) == pytest.approx(28.8)
    result = blind_solve(problem, 10.0)
    assert result.status == "optimal" and result.plan.makespan_ms == pytest.approx(28.8)


def test_memory_bound_beats_the_quick_bound_and_holds_on_random_small_problems():
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
        result = blind_solve(problem, 2.0)
        assert result.status == "optimal"
        assert bound <= result.plan.makespan_ms + 1e-9
        stronger += bound > lower_bound(problem) + 1e-9
    assert stronger >= 2


def test_memory_bound_needs_a_limit():
    assert memory_lower_bound(make_problem(p=3, m=4)) == 0.0


def test_occupancy_bound_binds_near_the_least_memory_and_holds():
    """P=3, M=6 at the least memory any schedule needs: memory x time, not forward counts, is what
    runs out (the occupancy argument). The bound must rise above the memory-free and forward-count
    arguments and stay under the optimum CP-SAT proves without it (36 against 37). (The one-activation
    argument (one_at_a_time.py) reaches 36 here too, by another route.)"""
    doc = problem_doc(p=3, m=6, b=1.0, w=1.0, weight_grad_mib=0.0)
    need = max(min_memory(Problem.model_validate(doc)))
    for dev in doc["devices"]:
        dev["memory_limit_mib"] = need
    problem = Problem.model_validate(doc)
    occupancy = occupancy_bound(problem)
    assert occupancy > max(memory_free_bound(problem), forward_count_bound(problem)) + 1.0
    # the programs' bound takes it (and the pairwise exclusion one, which proves the optimum here)
    assert memory_lower_bound(problem) == max(occupancy, pairwise_exclusion_bound(problem))
    result = blind_solve(problem, 10.0)
    assert result.status == "optimal"
    assert max(memory_lower_bound(problem), lower_bound(problem)) <= result.plan.makespan_ms + 1e-9


def test_forwards_before_the_first_free_count_whole():
    """P=4, M=6, unit costs, device 0 holds 2.5 activations: its first backward ends at 8 at the
    earliest and frees nothing before, so only 2 whole forwards (not 2.5) can have started; with the
    backward in [7, 8) it is busy at most 3 of those 8 ms. 18 ms of work + 5 idle = 23 (22.5 counting
    fractions of a forward); the optimum CP-SAT proves without the bound is 27."""
    assert _whole_knapsack(250.0, [(1.0, 100.0, 8.0)]) == 2.0
    assert _whole_knapsack(250.0, [(1.0, 100.0, 8.0), (3.0, 120.0, 8.0)]) == 6.0  # two of the second
    assert _whole_knapsack(1000.0, [(1.0, 100.0, 3.0)]) == 3.0  # at most M
    doc = problem_doc(p=4, m=6)
    doc["devices"][0]["memory_limit_mib"] = 250.0
    problem = Problem.model_validate(doc)
    assert forward_count_bound(problem) == pytest.approx(23.0)
    result = blind_solve(problem, 20.0)
    assert result.status == "optimal"
    assert forward_count_bound(problem) <= result.plan.makespan_ms + 1e-9


def test_the_tail_counts_the_warm_up_idle_of_a_copy_bound_device():
    """P=5, M=4, unit costs but stage 2 takes 1.2x; device 2 holds two activations and a copy takes
    1.8 ms. Its first backward can start 5.2 ms after its first forward (at 2): memory and the copy
    lane let four forwards start before then, busy 4.0 ms, so 1.2 ms idle (warmup_waste). Its last B
    ends at >= 2 + 1.2 + 14.4 - 2.4 (two pending W's fit) = 15.2, then B1, B0, W0: 18.2, where the
    tail without that idle and every other argument give 17.6. The blind optimum is 20.8."""
    doc = problem_doc(p=5, m=4, offload=True, offload_ms=1.5, offloadable_mib=100.0, weight_grad_mib=100.0)
    heavy = doc["stages"][2]
    for field in ("forward_ms", "backward_input_ms", "backward_weight_ms", "offload_ms"):
        heavy[field] *= 1.2
    doc["devices"][2]["memory_limit_mib"] = 200.0
    problem = Problem.model_validate(doc)
    assert warmup_waste(problem, 2, 2) == pytest.approx(1.2)
    assert lower_bound(problem) == pytest.approx(17.6)
    assert memory_lower_bound(problem) == pytest.approx(18.2)
    result = blind_solve(problem, 20.0)
    assert result.status == "optimal" and result.plan.makespan_ms >= 18.2
