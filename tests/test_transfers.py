"""Transfers cost something: plans report them, drop the ones memory does not need, respect a host cap
(planner/transfers.py, docs/transfers.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeplan.planner.baselines import best_heuristic
from pipeplan.planner.baselines.classic import gpipe_orders
from pipeplan.planner.baselines.common import DoesNotFit, Outcome, better, evaluate, peaks_of, schedule_of
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.documents import problem_from_spec
from pipeplan.planner.memory import TimedOp, peak_memory
from pipeplan.planner.ops import Choice, Kind
from pipeplan.planner.simulator import Timing, build_plan, simulate
from pipeplan.planner.solver.incumbent import Incumbent
from pipeplan.planner.spec import spec_from_document
from pipeplan.planner.transfers import HEADROOM, prune, prune_plan
from pipeplan.planner.validator import validate_plan

SPECS = Path(__file__).resolve().parents[1] / "examples" / "specs"
GIB = 1024.0
LLAMA_MAKESPAN_BEFORE = 2311.6027  # best_heuristic before pruning existed: 192 offloads, 450 GiB/iter

SMALL = {"num_devices": 2, "num_microbatches": 4, "p2p_ms": 0.05, "options": {"offload": True},
         "stages": [{"device": d, "forward_ms": 1, "backward_input_ms": 1.1, "backward_weight_ms": 0.9,
                     "offload_ms": 0.6, "activation_mib": 512} for d in range(2)],
         "devices": [{"memory_limit_mib": 20000, "static_mib": 12000}, {"static_mib": 12000}]}
SMALL_KEY = "668e1cd3ffc711148ac090e0d3de975e2fecf37ef2aa86d232ed0b2db9c0556e"  # computed before the change


def llama(host_cap_mib: float | None = None) -> Problem:
    """Llama-2-7B on 8xH100 with offload allowed and 32 GiB per device (the issue's case)."""
    doc = json.loads((SPECS / "llama7b_8xh100.json").read_text())
    doc["training"].update(offload=True, memory_budget_gib=32)
    problem = problem_from_spec(spec_from_document(doc))
    devices = [d.model_copy(update={"host_memory_limit_mib": host_cap_mib}) for d in problem.devices]
    return problem.model_copy(update={"devices": devices})


def ops_of_kind(plan: Plan, kind: str) -> list[tuple[int, object]]:
    return [(dp.device, op) for dp in plan.devices for op in dp.ops if op.kind == kind]


def with_limits(problem: Problem, limits: list[float], host: float | None = None) -> Problem:
    devices = [d.model_copy(update={"memory_limit_mib": lim, "host_memory_limit_mib": host})
               for d, lim in zip(problem.devices, limits)]
    return Problem.model_validate({**problem.model_dump(), "devices": [d.model_dump() for d in devices]})


def all_offloaded(problem: Problem):
    """GPipe with every (stage, mb) offloaded: treats far more than any budget needs."""
    treat = {(k, i): "offload" for k in range(problem.num_stages) for i in range(problem.num_microbatches)}
    schedule = schedule_of(problem, gpipe_orders(problem), treat)
    return schedule, simulate(problem, schedule)


# -- contract ----------------------------------------------------------------------------------------

def test_key_unchanged_when_host_limit_unset():
    problem = Problem.model_validate(SMALL)
    assert problem.key() == SMALL_KEY
    assert "host_memory_limit_mib" not in problem.canonical_json()
    capped = with_limits(problem, [20000.0, None], host=1024.0)
    assert capped.key() != with_limits(problem, [20000.0, None]).key()


def test_example_spec_key_unchanged():
    doc = json.loads((SPECS / "llama7b_8xh100.json").read_text())
    key = problem_from_spec(spec_from_document(doc)).key()
    assert key == "03138338b07924cd73cb954ac362d407c9894c879f559e01c8e2ccf2b61c9385"


def test_old_plan_without_transfer_fields_still_parses_and_validates():
    problem = Problem.model_validate(SMALL)
    schedule, timing = all_offloaded(problem)
    doc = build_plan(problem, schedule, timing, "old").model_dump()
    for name in ("offloaded_mib", "recompute_ms", "host_memory_mib"):
        del doc[name]
    old = Plan.model_validate(doc)
    assert old.offloaded_mib is None and old.host_memory_mib is None
    assert validate_plan(problem, old) == []


# -- the case ----------------------------------------------------------------------------------

def test_llama_offloads_on_device_0_only_and_is_not_slower():
    problem = llama()
    plan = best_heuristic(problem)
    offloads = ops_of_kind(plan, "OFFLOAD")
    assert {device for device, _ in offloads} <= {0}
    assert plan.makespan_ms <= LLAMA_MAKESPAN_BEFORE + 1e-6
    assert plan.offloaded_mib == pytest.approx(sum(problem.stages[op.stage].offloadable_mib for _, op in offloads))
    assert plan.offloaded_mib < 32 * GIB  # was 450 GiB per iteration
    assert plan.host_memory_mib[1:] == [0.0] * 7


def test_llama_host_cap_is_respected():
    cap = 4800.0  # two of device 0's activations, below the 9.4 GiB the uncapped plan pins
    problem = llama(host_cap_mib=cap)
    plan = best_heuristic(problem)
    assert validate_plan(problem, plan) == []
    assert max(plan.host_memory_mib) <= cap


# -- metrics and the validator ---------------------------------------------------------------------------

def host_peak_brute_force(problem: Problem, plan: Plan, device: int) -> float:
    """Live pinned MiB at each OFFLOAD start: held on [OFFLOAD start, RELOAD end)."""
    ops = [op for dp in plan.devices if dp.device == device for op in dp.ops]
    spans = {}
    for op in ops:
        if op.kind in ("OFFLOAD", "RELOAD"):
            spans.setdefault((op.stage, op.mb), {})[op.kind] = op
    held = [(s["OFFLOAD"].start_ms, s["RELOAD"].end_ms, problem.stages[k].offloadable_mib)
            for (k, _), s in spans.items()]
    return max([sum(mib for a, b, mib in held if a <= t < b) for t, _, _ in held], default=0.0)


def test_metrics_equal_a_recomputation_from_the_ops():
    problem = Problem.model_validate({**SMALL, "options": {"offload": True, "recompute": True}})
    treat = {(0, 0): "offload", (0, 1): "offload", (0, 2): "recompute", (1, 3): "offload"}
    schedule = schedule_of(problem, gpipe_orders(problem), treat)
    plan = build_plan(problem, schedule, simulate(problem, schedule), "test")
    assert plan.offloaded_mib == pytest.approx(3 * 512.0)
    assert plan.recompute_ms == pytest.approx(1.0)
    assert plan.host_memory_mib == pytest.approx([host_peak_brute_force(problem, plan, d) for d in range(2)])
    assert plan.host_memory_mib[0] >= 512.0
    assert validate_plan(problem, plan) == []


@pytest.mark.parametrize("field,value", [("offloaded_mib", 1.0), ("recompute_ms", 5.0),
                                         ("host_memory_mib", [0.0, 0.0])])
def test_validator_rejects_a_plan_that_lies_about_transfers(field, value):
    problem = Problem.model_validate(SMALL)
    schedule, timing = all_offloaded(problem)
    plan = build_plan(problem, schedule, timing, "test").model_copy(update={field: value})
    assert any(field in line for line in validate_plan(problem, plan))


def test_validator_rejects_a_plan_over_the_host_cap():
    problem = Problem.model_validate(SMALL)
    schedule, timing = all_offloaded(problem)
    plan = build_plan(problem, schedule, timing, "test")
    need = plan.host_memory_mib[1]
    capped = with_limits(problem, [20000.0, None], host=need - 1.0)
    lines = validate_plan(capped, plan.model_copy(update={"problem_key": capped.key()}))
    assert any("device 0" in line and "host_memory_limit_mib" in line for line in lines)
    assert any("device 1" in line and f"{need:.6g}" in line for line in lines)


# -- pruning ---------------------------------------------------------------------------------------------

def test_unlimited_memory_drops_every_treatment():
    problem = Problem.model_validate({**SMALL, "devices": [{"static_mib": 0.0}] * 2})
    schedule, timing = all_offloaded(problem)
    pruned = prune(problem, schedule, timing)
    assert pruned.removed == 8
    assert not any(op.kind in (Kind.OFFLOAD, Kind.RELOAD) for op in pruned.timing.times)
    assert validate_plan(problem, build_plan(problem, pruned.schedule, pruned.timing, "t")) == []


def test_evaluate_prunes_and_refuses_over_the_host_cap():
    problem = Problem.model_validate({**SMALL, "devices": [{"static_mib": 0.0}] * 2})
    schedule, timing = all_offloaded(problem)
    limits = peaks_of(problem, schedule, timing)
    outcome = evaluate(with_limits(problem, limits), schedule, "all offloaded")
    assert 0 < outcome.transfer_cost[0] < 8 * 512.0  # pruning leaves only what memory needs
    assert outcome.plan().offloaded_mib == pytest.approx(outcome.transfer_cost[0])
    with pytest.raises(DoesNotFit, match="pinned host memory"):
        evaluate(with_limits(problem, limits, host=256.0), schedule, "all offloaded")


costs = st.floats(min_value=0.1, max_value=3.0, allow_nan=False)


@st.composite
def treated_problems(draw):
    """A random small problem, a GPipe schedule with random treatments, and limits it just fits."""
    p, m, chunks = draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.sampled_from([1, 2]))
    offload, recompute = draw(st.booleans()), draw(st.booleans())
    stages = []
    for k in range(p * chunks):
        act = draw(st.floats(1.0, 100.0))
        stage = {"device": k % p, "forward_ms": draw(costs), "backward_input_ms": draw(costs),
                 "backward_weight_ms": draw(costs), "activation_mib": act,
                 "weight_grad_mib": act * draw(st.floats(0.0, 1.0))}
        if offload:
            stage.update(offload_ms=draw(st.floats(0.05, 4.0)), offloadable_mib=act * draw(st.floats(0.3, 1.0)))
        if recompute:
            stage["checkpoint_mib"] = act * draw(st.floats(0.0, 0.5))
        stages.append(stage)
    problem = Problem.model_validate({
        "num_devices": p, "num_microbatches": m, "p2p_ms": draw(st.sampled_from([0.0, 0.5])),
        "options": {"split_backward": draw(st.booleans()), "offload": offload, "recompute": recompute},
        "stages": stages, "devices": [{"static_mib": 10.0}] * p})
    modes = [None] + ["offload"] * offload + ["recompute"] * recompute
    treat = {(k, i): draw(st.sampled_from(modes)) for k in range(p * chunks) for i in range(m)}
    schedule = schedule_of(problem, gpipe_orders(problem), {key: how for key, how in treat.items() if how})
    timing = simulate(problem, schedule)
    slack = draw(st.sampled_from([0.0, 0.0, 10.0, 60.0]))
    limits = [peak + slack for peak in peaks_of(problem, schedule, timing)]
    return with_limits(problem, limits), schedule, timing


