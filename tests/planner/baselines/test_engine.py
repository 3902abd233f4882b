"""The list-scheduling engine (planner/baselines/engine.py): each of its settings does what it is for,
on a small case that shows the problem it solves."""

from __future__ import annotations

import pytest
from core_schedules import at_least_memory_times, make_problem, problem_doc
from pipeplan.planner.baselines.engine import EngineConfig, ForwardPolicy, MemoryPolicy, WPolicy, run_engine
from pipeplan.planner.baselines.passes import exclusive_orders
from pipeplan.planner.contract import Problem
from pipeplan.planner.ops import Kind, Op
from pipeplan.planner.simulator import Schedule, Timing


def engine_times(problem: Problem, cfg: EngineConfig) -> Timing:
    schedule = run_engine(problem, cfg)
    assert isinstance(schedule, Schedule)
    return schedule.engine_timing  # type: ignore[attr-defined]


# -- give_up_after ------------------------------------------------------------------------------------
def test_the_engine_gives_up_only_past_its_horizon():
    """The greedy drops any attempt whose own timing ends past the best plan's (plus its slack), so
    the rest of such a run is wasted time."""
    problem = make_problem(4, 8, p2p=0.1, b=1.3, w=0.7)
    cfg = EngineConfig(split=True, forwards=ForwardPolicy(cap=[4, 3, 2, 1]))
    full = run_engine(problem, cfg)
    assert full is not None
    end = full.engine_timing.makespan
    last_start = max(start for start, _ in full.engine_timing.times.values())
    assert run_engine(problem, cfg, give_up_after=last_start - 1e-6) is None
    same = run_engine(problem, cfg, give_up_after=end)
    assert same is not None
    assert [d.compute for d in same.devices] == [d.compute for d in full.devices]
    assert same.engine_timing.times == full.engine_timing.times


# -- MemoryPolicy.reload_in_turn -----------------------------------------------------------------------
def slow_copies(offload_ms: float) -> Problem:
    """P=8, M=16, F=1, B=1.5, W=0.5 (3 ms a microbatch); offload and reload take `offload_ms`."""
    doc = problem_doc(p=8, m=16, offload=True, f=1.0, b=1.5, w=0.5, offload_ms=offload_ms,
                      reload_ms=offload_ms, offloadable_mib=100.0)
    return Problem.model_validate(doc)


def in_turn_gates(problem: Problem, every: int, first: int = 0) -> dict[int, int]:
    """Stage 0 offloads microbatches first, first + every, ...: {reloaded mb: mb of the stage-0
    backward its reload waits for} for the reloads gated on their own stage's backward."""
    def treat(k: int, i: int) -> str | None:
        return "offload" if k == 0 and i >= first and (i - first) % every == 0 else None

    cfg = EngineConfig(split=True, memory=MemoryPolicy(treat=treat, reload_in_turn=True))
    schedule = run_engine(problem, cfg)
    assert isinstance(schedule, Schedule)
    return {g.op.mb: g.after.mb for g in schedule.gates
            if g.op.kind is Kind.RELOAD and g.op.stage == 0 and not g.at_end
            and g.after.stage == 0 and g.after.kind is Kind.B}


@pytest.mark.parametrize(("offload_ms", "first", "back"), [
    (5.0, 0, 2),  # a 5-ms copy spans 2 microbatches of 3 ms: B(0, i - 2), not B(0, i - 1)
    (10.0, 0, 3),  # a 10-ms copy spans 4, more than the 3 between offloaded ones: B(0, i - 3)
    (2.0, 0, 1),  # shorter than a microbatch's work: one backward ahead
    (10.0, 2, 3),  # offloaded 2, 5, 8, ...: the first reaches back before any, so waits for none
])
def test_a_reload_waits_for_the_backward_its_copy_spans_back_to(offload_ms, first, back):
    """A reload waits for the backward of its stage's previous offloaded microbatch, or of the one
    its copy's span back when that is later: "the previous microbatch's" came too late to hide a
    copy longer than a microbatch's work."""
    gates = in_turn_gates(slow_copies(offload_ms), every=3, first=first)
    assert gates, "no reload was gated on its own stage's backward"
    if first:
        assert first not in gates
    assert all(after == mb - back for mb, after in gates.items()), gates


# -- ForwardPolicy.await_first_backward / await_later_forward -----------------------------------------
def v_problem() -> Problem:
    """V placement, P=4, M=16; B and W not multiples of F, so arrivals fall inside forwards."""
    return make_problem(4, 16, placement="v", chunks=2, p2p=0.1, b=1.3, w=0.7)


def late_first(**awaits: bool) -> EngineConfig:
    return EngineConfig(split=True, forwards=ForwardPolicy(late_first=True, **awaits))


def first_backward_delays(problem: Problem, timing: Timing) -> list[float]:
    """How late each stage's first backward starts after its inputs are there."""
    t = timing.times
    delays = []
    for k in range(problem.num_stages):
        ready = t[Op(Kind.F, k, 0)][1]
        if k + 1 < problem.num_stages:
            ready = max(ready, t[Op(Kind.B, k + 1, 0)][1] + problem.link_ms(k + 1, k))
        delays.append(t[Op(Kind.B, k, 0)][0] - ready)
    return delays


