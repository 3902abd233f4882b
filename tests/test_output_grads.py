"""`stages[k].output_grad_mib`: what B allocates and keeps until W beside the activation (the output
gradients torch's split backward stores for the weight gradients; measured on an H200 to the MiB,
docs/torch.md "On a GPU"). Counted by the contract's deltas, the least memory, every solver and the
heuristics; unset, a problem keeps its key."""

from __future__ import annotations

import logging

import pytest
from core_schedules import make_problem, plan_of, problem_doc, serialized
from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.bounds import min_memory
from pipeplan.planner.contract import Problem
from pipeplan.planner.memory import held_until_w
from pipeplan.planner.solver import solve
from pipeplan.planner.solver.periodic import TICKS_PER_MS, _Model, least_cycle_ms, periodic_outcome
from pipeplan.planner.validator import validate_plan
from pydantic import ValidationError

GRADS = 60.0  # beside a 100-MiB activation, of which W needs 20 (weight_grad_mib)


def with_grads(limit: float | None = None, **kw) -> Problem:
    return make_problem(p=2, m=4, limit=limit, weight_grad_mib=20.0, output_grad_mib=GRADS, **kw)


def test_it_may_exceed_the_activation_and_an_unset_one_leaves_the_key_alone():
    plain = make_problem(p=2, m=4)
    doc = problem_doc(p=2, m=4, output_grad_mib=None)
    assert Problem.model_validate(doc).key() == plain.key()
    big = with_grads()
    assert big.stages[0].output_grad_mib == GRADS and big.key() != plain.key()
    assert make_problem(p=2, m=4, output_grad_mib=250.0).output_grad_of(1) == 250.0  # above the activation
    with pytest.raises(ValidationError, match="output_grad_mib must be >= 0"):
        make_problem(p=2, m=4, output_grad_mib=-1.0)


def test_one_microbatch_at_a_time_peaks_at_its_activation_plus_what_b_keeps():
    """The serialized schedule holds one activation at a time: each device peaks at B's start,
    100 + 60; without a split backward nothing is kept for W and the least memory is 100."""
    problem = with_grads()
    plan = plan_of(problem, serialized(problem))
    assert validate_plan(problem, plan) == []
    assert plan.peak_memory_mib == pytest.approx([100.0 + GRADS] * 2)
    assert min_memory(problem) == pytest.approx([100.0 + GRADS] * 2)
    assert min_memory(with_grads(split=False)) == pytest.approx([100.0, 100.0])


def test_torchs_first_stage_keeps_none_since_its_whole_backward_runs_in_w():
    held = held_until_w(with_grads())
    assert [s.weight_grad_mib for s in held.stages] == [100.0, 100.0]
    assert [held.output_grad_of(k) for k in range(2)] == [0.0, GRADS]


LIMIT = 300.0  # P=3: two activations in flight beside one B's gradients and a pending W's part


def tight() -> Problem:
    return make_problem(p=3, m=6, limit=LIMIT, weight_grad_mib=20.0, output_grad_mib=GRADS)


@pytest.mark.parametrize("engine", ["cpsat", "milp"])
def test_the_solvers_plan_within_the_limit_with_it(engine, caplog):
    """CP-SAT's own optimum (23 ms) counts B's gradients from B's start to W's end: a model that
    left them out finds a 23-ms order that passes the limit, which the validator refuses (the solve
    then returns 1F1B's 24). MILP counts them from F, which may only over-count; without them its
    solutions pass the limit and are refused (a warning) where now none is."""
    problem = tight()
    with caplog.at_level(logging.WARNING):
        result = solve(problem, 5.0, hint=plan_of(problem, serialized(problem)), engine=engine,
                       deterministic=True)
    assert not [r for r in caplog.records if "solver plan rejected" in r.getMessage()]
    assert validate_plan(problem, result.plan) == []
    assert max(result.plan.peak_memory_mib) <= LIMIT + 1e-6
    if engine == "cpsat":
        assert result.plan.method == "cp-sat" and result.plan.makespan_ms == pytest.approx(23.0)


def test_the_periodic_model_counts_it_in_its_cycle():
    """P=2 at 250 MiB: the least cycle (3 ms, the busiest device's work) repeats two activations
    and a pending W's part beside each other, which fits only without B's 60 MiB: the model finds
    that cycle without them and none with them; the repetition it gives is valid."""
    with_grads, without = (make_problem(p=2, m=6, limit=250.0, weight_grad_mib=20.0, output_grad_mib=og)
                           for og in (GRADS, None))
    period = round(least_cycle_ms(with_grads) * TICKS_PER_MS)
    assert _Model(without, period).solve(3.0, 1, 0) is not None
    assert _Model(with_grads, period).solve(3.0, 1, 0) is None
    out = periodic_outcome(with_grads, 5.0)
    assert out is not None and validate_plan(with_grads, out.plan(with_grads.key()), with_grads.key()) == []


def test_the_heuristics_plan_within_the_limit_with_it():
    problem = tight()
    plan = run_baseline(problem, "greedy")
    assert validate_plan(problem, plan, problem.key()) == []
    assert max(plan.peak_memory_mib) <= LIMIT + 1e-6
