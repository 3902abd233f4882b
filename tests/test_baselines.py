"""Baselines: hand-computed makespans, the reference figures of docs/baselines.md, applicability and memory errors."""

from __future__ import annotations

import pytest
from core_schedules import at_least_memory_times, make_problem, problem_doc
from pipeplan.planner.baselines import NAMES, DoesNotFit, NotApplicable, best_heuristic, compare, run_baseline
from pipeplan.planner.baselines.classic import serialized_schedule
from pipeplan.planner.baselines.common import TIE_TOLERANCE, evaluate, peaks_of
from pipeplan.planner.baselines.greedy import greedy_outcome
from pipeplan.planner.baselines.offload import pipeoffload_outcome
from pipeplan.planner.baselines.treatments import fractional_treat, slow_copies
from pipeplan.planner.bounds import ALL, MemoryInfeasibleError, lower_bound, min_memory
from pipeplan.planner.contract import Problem
from pipeplan.planner.validator import validate_plan


def reference_case(p: int, m: int, het: bool, chunks: int = 1, limit: float | None = None,
                   offload_ms: float | None = None, **options) -> Problem:
    """docs/baselines.md, "Reference figures": activation held from F until W, limits in activations per device; V
    cases use half-cost (and half-size) chunks with stage k and 2P-1-k on one device."""
    f, b, w, link = (1.0, 1.2, 0.8, 0.05) if het else (1.0, 1.0, 1.0, 0.0)
    c = 1.0 / chunks
    stages = []
    for k in range(p * chunks):
        lap, r = divmod(k, p)
        stages.append({"device": p - 1 - r if lap % 2 else r, "forward_ms": f * c,
                       "backward_input_ms": b * c, "backward_weight_ms": w * c,
                       "activation_mib": c, "weight_grad_mib": c})
        if offload_ms is not None:
            stages[-1]["offload_ms"] = offload_ms * c
    return Problem.model_validate({
        "num_devices": p, "num_microbatches": m, "p2p_ms": link, "options": options,
        "stages": stages, "devices": [{"memory_limit_mib": limit}] * p})


# (case, 1F1B, ZB-H1, ZB auto @1p, ZB-V @1p) from docs/baselines.md, "Reference figures", except
# ZB-H1 on het: the reference's 109.2 / 220.4 are the time-filled pattern's; the published order (the same order torch's
# ScheduleInterleavedZeroBubble generates for one stage per rank, see tests/test_peers.py) gives
# 107.2 / 216, equal to the ZB automatic scheduler at 1F1B's memory.
REFERENCE = [
    ((4, 8, False), 33, 27, 27, 25.5),
    ((8, 32, False), 117, 103, 103, 99.5),
    ((16, 64, False), 237, 207, 207, 199.5),
    ((8, 32, True), 120.4, 107.2, 107.2, 101.95),
    ((16, 64, True), 244.4, 216, 216, 204.9),
]


@pytest.mark.parametrize("case, f1b, h1, auto, zbv", REFERENCE)
def test_reference_1f1b_and_zb_h1(case, f1b, h1, auto, zbv):
    p, m, het = case
    problem = reference_case(p, m, het)
    tol = 0.01 if het else 1e-9
    assert run_baseline(problem, "1f1b").makespan_ms == pytest.approx(f1b, rel=tol)
    assert run_baseline(problem, "zb-h1").makespan_ms == pytest.approx(h1, rel=tol)
    # at 1F1B's memory (P activations) the heuristics reach the ZB automatic scheduler's figure
    at_1p = reference_case(p, m, het, limit=float(p))
    best = best_heuristic(at_1p)
    assert best.makespan_ms <= auto * 1.001
    assert max(best.peak_memory_mib) <= p


@pytest.mark.parametrize("case, f1b, h1, auto, zbv", REFERENCE[:2])
def test_reference_zb_v_uniform(case, f1b, h1, auto, zbv):
    p, m, het = case
    plan = run_baseline(reference_case(p, m, het, chunks=2, limit=float(p)), "zb-v")
    assert plan.makespan_ms == pytest.approx(zbv)


