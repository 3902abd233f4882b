"""Start a new problem from a solved neighbour's plan: kept, re-timed, resized or repaired, and
validated (docs/reuse.md has the reasoning and the measurements).

Two problems are *neighbours* when they share their pipeline structure (`signature`: devices, each
stage's device, options) and differ only in numbers: budgets, costs, sizes, the microbatch count. A
plan's op orders then apply to both; its times do not. `distance` ranks neighbours for a cache.

`reuse_plan` tries, in turn:
1. *as is*: same ops, costs and sizes, and every peak within the new limits;
2. *re-timed*: the plan's orders, timed under the new costs, every allocation (F, RELOAD, RECOMPUTE)
   gated on the last release of each lane (compute: B/W/BW; copies out: OFFLOAD) that ended before it
   in the plan. The simulator alone starts ops as early as it can, which pulls forwards ahead of the
   backwards whose memory they waited for; with the gates each device's memory events keep their
   order whatever the durations, so no device peaks above the plan with the same sizes;
3. *resized* to M' microbatches (ranked by first forward): fewer drops the last ones; more moves the
   second half later by (M' - M) periods and fills the gap with the steady-state microbatches before
   it, cycled, each moved as a whole;
4. *repaired* when a device goes over its limit: every over-limit stretch is relieved at its highest
   point (offload, an earlier W, recompute, a delayed allocation) and the schedule re-timed, round
   after round within a time box.

Every answer is validated (or left to a caller that validates: `validate=False`), so a plan of a
larger budget reaches a smaller one only when it fits there. Pure: no I/O.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, TypeVar

from .baselines.common import DoesNotFit, evaluate, over_limit, peaks_of
from .bounds import MemoryInfeasibleError, check_memory_feasible, lower_bound
from .contract import DevicePlan, Plan, PlanOp, Problem
from .memory import memory_curve
from .ops import Choice, Kind, Lane, Op, op_of
from .simulator import (
    DeadlockError,
    DeviceOrder,
    Gate,
    Schedule,
    ScheduleError,
    Timing,
    schedule_from_plan,
    simulate,
)
from .transfers import prune_plan
from .validator import InvalidPlanError, validate_plan

NEIGHBOUR_FORMAT = "pipeplan.neighbours/v1"
REPAIR_S = 3.0  # the repair rounds' default time box: the service's first plan waits up to 3 s for its greedy
MAX_ROUNDS = 64
TOL = 1e-9

_ALLOCATING = frozenset({"F", "RELOAD", "RECOMPUTE"})
_RELEASE_LANE = {"B": Lane.COMPUTE, "W": Lane.COMPUTE, "BW": Lane.COMPUTE, "OFFLOAD": Lane.D2H}


# -- who is a neighbour ---------------------------------------------------------------------------
def structure(problem: Problem) -> dict:
    """What two neighbours share: the device count, each stage's device, and the options (which op
    kinds exist). Metadata (model name, layer ranges) is provenance: a repartitioned or recalibrated
    model is a neighbour with other costs."""
    return {"format": NEIGHBOUR_FORMAT, "num_devices": problem.num_devices,
            "placement": [s.device for s in problem.stages], "options": problem.options.model_dump()}


def signature(problem: Problem) -> str:
    """SHA-256 hex of the canonical `structure`: equal for neighbours, the index a cache keeps."""
    doc = json.dumps(structure(problem), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


def difference(problem: Problem, other: Problem) -> str | None:
    """Which part of the structure differs (None: they are neighbours)."""
    a, b = structure(problem), structure(other)
    if a["num_devices"] != b["num_devices"]:
        return f"num_devices is {a['num_devices']}, the neighbour's {b['num_devices']}"
    if len(a["placement"]) != len(b["placement"]):
        return f"{len(a['placement'])} stages, the neighbour {len(b['placement'])}"
    if a["placement"] != b["placement"]:
        k = next(k for k, (x, y) in enumerate(zip(a["placement"], b["placement"])) if x != y)
        return f"stages[{k}].device is {a['placement'][k]}, the neighbour's {b['placement'][k]}"
    if a["options"] != b["options"]:
        return f"options are {a['options']}, the neighbour's {b['options']}"
    return None


def _change(a: float | None, b: float | None) -> float:
    """Symmetric relative change in [0, 1]; unlimited (None) against a number is 1."""
    if a is None or b is None:
        return 0.0 if a is b else 1.0
    top = max(abs(a), abs(b))
    return 0.0 if top == 0 else abs(a - b) / top


_DURATIONS = ("forward_ms", "backward_input_ms", "backward_weight_ms", "recompute_ms", "offload_ms",
              "reload_ms")
_SIZES = ("activation_mib", "weight_grad_mib", "offloadable_mib", "checkpoint_mib")


class Distance(NamedTuple):
    """How far a neighbour is, each part a relative change in [0, 1] (|a - b| / max(a, b))."""

    budget: float  # the largest change of a device's free memory (limit - static; unlimited vs not: 1)
    larger_budget: bool  # the neighbour had more free memory on some device: its plan may not fit here
    costs: float  # the largest change of an op duration or p2p_ms
    memory: float  # the largest change of an activation size
    microbatches: float  # of the microbatch count (M x 2: 0.5)

    @property
    def total(self) -> float:
        """The ranking: the parts summed, a larger budget's change counted twice (its plan must be
        repaired here, a smaller budget's fits as it is)."""
        return self.budget * (2 if self.larger_budget else 1) + self.costs + self.memory + self.microbatches


