"""The greedy's "offload, crowded recompute" treatment: a stage whose activation never fits beside a
later stage's on its device (the LM head beside the embedding in V placement) is recomputed, the rest
offloaded."""

from __future__ import annotations

from core_schedules import at_least_memory_times, problem_doc
from pipeplan.planner.baselines import best_heuristic
from pipeplan.planner.baselines.greedy import (
    Attempt,
    crowded,
    engine_variants,
    reducing_treat,
    reducing_treatments,
    run_try,
)
from pipeplan.planner.contract import Problem
from pipeplan.planner.validator import validate_plan


def head_heavy_v(m: int = 8) -> Problem:
    """V placement on 4 devices; the last stage (device 0) holds 4x the others' activation, and
    device 0 has just room for it and checkpoints: stage 0's activation cannot sit beside it. Copies
    take 3 forwards, so an offloaded activation of stage 0 crowds out the head (129 vs 137 ms)."""
    doc = problem_doc(p=4, m=m, chunks=2, placement="v", offload=True, recompute=True)
    last = doc["stages"][-1]
    last["activation_mib"] *= 4
    last["offloadable_mib"] = last["activation_mib"]
    for s in doc["stages"]:
        s["offload_ms"] = 3.0 * s["forward_ms"]
        s["reload_ms"] = 3.0 * s["forward_ms"]
    return at_least_memory_times(doc, [1.05, 2.0, 2.0, 2.0])


def test_crowded_names_only_the_stage_beside_the_head():
    problem = head_heavy_v()
    assert [k for k in range(problem.num_stages) if crowded(problem, k)] == [0]
    treat = reducing_treat(problem, "offload, crowded recompute")
    assert treat is not None
    assert treat(0, 3) == "recompute"
    assert treat(1, 3) == "offload"


def test_no_crowded_treatment_where_nothing_is_crowded():
    doc = problem_doc(p=4, m=8, chunks=2, placement="v", offload=True, recompute=True)
    problem = Problem.model_validate(doc)
    assert not any(crowded(problem, k) for k in range(problem.num_stages))
    assert all("crowded" not in name for name, _, _ in reducing_treatments(problem))


def test_crowded_treatment_is_valid_and_beats_offloading_everything():
    problem = head_heavy_v()

    def best_of(mode: str) -> float:
        treat = reducing_treat(problem, mode)
        spans = []
        for eager in (False, True):
            for name, cfg in engine_variants(problem):
                out = run_try(problem, Attempt(mode, treat, eager, name, cfg))
                if out is not None:
                    plan = out.plan()
                    assert validate_plan(problem, plan) == []
                    spans.append(plan.makespan_ms)
        return min(spans)

    crowd, offload = best_of("offload, crowded recompute"), best_of("offload")
    assert crowd < offload
    best = best_heuristic(problem)
    assert validate_plan(problem, best) == []
    assert best.makespan_ms <= crowd + 1e-9
