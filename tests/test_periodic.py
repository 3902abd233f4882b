"""Periodic steady states (planner/solver/periodic.py): one microbatch's ops placed modulo a cycle
time by a small CP-SAT model, repeated M times, re-timed by the simulator; valid plans, at the
cycle the pipeline's busiest device allows when memory does not bind, longer when it does."""

from __future__ import annotations

import pytest
from core_schedules import make_problem
from pipeplan.planner.solver.periodic import _Model, expand, least_cycle_ms, periodic_outcome
from pipeplan.planner.validator import validate_plan


def test_without_a_binding_limit_it_repeats_at_the_busiest_devices_pace():
    """P=4, M=8, unit costs: each device does 3 ms per microbatch, so the cycle is 3 ms, and the
    repetition ends (M - 1) x 3 after one microbatch's 9 ms of forwards and backwards: 30 ms (a
    steady state has no zero-bubble tail: the heuristics reach 27)."""
    problem = make_problem(p=4, m=8)
    assert least_cycle_ms(problem) == 3.0
    out = periodic_outcome(problem, 10.0)
    assert out is not None and out.makespan == pytest.approx(30.0)
    assert out.method == "periodic (cycle 3 ms)"
    plan = out.plan(problem.key())
    assert not validate_plan(problem, plan, problem.key())


@pytest.mark.parametrize("kw", [
    {"recompute": True},
    {"offload": True, "offload_ms": 1.0, "offloadable_mib": 100.0},
])
def test_where_memory_binds_it_treats_stages_and_stays_within_the_limit(kw):
    """Device 0 holds 2.5 activations where a 3-ms cycle needs 3 in flight (its activation lives 8
    ms: F, the 6-ms round trip, B): the model recomputes or offloads every microbatch of a stage, or
    lengthens the cycle, and the repeated plan is valid (memory included)."""
    problem = make_problem(p=4, m=8, limit=250.0, **kw)
    out = periodic_outcome(problem, 10.0)
    assert out is not None
    plan = out.plan(problem.key())
    assert not validate_plan(problem, plan, problem.key())
    assert max(plan.peak_memory_mib) <= 250.0 + 1e-6
    assert out.makespan > 30.0  # memory costs the repetition time


def test_the_model_does_not_grow_with_the_microbatches():
    small, big = make_problem(p=4, m=8, limit=250.0, recompute=True), make_problem(p=4, m=64, limit=250.0,
                                                                                  recompute=True)
    sizes = [len(_Model(pr, 41).model.Proto().variables) for pr in (small, big)]
    assert sizes[0] == sizes[1]


def test_expansion_gives_every_op_of_every_microbatch_once():
    problem = make_problem(p=3, m=5)
    model = _Model(problem, 30)
    starts = model.solve(5.0, 1, 0)
    schedule = expand(problem, starts, 30, 1)
    ops = schedule.all_ops()
    assert len(ops) == len(set(ops)) == 3 * 3 * 5  # F, B, W per stage and microbatch