def distance(problem: Problem, neighbour: Problem) -> Distance:
    """How `neighbour` differs from `problem` (both assumed neighbours: see `difference`)."""
    free = [(problem.free_mib(d), neighbour.free_mib(d)) for d in range(problem.num_devices)]
    budget = max(_change(*(None if math.isinf(x) else x for x in pair)) for pair in free)
    costs = max([_change(problem.p2p_ms, neighbour.p2p_ms)]
                + [_change(getattr(s, f), getattr(t, f)) for s, t in zip(problem.stages, neighbour.stages)
                   for f in _DURATIONS])
    memory = max(_change(getattr(s, f), getattr(t, f)) for s, t in zip(problem.stages, neighbour.stages)
                 for f in _SIZES)
    return Distance(budget=budget, larger_budget=any(theirs > ours * (1 + TOL) for ours, theirs in free),
                    costs=costs, memory=memory,
                    microbatches=_change(problem.num_microbatches, neighbour.num_microbatches))


T = TypeVar("T")


def nearest(problem: Problem, candidates: Iterable[tuple[Problem, T]]) -> list[tuple[Distance, Problem, T]]:
    """The candidates that are neighbours of `problem`, nearest first (`Distance.total`)."""
    found = [(distance(problem, other), other, item) for other, item in candidates
             if difference(problem, other) is None]
    return sorted(found, key=lambda x: x[0].total)


# -- reuse ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reuse:
    """A neighbour's plan made a plan of this problem (`plan`, validated), or why not (`reason`)."""

    plan: Plan | None
    neighbour_key: str
    how: str  # what was done: "as is", "re-timed", "32 -> 64 microbatches, re-timed", "..., repaired"
    reason: str | None
    elapsed_s: float


def reuse_plan(problem: Problem, neighbour: Problem, plan: Plan, problem_key: str | None = None,
               time_limit_s: float = REPAIR_S, validate: bool = True) -> Reuse:
    """`plan` (a validated plan of `neighbour`) adapted to `problem`: see the module docstring.
    Never raises for a plan that does not apply; the reason says why. `validate=False` leaves the
    final validation to a caller that validates anyway (a repository validates every plan it
    stores; validating takes about half a second at 12,000 ops)."""
    started = time.monotonic()
    key = problem_key or problem.key()
    source = plan.problem_key

    def answer(result: Plan | None, how: str, reason: str | None = None) -> Reuse:
        return Reuse(result, source, how, reason, time.monotonic() - started)

    diff = difference(problem, neighbour)
    if diff is not None:
        return answer(None, "", f"not a neighbour: {diff}")
    if source != neighbour.key():
        return answer(None, "", f"the plan is not the neighbour's: its problem_key is {source[:12]}…")
    try:
        check_memory_feasible(problem)
    except MemoryInfeasibleError as exc:
        return answer(None, "", str(exc))
    m_old, m_new = neighbour.num_microbatches, problem.num_microbatches
    if m_old == m_new:
        kept = _as_is(problem, neighbour, plan, key, _method(plan, source, "as is"), validate)
        if kept is not None:
            return answer(kept, "as is")
        orders, how = plan, "re-timed"
    else:
        orders, how = resized(plan, neighbour, m_new), f"{m_old} -> {m_new} microbatches, re-timed"
    schedule = schedule_from_plan(orders)
    schedule.gates += memory_gates(orders)
    try:
        timing = simulate(problem, schedule)
    except ScheduleError as exc:
        return answer(None, how, f"the neighbour's orders do not apply: {exc}")
    if over_limit(problem, peaks_of(problem, schedule, timing)):
        repaired = _repair(problem, schedule, timing, started + time_limit_s)
        if isinstance(repaired, str):
            return answer(None, how, repaired)
        schedule, timing = repaired
        how += ", repaired"
    try:
        outcome = evaluate(problem, schedule, _method(plan, source, how), timing)
        return answer(outcome.plan(key, validate), how)
    except (DoesNotFit, InvalidPlanError) as exc:  # a host memory cap, which nothing here treats
        reason = exc.violations[0] if isinstance(exc, InvalidPlanError) else str(exc)
        return answer(None, how, f"the {how} plan is invalid: {reason}")


