"""The stage-tail argument (planner/bounds/stage_tail.py): its value by hand on a V placement's LM
head, exact where a plan meets it, and never above an optimum found without it. That no simulated
valid plan is below it is checked with every quick argument (test_bounds.py's property test)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from core_schedules import problem_doc
from pipeplan.planner.baselines import best_heuristic
from pipeplan.planner.bounds import ALL, prove
from pipeplan.planner.bounds.backward_stretches import backward_stretches_bound
from pipeplan.planner.bounds.pipeline import backward_chain, forward_head
from pipeplan.planner.bounds.stage_tail import stage_tail_bound
from pipeplan.planner.contract import Problem
from support.bound_cases import deciding, others, random_problem
from support.oracles import blind_optimum

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for bench/

from bench.models import select_rows


def real_row(name: str, microbatches: int):
    [row] = [r for r in select_rows(False, name) if r.id == name]
    return row.problem(microbatches)


def test_the_lm_head_by_hand():
    """Gemma-2-9B-like V on 8 devices at 70%, M = 8: device 0 holds the embedding and the LM head.
    Its last head B ends after the head's forwards and backwards from the head's forward head on,
    and all its W's but those whose weight gradients fit beside a head activation; then the
    backward chain through all 15 other stages. 670.8 ms: what 240 s of whole-problem CP-SAT found
    (docs/benchmarks.md), so the optimum; every other argument says at most 651.4."""
    problem = real_row("gemma2-9b-p8-v@70%", 8)
    head = problem.stages[-1]
    assert problem.stages_of(0) == [0, problem.num_stages - 1]
    waiting = 1 + int((problem.free_mib(0) - head.activation_mib) // head.weight_grad_mib)
    last = problem.num_stages - 1
    expected = (forward_head(problem, last) + 8 * (head.forward_ms + head.backward_input_ms)
                + (8 - waiting) * head.backward_weight_ms + backward_chain(problem, last))
    assert stage_tail_bound(problem) == pytest.approx(expected)
    assert expected == pytest.approx(670.8, abs=0.05)
    proof = prove(problem, ALL)
    assert proof.tight == "stage_tail"
    assert others(proof.values, "stage_tail") < 651.5


def test_exact_where_a_plan_meets_it():
    """Llama-2-7B on 8 GPUs at 1F1B's memory, M = 8: the last stage (the heaviest, with the LM head)
    runs its 8 forwards and backwards from 110 ms on and one of its W's (memory lets 7 wait), then
    the 131.6-ms chain: 538.4, which the greedy's plan meets, so both are optimal."""
    problem = real_row("llama2-7b-p8@100%", 8)
    assert best_heuristic(problem).makespan_ms == pytest.approx(stage_tail_bound(problem))
    assert stage_tail_bound(problem) > others(prove(problem, ALL).values, "stage_tail") + 1.0


def test_a_negligible_weight_gradient_lets_every_w_wait():
    """Memory over a weight gradient of 1e-310 MiB overflows to infinity (hypothesis found it): every
    W may wait, and the bound is the forwards, backwards and chain alone."""
    problem = Problem.model_validate(problem_doc(p=2, m=3, weight_grad_mib=1e-310, limit=150.0))
    # stage 1 from 1 ms on: 3 F and 3 B, then B(0) and W(0)
    assert stage_tail_bound(problem) == pytest.approx(1.0 + 6.0 + 2.0)
    assert backward_stretches_bound(problem) > 0.0  # one activation at a time: it applies


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_never_above_a_blind_optimum(seed):
    """Random small problems where this argument is above every other one: CP-SAT blind to the
    memory-aware bounds proves an optimum, and the argument is not above it."""
    problem, bound = deciding(random_problem, random.Random(seed), "stage_tail")
    result = blind_optimum(problem, seconds=8.0)
    assert result.status == "optimal"
    assert bound <= result.plan.makespan_ms + 1e-9
