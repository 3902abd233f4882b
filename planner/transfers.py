"""Drop the offloads and recomputes a timed schedule does not need (docs/transfers.md).

Host copies are not free: they share PCIe with the pipeline's own traffic, pin host memory and cost
CPU time; a recompute costs compute. A heuristic that treats whole stages (or a solver that found a
treatment harmless) often treats microbatches whose memory was never short. `prune` removes every
treatment it can while each device stays within its memory limit, keeping every other op where it
was: a removed treatment's ops just vanish. Kept times make each removal's effect on memory exact and
local (an offload's activation stays on the device from its OFFLOAD's end to its RELOAD's start; a
recompute's from its forward's start to the RECOMPUTE's start), so the pass needs no re-simulation
and can never lengthen the makespan; pinned host memory can only fall. `retime` then starts every op
as early as the thinner schedule allows, kept only when it still fits.

Order: offloads before recomputes (the plan's second objective is fewer offloaded MiB, its third less
recompute time), largest first, and among equals in time order. Measured on 38 greedy schedules
(docs/transfers.md): time order keeps 0.8% fewer offloaded MiB than shortest-held first (the
classic interval-packing rule), 0.5% fewer than longest-held first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .contract import Plan, Problem
from .memory import TimedOp, _tick, host_memory, peak_memory
from .ops import LANES, Choice, Kind, Op, choices_from_ops, memory_delta, op_of
from .simulator import DeviceOrder, Schedule, ScheduleError, Timing, build_plan, schedule_from_plan, simulate

HEADROOM = 1e-7  # relative: prune stays this far inside the validator's 1e-6 tolerance on limits


@dataclass(frozen=True)
class Pruned:
    """The schedule and timing without the removed treatments; `removed` counts (stage, mb) pairs."""

    schedule: Schedule
    timing: Timing
    removed: int


@dataclass(frozen=True)
class _Candidate:
    """Removing one treatment adds `mib` to its device's memory on [start, end) (ticks)."""

    pair: tuple[int, int]
    device: int
    start: int
    end: int
    mib: float
    ops: tuple[Op, ...]

    @property
    def order(self) -> tuple[bool, float, int]:
        offload = any(op.kind is Kind.OFFLOAD for op in self.ops)
        return (not offload, -self.mib, self.start)


def is_treated(choices: dict[tuple[int, int], Choice]) -> bool:
    return any(c.offload or c.recompute for c in choices.values())


def prune(problem: Problem, schedule: Schedule, timing: Timing) -> Pruned:
    """Remove every offload and recompute whose memory the device can hold, times kept."""
    candidates = _candidates(problem, timing)
    if not candidates:
        return Pruned(schedule, timing, 0)
    by_device: dict[int, list[_Candidate]] = {}
    for c in candidates:
        by_device.setdefault(c.device, []).append(c)
    room = {d: _Room(problem, d, _device_ops(schedule.devices[d], timing), timing.choices, own)
            for d, own in by_device.items()}
    chosen = [c for c in sorted(candidates, key=lambda c: c.order) if room[c.device].take(c)]
    if not chosen:
        return Pruned(schedule, timing, 0)
    return Pruned(*_without(schedule, timing, chosen), len(chosen))


def retime(problem: Problem, schedule: Schedule, timing: Timing) -> Timing:
    """Every op as early as the orders allow, if that fits device memory, adds no pinned host memory
    beyond max(cap, before) and is not longer; else `timing` unchanged."""
    try:
        asap = simulate(problem, schedule)
    except ScheduleError:
        return timing
    if asap.makespan > timing.makespan:
        return timing
    for d, order in enumerate(schedule.devices):
        ops = order.compute + order.d2h + order.h2d
        if not _within(peak_memory(problem, d, asap.timed(ops), asap.choices), problem.limit_of(d)):
            return timing
        copies = order.d2h + order.h2d
        host_cap = max(problem.host_limit_of(d), host_memory(problem, timing.timed(copies)))
        if not _within(host_memory(problem, asap.timed(copies)), host_cap):
            return timing
    return asap


def prune_plan(problem: Problem, plan: Plan) -> Plan:
    """`plan` without the treatments it does not need (times kept; everything else it says kept),
    or `plan` itself when it has none to drop. Not validated here: the caller validates."""
    if not any(op.kind in ("OFFLOAD", "RECOMPUTE") for dp in plan.devices for op in dp.ops):
        return plan
    times = {op_of(o): (o.start_ms, o.end_ms) for dp in plan.devices for o in dp.ops}
    choices, errors = choices_from_ops(problem, list(times))
    if errors:
        return plan
    pruned = prune(problem, schedule_from_plan(plan), Timing(times, choices))
    if not pruned.removed:
        return plan
    built = build_plan(problem, pruned.schedule, pruned.timing, plan.method, plan.problem_key)
    fields = ("devices", "peak_memory_mib", "bubble_ratio", "offloaded_mib", "recompute_ms", "host_memory_mib")
    return plan.model_copy(update={name: getattr(built, name) for name in fields})


