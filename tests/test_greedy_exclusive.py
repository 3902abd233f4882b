"""A device that holds one activation at a time (greedy.exclusive_orders): the solver's greedy tries
a fixed order there (EngineConfig.fixed), one kept microbatch whose round trip is filled with the
forwards of q recomputed ones, which no priority rule finds."""

from __future__ import annotations

import pytest
from core_schedules import at_least_memory_times, problem_doc
from pipeplan.planner.baselines import greedy
from pipeplan.planner.baselines.engine import EngineConfig, run_engine
from pipeplan.planner.contract import Problem
from pipeplan.planner.ops import Kind, Op


def one_tight_device(share: float, p: int = 4, m: int = 8) -> Problem:
    """Uniform P, M (F=1, B=1.5, W=0.5, activations of 100 MiB, checkpoints of 10, recompute allowed);
    device P-2 at `share` x its least memory, the others roomy."""
    doc = problem_doc(p=p, m=m, recompute=True, p2p=0.05, b=1.5, w=0.5, weight_grad_mib=60.0)
    shares = [10.0] * p
    shares[p - 2] = share
    return at_least_memory_times(doc, shares)


def test_a_fixed_order_is_run_as_given_with_recomputes_before_their_backwards():
    problem = one_tight_device(1.3)
    [(label, fixed, recomputed)] = greedy.exclusive_orders(problem)[:1]
    assert label == "exclusive q=2" and list(fixed) == [2]
    cfg = EngineConfig(split=True, cap=[4, 3, 2, 1], mem_cap=[problem.limit_of(d) for d in range(4)],
                       treat=lambda k, i: "recompute" if (k, i) in recomputed else None, fixed=fixed)
    schedule = run_engine(problem, cfg)
    assert schedule is not None
    expected = [x for op in fixed[2] for x in
                ([Op(Kind.RECOMPUTE, op.stage, op.mb)] if op.kind is Kind.B and (op.stage, op.mb) in recomputed
                 else []) + [op]]
    assert schedule.devices[2].compute == expected


def test_groups_of_one_kept_and_q_recomputed_microbatches_only_where_one_activation_fits():
    problem = one_tight_device(1.3)
    orders = greedy.exclusive_orders(problem)
    # stage 2's round trip (the last stage's F and B, two links) is 2.6 forwards: q = 2, then 3
    assert [label for label, _, _ in orders] == ["exclusive q=2", "exclusive q=3"]
    _, fixed, recomputed = orders[0]
    assert fixed[2][:5] == [Op(Kind.F, 2, 0), Op(Kind.F, 2, 1), Op(Kind.F, 2, 2), Op(Kind.B, 2, 0),
                            Op(Kind.W, 2, 0)]
    assert recomputed == {(2, i) for i in range(8) if i % 3}
    assert greedy.exclusive_orders(one_tight_device(2.5)) == []  # two activations fit
    no_recompute = problem.model_copy(update={"options": problem.options.model_copy(update={"recompute": False})})
    assert greedy.exclusive_orders(no_recompute) == []


def test_the_solvers_greedy_fills_the_kept_round_trip_with_recomputed_forwards():
    problem = one_tight_device(1.3)
    inline = greedy.greedy_outcome(problem)  # no fixed orders there
    solver = greedy.greedy_outcome(problem, inline=False)
    assert "exclusive" in solver.method
    assert solver.makespan == pytest.approx(35.2)
    assert inline.makespan >= 38.0