def peak_without(problem: Problem, timing: Timing, pair: tuple[int, int]) -> float:
    """Peak of `pair`'s device with its treatment removed and every other op kept where it is."""
    choices = {**timing.choices, pair: Choice(timing.choices[pair].split)}
    gone = {Kind.OFFLOAD, Kind.RELOAD, Kind.RECOMPUTE}
    device = problem.stages[pair[0]].device
    ops = [TimedOp(op, *t) for op, t in timing.times.items()
           if problem.stages[op.stage].device == device and not ((op.stage, op.mb) == pair and op.kind in gone)]
    return peak_memory(problem, device, ops, choices)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(treated_problems())
def test_pruning_leaves_only_needed_treatments(case):
    problem, schedule, timing = case
    pruned = prune(problem, schedule, timing)
    assert pruned.timing.makespan <= timing.makespan + 1e-9
    plan = build_plan(problem, pruned.schedule, pruned.timing, "pruned")
    assert validate_plan(problem, plan) == []
    for pair, choice in pruned.timing.choices.items():
        if choice.offload or choice.recompute:
            limit = problem.limit_of(problem.stages[pair[0]].device)
            assert peak_without(problem, pruned.timing, pair) > limit + HEADROOM * max(1.0, limit) - 1e-9, pair


# -- tie-breaks ------------------------------------------------------------------------------------------

