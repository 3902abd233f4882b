"""Pacing (EngineConfig.pace): a device with several stages runs an earlier stage's forward only while
that stage is fewer than pace[d] microbatches ahead of the device's last stage; the solver's greedy
tries paced variants where memory makes activations be offloaded or recomputed."""

from __future__ import annotations

import math

import pytest
from core_schedules import at_least_memory_times, make_problem, problem_doc
from pipeplan.planner.baselines import greedy
from pipeplan.planner.baselines.engine import EngineConfig, run_engine
from pipeplan.planner.baselines.greedy import forward_pipe_depths, paced_tries, paces, treatments
from pipeplan.planner.contract import Problem
from pipeplan.planner.ops import Kind
from pipeplan.planner.simulator import Schedule


def widest_lead(problem: Problem, schedule: Schedule) -> list[int]:
    """Per device, the most forwards an earlier stage had run beyond its last stage's when one of its
    forwards started (0 on a device with one stage)."""
    leads = []
    for d, order in enumerate(schedule.devices):
        stages = problem.stages_of(d)
        last, done, lead = stages[-1], dict.fromkeys(stages, 0), 0
        for op in order.compute:
            if op.kind is Kind.F:
                if op.stage != last:
                    lead = max(lead, done[op.stage] - done[last])
                done[op.stage] += 1
        leads.append(lead)
    return leads


@pytest.mark.parametrize("placement", ["v", "loop"])
def test_an_earlier_stage_never_runs_further_ahead_than_its_pace(placement):
    problem = make_problem(4, 16, chunks=2, placement=placement, p2p=0.1, b=1.3, w=0.7)
    free = run_engine(problem, EngineConfig(split=True, cap=[16] * 8))
    assert isinstance(free, Schedule)
    pace = [2, 2, 3, 1]
    assert any(lead >= p for lead, p in zip(widest_lead(problem, free), pace)), \
        "unpaced, no device runs ahead: this problem no longer shows what pacing limits"
    paced = run_engine(problem, EngineConfig(split=True, cap=[16] * 8, pace=pace))
    assert isinstance(paced, Schedule)
    assert all(lead < p for lead, p in zip(widest_lead(problem, paced), pace)), widest_lead(problem, paced)
    assert sum(len(order.compute) for order in paced.devices) == 3 * 8 * 16


def test_forward_pipe_depths_count_periods_from_first_to_last_stage():
    # V, P=4, F=B=W=1, 0.1-ms links: a device's period is 2 x 3 = 6 ms; device 0's pipe runs stages
    # 1..6 (6 ms of forwards, 7 links = 6.7 ms), device 3 holds stages 3 and 4 back to back (0 ms)
    problem = make_problem(4, 16, chunks=2, placement="v", p2p=0.1)
    assert forward_pipe_depths(problem) == [2, 1, 1, 1]
    assert paces(problem) == [("pace 2x", [4, 2, 2, 2]), ("pace 3x", [6, 3, 3, 3]),
                              ("pace 2x deepest", [4, 4, 4, 4])]


def test_paced_variants_only_where_memory_needs_offload_or_recompute():
    v = make_problem(4, 16, chunks=2, placement="v", offload=True, recompute=True, limit=500.0)
    tries = paced_tries(v, treatments(v, False))
    assert tries and all(t.treat is not None and t.config.pace is not None for t in tries)
    assert all(t.config.w_lag is None and not t.config.chunk_reserve and t.config.prefer_late_forward
               for t in tries)
    assert len({(t.treat_name, t.name) for t in tries}) == len(tries)
    unlimited = make_problem(4, 16, chunks=2, placement="v", offload=True, recompute=True)
    assert paced_tries(unlimited, treatments(unlimited, False)) == []
    one_stage = make_problem(4, 16, offload=True, recompute=True, limit=300.0)
    assert paced_tries(one_stage, treatments(one_stage, False)) == []


def tight_v_problem() -> Problem:
    """V, P=4, M=16 at 1.3x the least memory each device needs: activations must be offloaded or
    recomputed, and unpaced the devices fill up with first-chunk forwards."""
    doc = problem_doc(p=4, m=16, chunks=2, placement="v", offload=True, recompute=True, p2p=0.1, b=1.3, w=0.7)
    for s in doc["stages"]:
        s["offload_ms"] = 1.0
    return at_least_memory_times(doc, [1.3] * 4)


def test_the_solvers_greedy_finds_a_paced_plan_the_unpaced_variants_miss():
    problem = tight_v_problem()
    unpaced = [greedy.run_try(problem, a) for a in greedy.greedy_tries(problem, treatments(problem, False))]
    best_unpaced = min((o.makespan for o in unpaced if o is not None), default=math.inf)
    inline = greedy.greedy_outcome(problem)
    solver = greedy.greedy_outcome(problem, inline=False)
    assert "pace" in solver.method and "pace" not in inline.method
    assert solver.makespan < 0.7 * min(best_unpaced, inline.makespan), (solver.makespan, best_unpaced)
