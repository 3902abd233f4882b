"""Lower bound on the makespan and minimum memory: sound on every simulated plan, and tight where proved."""

from __future__ import annotations

import itertools
import random

import pytest
from core_schedules import (gpipe, make_problem, one_activation_at_a_time, one_f_one_b, plan_of, problem_doc,
                            serialized)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeplan.planner.bounds import (ALL, MemoryInfeasibleError, check_memory_feasible, lower_bound,
                                     min_memory, prove)
from pipeplan.planner.bounds.backward_stretches import backward_stretches_bound
from pipeplan.planner.bounds.forward_count import forward_count_bound
from pipeplan.planner.bounds.memory_free import memory_free_bound
from pipeplan.planner.bounds.occupancy import occupancy_bound
from pipeplan.planner.bounds.one_at_a_time import _least_split, one_at_a_time_bound
from pipeplan.planner.bounds.warmup import warmup_bound
from pipeplan.planner.contract import Problem
from pipeplan.planner.validator import validate_plan
from support.bound_cases import deciding, others
from support.oracles import blind_optimum

durations = st.floats(min_value=0.1, max_value=5.0, allow_nan=False).map(lambda x: round(x, 3))
sizes = st.floats(min_value=1.0, max_value=1000.0).map(lambda x: round(x, 1))


@st.composite
def problems(draw) -> Problem:
    p = draw(st.integers(1, 4))
    chunks = draw(st.integers(1, 2))
    placement = draw(st.sampled_from(["loop", "v"]))
    options = {name: draw(st.booleans()) for name in ("split_backward", "offload", "recompute")}
    stages = []
    for k in range(p * chunks):
        c, r = divmod(k, p)
        activation = draw(sizes)
        stage = {
            "device": p - 1 - r if placement == "v" and c % 2 else r,
            "forward_ms": draw(durations), "backward_input_ms": draw(durations),
            "backward_weight_ms": draw(st.sampled_from([0.0, 0.5])) or draw(durations),
            "recompute_ms": draw(durations), "offload_ms": draw(durations),
            "activation_mib": activation,
            "offloadable_mib": round(activation * draw(st.floats(0, 1)), 1),
            "checkpoint_mib": round(activation * draw(st.floats(0, 1)), 1),
            "weight_grad_mib": round(activation * draw(st.floats(0, 1)), 1),
        }
        stages.append(stage)
    return Problem.model_validate({
        "num_devices": p, "num_microbatches": draw(st.integers(1, 5)),
        "p2p_ms": draw(st.sampled_from([0.0, 0.05, 0.7])), "options": options, "stages": stages,
        "devices": [{"static_mib": draw(st.sampled_from([0.0, 1000.0]))} for _ in range(p)],
    })


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_bounds_hold_on_simulated_plans(problem):
    """No valid plan beats lower_bound or min_memory; the serialized schedule reaches min_memory."""
    schedules = [serialized] + ([one_f_one_b, gpipe] if problem.chunks == 1 else [])
    bound, needed = lower_bound(problem), min_memory(problem)
    for schedule in schedules:
        plan = plan_of(problem, schedule(problem))
        assert validate_plan(problem, plan) == []
        assert plan.makespan_ms >= bound - 1e-9
        assert plan.lower_bound_ms == pytest.approx(bound)
        assert all(peak >= n - 1e-6 for peak, n in zip(plan.peak_memory_mib, needed))
        if schedule is serialized:
            assert plan.peak_memory_mib == pytest.approx(needed)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 8), (8, 32)])
def test_lower_bound_tight_for_uniform_one_f_one_b(p, m):
    """Uniform stages, fused backward: 1F1B's (M+P-1)(F+B+W) is optimal, and the bound says so."""
    problem = make_problem(p=p, m=m, split=False)
    assert lower_bound(problem) == pytest.approx((m + p - 1) * 3.0)
    assert plan_of(problem, one_f_one_b(problem)).makespan_ms == pytest.approx(lower_bound(problem))


def test_lower_bound_hand_values():
    # one device: all the work, nothing else
    assert lower_bound(make_problem(p=1, m=4, f=1.0, b=2.0, w=0.5)) == pytest.approx(14.0)
    # one microbatch, 2 devices, link 0.5: F 1 + link + F 1 + B 1 + link + B 1 + W 1 = 6
    assert lower_bound(make_problem(p=2, m=1, p2p=0.5)) == pytest.approx(6.0)
    # uniform split backward, P=4, M=8: the last device cannot start before 3 forwards and then has
    # 8 x 3 of work (27); ZB-H1 reaches it (docs/baselines.md, "Reference figures": uni P=4 M=8 ZB-H1 = 27).
    assert lower_bound(make_problem(p=4, m=8)) == pytest.approx(27.0)


