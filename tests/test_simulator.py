"""Simulator: hand-computed makespans, deadlock and structure errors, plan assembly, memory timeline."""

from __future__ import annotations

import pytest
from core_schedules import gpipe, make_problem, one_f_one_b, plan_of, serialized
from pipeplan.planner.memory import memory_curve
from pipeplan.planner.ops import Choice, Kind, Op
from pipeplan.planner.simulator import (
    DeadlockError,
    DeviceOrder,
    Gate,
    Schedule,
    ScheduleError,
    schedule_from_plan,
    simulate,
)
from pipeplan.planner.validator import validate_plan


def F(k, i):
    return Op(Kind.F, k, i)


def BW(k, i):
    return Op(Kind.BW, k, i)


@pytest.mark.parametrize("p, m", [(1, 1), (2, 2), (3, 5), (4, 8), (8, 32)])
@pytest.mark.parametrize("schedule", [one_f_one_b, gpipe])
def test_uniform_fused_backward_makespan(p, m, schedule):
    """(M + P - 1)(F + B + W) for uniform stages with combined backward and free links."""
    problem = make_problem(p=p, m=m, split=False, f=1.0, b=1.5, w=0.5)
    plan = plan_of(problem, schedule(problem))
    assert plan.makespan_ms == pytest.approx((m + p - 1) * 3.0)
    busy = m * 3.0 * p
    assert plan.bubble_ratio == pytest.approx(1 - busy / (p * plan.makespan_ms))
    assert validate_plan(problem, plan) == []


def test_one_f_one_b_peak_memory_per_device():
    problem = make_problem(p=4, m=8, split=False)
    plan = plan_of(problem, one_f_one_b(problem))
    assert plan.peak_memory_mib == [400.0, 300.0, 200.0, 100.0]
    gp = plan_of(problem, gpipe(problem))
    assert gp.peak_memory_mib == [800.0] * 4


def test_single_device_is_sequential():
    problem = make_problem(p=1, m=3, split=False, f=1.0, b=2.0, w=0.0)
    assert plan_of(problem, one_f_one_b(problem)).makespan_ms == pytest.approx(9.0)


def test_links_on_the_critical_path():
    # F0 0-1, F1 1.5-2.5, BW1 2.5-4.5, BW0 5-7
    problem = make_problem(p=2, m=1, split=False, p2p=0.5)
    timing = simulate(problem, one_f_one_b(problem))
    assert timing.times[F(1, 0)] == (1.5, 2.5)
    assert timing.times[BW(0, 0)] == (5.0, 7.0)
    assert timing.makespan == pytest.approx(7.0)


def test_same_device_stages_pay_no_link():
    """Loop placement on one device: stage 0 -> 1 stays on device 0, no p2p cost."""
    problem = make_problem(p=1, m=1, chunks=2, split=False, p2p=5.0)
    timing = simulate(problem, serialized(problem))
    assert timing.makespan == pytest.approx(6.0)


def test_offload_round_trip_makespan():
    # F 0-1, OFFLOAD 1-1.5, RELOAD 1.5-2, B 2-3, W 3-4
    problem = make_problem(p=1, m=1, offload=True)
    timing = simulate(problem, serialized(problem))
    assert timing.times[Op(Kind.OFFLOAD, 0, 0)] == (1.0, 1.5)
    assert timing.times[Op(Kind.RELOAD, 0, 0)] == (1.5, 2.0)
    assert timing.makespan == pytest.approx(4.0)
    assert timing.choices[(0, 0)] == Choice(split=True, offload=True, recompute=False)


def test_gates_delay_ops():
    problem = make_problem(p=1, m=2, split=False)
    orders = [DeviceOrder(compute=[F(0, 0), F(0, 1), BW(0, 0), BW(0, 1)])]
    free = simulate(problem, Schedule(orders))
    assert free.times[F(0, 1)] == (1.0, 2.0)
    # a start gate: F(0,1) may not start before BW(0,0) starts -- impossible with this lane order
    with pytest.raises(DeadlockError):
        simulate(problem, Schedule(orders, [Gate(F(0, 1), BW(0, 0))]))
    orders2 = [DeviceOrder(compute=[F(0, 0), BW(0, 0), F(0, 1), BW(0, 1)])]
    gated = simulate(problem, Schedule(orders2, [Gate(F(0, 1), BW(0, 0), at_end=True)]))
    assert gated.times[F(0, 1)] == (3.0, 4.0)


def test_deadlock_within_a_device_names_the_ops():
    problem = make_problem(p=1, m=1, split=False)
    with pytest.raises(DeadlockError) as info:
        simulate(problem, Schedule([DeviceOrder(compute=[BW(0, 0), F(0, 0)])]))
    message = str(info.value)
    assert message.startswith("orders deadlock:")
    assert "device 0 compute lane waits at BW(stage 0, mb 0) for F(stage 0, mb 0)" in message