def best_reuse(problem: Problem, candidates: Iterable[tuple[Problem, Plan]], problem_key: str | None = None,
               tries: int = 3, time_limit_s: float = REPAIR_S, validate: bool = True) -> Reuse | None:
    """The fastest valid reuse among the `tries` nearest neighbours within about `time_limit_s` in
    all (None: no neighbour). When none gives a plan, the nearest one's answer says why."""
    deadline = time.monotonic() + time_limit_s
    key = problem_key or problem.key()
    best: Reuse | None = None
    for _, other, plan in nearest(problem, candidates)[:tries]:
        left = deadline - time.monotonic()
        if left <= 0 and best is not None:
            break
        got = reuse_plan(problem, other, plan, key, max(0.0, left), validate)
        if best is None or (got.plan is not None and (
                best.plan is None or got.plan.makespan_ms < best.plan.makespan_ms)):
            best = got
    return best


def _method(plan: Plan, source: str, how: str) -> str:
    """"reuse of <key> rev <N> (<how>): <the neighbour's method>", without nesting an earlier
    reuse's prefix (the stored revision links the neighbour; the root method says what made it)."""
    root = plan.method.split("): ", 1)[1] if plan.method.startswith("reuse of ") else plan.method
    return f"reuse of {source[:12]} rev {plan.revision} ({how}): {root}"


def _as_is(problem: Problem, neighbour: Problem, plan: Plan, key: str, method: str,
           validate: bool) -> Plan | None:
    """The plan itself as a plan of `problem` (its own bound) when it fits here: same ops, costs and
    sizes, every device's peak (and pinned host memory) within its limits; without the treatments
    this budget does not need."""
    change = distance(problem, neighbour)
    if change.costs or change.memory or problem.num_microbatches != neighbour.num_microbatches:
        return None
    capped = any(math.isfinite(problem.host_limit_of(d)) for d in range(problem.num_devices))
    if over_limit(problem, plan.peak_memory_mib) or (capped and plan.host_memory_mib is None) or any(
            h > problem.host_limit_of(d) * (1 + TOL) for d, h in enumerate(plan.host_memory_mib or [])):
        return None
    bound = lower_bound(problem)
    candidate = plan.model_copy(update={
        "problem_key": key, "revision": 1, "method": method, "solver_bound_ms": None,
        "lower_bound_ms": min(bound, plan.makespan_ms),
        "status": "optimal" if plan.makespan_ms <= bound * (1 + TOL) else "feasible"})
    candidate = prune_plan(problem, candidate)
    return None if validate and validate_plan(problem, candidate, key) else candidate


# -- orders -----------------------------------------------------------------------------------------
def memory_gates(plan: Plan) -> list[Gate]:
    """Each allocating op gated on the last release of each releasing lane that ended, in `plan`,
    at or before it started (and was listed before it, so ties at zero duration cannot cycle)."""
    gates = []
    for dp in plan.devices:
        releases: dict[Lane, list[PlanOp]] = {Lane.COMPUTE: [], Lane.D2H: []}
        ends: dict[Lane, list[float]] = {Lane.COMPUTE: [], Lane.D2H: []}
        for pop in dp.ops:  # listed by start (the contract), in each lane's order
            if pop.kind in _ALLOCATING:
                op = op_of(pop)
                for lane, seen in ends.items():
                    j = bisect.bisect_right(seen, pop.start_ms + TOL * max(1.0, abs(pop.start_ms))) - 1
                    if j >= 0:
                        gates.append(Gate(op, op_of(releases[lane][j]), at_end=True))
            lane = _RELEASE_LANE.get(pop.kind)
            if lane is not None:
                releases[lane].append(pop)
                ends[lane].append(max(pop.end_ms, ends[lane][-1] if ends[lane] else -math.inf))
    return gates