def test_min_memory_hand_values():
    # one stage per device: one activation, whatever the options
    assert min_memory(make_problem(p=2, m=4, static=1000.0, offload=True)) == [1100.0, 1100.0]
    # V placement on 2 devices: device 0 holds stages 0 and 3; stage 0 waits at its residue
    assert min_memory(make_problem(p=2, m=2, chunks=2, placement="v")) == [200.0, 200.0]
    assert min_memory(make_problem(p=2, m=2, chunks=2, placement="v", offload=True)) == [120.0, 120.0]
    assert min_memory(make_problem(p=2, m=2, chunks=2, placement="v", recompute=True)) == [110.0, 110.0]
    both = make_problem(p=2, m=2, chunks=2, placement="v", recompute=True, offload=True)
    assert min_memory(both) == [110.0, 110.0]


def test_min_memory_is_tight_at_the_limit():
    """A limit equal to min_memory admits a valid plan (the serialized one); 1 MiB less admits none."""
    free = make_problem(p=2, m=3, chunks=2, placement="v", offload=True, static=500.0)
    needed = min_memory(free)
    exact = make_problem(p=2, m=3, chunks=2, placement="v", offload=True, static=500.0, limit=max(needed))
    assert check_memory_feasible(exact) == needed
    assert validate_plan(exact, plan_of(exact, serialized(exact))) == []
    short = make_problem(p=2, m=3, chunks=2, placement="v", offload=True, static=500.0, limit=max(needed) - 1)
    with pytest.raises(MemoryInfeasibleError) as info:
        check_memory_feasible(short)
    error = info.value
    assert "device 0 needs at least 620.0 MiB but its limit is 619.0 MiB" in str(error)
    assert "device 1 needs at least 620.0 MiB" in str(error)
    assert error.needed_mib == [620.0, 620.0]
    doc = error.to_dict()
    assert doc["error"] == "infeasible" and doc["min_memory_mib"] == [620.0, 620.0]
    assert doc["memory_limit_mib"] == [619.0, 619.0]


def test_infeasible_names_only_the_short_device():
    doc = make_problem(p=2, m=2, static=100.0).model_dump()
    doc["devices"][1]["memory_limit_mib"] = 150.0
    with pytest.raises(MemoryInfeasibleError) as info:
        check_memory_feasible(Problem.model_validate(doc))
    assert str(info.value) == "infeasible memory budget: device 1 needs at least 200.0 MiB but its limit is 150.0 MiB"


def test_lower_bound_uneven_stages_one_microbatch():
    """Regression: the backward chain above stage k counted stage k's own backward instead of stage
    S-1's, so unequal stages gave a 'bound' above an achievable makespan (6.0 > 5.5 here)."""
    doc = make_problem(p=2, m=1, split=False).model_dump()
    doc["stages"][0].update(backward_input_ms=1.0, backward_weight_ms=1.0)  # BW 2.0
    doc["stages"][1].update(backward_input_ms=1.0, backward_weight_ms=0.5)  # BW 1.5
    problem = Problem.model_validate(doc)
    assert lower_bound(problem) == pytest.approx(5.5)  # F0 + F1 + BW1 + BW0
    assert plan_of(problem, one_f_one_b(problem)).makespan_ms == pytest.approx(5.5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.floats(0, 1.5))
def test_every_baseline_is_valid_and_within_bounds(problem, slack):
    """Every baseline on random problems: a valid plan (or a stated reason) no better than the bounds;
    and under any limit at or above min_memory, best_heuristic always finds a plan that fits."""
    from pipeplan.planner.baselines import NAMES, DoesNotFit, NotApplicable, best_heuristic, run_baseline

    doc = problem.model_dump()
    extra = slack * sum(s.activation_mib for s in problem.stages)
    for d, needed in enumerate(min_memory(problem)):
        doc["devices"][d]["memory_limit_mib"] = needed + extra
    for pr in (problem, Problem.model_validate(doc)):
        bound, needed = lower_bound(pr), min_memory(pr)
        for name in NAMES:
            try:
                plan = run_baseline(pr, name)
            except (NotApplicable, DoesNotFit) as exc:
                assert str(exc)
                continue
            assert validate_plan(pr, plan) == [], name
            assert plan.makespan_ms >= bound - 1e-6, name
            assert all(p >= n - 1e-6 for p, n in zip(plan.peak_memory_mib, needed)), name
        best = best_heuristic(pr)
        assert validate_plan(pr, best) == []


def test_infeasible_report_is_json_with_unlimited_devices():
    """An unlimited device is null in the report, so the service can send it as JSON."""
    import json

    doc = make_problem(p=2, m=2).model_dump()
    doc["devices"][0]["memory_limit_mib"] = 0.5
    doc["devices"][1]["memory_limit_mib"] = None
    with pytest.raises(MemoryInfeasibleError) as info:
        check_memory_feasible(Problem.model_validate(doc))
    report = json.loads(json.dumps(info.value.to_dict(), allow_nan=False))
    assert report["memory_limit_mib"] == [0.5, None]
    assert report["min_memory_mib"][0] > 0.5


