"""The registry of bound arguments: `prove` names the tight one, `lower_bound` takes the largest of
those asked for, and a solve assumes only the ones it is given."""

from __future__ import annotations

import pytest
from core_schedules import make_problem
from pipeplan.planner.bounds import ALL, ARGUMENTS, QUICK, lower_bound, prove
from pipeplan.planner.solver import solve
from support.bound_cases import heavy_head


def one_activation_device():
    """P=2, M=4, unit costs, room for one activation, 3-ms copies: 13 memory-free, 14 with the
    warm-up idle, 16 holding one activation at a time, 17 by pairwise exclusion."""
    return make_problem(p=2, m=4, limit=100.0, offload=True, offload_ms=3.0, offloadable_mib=100.0)


def test_prove_names_the_tight_argument_and_every_value():
    problem = one_activation_device()
    quick = prove(problem)
    assert (quick.ms, quick.tight) == (pytest.approx(16.0), "one_at_a_time")
    assert quick.values == pytest.approx({"memory_free": 13.0, "arrivals": 13.0, "warm_up": 14.0,
                                          "one_at_a_time": 16.0, "stage_tail": 11.0})
    every = prove(problem, ALL)
    assert (every.ms, every.tight) == (pytest.approx(17.0), "pairwise_exclusion")
    assert set(every.values) == ALL
    assert prove(problem, {"warm_up", "memory_free"}).tight == "warm_up"


def test_a_tie_goes_to_the_argument_listed_first():
    """heavy_head(2): the stage tail, forward counting and pairwise exclusion all prove 19.5."""
    proof = prove(heavy_head(2), ALL)
    assert proof.values["forward_count"] == proof.values["pairwise_exclusion"] == pytest.approx(19.5)
    assert proof.values["stage_tail"] == pytest.approx(19.5)
    assert proof.tight == "stage_tail"


def test_lower_bound_is_the_largest_of_the_arguments_asked_for():
    problem = one_activation_device()
    assert lower_bound(problem) == max(a.bound(problem) for a in ARGUMENTS if a.name in QUICK)
    assert lower_bound(problem, ALL) == max(a.bound(problem) for a in ARGUMENTS)
    assert lower_bound(problem, ()) == 0.0
    assert prove(problem, ()).tight is None
    assert QUICK < ALL and {a.name for a in ARGUMENTS} == ALL


def test_an_unknown_argument_is_named():
    with pytest.raises(ValueError, match="'exclusive'"):
        lower_bound(one_activation_device(), {"exclusive"})


def test_a_solve_assumes_only_the_arguments_it_is_given():
    problem = one_activation_device()
    assert solve(problem, 0.0).lower_bound_ms == pytest.approx(16.0)
    blind = solve(problem, 0.0, bounds={"memory_free"})
    assert blind.lower_bound_ms == pytest.approx(13.0) and blind.solver_bound_ms is None
    programs = solve(problem, 0.0, bounds={"memory_free", "pairwise_exclusion"})
    assert programs.solver_bound_ms == pytest.approx(17.0)
    with pytest.raises(ValueError, match="'nonsense'"):
        solve(problem, 0.0, bounds={"nonsense"})
