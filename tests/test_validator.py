"""The validator rejects each kind of contract violation, each built by mutating a valid plan."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from core_schedules import make_problem, one_f_one_b, plan_of, serialized
from pipeplan.planner.contract import Plan, PlanOp, Problem
from pipeplan.planner.validator import InvalidPlanError, assert_valid, validate_plan

# Two devices with a link; one problem offloads (80 of 100 MiB offloadable), one recomputes (10 MiB
# checkpoint). Both plans are checked valid before any mutation.
PROBLEM = make_problem(p=2, m=3, p2p=0.5, offload=True, recompute=False)
PLAN = plan_of(PROBLEM, serialized(PROBLEM))
RPROBLEM = make_problem(p=2, m=3, p2p=0.5, offload=False, recompute=True)
RPLAN = plan_of(RPROBLEM, serialized(RPROBLEM))


def test_base_plans_are_valid():
    assert validate_plan(PROBLEM, PLAN) == []
    assert validate_plan(RPROBLEM, RPLAN) == []
    assert any(op.kind == "OFFLOAD" for op in PLAN.devices[0].ops)
    assert any(op.kind == "RECOMPUTE" for op in RPLAN.devices[0].ops)
    assert_valid(PROBLEM, PLAN)


def mutate(plan: Plan, change: Callable[[dict], None]) -> Plan:
    doc = plan.model_dump()
    change(doc)
    return Plan.model_validate(doc)


def find(doc: dict, kind: str, stage: int, mb: int) -> tuple[list, int]:
    for dp in doc["devices"]:
        for index, op in enumerate(dp["ops"]):
            if (op["kind"], op["stage"], op["mb"]) == (kind, stage, mb):
                return dp["ops"], index
    raise KeyError((kind, stage, mb))


def remove(kind: str, stage: int, mb: int):
    def change(doc):
        ops, index = find(doc, kind, stage, mb)
        del ops[index]
    return change


def shift(kind: str, stage: int, mb: int, by: float, keep_duration: bool = True):
    def change(doc):
        ops, index = find(doc, kind, stage, mb)
        ops[index]["start_ms"] += by
        if keep_duration:
            ops[index]["end_ms"] += by
    return change


def _duplicate(doc):
    ops, index = find(doc, "F", 0, 1)
    ops.insert(index + 1, dict(ops[index]))


def _wrong_device(doc):
    ops, index = find(doc, "W", 1, 2)
    op = ops.pop(index)
    doc["devices"][0]["ops"].append(op)
    doc["devices"][0]["ops"].sort(key=lambda o: o["start_ms"])


def _swap_listing(doc):
    ops = doc["devices"][0]["ops"]
    ops[0], ops[1] = ops[1], ops[0]


def _add_recompute(doc):
    ops, index = find(doc, "OFFLOAD", 0, 0)
    start = ops[index]["start_ms"]
    ops.insert(index, {"kind": "RECOMPUTE", "stage": 0, "mb": 0, "start_ms": start, "end_ms": start + 1.0})


def _overlap_offloads(doc):
    """Move OFFLOAD(0, 0) to start 0.2 ms into OFFLOAD(0, 1) (keeping its duration)."""
    ops, index = find(doc, "OFFLOAD", 0, 0)
    later, later_index = find(doc, "OFFLOAD", 0, 1)
    length = ops[index]["end_ms"] - ops[index]["start_ms"]
    ops[index]["start_ms"] = later[later_index]["start_ms"] + 0.2
    ops[index]["end_ms"] = ops[index]["start_ms"] + length


def _rekey(problem: Problem):
    return lambda doc: doc.update(problem_key=problem.key())


MUTATIONS: dict[str, tuple[Callable, str]] = {
    "missing op": (remove("F", 1, 2), "F(stage 1, mb 2) is missing"),
    "missing backward": (remove("W", 0, 1), "has only one of B and W"),
    "duplicate op": (_duplicate, "F(stage 0, mb 1) appears 2 times"),
    "wrong device": (_wrong_device, "W(stage 1, mb 2) is on device 0 but its stage is on device 1"),
    "wrong duration": (shift("B", 0, 1, 0.25, keep_duration=False), "B(stage 0, mb 1) lasts 0.75 ms"),
    "dependency broken": (shift("W", 1, 0, -0.5), "W(stage 1, mb 0) starts at"),
    "link ignored": (shift("F", 1, 0, -0.5), "before F(stage 0, mb 0) ends (1 ms) + link 0.5 ms"),
    "reload before offload ends": (shift("RELOAD", 0, 0, -4.25), "before OFFLOAD(stage 0, mb 0) ends"),
    "backward before reload": (shift("RELOAD", 0, 2, 0.25), "B(stage 0, mb 2) starts at"),
    "lane overlap": (shift("F", 0, 1, -0.5), "compute lane: F(stage 0, mb 1) starts at"),
    "copy lane overlap": (_overlap_offloads, "d2h lane: OFFLOAD(stage 0, mb 0) starts at"),
    "out of order listing": (_swap_listing, "device 0: F(stage 0, mb 0) is listed out of start_ms order"),
    "wrong makespan": (lambda d: d.update(makespan_ms=d["makespan_ms"] - 1), "makespan_ms is"),
    "wrong bubble": (lambda d: d.update(bubble_ratio=0.01), "bubble_ratio is 0.01"),
    "wrong peak": (lambda d: d["peak_memory_mib"].__setitem__(1, 5.0), "peak_memory_mib[1] is 5;"),
    "peak list length": (lambda d: d["peak_memory_mib"].pop(), "peak_memory_mib has 1 entries; expected 2"),
    "bad key": (lambda d: d.update(problem_key="0" * 64), "problem_key is 000000000000… but the problem's key"),
    "lower bound above makespan": (lambda d: d.update(lower_bound_ms=1e6), "lower_bound_ms 1e+06 exceeds"),
    "offload without reload": (remove("RELOAD", 0, 1), "(stage 0, mb 1) has OFFLOAD without RELOAD"),
    "both offload and recompute": (_add_recompute, "(stage 0, mb 0) both offloads and recomputes"),
    "device listed twice": (lambda d: d["devices"].append(d["devices"][1]), "devices lists [0, 1, 1]"),
    "unknown stage": (lambda d: d["devices"][0]["ops"].append(
        {"kind": "F", "stage": 9, "mb": 0, "start_ms": 99.0, "end_ms": 100.0}), "F(stage 9, mb 0): no such stage"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_validator_rejects(name):
    change, expected = MUTATIONS[name]
    bad = mutate(PLAN, change)
    violations = validate_plan(PROBLEM, bad)
    assert any(expected in v for v in violations), violations
    with pytest.raises(InvalidPlanError) as info:
        assert_valid(PROBLEM, bad)
    assert info.value.violations == violations


def test_memory_over_limit():
    peak = max(PLAN.peak_memory_mib)
    tight = make_problem(p=2, m=3, p2p=0.5, offload=True, limit=peak - 1.0)
    violations = validate_plan(tight, mutate(PLAN, _rekey(tight)))
    assert violations and all("over its limit" in v for v in violations), violations
    assert f"(peak {peak:g} MiB)" in violations[0]
    exact = make_problem(p=2, m=3, p2p=0.5, offload=True, limit=peak)
    assert validate_plan(exact, mutate(PLAN, _rekey(exact))) == []


def test_memory_counts_frees_before_allocations():
    """B of mb 0 ends exactly when F of mb 1 starts: a limit of one activation is enough."""
    problem = make_problem(p=1, m=2, split=False, limit=100.0)
    plan = plan_of(problem, one_f_one_b(problem))
    assert plan.peak_memory_mib == [100.0]
    assert validate_plan(problem, plan) == []


def test_split_when_disallowed():
    fused = make_problem(p=2, m=3, p2p=0.5, offload=True, split=False)
    violations = validate_plan(fused, mutate(PLAN, _rekey(fused)))
    assert any("splits B and W but options.split_backward is false" in v for v in violations), violations


def test_offload_when_disallowed():
    no_offload = make_problem(p=2, m=3, p2p=0.5)
    violations = validate_plan(no_offload, mutate(PLAN, _rekey(no_offload)))
    assert any("offloads but options.offload is false" in v for v in violations), violations


def test_recompute_when_disallowed_and_dependency():
    no_recompute = make_problem(p=2, m=3, p2p=0.5)
    violations = validate_plan(no_recompute, mutate(RPLAN, _rekey(no_recompute)))
    assert any("recomputes but options.recompute is false" in v for v in violations), violations
    # the backward must wait for its recompute
    early = mutate(RPLAN, shift("RECOMPUTE", 0, 1, 0.5))
    violations = validate_plan(RPROBLEM, early)
    assert any("B(stage 0, mb 1) starts at" in v and "RECOMPUTE(stage 0, mb 1) ends" in v for v in violations)


def test_reports_every_violation_not_just_the_first():
    bad = mutate(PLAN, lambda d: (d.update(makespan_ms=1.0, bubble_ratio=0.5), _swap_listing(d)))
    violations = validate_plan(PROBLEM, bad)
    assert len(violations) >= 3


def test_violations_are_capped_per_check():
    shifted = mutate(PLAN, lambda d: [op.update(end_ms=op["end_ms"] + 0.001) for dp in d["devices"]
                                      for op in dp["ops"]])
    violations = validate_plan(PROBLEM, shifted)
    assert any(v.startswith("... ") and "more like the above" in v for v in violations)
    assert len(violations) < 60


def test_problem_key_override():
    """Callers that already know the key (the service) may pass it instead of recomputing it."""
    assert validate_plan(PROBLEM, PLAN, problem_key=PLAN.problem_key) == []
    assert validate_plan(PROBLEM, PLAN, problem_key="f" * 64)


def test_plan_op_is_json_round_trip_stable():
    again = Plan.model_validate_json(PLAN.model_dump_json())
    assert validate_plan(PROBLEM, again) == []
    assert isinstance(again.devices[0].ops[0], PlanOp)