def later_forward_delays(problem: Problem, timing: Timing) -> list[float]:
    """How late each second-chunk forward starts after its input is there."""
    t = timing.times
    return [t[Op(Kind.F, k, i)][0] - t[Op(Kind.F, k - 1, i)][1] - problem.link_ms(k - 1, k)
            for k in range(problem.num_devices, problem.num_stages)
            for i in range(problem.num_microbatches)]


def test_the_first_backward_chain_runs_without_waiting():
    """A list scheduler starts a forward and an arrival waits for all of it: in a V's warm-up that
    delays the first microbatch's whole backward chain."""
    problem = v_problem()
    before = first_backward_delays(problem, engine_times(problem, late_first()))
    assert max(before) > 0.1, "this problem no longer shows the delay the rule is for"
    after = first_backward_delays(problem, engine_times(problem, late_first(await_first_backward=True)))
    assert max(after) < 1e-6, after


def test_later_chunk_forwards_wait_less():
    problem = v_problem()
    before = later_forward_delays(problem, engine_times(problem, late_first(await_first_backward=True)))
    after = later_forward_delays(problem, engine_times(problem, late_first(await_first_backward=True,
                                                                           await_later_forward=True)))
    assert sum(after) < sum(before), (sum(after), sum(before))


# -- ForwardPolicy.pace --------------------------------------------------------------------------------
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
    free = run_engine(problem, EngineConfig(split=True, forwards=ForwardPolicy(cap=[16] * 8)))
    assert isinstance(free, Schedule)
    pace = [2, 2, 3, 1]
    assert any(lead >= p for lead, p in zip(widest_lead(problem, free), pace)), \
        "unpaced, no device runs ahead: this problem no longer shows what pacing limits"
    paced = run_engine(problem, EngineConfig(split=True, forwards=ForwardPolicy(cap=[16] * 8, pace=pace)))
    assert isinstance(paced, Schedule)
    assert all(lead < p for lead, p in zip(widest_lead(problem, paced), pace)), widest_lead(problem, paced)
    assert sum(len(order.compute) for order in paced.devices) == 3 * 8 * 16


# -- WPolicy.yields ------------------------------------------------------------------------------------
def middle_busiest() -> Problem:
    """P=3, M=8: device 1 (F 1.2, B 1, W 2) has the most work, device 0 (F 0.5) the least; W's are
    long enough for a backward to arrive while one runs."""
    problem = make_problem(3, 8, b=1.0, w=2.0)
    stages = list(problem.stages)
    stages[0] = stages[0].model_copy(update={"forward_ms": 0.5})
    stages[1] = stages[1].model_copy(update={"forward_ms": 1.2})
    return problem.model_copy(update={"stages": stages})


def backwards_behind_a_w(problem: Problem, yields: bool, device: int) -> int:
    """How many W's on `device` started while the next backward of a stage there was known to arrive
    (its forward had started and the backward above it had started earlier) before the W's end."""
    t = engine_times(problem, EngineConfig(split=True, weights=WPolicy(yields=yields))).times
    m = problem.num_microbatches
    count = 0
    for op, (start, end) in t.items():
        if op.kind is not Kind.W or problem.stages[op.stage].device != device:
            continue
        for k in problem.stages_of(device):
            if k + 1 == problem.num_stages:
                continue
            waiting = [i for i in range(m) if t[Op(Kind.B, k, i)][0] > start]
            if not waiting:
                continue
            i = min(waiting)
            above = t[Op(Kind.B, k + 1, i)]
            arrival = max(above[1] + problem.link_ms(k + 1, k), t[Op(Kind.F, k, i)][1])
            known = above[0] < start - 1e-9 and t[Op(Kind.F, k, i)][0] <= start
            count += known and start + 1e-9 < arrival < end - 1e-9
    return count


def test_a_w_off_the_busiest_device_lets_an_arriving_backward_go_first():
    """A W started just before a backward arrives delays that backward's whole chain."""
    problem = middle_busiest()
    assert backwards_behind_a_w(problem, False, 0) > 0, "no longer shows the delay"
    assert backwards_behind_a_w(problem, True, 0) == 0


def test_the_busiest_device_never_waits():
    """Device 1's idle would be the makespan's: it still starts a W a backward then waits for."""
    assert backwards_behind_a_w(middle_busiest(), True, 1) > 0


# -- EngineConfig.fixed --------------------------------------------------------------------------------
def test_a_fixed_order_is_run_as_given_with_recomputes_before_their_backwards():
    """Device 2 of P=4 holds one activation at a time; its fixed order (passes.exclusive_orders)
    runs exactly as given, a recompute before each recomputed microbatch's backward."""
    doc = problem_doc(p=4, m=8, recompute=True, p2p=0.05, b=1.5, w=0.5, weight_grad_mib=60.0)
    problem = at_least_memory_times(doc, [10.0, 10.0, 1.3, 10.0])
    first = exclusive_orders(problem)[0]
    assert first.label == "exclusive q=2" and list(first.orders) == [2]
    cfg = EngineConfig(split=True, forwards=ForwardPolicy(cap=[4, 3, 2, 1]),
                       memory=MemoryPolicy(limits=[problem.limit_of(d) for d in range(4)],
                                           treat=first.treat(None)),
                       fixed=first.orders)
    schedule = run_engine(problem, cfg)
    assert schedule is not None
    expected = [x for op in first.orders[2] for x in
                ([Op(Kind.RECOMPUTE, op.stage, op.mb)]
                 if op.kind is Kind.B and (op.stage, op.mb) in first.recomputed else []) + [op]]
    assert schedule.devices[2].compute == expected