def test_warmup_bound_hand_value():
    """P=2, M=4, unit costs, room for one activation, 3-ms copies: device 0 runs F(0,0), then nothing
    fits until its copy ends at 4 > the first backward's earliest start (3), so 2 ms are idle."""
    problem = make_problem(p=2, m=4, limit=100.0, offload=True, offload_ms=3.0, offloadable_mib=100.0)
    assert memory_free_bound(problem) == pytest.approx(13.0)  # device 1: F(0,0), then its 12 ms
    assert warmup_bound(problem) == pytest.approx(14.0)  # device 0: 12 ms of work + 2 idle
    assert lower_bound(problem) >= 14.0  # one_at_a_time_bound says 16: one activation at a time
    # a recompute as slow as the forward gains nothing; one twice as fast halves the idle
    rec = make_problem(p=2, m=4, limit=100.0, recompute=True, checkpoint_mib=0.0)
    assert warmup_bound(rec) == pytest.approx(14.0)
    fast = make_problem(p=2, m=4, limit=100.0, recompute=True, checkpoint_mib=0.0, recompute_ms=0.5)
    assert warmup_bound(fast) == pytest.approx(13.0)
    # no limit, or room for every forward before the first backward: no warm-up bound
    assert warmup_bound(make_problem(p=2, m=4)) == 0.0
    assert warmup_bound(make_problem(p=2, m=4, limit=400.0)) <= memory_free_bound(problem)


WARMUP_CASES = [
    {"p": 2, "m": 4, "limit": 100.0, "offload": True, "offload_ms": 3.0, "offloadable_mib": 100.0},
    {"p": 2, "m": 3, "limit": 100.0, "recompute": True, "checkpoint_mib": 0.0},
    {"p": 3, "m": 4, "limit": 130.0, "offload": True, "recompute": True, "offload_ms": 3.0,
     "offloadable_mib": 100.0, "checkpoint_mib": 5.0, "weight_grad_mib": 50.0},
    {"p": 3, "m": 4, "limit": 150.0, "offload": True, "offload_ms": 2.0, "offloadable_mib": 60.0},
    {"p": 2, "m": 5, "limit": 150.0, "offload": True, "offload_ms": 2.5, "offloadable_mib": 100.0,
     "weight_grad_mib": 80.0},
]


@pytest.mark.parametrize("kw", WARMUP_CASES)
def test_warmup_bound_is_below_the_proven_optimum(kw):
    """CP-SAT blind to every memory-aware bound (it knows only memory_free_bound) proves an optimum;
    warmup_bound is never above it, and is above the memory-free bound on these cases."""
    problem = make_problem(**kw)
    result = blind_optimum(problem, 10.0)
    assert result.status == "optimal"
    assert warmup_bound(problem) > memory_free_bound(problem) + 1e-9
    assert warmup_bound(problem) <= result.plan.makespan_ms + 1e-9


def test_one_at_a_time_hand_value():
    """P=2, M=4, unit costs, 150 MiB for activations of 100 and weight gradients of 80: device 0 holds
    one at a time. Kept, a microbatch holds it 5 ms (F, the 2-ms round trip, B, W) with 2 idle;
    recomputed, 3 ms (R, B, W) with its forward outside. One kept and three recomputed: 14 ms of
    stretches and one forward the kept one's idle cannot take, 15 (a fractional split, 4/3 and 8/3,
    would say 14 2/3); the blind optimum is 15 too."""
    problem = make_problem(p=2, m=4, limit=150.0, recompute=True, checkpoint_mib=0.0, weight_grad_mib=80.0)
    assert one_at_a_time_bound(problem) == pytest.approx(15.0)
    assert blind_optimum(problem, 20.0).plan.makespan_ms == pytest.approx(15.0)
    assert lower_bound(problem) == pytest.approx(one_at_a_time_bound(problem))
    assert memory_free_bound(problem) == pytest.approx(13.0)
    # the same device in the middle of P=3 (round trip 2): the last stretch's B(0) and W(0) follow it,
    # less its own W: + 1 ms, beside the forward head of 1 ms
    doc = problem_doc(p=3, m=4, recompute=True, checkpoint_mib=0.0, weight_grad_mib=80.0)
    doc["devices"][1]["memory_limit_mib"] = 150.0
    middle = Problem.model_validate(doc)
    assert one_at_a_time_bound(middle) == pytest.approx(1.0 + 15.0 + 1.0)
    assert blind_optimum(middle, 20.0).plan.makespan_ms >= one_at_a_time_bound(middle) - 1e-9
    # room for two activations, or no limit: nothing to say
    roomy = make_problem(p=2, m=4, limit=200.0, recompute=True, weight_grad_mib=80.0)
    assert one_at_a_time_bound(roomy) == 0.0
    assert one_at_a_time_bound(make_problem(p=2, m=4, recompute=True)) == 0.0