@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (4, 8), (5, 7)])
def test_hand_computed_makespans(p, m):
    fused = make_problem(p=p, m=m, split=False, f=1.0, b=1.5, w=0.5)
    for name in ("1f1b", "gpipe"):
        assert run_baseline(fused, name).makespan_ms == pytest.approx((m + p - 1) * 3.0)
    uni = make_problem(p=p, m=m, split=True)
    assert run_baseline(uni, "zb-h1").makespan_ms == pytest.approx((p - 1) + 3 * m)
    assert run_baseline(uni, "1f1b").makespan_ms == pytest.approx((m + p - 1) * 3.0)


def test_one_f_one_b_peak_is_the_warm_up():
    plan = run_baseline(make_problem(p=4, m=8, split=False), "1f1b")
    assert plan.peak_memory_mib == [400.0, 300.0, 200.0, 100.0]
    assert plan.method == "1f1b"


def test_not_applicable_reasons():
    one_chunk = make_problem(p=2, m=2, split=False)
    for name, words in [("interleaved-1f1b", "2 stages per device"), ("zb-v", "split_backward|V placement"),
                        ("zb-h1", "split_backward"), ("pipeoffload", "options.offload"),
                        ("adaoffload", "offload")]:
        with pytest.raises(NotApplicable, match=words):
            run_baseline(one_chunk, name)
    with pytest.raises(NotApplicable, match="one stage per device"):
        run_baseline(make_problem(p=2, m=2, chunks=2), "1f1b")
    with pytest.raises(ValueError, match="unknown baseline"):
        run_baseline(one_chunk, "nope")


def test_does_not_fit_names_device_and_memory():
    problem = make_problem(p=4, m=8, split=False, limit=250.0)
    with pytest.raises(DoesNotFit) as err:
        run_baseline(problem, "1f1b")
    assert "device 0 would need 400.0 MiB but its limit is 250.0 MiB" in str(err.value)
    assert err.value.needed_mib == [400.0, 300.0, 200.0, 100.0]
    plan = best_heuristic(problem)  # greedy still fits
    assert max(plan.peak_memory_mib) <= 250.0 and validate_plan(problem, plan) == []


def test_interleaved_and_v_placements():
    loop = make_problem(p=4, m=8, chunks=2, split=False)
    plan = run_baseline(loop, "interleaved-1f1b")
    # Megatron's figure: (M + (P-1)/v) x per-microbatch device time, vs (M + P - 1) x it for 1F1B
    assert plan.makespan_ms == pytest.approx((8 + 3 / 2) * 6.0)
    assert max(plan.peak_memory_mib) <= 2 * 4 * 100.0 * 1.5
    odd = make_problem(p=3, m=5, chunks=2)  # groups of P that do not divide M
    assert validate_plan(odd, run_baseline(odd, "interleaved-1f1b")) == []
    v = make_problem(p=4, m=8, chunks=2, placement="v")
    assert validate_plan(v, run_baseline(v, "zb-v")) == []


def test_offload_baselines_fit_half_of_one_f_one_b():
    """Half of 1F1B's peak with a fast host link: offload keeps the pipeline nearly dense."""
    problem = reference_case(8, 32, False, limit=4.0, offload_ms=0.5, offload=True)
    for name in ("greedy", "adaoffload", "pipeoffload"):
        plan = run_baseline(problem, name)
        assert max(plan.peak_memory_mib) <= 4.0 + 1e-9
        assert validate_plan(problem, plan) == []
    best = best_heuristic(problem)
    assert best.makespan_ms <= 117.0  # at least as fast as 1F1B with twice the memory
    assert "offload" in best.method


def test_adaoffload_reports_its_offloads():
    problem = reference_case(4, 8, False, limit=3.0, offload_ms=0.25, offload=True)
    plan = run_baseline(problem, "adaoffload")
    assert plan.method.startswith("adaoffload(") and "offloads" in plan.method
    assert max(plan.peak_memory_mib) <= 3.0 + 1e-9


def test_best_heuristic_infeasible_and_at_min_memory():
    problem = make_problem(p=3, m=4, chunks=2, placement="v", offload=True, recompute=True)
    need = min_memory(problem)
    tight = Problem.model_validate({**problem.model_dump(), "devices": [
        {"memory_limit_mib": n, "static_mib": 0.0} for n in need]})
    plan = best_heuristic(tight)
    assert validate_plan(tight, plan) == []
    short = Problem.model_validate({**problem.model_dump(), "devices": [
        {"memory_limit_mib": n - 1.0, "static_mib": 0.0} for n in need]})
    with pytest.raises(MemoryInfeasibleError):
        best_heuristic(short)


