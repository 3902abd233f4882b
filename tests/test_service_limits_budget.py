"""A refine budget is a budget: seeding (the baselines, the widened greedy) stops at the deadline
on a big problem, and a spent budget is a normal end ("budget"), not a job killed by RQ."""

from __future__ import annotations

import time

from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.solver import solve


def test_seeding_a_big_problem_stops_at_the_deadline():
    spec = {"model": {"layers": 64, "hidden": 4096, "heads": 32, "vocab": 32000, "seq_len": 4096},
            "hardware": "H100-80GB", "training": {"devices": 32, "microbatches": 128, "memory_budget_gib": 30}}
    problem = problem_from_document(spec)  # its baselines alone take well over 10 s on this machine
    t0 = time.monotonic()
    result = solve(problem, 2.0, workers=1)
    took = time.monotonic() - t0
    # unbounded, the seeding alone runs well over 10 s; the margin is for a loaded machine (a 2-s
    # budget took 3.2 s at load 8 on 2 cores), not for the budget
    assert took <= 2.0 + 3.0, f"a 2-s budget ran {took:.1f} s"
    assert result.outcome == "budget" and result.plan.makespan_ms > 0
