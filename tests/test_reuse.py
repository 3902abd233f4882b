"""planner.reuse: a neighbour's plan becomes a valid plan of a changed problem (budget, costs,
microbatch count), or the reason it cannot; the neighbour signature and distance."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from core_schedules import make_problem
from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.reuse import best_reuse, difference, distance, nearest, reuse_plan, signature
from pipeplan.planner.solver import solve
from pipeplan.planner.validator import validate_plan

ROOT = Path(__file__).resolve().parents[1]


def limited(m: int = 8, limit: float = 300.0, **kw) -> Problem:
    """P=4 with offload and recompute, under 1F1B's 400 MiB on device 0: plans must treat some."""
    kw = {"p2p": 0.05, "b": 1.2, "w": 0.8, "offload": True, "recompute": True, **kw}
    return make_problem(4, m, limit=limit, **kw)


@pytest.fixture(scope="module")
def refined() -> tuple[Problem, Plan]:
    """The solver's plan of the limited problem, as a cache holds it (it offloads on two devices)."""
    problem = limited()
    return problem, solve(problem, 1.0, seed=0, workers=2).plan


def budget(problem: Problem, factor: float) -> Problem:
    return problem.model_copy(update={"devices": [
        d.model_copy(update={"memory_limit_mib": d.static_mib + factor * (d.memory_limit_mib - d.static_mib)})
        for d in problem.devices]})


def valid(problem: Problem, plan: Plan | None) -> Plan:
    assert plan is not None
    assert plan.problem_key == problem.key()
    assert validate_plan(problem, plan) == []
    return plan


def test_a_larger_budget_gets_the_neighbours_plan_at_once(refined) -> None:
    neighbour, plan = refined
    problem = budget(neighbour, 1.03)
    r = reuse_plan(problem, neighbour, plan)
    assert r.how == "as is" and r.reason is None and r.neighbour_key == plan.problem_key
    assert valid(problem, r.plan).makespan_ms <= plan.makespan_ms
    assert r.plan.method.startswith(f"reuse of {plan.problem_key[:12]} rev {plan.revision} (as is): ")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_recalibrated_costs_keep_the_memory_order(refined, seed: int) -> None:
    """Costs ±10% per stage at the same budget: the orders re-timed fit without repair, and no device
    peaks above the neighbour's plan (the memory gates keep each device's events in order)."""
    neighbour, plan = refined
    rng = random.Random(seed)
    names = ("forward_ms", "backward_input_ms", "backward_weight_ms", "offload_ms", "reload_ms")
    problem = neighbour.model_copy(update={"stages": [
        s.model_copy(update={n: getattr(s, n) * rng.uniform(0.9, 1.1) for n in names})
        for s in neighbour.stages]})
    r = reuse_plan(problem, neighbour, plan)
    assert r.how == "re-timed"
    got = valid(problem, r.plan)
    assert all(a <= b + 1e-6 for a, b in zip(got.peak_memory_mib, plan.peak_memory_mib))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "gpipe"])
@pytest.mark.parametrize("m", [1, 3, 4, 6])
def test_fewer_microbatches_of_a_published_schedule_is_that_schedule(name: str, m: int) -> None:
    """Trimming drops the last microbatches: what is left is the pattern for M' exactly."""
    base = make_problem(4, 8, p2p=0.1, b=1.5, w=0.7)
    problem = make_problem(4, m, p2p=0.1, b=1.5, w=0.7)
    r = reuse_plan(problem, base, run_baseline(base, name))
    assert valid(problem, r.plan).makespan_ms == pytest.approx(run_baseline(problem, name).makespan_ms)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("m", [9, 16, 32])
def test_more_microbatches_repeat_the_steady_state(name: str, m: int) -> None:
    """1F1B and ZB-H1 are periodic after their warm-up: repeating the steady state by the plan's
    period is the pattern for M' (no link cost), and never slower than it (with one)."""
    for p2p in (0.0, 0.1):
        base = make_problem(4, 8, p2p=p2p, b=1.5, w=0.7)
        problem = make_problem(4, m, p2p=p2p, b=1.5, w=0.7)
        r = reuse_plan(problem, base, run_baseline(base, name))
        assert r.how == f"8 -> {m} microbatches, re-timed"
        pattern = run_baseline(problem, name).makespan_ms
        got = valid(problem, r.plan).makespan_ms
        assert got == pytest.approx(pattern) if p2p == 0 else got <= pattern + 1e-9


