"""Between plans (float milliseconds) and solver solutions (integer ticks).

A solution becomes a plan in two ways, both validated: the solver's own times (true durations from
the same starts; always valid under `Scale`'s rounding) and the ASAP re-timing of its lane orders
(often a little shorter when ticks were rounded up, but it may pull an allocation earlier, so it is
kept only when it validates and is faster).
"""

from __future__ import annotations

import heapq
import math

from ..contract import Plan, Problem
from ..ops import Choice, Kind, Op, choices_from_ops, deps, duration, lane_of, op_of
from ..simulator import DeviceOrder, Schedule, Timing, build_plan, schedule_from_plan, simulate
from ..validator import validate_plan
from .scaling import Scale, time_values


def schedule_of(problem: Problem, times: dict[Op, tuple[float, float]]) -> Schedule:
    """Lane orders by start time (ties: the earlier end first, so zero-length ops do not overtake)."""
    orders = [DeviceOrder() for _ in range(problem.num_devices)]
    for op in sorted(times, key=lambda o: (times[o][0], times[o][1], o.kind.value, o.stage, o.mb)):
        orders[problem.stages[op.stage].device].lane(lane_of(op.kind)).append(op)
    return Schedule(orders)


def plan_from_ticks(problem: Problem, starts: dict[Op, int], choices: dict[tuple[int, int], Choice],
                    scale: Scale, method: str, key: str, solver_bound_ms: float | None = None) -> Plan | None:
    """The best valid plan from a solution's integer starts, or None if neither form validates."""
    t0 = min(starts.values())
    times = {op: ((s - t0) / scale.time_scale, (s - t0) / scale.time_scale + duration(problem, op))
             for op, s in starts.items()}
    schedule = schedule_of(problem, times)
    candidates = []
    exact = build_plan(problem, schedule, Timing(times, choices), method, key,
                       solver_bound_ms=_bound(solver_bound_ms, problem, times))
    if not validate_plan(problem, exact, key):
        candidates.append(exact)
    try:
        sched = schedule_from_plan(exact)
        timing = simulate(problem, sched)
        if timing.makespan < exact.makespan_ms - 1e-9:
            asap = build_plan(problem, sched, timing, method, key,
                              solver_bound_ms=_bound(solver_bound_ms, problem, timing.times))
            if not validate_plan(problem, asap, key):
                candidates.append(asap)
    except ValueError:
        pass
    return min(candidates, key=lambda p: p.makespan_ms, default=None)


def _bound(bound: float | None, problem: Problem, times) -> float | None:
    if bound is None:
        return None
    makespan = max(e for _, e in times.values()) - min(s for s, _ in times.values())
    return min(bound, makespan)


def plan_times(plan: Plan, split: bool, problem: Problem) -> tuple[dict[Op, tuple[float, float]], dict]:
    """Op times of a plan; a BW becomes B then W at once when splitting is allowed (same timing,
    memory freed no later), which is the form the CP-SAT model uses."""
    times: dict[Op, tuple[float, float]] = {}
    for dp in plan.devices:
        for pop in dp.ops:
            op = op_of(pop)
            if split and op.kind is Kind.BW:
                mid = pop.start_ms + duration(problem, Op(Kind.B, op.stage, op.mb))
                times[Op(Kind.B, op.stage, op.mb)] = (pop.start_ms, mid)
                times[Op(Kind.W, op.stage, op.mb)] = (mid, pop.end_ms)
            else:
                times[op] = (pop.start_ms, pop.end_ms)
    t0 = min(s for s, _ in times.values())
    times = {op: (s - t0, e - t0) for op, (s, e) in times.items()}
    choices, errors = choices_from_ops(problem, list(times))
    if errors:
        raise ValueError("; ".join(errors[:5]))
    return times, choices