def test_compare_lists_every_name():
    problem = make_problem(p=2, m=4)
    rows = compare(problem)
    assert [r.name for r in rows] == NAMES
    for row in rows:
        assert (row.plan is None) != (row.reason is None)
        if row.plan:
            assert row.plan.makespan_ms >= lower_bound(problem) - 1e-9


@pytest.mark.parametrize("case, f1b, h1, auto, zbv", REFERENCE)
def test_reference_zb_v_published_order(case, f1b, h1, auto, zbv):
    """ZB-V's published order without a limit: the reference on uni, within 1% on het (101.85 and
    204.65 against 101.95 and 204.9); never above 1F1B's peak (P activations)."""
    p, m, het = case
    plan = run_baseline(reference_case(p, m, het, chunks=2), "zb-v")
    assert plan.makespan_ms == pytest.approx(zbv, rel=0.01 if het else 1e-9)
    assert max(plan.peak_memory_mib) <= p


def test_serialized_fallback_waits_for_the_same_devices_later_stage():
    """Loop placement at exactly min_memory: stage 1's reload must wait for stage 3's W (same
    device), not for stage 2's (another device) — found by the property test."""
    stages = [
        {"device": 0, "forward_ms": 1, "backward_input_ms": 1, "backward_weight_ms": 0, "offload_ms": 0.5,
         "activation_mib": 1},
        {"device": 1, "forward_ms": 1, "backward_input_ms": 1, "backward_weight_ms": 0, "activation_mib": 1},
        {"device": 0, "forward_ms": 1, "backward_input_ms": 0.5, "backward_weight_ms": 0, "activation_mib": 1},
        {"device": 1, "forward_ms": 1, "backward_input_ms": 1, "backward_weight_ms": 1, "activation_mib": 1,
         "weight_grad_mib": 1},
    ]
    problem = Problem.model_validate({
        "num_devices": 2, "num_microbatches": 2, "options": {"offload": True}, "stages": stages,
        "devices": [{"memory_limit_mib": 1.0}] * 2})
    assert min_memory(problem) == [1.0, 1.0]
    serialized = evaluate(problem, serialized_schedule(problem), "serialized")  # DoesNotFit if wrong
    assert max(peaks_of(problem, serialized.schedule, serialized.timing)) <= 1.0
    plan = best_heuristic(problem)
    assert validate_plan(problem, plan) == [] and max(plan.peak_memory_mib) <= 1.0


def test_loop_placement_at_one_f_one_b_memory():
    """Interleaved 1F1B needs more than 1F1B's memory; the greedy's 'later chunk first' variant keeps
    a loop-placed model within it and still beats 1F1B-with-one-chunk's 117."""
    p, m = 8, 32
    stages = [{"device": k % p, "forward_ms": 0.5, "backward_input_ms": 0.5, "backward_weight_ms": 0.5,
               "activation_mib": 0.5, "weight_grad_mib": 0.5} for k in range(2 * p)]
    problem = Problem.model_validate({"num_devices": p, "num_microbatches": m, "stages": stages,
                                      "devices": [{"memory_limit_mib": float(p)}] * p})
    with pytest.raises(DoesNotFit):
        run_baseline(problem, "interleaved-1f1b")
    plan = best_heuristic(problem)
    assert max(plan.peak_memory_mib) <= p and plan.makespan_ms <= 102.0 + 1e-9


def test_slow_host_link_offloads_a_share_and_beats_uniform_pipeoffload():
    """Half memory, copies three times a forward (§4's model, P=8, M=16): offloading every long-lived
    activation would saturate the copy lane, so greedy offloads a share of them; uniform PipeOffload
    only fits with its forwards throttled by memory, and is much slower."""
    problem = reference_case(8, 16, True, limit=4.0, offload_ms=3.0, offload=True)
    fast = reference_case(8, 16, True, limit=4.0, offload_ms=1.0, offload=True)
    assert slow_copies(problem) and not slow_copies(fast)
    shares = fractional_treat(problem, 0.8)
    offloaded = [sum(shares(k, i) == "offload" for i in range(16)) for k in range(8)]
    # long waits at the front need the largest shares; the last stages need none (measured:
    # 15, 14, 14, 13, 5, 0, 0, 0)
    assert offloaded == sorted(offloaded, reverse=True) and 0 < offloaded[0] < 16 and offloaded[-1] == 0
    greedy = run_baseline(problem, "greedy")
    uniform = pipeoffload_outcome(problem, uniform_only=True)
    assert "throttled" in uniform.method
    for plan in (greedy, uniform.plan()):
        assert validate_plan(problem, plan) == []
    assert greedy.makespan_ms <= 0.85 * uniform.makespan  # measured: 74.8 against 93.0