def test_deadlock_across_devices_names_the_ops():
    """Device 1 wants mb 1 first; mb 1's forward on device 0 waits for mb 0's backward from device 1."""
    problem = make_problem(p=2, m=2, split=False)
    orders = [
        DeviceOrder(compute=[F(0, 0), BW(0, 0), F(0, 1), BW(0, 1)]),
        DeviceOrder(compute=[F(1, 1), BW(1, 1), F(1, 0), BW(1, 0)]),
    ]
    with pytest.raises(DeadlockError) as info:
        simulate(problem, Schedule(orders))
    message = str(info.value)
    assert "device 0 compute lane waits at BW(stage 0, mb 0) for BW(stage 1, mb 0)" in message
    assert "device 1 compute lane waits at F(stage 1, mb 1) for F(stage 0, mb 1)" in message


@pytest.mark.parametrize("orders, expected", [
    ([DeviceOrder(compute=[F(0, 0), BW(0, 0)])], "schedule has 1 devices; problem has 2"),
    ([DeviceOrder(compute=[F(0, 0), BW(0, 0)]), DeviceOrder(compute=[F(1, 0)])],
     "(stage 1, mb 0) has no backward"),
    ([DeviceOrder(compute=[F(0, 0), BW(0, 0), BW(1, 0)]), DeviceOrder(compute=[F(1, 0)])],
     "BW(stage 1, mb 0) is ordered on device 0"),
    ([DeviceOrder(compute=[F(0, 0), BW(0, 0)], d2h=[F(1, 0)]), DeviceOrder(compute=[BW(1, 0)])],
     "F(stage 1, mb 0) is in the d2h lane of device 0"),
    ([DeviceOrder(compute=[F(0, 0), BW(0, 0), BW(0, 0)]), DeviceOrder(compute=[F(1, 0), BW(1, 0)])],
     "BW(stage 0, mb 0) appears 2 times"),
])
def test_malformed_schedules(orders, expected):
    problem = make_problem(p=2, m=1, split=False)
    with pytest.raises(ScheduleError) as info:
        simulate(problem, Schedule(orders))
    assert expected in str(info.value)
    assert not isinstance(info.value, DeadlockError)


def test_gate_on_unknown_op():
    problem = make_problem(p=1, m=1, split=False)
    schedule = Schedule([DeviceOrder(compute=[F(0, 0), BW(0, 0)])], [Gate(BW(0, 0), F(0, 5))])
    with pytest.raises(ScheduleError, match="names an op the schedule lacks"):
        simulate(problem, schedule)


def test_schedule_from_plan_round_trip():
    """Re-timing an ASAP plan's own orders reproduces the plan exactly."""
    problem = make_problem(p=4, m=6, p2p=0.1)
    plan = plan_of(problem, one_f_one_b(problem))
    assert plan_of(problem, schedule_from_plan(plan)).model_dump() == plan.model_dump()


@pytest.mark.parametrize("kw", [
    {"p": 2, "m": 3, "p2p": 0.5, "offload": True},
    {"p": 2, "m": 3, "chunks": 2, "placement": "v", "recompute": True},
])
def test_schedule_from_plan_keeps_orders(kw):
    """A plan built with extra gates re-times to the same orders, never later, still valid."""
    problem = make_problem(**kw)
    plan = plan_of(problem, serialized(problem))
    schedule = schedule_from_plan(plan)
    again = plan_of(problem, schedule)
    assert schedule_from_plan(again).devices == schedule.devices
    assert again.makespan_ms <= plan.makespan_ms
    assert validate_plan(problem, again) == []


def test_memory_curve_steps():
    """One device, 1F1B, fused backward: +100 at each F start, -100 at each BW end; frees first."""
    problem = make_problem(p=1, m=2, split=False, static=50.0)
    timing = simulate(problem, one_f_one_b(problem))
    ops = timing.timed([F(0, 0), BW(0, 0), F(0, 1), BW(0, 1)])
    curve = memory_curve(problem, 0, ops, timing.choices)
    assert curve == [(0.0, 50.0), (0.0, 150.0), (3.0, 150.0), (6.0, 50.0)]


def test_memory_curve_split_offload():
    problem = make_problem(p=1, m=1, offload=True, weight_grad_mib=30.0)
    timing = simulate(problem, serialized(problem))
    kinds = [Kind.F, Kind.OFFLOAD, Kind.RELOAD, Kind.B, Kind.W]
    curve = memory_curve(problem, 0, timing.timed([Op(k, 0, 0) for k in kinds]), timing.choices)
    # F +100 @0; OFFLOAD -80 @1.5; RELOAD +80 @1.5 (same instant: free first); B -70 @3; W -30 @4
    assert curve == [(0.0, 0.0), (0.0, 100.0), (1.5, 100.0), (3.0, 30.0), (4.0, 0.0)]