def period_ms(plan: Plan, problem: Problem) -> float:
    """The plan's steady-state time per microbatch: over the middle half of the microbatches, the
    mean spacing of one stage's successive forwards (or backwards), the median over stages and
    kinds (a memory-limited plan spaces them unevenly, so the mean, not the median gap); the busiest
    device's work per microbatch when there are too few microbatches."""
    starts: dict[tuple[str, int], list[float]] = {}
    for dp in plan.devices:
        for pop in dp.ops:
            if pop.kind in ("F", "B", "BW"):
                starts.setdefault((pop.kind, pop.stage), []).append(pop.start_ms)
    m = problem.num_microbatches
    lo, hi = m // 4, (3 * m) // 4
    if hi <= lo:
        return max(problem.work_ms(d) for d in range(problem.num_devices))
    spacing = [(ts[hi] - ts[lo]) / (hi - lo) for ts in map(sorted, starts.values())]
    return statistics.median(spacing)


def resized(plan: Plan, problem: Problem, m_new: int) -> Plan:
    """`plan`'s orders for `m_new` microbatches, as a plan-shaped list of ops whose times only order
    them (not a valid plan: the input of schedule_from_plan). Microbatches are ranked by their first
    forward. Fewer: the last M - M' are dropped (what is left holds no more memory; 1F1B, ZB-H1/H2
    and GPipe so trimmed are those schedules for M'). More: a pipeline schedule is a warm-up, a
    steady state advancing one microbatch per `period_ms` and a cool-down; the first half stays,
    the second half moves later by (M' - M) periods, and the gap is filled with copies of the
    microbatches just before it (up to M/2 - P of them, cycled, so a share of treated microbatches
    repeats), each moved by its distance in periods. A microbatch moves as a whole, so its own ops
    keep their order; an early one's deferred W stays where it was (in the new steady state, not
    the cool-down: a small loss the solver can win back)."""
    m_old = problem.num_microbatches
    first: dict[int, float] = {}
    for dp in plan.devices:
        for pop in dp.ops:
            if pop.kind == "F":
                first[pop.mb] = min(first.get(pop.mb, math.inf), pop.start_ms)
    ranked = sorted(range(m_old), key=lambda i: (first.get(i, math.inf), i))
    moves: dict[int, list[tuple[int, float]]] = {}  # old mb -> [(new mb, shift ms)]
    if m_new >= m_old:
        period = period_ms(plan, problem)
        extra = m_new - m_old
        head = (m_old + 1) // 2
        window = max(1, min(extra, head - problem.num_devices))
        for pos, mb in enumerate(ranked):
            moves.setdefault(mb, []).append((pos, 0.0) if pos < head else (pos + extra, extra * period))
        for j in range(extra):
            src = head - window + j % window
            moves[ranked[src]].append((head + j, (head + j - src) * period))
    else:
        moves = {mb: [(pos, 0.0)] for pos, mb in enumerate(ranked[:m_new])}
    devices = []
    for dp in plan.devices:
        ops = [(pop.start_ms + shift, pop.end_ms + shift, n, new, pop)
               for n, pop in enumerate(dp.ops) for new, shift in moves.get(pop.mb, ())]
        ops.sort(key=lambda x: x[:4])
        devices.append(DevicePlan.model_construct(device=dp.device, ops=[
            PlanOp.model_construct(kind=pop.kind, stage=pop.stage, mb=new, start_ms=s, end_ms=e)
            for s, e, _, new, pop in ops]))
    return plan.model_copy(update={"devices": devices})


# -- repair ---------------------------------------------------------------------------------------
Relief = Callable[[Schedule], None]  # a change to a schedule, in place