def test_reloads_come_back_in_turn_on_a_slow_link():
    """Half memory, copies three times a forward: a reload waits for its stage's previous backward, so
    reloads do not queue on the copy lane early and hold the memory forwards need."""
    problem = reference_case(8, 32, True, limit=4.0, offload_ms=3.0, offload=True)
    plan = run_baseline(problem, "greedy")
    assert validate_plan(problem, plan) == []
    start = {(op.kind, op.stage, op.mb): op.start_ms for d in plan.devices for op in d.ops}
    reloads = [(k, i) for kind, k, i in start if kind == "RELOAD" and i > 0]
    assert reloads and all(start[("RELOAD", k, i)] >= start[("B", k, i - 1)] - 1e-9 for k, i in reloads)
    assert plan.makespan_ms <= 115.0 + 1e-6  # measured 115.0; reloads free to start earlier: 141.8


def test_eager_forwards_reach_the_memory_bound_at_quarter_memory():
    """A quarter of 1F1B's memory, copies as fast as a forward: a forward that needs room for one
    reload only once the copies under way are done keeps the pipeline full. The greedy meets the
    memory bound, so it is optimal (the forwards held for that room now: 151.2)."""
    problem = reference_case(8, 32, True, limit=2.0, offload_ms=1.0, offload=True)
    plan = run_baseline(problem, "greedy")
    assert validate_plan(problem, plan) == [] and "eager" in plan.method
    assert plan.makespan_ms == pytest.approx(lower_bound(problem, ALL))  # 111.3


def test_compare_summarizes_a_schedule_that_does_not_fit_in_one_line():
    """16 devices over their limit read as the worst one, not 16 clauses."""
    problem = make_problem(p=16, m=32, limit=800.0)
    row = next(r for r in compare(problem) if r.name == "1f1b")
    assert row.plan is None
    assert row.reason.startswith("does not fit: needs 1.6 GiB on GPU 0 (limit 0.8 GiB; ")
    assert "more GPUs over" in row.reason and row.reason.count("GPU") == 2


def test_last_stage_forward_needs_no_restore_reserve_in_v_placement():
    """V placement puts the LM head (the last stage) on device 0 beside stage 0. When device 0 barely
    fits one head activation, reserving room for a stage-0 restore before the head's forward blocked
    every engine variant and greedy fell back to one microbatch at a time (152 here)."""
    doc = problem_doc(p=4, m=8, chunks=2, placement="v", recompute=True, weight_grad_mib=50.0,
                      checkpoint_mib=0.0)
    doc["stages"][-1].update(activation_mib=400.0, weight_grad_mib=200.0)
    need = min_memory(Problem.model_validate(doc))
    for d, dev in enumerate(doc["devices"]):
        dev["memory_limit_mib"] = need[d] + (20.0 if d == 0 else 300.0)
    outcome = greedy_outcome(Problem.model_validate(doc), inline=False)
    assert "serialized" not in outcome.method
    assert outcome.makespan <= 67.0 + 1e-9


def test_greedy_reports_each_new_best_as_it_is_found():
    """The solver streams the widened greedy's bests (its extra passes take tens of seconds at P=16),
    so each must come out in order and the last must be the answer. V placement, P=4, M=8, 1.2x the
    least memory: three bests, 137 -> 88 -> 71."""
    problem = at_least_memory_times(problem_doc(p=4, m=8, chunks=2, placement="v", offload=True,
                                                recompute=True), [1.2] * 4)
    seen = []
    outcome = greedy_outcome(problem, inline=False, on_better=seen.append)
    assert len(seen) >= 2
    # each is faster, or as fast within the tie tolerance and lighter on copies
    assert all(b.makespan <= a.makespan * (1 + TIE_TOLERANCE) for a, b in zip(seen, seen[1:]))
    assert seen[-1] is outcome
