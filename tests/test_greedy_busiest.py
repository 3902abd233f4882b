"""The solver's greedy doubles the warm-up cap of a uniquely busiest device in the middle of the chain
(greedy.busiest_tries): under 1F1B's cap it idles until its first backward comes back."""

from __future__ import annotations

from core_schedules import at_least_memory_times, make_problem, problem_doc
from pipeplan.planner.baselines import greedy
from pipeplan.planner.baselines.greedy import busiest_tries, treatments
from pipeplan.planner.contract import Problem


def heavy_middle(heavy: float = 1.5, stage: int = 1) -> Problem:
    """P=6, M=8, one stage `heavy` times the others, its device at 1.6x its least memory."""
    doc = problem_doc(p=6, m=8, offload=True, recompute=True, offload_ms=1.5)
    for field in ("forward_ms", "backward_input_ms", "backward_weight_ms"):
        doc["stages"][stage][field] *= heavy
    return at_least_memory_times(doc, [1.6 if d == stage else 3.2 for d in range(6)])


def test_only_the_busiest_stage_gets_twice_one_f_one_b_cap():
    problem = heavy_middle()
    tries = busiest_tries(problem, treatments(problem, False))
    assert tries and all("busiest 2x" in t.name for t in tries)
    one_f_one_b = [6 - k for k in range(6)]
    for t in tries:
        assert t.config.cap == [2 * 5 - 1 if k == 1 else c for k, c in enumerate(one_f_one_b)]


def test_no_busiest_variants_without_a_clear_middle_bottleneck():
    for problem in (heavy_middle(heavy=1.02), heavy_middle(stage=5),
                    make_problem(4, 16, chunks=2, placement="v", offload=True, limit=500.0)):
        assert busiest_tries(problem, treatments(problem, False)) == []


def test_the_solvers_greedy_takes_a_busiest_variant_where_it_is_faster():
    problem = heavy_middle()
    solver = greedy.greedy_outcome(problem, inline=False)
    assert "busiest 2x" in solver.method
    assert solver.makespan < greedy.greedy_outcome(problem).makespan
