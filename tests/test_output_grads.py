"""`stages[k].output_grad_mib`: what B allocates and keeps until W beside the activation (the output
gradients torch's split backward stores for the weight gradients; measured on an H200 to the MiB,
docs/torch.md "On a GPU"). Counted by the contract's deltas, the least memory, every solver and the
heuristics; unset, a problem keeps its key."""

from __future__ import annotations

import pytest
from core_schedules import make_problem, plan_of, problem_doc, serialized
from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.bounds import min_memory
from pipeplan.planner.contract import Problem
from pipeplan.planner.memory import held_until_w
from pipeplan.planner.solver import solve
from pipeplan.planner.solver.periodic import periodic_outcome
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
def test_the_solvers_plan_within_the_limit_with_it(engine):
    """CP-SAT's own optimum (23 ms) counts B's gradients from B's start to W's end: a model that
    left them out finds a 23-ms order that passes the limit, which the validator refuses (the solve
    then returns 1F1B's 24). MILP counts them from F, which may only over-count."""
    problem = tight()
    result = solve(problem, 5.0, hint=plan_of(problem, serialized(problem)), engine=engine, deterministic=True)
    assert validate_plan(problem, result.plan) == []
    assert max(result.plan.peak_memory_mib) <= LIMIT + 1e-6
    if engine == "cpsat":
        assert result.plan.method == "cp-sat" and result.plan.makespan_ms == pytest.approx(23.0)


def test_the_periodic_model_and_the_heuristics_plan_within_the_limit_with_it():
    problem = tight()
    out = periodic_outcome(problem, 5.0)
    assert out is not None
    for plan in [out.plan(problem.key()), run_baseline(problem, "greedy")]:
        assert validate_plan(problem, plan, problem.key()) == [], plan.method
        assert max(plan.peak_memory_mib) <= LIMIT + 1e-6, plan.method