def test_one_at_a_time_split_is_the_least_whole_one():
    """The treatment split searched in closed form equals enumerating every whole split."""
    rng = random.Random(3)
    for _ in range(300):
        kinds = [(rng.uniform(0, 10), rng.uniform(0, 8), rng.uniform(0, 5)) for _ in range(rng.randint(1, 3))]
        m, outside = rng.randint(1, 9), rng.uniform(0, 20)
        every = min(sum(n * kd[0] for n, kd in zip(x, kinds))
                    + max(0.0, outside + sum(n * (kd[2] - kd[1]) for n, kd in zip(x, kinds)))
                    for x in itertools.product(range(m + 1), repeat=len(kinds)) if sum(x) == m)
        assert _least_split(kinds, m, outside) == pytest.approx(every)


ONE_AT_A_TIME_CASES = [
    {"p": 2, "m": 4, "limit": 150.0, "recompute": True, "checkpoint_mib": 0.0, "weight_grad_mib": 80.0},
    {"p": 3, "m": 4, "limit": 150.0, "recompute": True, "offload": True, "offload_ms": 2.0,
     "offloadable_mib": 100.0, "checkpoint_mib": 1.0, "weight_grad_mib": 80.0},
    {"p": 3, "m": 4, "limit": 150.0, "offload": True, "offload_ms": 1.0, "offloadable_mib": 100.0,
     "weight_grad_mib": 80.0},
    {"p": 4, "m": 5, "limit": 120.0, "recompute": True, "offload": True, "offload_ms": 1.5,
     "offloadable_mib": 100.0, "checkpoint_mib": 2.0, "weight_grad_mib": 70.0},
]


@pytest.mark.parametrize("kw", ONE_AT_A_TIME_CASES)
def test_one_at_a_time_is_below_the_proven_optimum(kw):
    """As for warmup_bound: CP-SAT blind to the memory-aware bounds proves an optimum, and
    one_at_a_time_bound, above the forward-count and occupancy bounds on these cases (the solver's
    pairwise exclusion bound, a different argument, is higher on two of them), is never above it."""
    problem = make_problem(**kw)
    result = blind_optimum(problem, 20.0)
    assert result.status == "optimal"
    others = max(memory_free_bound(problem), warmup_bound(problem), forward_count_bound(problem),
                 occupancy_bound(problem))
    assert one_at_a_time_bound(problem) > others + 1e-9
    assert one_at_a_time_bound(problem) <= result.plan.makespan_ms + 1e-9


def limited(limits: list[float | None], **kw) -> Problem:
    """`problem_doc(**kw)` with device d's memory limit limits[d]."""
    doc = problem_doc(**kw)
    for dev, limit in zip(doc["devices"], limits):
        dev["memory_limit_mib"] = limit
    return Problem.model_validate(doc)


def test_backward_stretches_hand_value():
    """P=3, M=4, unit F and B, W 0.5, activations of 100 and weight gradients of 40 with 120 MiB on
    device 0: one activation at a time, and no pending W beside it. The first backward can start at
    5; after it, three kept stretches of 6 (F, the 4-ms round trip, B) and the B of the one that may
    cross it; the three W's not at the end, outside every stretch; one W after the last B. 26, which
    the blind optimum meets; every other argument is at most 24.5."""
    problem = limited([120.0, None, None], p=3, m=4, w=0.5, weight_grad_mib=40.0)
    assert backward_stretches_bound(problem) == pytest.approx(26.0)
    proof = prove(problem, ALL)
    assert proof.tight == "backward_stretches"
    assert others(proof.values, proof.tight) == pytest.approx(24.5)
    result = blind_optimum(problem, 20.0)
    assert (result.status, result.plan.makespan_ms) == ("optimal", pytest.approx(26.0))
    # room for two activations: nothing to say
    roomy = limited([200.0, None, None], p=3, m=4, w=0.5, weight_grad_mib=40.0)
    assert backward_stretches_bound(roomy) == 0.0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_backward_stretches_is_below_the_proven_optimum(seed):
    """Offloads and recomputes beside kept microbatches (bench/bounds.py --family one_at_a_time):
    the first random problem where the argument is above every other one, never above the blind
    optimum."""
    problem, bound = deciding(one_activation_at_a_time, random.Random(seed), "backward_stretches", 100)
    result = blind_optimum(problem, 20.0)
    assert result.status == "optimal"
    assert bound <= result.plan.makespan_ms + 1e-9