def ticks_of_plan(problem: Problem, plan: Plan, scale: Scale) -> tuple[dict[Op, int], dict]:
    """Integer starts for a plan: its own times when the scale is exact, else order-kept ticks.

    Rounded-up tick durations make a chain of ops longer than the plan's; re-timing the orders ASAP
    in ticks (as this once did) started forwards before the frees they waited for, and the hint broke
    every memory limit (Gemma-like V, 40 GiB: 4.7x the cap on device 0), so CP-SAT and every LNS step
    searched from scratch on all real-model problems. Multiplying every time by a stretch (1 + 3
    ticks per shortest span, 1.003) fixed that but made the hint 0.3% longer than the plan: on
    Llama-3-8B V at half memory, 20 ms that every CP-SAT/LNS run had to win back before a single
    plan could beat the seed (60-s solves found nothing). `_order_kept` instead keeps every "ends no
    later than it starts" relation of the plan (which is all that lane order, precedence and memory
    need), so the hint is only the rounding of the longest chain longer.
    """
    split = problem.options.split_backward
    times, choices = plan_times(plan, split, problem)
    if scale.time_exact:
        return {op: round(s * scale.time_scale) for op, (s, _) in times.items()}, choices
    if problem.num_stages * problem.num_microbatches < ORDER_KEPT_MIN_PAIRS:
        factor = scale.time_scale * stretch(problem, scale)
        starts = {op: math.ceil(s * factor - 1e-9) for op, (s, _) in times.items()}
        return _pushed(problem, scale, starts, choices), choices
    return _order_kept(problem, scale, times, choices), choices


# Below this many (stage, microbatch) pairs the stretched hint is kept: there a single-worker CP-SAT
# run from the exact-length hint stays near it (the example's P=4, M=4 model: a 2-s refine found
# nothing, from the stretched hint 12.24 -> 11.24 ms), while on real-model rows (256+ pairs) the
# stretch's 0.3% is what no 60-s search won back (Llama-3-8B V @50%: 6,761 -> 6,595 ms with it gone).
ORDER_KEPT_MIN_PAIRS = 128


def stretch(problem: Problem, scale: Scale) -> float:
    """How much longer tick timelines must be than float ones: an op of d ms and its link can each
    gain a tick by rounding, plus one for the start; 1 + 3 ticks per shortest span covers it."""
    positive = [v for v in time_values(problem) if v > 0]
    return 1.0 + 3.0 / (min(positive, default=1.0) * scale.time_scale)


def _pushed(problem: Problem, scale: Scale, starts: dict[Op, int],
            choices: dict[tuple[int, int], Choice]) -> dict[Op, int]:
    """Starts moved later where a dependency or lane order needs it (never earlier)."""
    order = sorted(starts, key=lambda op: (starts[op], lane_of(op.kind).value, op.stage, op.mb))
    last: dict[tuple[int, str], Op] = {}
    out: dict[Op, int] = {}
    for op in order:
        start = starts[op]
        for dep in deps(problem, op, choices):
            if dep.before in out:
                start = max(start, out[dep.before] + scale.t(duration(problem, dep.before))
                            + (scale.t(dep.lag_ms) if dep.lag_ms else 0))
        lane = (problem.stages[op.stage].device, lane_of(op.kind).value)
        if lane in last:
            prev = last[lane]
            start = max(start, out[prev] + scale.t(duration(problem, prev)))
        out[op] = start
        last[lane] = op
    return out


def _order_kept(problem: Problem, scale: Scale, times: dict[Op, tuple[float, float]],
                choices: dict[tuple[int, int], Choice]) -> dict[Op, int]:
    """Tick starts, each no earlier than its own time rounded, such that an op that ends no later
    than another starts (float noise as the validator allows) still does in ticks, link lags
    included. Then two intervals overlap in ticks only where they overlapped in the plan: lane
    orders hold, and every moment's live memory is a subset of one the plan already had."""
    ts = scale.time_scale
    order = sorted(times, key=lambda op: (*times[op], lane_of(op.kind).value, op.stage, op.mb))
    pending: list[tuple[float, int]] = []  # (float end, tick end) of ops not yet known to be over
    released = 0  # latest tick end of the ops that ended, in the plan, by the current start
    out: dict[Op, int] = {}
    for op in order:
        s, e = times[op]
        while pending and pending[0][0] <= s + 1e-6 * max(1.0, abs(s)):
            released = max(released, heapq.heappop(pending)[1])
        start = max(round(s * ts), released)
        for dep in deps(problem, op, choices):
            if dep.before in out:
                start = max(start, out[dep.before] + scale.t(duration(problem, dep.before))
                            + (scale.t(dep.lag_ms) if dep.lag_ms else 0))
        out[op] = start
        heapq.heappush(pending, (e, start + scale.t(duration(problem, op))))
    return out