def _repair(problem: Problem, schedule: Schedule, timing: Timing,
            deadline: float) -> tuple[Schedule, Timing] | str:
    """Relieve every stretch of time a device is over its limit, at its highest point, round after
    round until every device fits: the repaired schedule and its timing, or why there is none. The
    memory gates keep every other allocation behind the releases it followed, so a relief lowers
    the device's memory where it acts and raises it nowhere else; but where a steady state fills the
    budget, a W run earlier or a recompute's extra forward can move the excess to the next period,
    so big problems may need more rounds than the time box holds."""
    for _ in range(MAX_ROUNDS):
        worst = _worst_instants(problem, schedule, timing)
        if not worst:
            return schedule, timing
        d, at, excess = worst[0]
        where = f"device {d} is {excess:.1f} MiB over its limit at {at:.1f} ms"
        taken: set = set()  # what this round's reliefs already act on (one instant's may cover the next)
        reliefs = [r for d, at, excess in worst
                   for r in _reliefs(problem, schedule, timing, d, at, excess, taken)]
        if time.monotonic() > deadline:
            return f"the repair ran out of time: {where}"
        applied = _apply(problem, schedule, reliefs, deadline)
        if applied is None:
            return f"{where}, and nothing held there can be offloaded, recomputed, freed or delayed"
        schedule, timing = applied
    return f"no fit after {MAX_ROUNDS} repair rounds"


