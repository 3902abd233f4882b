"""The engine's adaptive treatment (EngineConfig.adaptive): each activation is kept, offloaded or
recomputed as its forward starts, by what memory and the copy lane admit then."""

from __future__ import annotations

from dataclasses import replace

from core_schedules import make_problem

from planner.baselines.common import evaluate
from planner.baselines.engine import EngineConfig, run_engine
from planner.baselines.greedy import engine_variants, reducing_treat, reducing_treatments, run_try
from planner.contract import Problem
from planner.ops import Kind
from planner.validator import validate_plan


def tight(offload: bool, recompute: bool, copy_ms: float = 3.0) -> Problem:
    """P=4, M=8, unit costs; every device has room for two activations (1F1B wants up to four)."""
    return make_problem(p=4, m=8, limit=250.0, offload=offload, recompute=recompute, offload_ms=copy_ms,
                        offloadable_mib=100.0, checkpoint_mib=1.0, weight_grad_mib=20.0)


def cfg_of(problem: Problem, adaptive: str, eager: bool = False) -> EngineConfig:
    split = problem.options.split_backward
    limits = [problem.limit_of(d) for d in range(problem.num_devices)]
    cap = [problem.num_stages - k for k in range(problem.num_stages)]
    return EngineConfig(split=split, cap=cap, mem_cap=limits, reload_in_turn=True,
                        reserve_after_copies=eager, adaptive=adaptive)


def kinds(problem: Problem, schedule) -> dict[Kind, int]:
    out: dict[Kind, int] = {}
    for dev in schedule.devices:
        for op in dev.compute + dev.d2h + dev.h2d:
            out[op.kind] = out.get(op.kind, 0) + 1
    return out


def test_keep_first_recomputes_only_what_memory_needs():
    """Only recompute allowed: the adaptive engine keeps what fits and recomputes the rest, so it
    recomputes fewer activations than recomputing every stage but the last, and is no slower."""
    problem = tight(offload=False, recompute=True)
    schedule = run_engine(problem, cfg_of(problem, "keep first"))
    assert schedule is not None
    outcome = evaluate(problem, schedule, "adaptive")
    plan = outcome.plan()
    assert validate_plan(problem, plan) == []
    recomputes = sum(1 for d in plan.devices for op in d.ops if op.kind == "RECOMPUTE")
    every = reducing_treat(problem, "recompute")
    static = run_engine(problem, replace(cfg_of(problem, ""), treat=every))
    assert static is not None
    static_plan = evaluate(problem, static, "recompute").plan()
    assert 0 < recomputes < sum(1 for d in static_plan.devices for op in d.ops if op.kind == "RECOMPUTE")
    assert plan.makespan_ms <= static_plan.makespan_ms + 1e-9


def test_offload_first_copies_while_the_lane_is_free():
    """Offload first: the first forward of every stage but the last is offloaded (its lane is
    idle); each plan is valid and fits."""
    problem = tight(offload=True, recompute=True, copy_ms=1.0)
    schedule = run_engine(problem, cfg_of(problem, "offload first", eager=True))
    assert schedule is not None
    assert all(schedule.devices[d].d2h and schedule.devices[d].d2h[0].mb == 0
               for d in range(problem.num_devices - 1))
    assert not schedule.devices[-1].d2h  # the last stage's backward follows its forward at once
    keep = run_engine(problem, cfg_of(problem, "keep first"))
    assert keep is not None
    assert kinds(problem, schedule).get(Kind.OFFLOAD, 0) >= kinds(problem, keep).get(Kind.OFFLOAD, 0)
    for sched in (schedule, keep):
        # eager forwards fill memory to the brim: the engine's own timing is the one that fits
        outcome = evaluate(problem, sched, "adaptive", sched.engine_timing)
        assert validate_plan(problem, outcome.plan()) == []


def test_greedy_tries_both_orders_last():
    """The greedy lists the adaptive treatments after the fixed ones (the inline budget reaches
    those first), and run_try gives each its order."""
    problem = tight(offload=True, recompute=True)
    labels = [t[0] for t in reducing_treatments(problem)]
    assert labels[-2:] == ["adaptive", "adaptive, offload first"]
    only_rec = tight(offload=False, recompute=True)
    assert [t[0] for t in reducing_treatments(only_rec)][-1] == "adaptive"
    name, cfg = engine_variants(problem)[0]
    treat = {t[0]: t for t in reducing_treatments(problem)}["adaptive"]
    outcome = run_try(problem, (treat[0], treat[1], treat[2], name, cfg))
    assert outcome is not None and "adaptive" in outcome.method
    assert validate_plan(problem, outcome.plan()) == []