def cost_key(offloaded: float, recomputed: float) -> tuple[float, float]:
    """(offloaded MiB, recompute ms), the tie-break after the makespan, rounded to 1e-6 so that float
    noise in a sum never decides a tie."""
    return (round(offloaded, 6), round(recomputed, 6))


def transfer_cost(plan: Plan | None) -> tuple[float, float]:
    """cost_key of a plan; not reported (None) counts as nothing, no plan as infinitely much."""
    if plan is None:
        return (math.inf, math.inf)
    return cost_key(plan.offloaded_mib or 0.0, plan.recompute_ms or 0.0)


def _within(value: float, limit: float) -> bool:
    return value <= limit + HEADROOM * max(1.0, limit)


def _candidates(problem: Problem, timing: Timing) -> list[_Candidate]:
    out = []
    for (k, i), choice in timing.choices.items():
        stage = problem.stages[k]
        if choice.offload:
            off, rel = Op(Kind.OFFLOAD, k, i), Op(Kind.RELOAD, k, i)
            start, end, mib, ops = timing.times[off][1], timing.times[rel][0], stage.offloadable_mib, (off, rel)
        elif choice.recompute:
            rec = Op(Kind.RECOMPUTE, k, i)
            start, end = timing.times[Op(Kind.F, k, i)][0], timing.times[rec][0]
            mib, ops = stage.activation_mib - stage.checkpoint_mib, (rec,)
        else:
            continue
        out.append(_Candidate((k, i), stage.device, _tick(start), _tick(end), mib, ops))
    return out


def _without(schedule: Schedule, timing: Timing, chosen: list[_Candidate]) -> tuple[Schedule, Timing]:
    """The schedule and timing with `chosen`'s ops gone (and every gate that names one of them)."""
    gone = {op for c in chosen for op in c.ops}
    devices = [DeviceOrder(*([op for op in order.lane(lane) if op not in gone] for lane in LANES))
               for order in schedule.devices]
    gates = [g for g in schedule.gates if g.op not in gone and g.after not in gone]
    choices = dict(timing.choices)
    for c in chosen:
        choices[c.pair] = Choice(choices[c.pair].split)
    times = {op: t for op, t in timing.times.items() if op not in gone}
    return Schedule(devices, gates), Timing(times, choices)


def _device_ops(order: DeviceOrder, timing: Timing) -> list[TimedOp]:
    return timing.timed([op for lane in LANES for op in order.lane(lane)])


class _Room:
    """One device's memory level per instant (after its frees, then its allocations), on the ticks
    of its events and of its candidates' intervals, so that a removal is a slice add."""

    def __init__(self, problem: Problem, device: int, ops: list[TimedOp],
                 choices: dict[tuple[int, int], Choice], candidates: list[_Candidate]):
        self.limit = problem.limit_of(device)
        ticks, frees, deltas = [], [], []
        for t in ops:
            delta = memory_delta(problem, t.op, choices[(t.op.stage, t.op.mb)])
            ticks += [_tick(t.start), _tick(t.end)]
            frees += [1, 0]
            deltas += [delta.at_start, delta.at_end]
        for c in candidates:  # this device's: their interval ends become points of the curve
            ticks += [c.start, c.end]
            frees += [1, 1]
            deltas += [0.0, 0.0]
        tick_arr = np.array(ticks, dtype=np.int64)
        order = np.lexsort((np.array(frees), tick_arr))
        sorted_ticks = tick_arr[order]
        levels = problem.devices[device].static_mib + np.cumsum(np.array(deltas)[order])
        last = np.append(sorted_ticks[1:] != sorted_ticks[:-1], True)
        self.ticks = sorted_ticks[last]
        self.levels = levels[last]

    def take(self, c: _Candidate) -> bool:
        """Remove `c` if its memory fits for its whole interval; say whether it was removed."""
        lo, hi = np.searchsorted(self.ticks, (c.start, c.end))
        if hi <= lo or c.mib <= 0:
            return True
        window = self.levels[lo:hi]
        if not _within(float(window.max()) + c.mib, self.limit):
            return False
        window += c.mib
        return True
