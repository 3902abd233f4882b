"""Property test: on random valid small problems every baseline yields a valid plan or a reason, and
best_heuristic always answers for a feasible budget and refuses an infeasible one."""

from __future__ import annotations

import pytest
from core_schedules import make_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeplan.planner.baselines import NAMES, DoesNotFit, NotApplicable, best_heuristic, run_baseline
from pipeplan.planner.baselines.classic import gpipe_orders, one_f_one_b_orders
from pipeplan.planner.baselines.common import over_limit, peaks_of, schedule_of, untimed_peaks
from pipeplan.planner.baselines.zero_bubble import (
    _lagged_order,
    zb_h1_orders,
    zb_h2_orders,
    zb_memory_fit_schedule,
)
from pipeplan.planner.bounds import MemoryInfeasibleError, min_memory
from pipeplan.planner.contract import Problem
from pipeplan.planner.memory import order_peak
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.simulator import simulate
from pipeplan.planner.validator import validate_plan
from support.examples import examples

costs = st.floats(min_value=0.1, max_value=3.0, allow_nan=False)


@st.composite
def problems(draw) -> Problem:
    p = draw(st.integers(1, 5))
    m = draw(st.integers(1, 10))
    chunks = draw(st.sampled_from([1, 2]))
    placement = draw(st.sampled_from(["loop", "v"]))
    offload = draw(st.booleans())
    recompute = draw(st.booleans())
    stages = []
    for k in range(p * chunks):
        lap, r = divmod(k, p)
        act = draw(st.floats(min_value=1.0, max_value=100.0))
        stage = {"device": p - 1 - r if placement == "v" and lap % 2 else r,
                 "forward_ms": draw(costs), "backward_input_ms": draw(costs),
                 "backward_weight_ms": draw(st.floats(min_value=0.0, max_value=3.0)),
                 "activation_mib": act,
                 "weight_grad_mib": act * draw(st.floats(0.0, 1.0))}
        if offload:
            stage["offload_ms"] = draw(st.one_of(st.just(0.0), st.floats(min_value=0.05, max_value=4.0)))
            stage["offloadable_mib"] = act * draw(st.floats(0.3, 1.0))
        if recompute:
            stage["checkpoint_mib"] = act * draw(st.floats(0.0, 0.5))
        stages.append(stage)
    if offload and all(s["offload_ms"] == 0.0 for s in stages):
        stages[0]["offload_ms"] = 0.5  # the contract wants some offload cost when offload is allowed
    doc = {"num_devices": p, "num_microbatches": m, "p2p_ms": draw(st.sampled_from([0.0, 0.05, 0.5])),
           "options": {"split_backward": draw(st.booleans()), "offload": offload, "recompute": recompute},
           "stages": stages,
           "devices": [{"memory_limit_mib": None, "static_mib": draw(st.sampled_from([0.0, 50.0]))}
                       for _ in range(p)]}
    problem = Problem.model_validate(doc)
    # memory limits between min_memory and unlimited (or just below min_memory, to test refusal)
    need = min_memory(problem)
    slack = draw(st.sampled_from([None, 0.0, 0.25, 1.0, 3.0, -0.1]))
    for d, dev in enumerate(doc["devices"]):
        act = max(s["activation_mib"] for s in stages)
        dev["memory_limit_mib"] = None if slack is None else max(0.0, need[d] + slack * act)
    return Problem.model_validate(doc)