@pytest.mark.parametrize("m", [16, 4, 9])
def test_a_refined_plan_resized_is_valid(refined, m: int) -> None:
    neighbour, plan = refined
    problem = neighbour.model_copy(update={"num_microbatches": m})
    r = reuse_plan(problem, neighbour, plan)
    assert r.how.startswith(f"8 -> {m} microbatches, re-timed")
    got = valid(problem, r.plan)
    assert {op.mb for dp in got.devices for op in dp.ops} == set(range(m))


def test_a_smaller_budget_is_repaired_or_refused_never_broken(refined) -> None:
    """Every budget from the least feasible up: a plan that validates there, or the reason; a
    budget the plan breaks is never answered with the plan itself."""
    neighbour, plan = refined
    repaired = 0
    for factor in (0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4):
        problem = budget(neighbour, factor)
        r = reuse_plan(problem, neighbour, plan)
        if r.plan is None:
            assert r.reason
            continue
        valid(problem, r.plan)
        if validate_plan(problem, plan.model_copy(update={"problem_key": problem.key()})):
            assert r.how != "as is"
            repaired += "repaired" in r.how
    assert repaired >= 3


def test_an_infeasible_budget_says_the_least_memory_needed(refined) -> None:
    neighbour, plan = refined
    r = reuse_plan(budget(neighbour, 0.01), neighbour, plan)
    assert r.plan is None and "needs at least" in r.reason


def test_without_treatments_a_smaller_budget_delays_allocations() -> None:
    """No offload or recompute allowed: only W's run earlier and forwards wait."""
    neighbour = make_problem(4, 8, b=1.2, w=0.8)
    plan = run_baseline(neighbour, "zb-h2")
    problem = make_problem(4, 8, b=1.2, w=0.8, limit=0.8 * max(plan.peak_memory_mib))
    r = reuse_plan(problem, neighbour, plan)
    assert r.how == "re-timed, repaired"
    assert max(valid(problem, r.plan).peak_memory_mib) <= problem.limit_of(0) + 1e-6


def test_signature_ignores_numbers_but_not_structure(refined) -> None:
    neighbour, _ = refined
    same = [budget(neighbour, 1.5), neighbour.model_copy(update={"num_microbatches": 64, "p2p_ms": 1.0}),
            neighbour.model_copy(update={"metadata": {"model": "another"}}),
            limited(activation_mib=120.0, f=2.0)]
    assert {signature(p) for p in same} == {signature(neighbour)}
    assert all(difference(p, neighbour) is None for p in same)
    loop, v = make_problem(2, 8, chunks=2), make_problem(2, 8, chunks=2, placement="v")
    others = [(make_problem(2, 8, offload=True, recompute=True, limit=300.0), neighbour, "num_devices"),
              (limited(recompute=False), neighbour, "options"),
              (v, loop, "stages[2].device")]
    for problem, base, field in others:
        assert signature(problem) != signature(base)
        r = reuse_plan(problem, base, refined[1] if base is neighbour else run_baseline(base, "gpipe"))
        assert r.plan is None and r.reason.startswith(f"not a neighbour: {field}")


def test_nearest_ranks_by_distance_and_flags_larger_budgets(refined) -> None:
    neighbour, plan = refined
    problem = budget(neighbour, 0.97)
    # 3% more and 3% less memory: the smaller budget's plan fits as it is, so it ranks first
    roomy, tight = budget(neighbour, 1.0), budget(neighbour, 0.94)
    doubled = neighbour.model_copy(update={"num_microbatches": 16})
    foreign = make_problem(2, 8, offload=True, recompute=True, limit=300.0)
    candidates = [(doubled, "doubled"), (foreign, "foreign"), (roomy, "roomy"), (tight, "tight")]
    ranked = nearest(problem, candidates)
    assert [item for _, _, item in ranked] == ["tight", "roomy", "doubled"]
    assert distance(problem, roomy).larger_budget and not distance(problem, tight).larger_budget
    assert distance(problem, doubled).microbatches == pytest.approx(0.5)
    best = best_reuse(problem, [(foreign, plan), (neighbour, plan)])
    assert best is not None and best.neighbour_key == plan.problem_key and valid(problem, best.plan)
    assert best_reuse(problem, [(foreign, plan)]) is None
    wrong = reuse_plan(problem, doubled, plan)  # not the plan of that neighbour
    assert wrong.plan is None and "not the neighbour's" in wrong.reason


def test_bench_quick_prints_every_change() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "reuse.py"), "--quick"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| qwen")]
    assert [r.split(" | ")[1] for r in rows] == ["budget +5%", "budget -5%", "M x2", "M /2", "costs +10%",
                                                  "costs ±10%"]
    assert "as is" in rows[0] and "32 -> 64 microbatches" in rows[2]
