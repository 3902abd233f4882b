"""ASAP timing of per-device op orders, and assembly of the resulting plan v1.

A heuristic or a solver decides *orders* (per device: the compute order and the two copy-lane
orders) and, optionally, *gates* (an op may not start before another op starts or ends; this is how
a reload is delayed until just before its backward instead of running as early as possible). The
simulator turns that into times: every op starts as soon as its lane, its dependencies and its gates
allow. Orders that wait on each other in a cycle are reported as a deadlock, naming the ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from .bounds import lower_bound
from .contract import DevicePlan, Plan, PlanOp, Problem
from .iteration import iteration_bound, iteration_ms, throughput
from .memory import TimedOp, host_memory, offloaded_mib, order_peak, peak_memory, recompute_ms
from .ops import (
    COMPUTE_KINDS,
    LANES,
    Choice,
    Kind,
    Lane,
    Op,
    choices_from_ops,
    deps,
    duration,
    lane_of,
    op_of,
)


class Gate(NamedTuple):
    """`op` may not start before `after` starts (at_end=False) or ends (at_end=True)."""

    op: Op
    after: Op
    at_end: bool = False


@dataclass
class DeviceOrder:
    compute: list[Op] = field(default_factory=list)
    d2h: list[Op] = field(default_factory=list)
    h2d: list[Op] = field(default_factory=list)

    def lane(self, lane: Lane) -> list[Op]:
        return {Lane.COMPUTE: self.compute, Lane.D2H: self.d2h, Lane.H2D: self.h2d}[lane]


@dataclass
class Schedule:
    """Op orders per device plus gates: everything needed to time a plan."""

    devices: list[DeviceOrder]
    gates: list[Gate] = field(default_factory=list)

    def all_ops(self) -> list[Op]:
        return [op for d in self.devices for lane in LANES for op in d.lane(lane)]


class ScheduleError(ValueError):
    """The orders do not describe a complete, consistent set of ops for the problem."""


class DeadlockError(ScheduleError):
    """The orders wait on each other in a cycle; the message names the blocked ops."""


@dataclass
class Timing:
    """Start and end of every op, with the choices its op set implies."""

    times: dict[Op, tuple[float, float]]
    choices: dict[tuple[int, int], Choice]

    @cached_property
    def makespan(self) -> float:
        """Read many times per candidate while heuristics compare; `times` is not changed once timed."""
        return max(e for _, e in self.times.values()) - min(s for s, _ in self.times.values())

    def timed(self, ops: list[Op]) -> list[TimedOp]:
        return [TimedOp(op, *self.times[op]) for op in ops]


def check_schedule(problem: Problem, schedule: Schedule) -> dict[tuple[int, int], Choice]:
    """Validate the structure of `schedule` and return the choices it implies."""
    if len(schedule.devices) != problem.num_devices:
        raise ScheduleError(f"schedule has {len(schedule.devices)} devices; problem has {problem.num_devices}")
    problems: list[str] = []
    for d, order in enumerate(schedule.devices):
        for lane in LANES:
            for op in order.lane(lane):
                if lane_of(op.kind) is not lane:
                    problems.append(f"{op} is in the {lane.value} lane of device {d}")
                elif op.stage < problem.num_stages and problem.stages[op.stage].device != d:
                    problems.append(f"{op} is ordered on device {d}, not on its stage's device")
    choices, errors = choices_from_ops(problem, schedule.all_ops())
    problems += errors
    if problems:
        raise ScheduleError("; ".join(problems[:10]))
    return choices


def simulate(problem: Problem, schedule: Schedule,
             choices: dict[tuple[int, int], Choice] | None = None) -> Timing:
    """Time every op as early as its lane order, dependencies and gates allow.

    Lanes are walked in order, each as far as its next op's predecessors are timed; a lane blocked on
    an untimed op waits on that op and resumes when it is timed. Every op and every edge is looked at
    about once, without building a graph (the inline first plan of up to 131,072 ops simulates several
    candidates, so this is on the hot path of a POST). `choices`: check_schedule's result, when the
    caller has it already."""
    choices = choices if choices is not None else check_schedule(problem, schedule)
    gates: dict[Op, list[tuple[Op, bool]]] = {}
    for gate in schedule.gates:
        gates.setdefault(gate.op, []).append((gate.after, gate.at_end))
    lanes = [ops for order in schedule.devices for ops in (order.compute, order.d2h, order.h2d) if ops]
    known = {op for ops in lanes for op in ops}
    for gate in schedule.gates:
        if gate.op not in known or gate.after not in known:
            raise ScheduleError(f"gate {gate.op} after {gate.after} names an op the schedule lacks")

    times: dict[Op, tuple[float, float]] = {}
    waiting_on: dict[Op, list[int]] = {}  # untimed op -> lanes whose head waits for it
    position = [0] * len(lanes)
    runnable = list(range(len(lanes)))
    while runnable:
        index = runnable.pop()
        ops, i = lanes[index], position[index]
        free_at = times[ops[i - 1]][1] if i else 0.0
        while i < len(ops):
            op = ops[i]
            start, blocker = free_at, None
            for dep in deps(problem, op, choices):
                timed = times.get(dep.before)
                if timed is None:
                    blocker = dep.before
                    break
                start = max(start, timed[1] + dep.lag_ms)
            if blocker is None:
                for after, at_end in gates.get(op, ()):
                    timed = times.get(after)
                    if timed is None:
                        blocker = after
                        break
                    start = max(start, timed[1] if at_end else timed[0])
            if blocker is not None:
                waiting_on.setdefault(blocker, []).append(index)
                break
            free_at = start + duration(problem, op)
            times[op] = (start, free_at)
            runnable.extend(waiting_on.pop(op, ()))
            i += 1
        position[index] = i
    if len(times) < len(known):
        raise DeadlockError(_deadlock_message(problem, schedule, choices, times))
    return Timing(times, choices)


def _deadlock_message(problem: Problem, schedule: Schedule, choices: dict[tuple[int, int], Choice],
                      times: dict[Op, tuple[float, float]]) -> str:
    waits: dict[Op, list[Op]] = {}
    for gate in schedule.gates:
        waits.setdefault(gate.op, []).append(gate.after)
    lines = []
    for d, order in enumerate(schedule.devices):
        for lane in LANES:
            ops = order.lane(lane)
            head = next((op for op in ops if op not in times), None)
            if head is None:
                continue
            before = [dep.before for dep in deps(problem, head, choices)] + waits.get(head, [])
            blockers = ", ".join(str(b) for b in before if b not in times)
            lines.append(f"device {d} {lane.value} lane waits at {head} for {blockers}")
    return "orders deadlock: " + "; ".join(lines[:8])


def build_plan(problem: Problem, schedule: Schedule, timing: Timing, method: str,
               problem_key: str | None = None, status: str = "feasible",
               solver_bound_ms: float | None = None) -> Plan:
    """Assemble plan v1 from a timed schedule (metrics computed here, validation left to callers).

    Besides time and device memory, a plan reports what its transfers cost the host: MiB offloaded
    per iteration, recompute time and peak pinned host memory per device (docs/transfers.md)."""
    devices, peaks, host = [], [], []
    busy = 0.0
    for d, order in enumerate(schedule.devices):
        rank = {op: (lane_index, pos) for lane_index, lane in enumerate(LANES)
                for pos, op in enumerate(order.lane(lane))}
        ops = sorted(rank, key=lambda op: (timing.times[op][0], rank[op]))
        devices.append(DevicePlan(device=d, ops=[
            PlanOp(kind=op.kind.value, stage=op.stage, mb=op.mb,
                   start_ms=timing.times[op][0], end_ms=timing.times[op][1]) for op in ops]))
        copies = order.d2h or order.h2d
        peaks.append(peak_memory(problem, d, timing.timed(ops), timing.choices) if copies
                     else order_peak(problem, d, order.compute))
        host.append(host_memory(problem, timing.timed(order.d2h + order.h2d)))
        busy += sum(timing.times[op][1] - timing.times[op][0] for op in ops if op.kind in COMPUTE_KINDS)
    makespan = timing.makespan
    iteration = iteration_ms(problem, ((problem.stages[op.stage].device, op.kind, op.stage, s, e)
                                       for op, (s, e) in timing.times.items()))
    tokens, mfu = throughput(problem, iteration)
    bound = min(lower_bound(problem), makespan)
    return Plan(
        problem_key=problem_key or problem.key(),
        status=status,
        makespan_ms=makespan,
        lower_bound_ms=bound,
        bubble_ratio=1.0 - busy / (problem.num_devices * makespan) if makespan > 0 else 0.0,
        peak_memory_mib=peaks,
        method=method,
        devices=devices,
        solver_bound_ms=solver_bound_ms,
        offloaded_mib=offloaded_mib(problem, timing.choices),
        recompute_ms=recompute_ms(problem, timing.choices),
        host_memory_mib=host,
        iteration_ms=iteration,
        iteration_bound_ms=min(iteration_bound(problem, bound), iteration),
        tokens_per_s_per_gpu=tokens,
        mfu=mfu,
    )


def schedule_from_plan(plan: Plan) -> Schedule:
    """The orders (and reload gates) a timed plan implies, to re-time or improve it.

    Each reload is gated on the compute op running when it started, so re-timing keeps it as late
    as the plan had it instead of pulling it forward and raising memory.
    """
    devices, gates = [], []
    for dp in sorted(plan.devices, key=lambda d: d.device):
        order = DeviceOrder()
        last_compute = None
        for pop in sorted(dp.ops, key=lambda p: p.start_ms):
            op = op_of(pop)
            order.lane(lane_of(op.kind)).append(op)
            if op.kind in COMPUTE_KINDS:
                last_compute = op
            elif op.kind is Kind.RELOAD and last_compute is not None:
                gates.append(Gate(op, last_compute))
        devices.append(order)
    return Schedule(devices, gates)
