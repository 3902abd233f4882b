"""The several-stage warm-up (planner/bounds/chunk_warmup.py, inside the forward-count argument): hand
values, never above an optimum found without it, and strictly stronger than every other bound where
the LM head shares a device with the embedding stage. That no simulated valid plan is below it is
checked with every argument together (test_pairwise_exclusion.py)."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from core_schedules import make_problem, slow_copies_chunked
from pipeplan.planner.bounds import ALL, QUICK, lower_bound
from pipeplan.planner.bounds.chunk_warmup import chunked_warmup_waste
from pipeplan.planner.bounds.pairwise_exclusion import pairwise_exclusion_bound
from pipeplan.planner.bounds.pipeline import first_backward_start
from pipeplan.planner.contract import Problem
from support.bound_cases import heavy_head, other_bounds, random_problem
from support.oracles import blind_optimum

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for bench/

from bench.model_suite import find
from bench.models import rows_of


def test_heavy_head_hand_value():
    """M=3: the head's first backward starts at 6.5 at the earliest and only 20 MiB sit beside its
    activation then, so the embedding forwards before it are recomputed (R = F: no work done) and
    only the head's own forward (2) counts: 4.5 idle, 22.5 of work, 27.0, the proven optimum, where
    the pairwise exclusion bound says 25.5."""
    problem = heavy_head(3)
    assert first_backward_start(problem, 5) == pytest.approx(6.5)
    assert chunked_warmup_waste(problem, 0) == pytest.approx(4.5)
    assert chunked_warmup_waste(problem, 1) == 0.0  # room for everything there
    assert lower_bound(problem, ALL - QUICK) == pytest.approx(27.0)
    assert pairwise_exclusion_bound(problem) == pytest.approx(25.5)
    assert other_bounds(problem) < 27.0 - 1e-9
    result = blind_optimum(problem)
    assert result.status == "optimal" and result.plan.makespan_ms == pytest.approx(27.0)


def test_copy_bound_embedding_hand_value():
    """Gemma-2-9B-like V on 8 GPUs at 70% of 1F1B's memory: the head's activation (4,056 MiB) leaves
    648 of device 0's 4,704 free beside it, less than one embedding activation (1,312), so before
    the head's first backward only embedding forwards whose copies have ended count, one per 27.5-ms
    copy after the first forward's end, plus the head's forward. Memory must hold at the start of
    the last of those forwards too, a forward (9.6 ms) before the backward at the latest, so a copy
    counts only if it ends by then: 7 do for the backward's earliest start (221.8 ms); the 8th does
    for a start at 239.4, which would gain 9.6 ms of work for 17.5 of waiting. (Counting copies
    that end by the backward itself, the 8th was worth its 7.9 ms wait: 1.7 ms less idle.)"""
    [row] = [r for r in rows_of(replace(find("gemma2-9b-p8-v"), one_gpu_per_stage=True)) if r.share == 0.7]
    problem = row.problem()
    emb, head = problem.stages[0], problem.stages[-1]
    earliest = first_backward_start(problem, problem.num_stages - 1)
    assert int((earliest - 2 * emb.forward_ms) // emb.offload_ms) == 7
    eighth = 2 * emb.forward_ms + 8 * emb.offload_ms
    assert eighth - 8 * emb.forward_ms > earliest - 7 * emb.forward_ms
    expected = earliest - 7 * emb.forward_ms - head.forward_ms
    assert chunked_warmup_waste(problem, 0) == pytest.approx(expected, abs=0.01)
    assert lower_bound(problem, ALL - QUICK) >= problem.num_microbatches * problem.work_ms(0) + expected - 1e-6


def test_nothing_without_a_limit_or_with_one_stage():
    assert chunked_warmup_waste(make_problem(p=3, m=4, chunks=2, placement="v"), 0) == 0.0
    assert chunked_warmup_waste(make_problem(p=3, m=4, limit=500.0), 0) == 0.0


def test_room_for_everything_leaves_only_the_chain():
    """With memory for every activation, the work there is before the head's first backward (6.5)
    is the three embedding forwards (1.5) and the head's own (2): 3.0, less than with 320 MiB."""
    doc = heavy_head(3).model_dump()
    doc["devices"][0]["memory_limit_mib"] = 10_000.0
    assert chunked_warmup_waste(Problem.model_validate(doc), 0) == pytest.approx(3.0)


@pytest.mark.parametrize(("family", "seed"), [(random_problem, s) for s in (0, 1, 2, 3, 5, 6, 7)]
                         + [(slow_copies_chunked, s) for s in (2, 3, 7, 8, 11)])
def test_never_above_a_blind_optimum(family, seed):
    """Random small problems where this bound decides (above every other one): CP-SAT blind to the
    memory-aware bounds proves an optimum, and the bound is not above it. The second family is where
    the copies ended by the last forward's start decide how many forwards fit. (random_problem's
    seed 4: not proven in 8 s, deterministically.)"""
    rng = random.Random(seed)
    for _ in range(300):
        problem = family(rng)
        bound = lower_bound(problem, ALL - QUICK)
        if problem.chunks > 1 and bound > max(other_bounds(problem),
                                              pairwise_exclusion_bound(problem)) + 1e-6:
            break
    else:
        pytest.fail("no random problem where the bound decides")
    result = blind_optimum(problem, seconds=8.0)
    assert result.status == "optimal"
    assert bound <= result.plan.makespan_ms + 1e-9