# every baseline is also checked on random problems in tests/planner/bounds/test_bounds.py, and each
# one's plans, refusals and memory fit on hand-made ones in test_baselines.py: 40 examples by default
@settings(max_examples=examples(quick=40, thorough=150), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_baseline_is_valid_or_explains(problem: Problem):
    key = problem.key()
    feasible = all(n <= problem.limit_of(d) + 1e-9 for d, n in enumerate(min_memory(problem)))
    for name in NAMES:
        try:
            plan = run_baseline(problem, name, key)
        except NotApplicable as exc:
            assert exc.reason
            continue
        except DoesNotFit as exc:
            assert "device" in str(exc) and len(exc.needed_mib) == problem.num_devices
            continue
        assert validate_plan(problem, plan, key) == [], name
        assert plan.method
    if feasible:
        plan = best_heuristic(problem, key)
        assert validate_plan(problem, plan, key) == []
        greedy = run_baseline(problem, "greedy", key)  # greedy alone also always answers
        assert validate_plan(problem, greedy, key) == []
    else:
        try:
            best_heuristic(problem, key)
        except MemoryInfeasibleError as exc:
            assert exc.needed_mib == min_memory(problem)
        else:
            raise AssertionError("best_heuristic answered an infeasible budget")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_compute_only_orders_fix_the_peaks_without_times(problem: Problem):
    """evaluate() refuses a compute-only schedule from its order alone (memory.order_peak) before
    simulating it: those peaks must be exactly the ones the timed memory curves give."""
    if problem.chunks != 1:
        return
    builders = [gpipe_orders, one_f_one_b_orders]
    if problem.options.split_backward:
        builders += [zb_h1_orders, zb_h2_orders]
    for build in builders:
        schedule = schedule_of(problem, build(problem))
        untimed = untimed_peaks(problem, schedule)
        timed = peaks_of(problem, schedule, simulate(problem, schedule))
        assert untimed == pytest.approx(timed, rel=1e-9, abs=1e-9), build.__name__


def w_lag(order: list[Op]) -> int:
    """A lagged order's W lag: B(lag) comes just before W(0)."""
    first_w = next(i for i, op in enumerate(order) if op.kind == Kind.W)
    return sum(op.kind == Kind.B for op in order[:first_w]) - 1


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_memory_fit_pattern_fits_wherever_one_f_one_b_does(problem: Problem):
    """ZB-H1 with memory-fitted W lags: applicable (under a memory limit) exactly where 1F1B's order
    fits every device (its lag-0 order is 1F1B's), then within every limit, each stage k's W lag at
    most ZB-H1's k and as long as its device's memory allows (one microbatch more would not fit)."""
    if problem.chunks != 1 or not problem.options.split_backward or not problem.limited_devices():
        return
    s, m = problem.num_stages, problem.num_microbatches

    def peak(k: int, lag: int) -> float:
        return order_peak(problem, problem.stages[k].device, _lagged_order(m, k, s - k, lag))

    fits = all(peak(k, 0) <= problem.limit_of(problem.stages[k].device) + 1e-6 for k in range(s))
    try:
        schedule = zb_memory_fit_schedule(problem)
    except NotApplicable:
        assert not fits
        return
    assert fits
    assert not over_limit(problem, untimed_peaks(problem, schedule))
    for k in range(s):
        lag = w_lag(schedule.devices[problem.stages[k].device].compute)
        assert 0 <= lag <= k
        if lag < min(k, m - 1):
            assert peak(k, lag + 1) > problem.limit_of(problem.stages[k].device)


def test_memory_fit_pattern_is_zb_h1_where_the_activation_waits_for_w():
    """Identical stages whose whole activation is held until W, at 1F1B's peak: ZB-H1 itself."""
    problem = make_problem(6, 16, weight_grad_mib=100.0, activation_mib=100.0, forward_ms=1.0,
                           backward_input_ms=1.2, backward_weight_ms=0.8)
    budget = max(run_baseline(problem, "1f1b").peak_memory_mib)
    devices = [d.model_copy(update={"memory_limit_mib": budget}) for d in problem.devices]
    at_1f1b = problem.model_copy(update={"devices": devices})
    assert [d.compute for d in zb_memory_fit_schedule(at_1f1b).devices] == zb_h1_orders(at_1f1b)


def test_memory_fit_pattern_cuts_the_lag_to_what_the_device_holds():
    """Whole activations held until W: stage k holds S-k + lag of them. The last device's limit holds
    3 of 4 (lag 2, one short of ZB-H1's 3); every other device holds ZB-H1's 4 (lag k)."""
    problem = make_problem(4, 16, weight_grad_mib=100.0, activation_mib=100.0)
    limits = [400.0, 400.0, 400.0, 300.0]
    devices = [d.model_copy(update={"memory_limit_mib": x}) for d, x in zip(problem.devices, limits)]
    limited = problem.model_copy(update={"devices": devices})
    schedule = zb_memory_fit_schedule(limited)
    assert [w_lag(device.compute) for device in schedule.devices] == [0, 1, 2, 2]
    assert not over_limit(limited, untimed_peaks(limited, schedule))