def test_better_prefers_fewer_offloaded_mib_within_the_tolerance():
    problem = Problem.model_validate({**SMALL, "devices": [{"static_mib": 0.0}] * 2})
    schedule, timing = all_offloaded(problem)
    plain = {pair: Choice(c.split) for pair, c in timing.choices.items()}
    heavy = Outcome(problem, schedule, timing, "heavy")
    light = Outcome(problem, schedule, Timing(timing.times, plain), "light")
    assert better(heavy, light) is light and better(light, heavy) is light
    later = {op: (s * 1.01, e * 1.01) for op, (s, e) in timing.times.items()}
    slower_light = Outcome(problem, schedule, Timing(later, plain), "slower light")
    assert better(heavy, slower_light) is heavy
    assert better(heavy, slower_light, tolerance=0.02) is slower_light


def test_incumbent_prunes_offers_and_takes_an_equally_fast_lighter_plan():
    problem = Problem.model_validate({**SMALL, "devices": [{"static_mib": 0.0}] * 2})
    schedule, timing = all_offloaded(problem)
    heavy = build_plan(problem, schedule, timing, "heavy")
    inc = Incumbent(problem, problem.key(), None)
    assert inc.offer(heavy)
    assert inc.plan.offloaded_mib == 0.0 and not ops_of_kind(inc.plan, "OFFLOAD")
    assert inc.plan.makespan_ms == pytest.approx(heavy.makespan_ms)
    assert not inc.offer(heavy)  # as fast and, once pruned, as light: not better
    inc.plan = heavy  # an incumbent that still offloads (as one stored before pruning existed)
    assert inc.offer(heavy)  # the same plan pruned: as fast, lighter
    assert inc.plan.offloaded_mib == 0.0


def test_prune_plan_keeps_times_and_everything_else():
    problem = Problem.model_validate({**SMALL, "devices": [{"static_mib": 0.0}] * 2})
    schedule, timing = all_offloaded(problem)
    heavy = build_plan(problem, schedule, timing, "heavy", status="optimal").model_copy(
        update={"lower_bound_ms": 1.0, "revision": 3})
    thin = prune_plan(problem, heavy)
    kept = {(op.kind, op.stage, op.mb): op.start_ms for dp in thin.devices for op in dp.ops}
    before = {(op.kind, op.stage, op.mb): op.start_ms for dp in heavy.devices for op in dp.ops}
    assert kept == {key: t for key, t in before.items() if key[0] not in ("OFFLOAD", "RELOAD")}
    assert (thin.status, thin.lower_bound_ms, thin.revision, thin.method) == ("optimal", 1.0, 3, "heavy")
    assert validate_plan(problem, thin) == []
    assert prune_plan(problem, thin) is thin