def _apply(problem: Problem, schedule: Schedule, reliefs: list[tuple[Relief, bool]],
           deadline: float) -> tuple[Schedule, Timing] | None:
    """The schedule with every relief, and its timing. Reliefs marked safe cannot make the orders wait
    in a circle (treatments, W's run earlier, waits for a copy under way); the others can (moved
    forwards, waits for a compute op): when all together do, the safe ones are kept and the others
    added by halves, a half that deadlocks split again, until the deadline. None: nothing kept."""
    if not reliefs:
        return None
    kept = _trial(problem, schedule, [r for r, _ in reliefs])
    if kept is not None:
        return kept
    safe = [r for r, ok in reliefs if ok]
    kept = _trial(problem, schedule, safe) if safe and time.monotonic() < deadline else None
    pending = [risky] if (risky := [r for r, ok in reliefs if not ok]) else []
    while pending and time.monotonic() < deadline:
        part = pending.pop(0)
        got = _trial(problem, kept[0] if kept else schedule, part)
        if got is not None:
            kept = got
        elif len(part) > 1:
            pending[:0] = [part[:len(part) // 2], part[len(part) // 2:]]
    return kept


def _trial(problem: Problem, schedule: Schedule, reliefs: list[Relief]) -> tuple[Schedule, Timing] | None:
    """A copy of the schedule with the reliefs, and its timing; None when its orders deadlock."""
    trial = _copy(schedule)
    for relief in reliefs:
        relief(trial)
    try:
        return trial, simulate(problem, trial)
    except DeadlockError:
        return None


def _copy(schedule: Schedule) -> Schedule:
    return Schedule([DeviceOrder(list(o.compute), list(o.d2h), list(o.h2d)) for o in schedule.devices],
                    list(schedule.gates))


def _worst_instants(problem: Problem, schedule: Schedule, timing: Timing) -> list[tuple[int, float, float]]:
    """(device, time, MiB over the limit) at the highest point of each stretch of time a device is
    over its limit, worst first: a steady state over its limit in every period is relieved in one
    round, not one period per round."""
    out = []
    for d in over_limit(problem, peaks_of(problem, schedule, timing)):
        order = schedule.devices[d]
        limit = problem.limit_of(d) * (1 + TOL)
        curve = memory_curve(problem, d, timing.timed(order.compute + order.d2h + order.h2d), timing.choices)
        for over, stretch in itertools.groupby(curve, key=lambda point: point[1] > limit):
            if over:
                at, level = max(stretch, key=lambda point: point[1])
                out.append((d, at, level - problem.limit_of(d)))
    return sorted(out, key=lambda x: -x[2])


def _reliefs(problem: Problem, schedule: Schedule, timing: Timing, device: int, at: float,
             excess: float, taken: set) -> list[tuple[Relief, bool]]:
    """Changes that free memory on `device` at `at`, cheapest first, until they cover `excess`:
    offload an activation held there (free when the copy lane has room: its copy, in its forward's
    turn behind the device's earlier offloads, is out by `at`, delays no later copy (which would
    only move the excess on) and can be back before the backward); run a pending W before the op
    that allocates at `at` (it had to run anyway); recompute a held activation (one more forward);
    last, delay that allocation (`_delays`). What `taken` holds is left alone; what is chosen is
    added to it."""
    opts = problem.options
    order = schedule.devices[device]
    alloc = [op for op in order.compute + order.h2d
             if op.kind.value in _ALLOCATING and abs(timing.times[op][0] - at) <= TOL * max(1.0, at)]
    offloads = sorted((timing.times[Op(Kind.F, o.stage, o.mb)][1], *timing.times[o]) for o in order.d2h)
    ready = [f for f, _, _ in offloads]
    lane_free = list(itertools.accumulate((e for _, _, e in offloads), max))
    cheap, pulls, dear = [], [], []
    for k in problem.stages_of(device):
        s = problem.stages[k]
        for i in range(problem.num_microbatches):
            choice = timing.choices[(k, i)]
            f_start, f_end = timing.times[Op(Kind.F, k, i)]
            back = timing.times[_backward(choice, k, i)]
            held = s.weight_grad_mib + problem.output_grad_of(k)
            if choice.split and back[1] <= at < timing.times[Op(Kind.W, k, i)][0] and held > 0:
                pulls.append((held, Op(Kind.W, k, i)))
            if choice.offload or choice.recompute or not f_start <= at < back[0]:
                continue
            j = bisect.bisect_right(ready, f_end)  # its turn in the copy lane, by forward
            out = max(f_end, lane_free[j - 1] if j else 0.0) + s.offload_ms
            room = j == len(offloads) or out <= offloads[j][1]  # it delays no later copy
            if opts.offload and s.offloadable_mib > 0 and room and out <= at and out + s.reload_ms <= back[0]:
                cheap.append((back[0], s.offloadable_mib, (k, i)))
            elif opts.recompute and s.activation_mib > s.checkpoint_mib and back[0] - s.recompute_ms > at:
                dear.append((back[0], s.activation_mib - s.checkpoint_mib, (k, i)))
    before = next((op for op in alloc if op.kind is not Kind.RELOAD), None)
    options: list[tuple[float, object, Relief]] = []
    options += [(mib, pair, partial(_offload, problem, timing, pair))
                for _, mib, pair in sorted(cheap, reverse=True)]
    if before is not None:
        options += [(mib, w, partial(_pull, device, w, before))
                    for mib, w in sorted(pulls, key=lambda x: -x[0])]
    options += [(mib, pair, partial(_recompute, problem, timing, pair))
                for _, mib, pair in sorted(dear, reverse=True)]
    chosen: list[tuple[Relief, bool]] = []
    saved = 0.0
    for mib, what, relief in options:
        if saved >= excess:
            break
        if what not in taken:
            taken.add(what)
            chosen.append((relief, True))
            saved += mib
    if saved < excess:
        chosen += [(relief, safe) for op, relief, safe in _delays(problem, timing, device, order, alloc, at)
                   if op not in taken]
        taken.update(alloc)
    return chosen


def _backward(choice: Choice, k: int, i: int) -> Op:
    return Op(Kind.B if choice.split else Kind.BW, k, i)


def _delays(problem: Problem, timing: Timing, device: int, order: DeviceOrder, alloc: list[Op],
            at: float) -> list[tuple[Op, Relief, bool]]:
    """Delay each allocation at `at` past a release that cannot wait on it: a forward or recompute
    until the first offload under way ends (its forward ran before); a reload until the next B or W
    of the compute lane before its backward ends; else a forward moves after the next release of its
    lane (`_postpone`). (allocation, relief, safe: see `_apply`)."""
    running = [o for o in order.d2h if timing.times[o][0] <= at < timing.times[o][1]]
    out: list[tuple[Op, Relief, bool]] = []
    for op in alloc:
        if op.kind is Kind.RELOAD:
            back = next(o for o in order.compute
                        if o.kind in (Kind.B, Kind.BW) and (o.stage, o.mb) == (op.stage, op.mb))
            lane = order.compute[:order.compute.index(back)]
            release = next((o for o in lane if o.kind.value in _RELEASE_LANE and timing.times[o][1] > at),
                           None)
            if release is not None:
                out.append((op, partial(_gate, Gate(op, release, at_end=True)), False))
        elif running:
            out.append((op, partial(_gate, Gate(op, running[0], at_end=True)), True))
        elif op.kind is Kind.F:
            out.append((op, partial(_postpone, problem, device, op), False))
    return out


def _gate(gate: Gate, schedule: Schedule) -> None:
    schedule.gates.append(gate)


def _pull(device: int, w: Op, before: Op, schedule: Schedule) -> None:
    """Run W `w` right before `before` in the compute lane (it needs only its B, which ran already)."""
    lane = schedule.devices[device].compute
    lane.remove(w)
    lane.insert(lane.index(before), w)


def _postpone(problem: Problem, device: int, op: Op, schedule: Schedule) -> None:
    """Move forward `op` right after the next release (B, W, BW) of another microbatch j in its lane,
    if no op of its own microbatch comes first; its microbatch's later forwards follow: each moves
    after stage j's backward of its stage when it came before it (else that backward, which the
    release waits for, would wait for the moved forward)."""
    lane = schedule.devices[device].compute
    at = lane.index(op)
    n = next((n for n, o in enumerate(lane[at + 1:]) if o.kind.value in _RELEASE_LANE or o.mb == op.mb), None)
    if n is None or lane[at + 1 + n].mb == op.mb:
        return
    j = lane[at + 1 + n].mb
    _move(schedule, lane, at, at + 1 + n)
    for k in range(op.stage + 1, problem.num_stages):
        later = schedule.devices[problem.stages[k].device].compute
        forward = later.index(Op(Kind.F, k, op.mb))
        back = next(x for x, o in enumerate(later)
                    if o.kind in (Kind.B, Kind.BW) and (o.stage, o.mb) == (k, j))
        if forward < back:
            _move(schedule, later, forward, back)


def _move(schedule: Schedule, lane: list[Op], src: int, dst: int) -> None:
    """Move lane[src] to just after lane[dst] (src < dst). A gate that waited for the moved op's
    start (a reload's) now waits for the end of the op before its old place, the same moment in the
    old timing: waiting for the moved op could now be a circle."""
    op = lane.pop(src)
    lane.insert(dst, op)
    prev = lane[src - 1] if src > 0 else None
    schedule.gates[:] = [g if g.after != op or g.at_end else Gate(g.op, prev, at_end=True)
                         for g in schedule.gates if g.after != op or g.at_end or prev is not None]


def _recompute(problem: Problem, timing: Timing, pair: tuple[int, int], schedule: Schedule) -> None:
    """Recompute `pair` right before its backward, once the backward above it has started (earlier,
    it would hold the memory it frees longer: the engine's trigger)."""
    k, i = pair
    lane = schedule.devices[problem.stages[k].device].compute
    op = Op(Kind.RECOMPUTE, k, i)
    lane.insert(lane.index(_backward(timing.choices[pair], k, i)), op)
    if k + 1 < problem.num_stages:
        schedule.gates.append(Gate(op, _backward(timing.choices[(k + 1, i)], k + 1, i)))


def _offload(problem: Problem, timing: Timing, pair: tuple[int, int], schedule: Schedule) -> None:
    """Offload `pair`: copied out in its forward's turn, back in its backward's, starting with the
    compute op that leaves the copy time before the backward."""
    k, i = pair
    order = schedule.devices[problem.stages[k].device]
    times = timing.times
    back = _backward(timing.choices[pair], k, i)
    forward_end, back_start = times[Op(Kind.F, k, i)][1], times[back][0]
    out_turns = [times[Op(Kind.F, x.stage, x.mb)][1] for x in order.d2h]
    order.d2h.insert(bisect.bisect_right(out_turns, forward_end), Op(Kind.OFFLOAD, k, i))
    reload = Op(Kind.RELOAD, k, i)
    in_turns = [times[_backward(timing.choices[(x.stage, x.mb)], x.stage, x.mb)][0] for x in order.h2d]
    order.h2d.insert(bisect.bisect_right(in_turns, back_start), reload)
    lead = back_start - problem.stages[k].reload_ms
    lane = order.compute[:order.compute.index(back)]
    before = [op for op in lane if times.get(op, (math.inf,))[0] <= lead + TOL]  # new recomputes: untimed
    if before:
        schedule.gates.append(Gate(reload, before[-1]))
