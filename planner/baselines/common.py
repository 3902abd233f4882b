"""What every baseline shares: its two exceptions, op helpers, and the one way a schedule becomes a
validated plan (simulate -> memory check -> build_plan -> assert_valid).

Baselines only decide orders, gates and offload/recompute sets; timing, metrics and validation are the
core's job, so a baseline cannot emit a plan the validator would reject.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..contract import Plan, Problem
from ..memory import host_memory, offloaded_mib, order_peak, peak_memory, recompute_ms
from ..ops import BACKWARD_KINDS, Kind, Op, duration
from ..simulator import DeviceOrder, Gate, Schedule, Timing, build_plan, simulate
from ..transfers import Pruned, cost_key, is_treated, prune, retime
from ..validator import assert_valid

TOL = 1e-6
TIE_TOLERANCE = 1e-9  # relative: makespans this close tie, and the fewer offloaded MiB wins
LARGE_OPS = 2048  # stages x microbatches above which the slow baselines are skipped or trimmed


def is_large(problem: Problem) -> bool:
    """Big enough that the offload baselines cost seconds and greedy runs only a few variants inline."""
    return problem.num_stages * problem.num_microbatches > LARGE_OPS


class NotApplicable(Exception):
    """The baseline does not apply to this problem (placement, options); `reason` says why."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


class DoesNotFit(Exception):
    """The baseline's schedule exceeds some device's memory limit.

    `needed_mib` is the schedule's peak per device (static memory included), so a caller can tell
    how much memory this schedule would need.
    """

    def __init__(self, message: str, needed_mib: list[float]):
        self.needed_mib = needed_mib
        super().__init__(message)

    def summary(self, problem: Problem) -> str:
        """One line for a page or a table cell: the device most over its limit, "needs 33.5 GiB on
        GPU 0 (limit 32.0 GiB; 2 more GPUs over)" (the message lists every device: 30 lines at 16)."""
        over = over_limit(problem, self.needed_mib)
        if not over:
            return str(self)
        d = max(over, key=lambda x: self.needed_mib[x] - problem.limit_of(x))
        more = f"; {len(over) - 1} more GPU{'s' if len(over) > 2 else ''} over" if len(over) > 1 else ""
        return (f"needs {self.needed_mib[d] / 1024:.1f} GiB on GPU {d} "
                f"(limit {problem.limit_of(d) / 1024:.1f} GiB{more})")


def backward_ops(problem: Problem, k: int, i: int, split: bool | None = None) -> list[Op]:
    """B then W when splitting (allowed and wanted), else one BW."""
    if split is None:
        split = problem.options.split_backward
    if split and problem.options.split_backward:
        return [Op(Kind.B, k, i), Op(Kind.W, k, i)]
    return [Op(Kind.BW, k, i)]


def require_split(problem: Problem, name: str) -> None:
    if not problem.options.split_backward:
        raise NotApplicable(f"{name} splits the backward into B and W but options.split_backward is false")


def require_one_chunk(problem: Problem, name: str) -> None:
    if problem.chunks != 1:
        raise NotApplicable(f"{name} needs one stage per device; this problem has {problem.chunks} per device")


def require_chain_placement(problem: Problem, name: str) -> None:
    """One stage per device and each stage on a distinct device (any permutation works)."""
    require_one_chunk(problem, name)


def is_loop_placement(problem: Problem) -> bool:
    p = problem.num_devices
    return all(s.device == problem.stages[k % p].device for k, s in enumerate(problem.stages)) and \
        len({problem.stages[k].device for k in range(p)}) == p


def is_v_placement(problem: Problem) -> bool:
    p = problem.num_devices
    if problem.chunks != 2:
        return False
    return all(problem.stages[k].device == problem.stages[2 * p - 1 - k].device for k in range(p))


def peaks_of(problem: Problem, schedule: Schedule, timing: Timing) -> list[float]:
    peaks = []
    for d, order in enumerate(schedule.devices):
        ops = order.compute + order.d2h + order.h2d
        peaks.append(peak_memory(problem, d, timing.timed(ops), timing.choices))
    return peaks


def untimed_peaks(problem: Problem, schedule: Schedule) -> list[float] | None:
    """Every device's peak from its compute order (memory.order_peak), or None when a device copies."""
    if any(order.d2h or order.h2d for order in schedule.devices):
        return None
    return [order_peak(problem, d, order.compute) for d, order in enumerate(schedule.devices)]


def over_limit(problem: Problem, peaks: list[float]) -> list[int]:
    return [d for d, peak in enumerate(peaks)
            if peak > problem.limit_of(d) + TOL * max(1.0, abs(problem.limit_of(d)))]


def does_not_fit(problem: Problem, name: str, peaks: list[float]) -> DoesNotFit:
    over = over_limit(problem, peaks)
    parts = [f"device {d} would need {peaks[d]:.1f} MiB but its limit is {problem.limit_of(d):.1f} MiB"
             for d in over]
    return DoesNotFit(f"{name} does not fit the memory limits: " + "; ".join(parts), peaks)


def host_over_limit(problem: Problem, schedule: Schedule, timing: Timing) -> list[str]:
    """'device d would need X MiB of pinned host memory ...' for each device over its host cap."""
    out = []
    for d, order in enumerate(schedule.devices):
        need, cap = host_memory(problem, timing.timed(order.d2h + order.h2d)), problem.host_limit_of(d)
        if need > cap + TOL * max(1.0, cap):
            out.append(f"device {d} would need {need:.1f} MiB of pinned host memory but its host limit is"
                       f" {cap:.1f} MiB")
    return out


@dataclass
class Outcome:
    """A timed schedule that fits: cheap to compare; `plan()` builds and validates plan v1 only for
    the one a caller keeps (building and validating is most of the cost on large problems)."""

    problem: Problem
    schedule: Schedule
    timing: Timing
    method: str
    # the makespan before re-timing (evaluate): what a schedule built the same way is timed at first
    before_retime_ms: float | None = None

    @property
    def makespan(self) -> float:
        return self.timing.makespan

    @property
    def transfer_cost(self) -> tuple[float, float]:
        """(offloaded MiB, recompute ms) per iteration: the tie-break after the makespan."""
        return cost_key(offloaded_mib(self.problem, self.timing.choices),
                        recompute_ms(self.problem, self.timing.choices))

    def plan(self, problem_key: str | None = None, validate: bool = True) -> Plan:
        """Plan v1, validated unless the caller validates it itself (a repository validates every plan
        it stores: validating twice is seconds at the largest sizes)."""
        plan = build_plan(self.problem, self.schedule, self.timing, self.method, problem_key=problem_key)
        return assert_valid(self.problem, plan, problem_key) if validate else plan


def evaluate(problem: Problem, schedule: Schedule, method: str, timing: Timing | None = None,
             prune_transfers: bool = True) -> Outcome:
    """Time the schedule and refuse it (DoesNotFit) if it breaks a memory limit; drop the offloads
    and recomputes it does not need (transfers.prune) and refuse it if it still needs more pinned
    host memory than a device's host limit. A peer's schedule is evaluated with
    `prune_transfers=False`: pruning would make it another schedule than its authors'."""
    memo = getattr(schedule, "_evaluated", None)  # shared (cached) pattern schedules are timed once
    if timing is None and memo is not None and memo[0] is problem:
        timing, peaks = memo[1], memo[2]
    else:
        # without a memory limit nothing can fail to fit: the peaks are left to the plan that is kept
        limited = bool(problem.limited_devices())
        peaks = untimed_peaks(problem, schedule) if limited else None
        if peaks is not None and over_limit(problem, peaks):
            raise does_not_fit(problem, method, peaks)
        timing = timing or simulate(problem, schedule)
        if limited and peaks is None:
            peaks = peaks_of(problem, schedule, timing)
        schedule._evaluated = (problem, timing, peaks)  # type: ignore[attr-defined]
    if peaks is not None and over_limit(problem, peaks):
        raise does_not_fit(problem, method, peaks)
    if not is_treated(timing.choices):
        return Outcome(problem, schedule, timing, method)
    thin = prune(problem, schedule, timing) if prune_transfers else Pruned(schedule, timing, 0)
    host = host_over_limit(problem, thin.schedule, thin.timing)
    if host:
        raise DoesNotFit(f"{method} does not fit the host memory limits: " + "; ".join(host),
                         peaks if peaks is not None else peaks_of(problem, schedule, timing))
    # Treatments are dropped with every other op kept in place; starting each op as early as the thinner
    # schedule allows can be much faster, so the outcome carries that timing and is compared on it
    # (DeepSeek-like V at 70%: a variant timed 1,179 ms runs in 1,117 so; the greedy used to compare
    # the 1,179 and keep another).
    timing = retime(problem, thin.schedule, thin.timing) if thin.removed else thin.timing
    return Outcome(problem, thin.schedule, timing, method, before_retime_ms=thin.timing.makespan)


def better(a: Outcome | None, b: Outcome | None, tolerance: float = TIE_TOLERANCE) -> Outcome | None:
    """The faster; between makespans within `tolerance` (relative) of each other, the one that
    offloads fewer MiB, then recomputes less (a host copy is never free: docs/transfers.md)."""
    if a is None:
        return b
    if b is None:
        return a
    if abs(b.makespan - a.makespan) <= tolerance * max(a.makespan, b.makespan):
        return b if b.transfer_cost < a.transfer_cost else a
    return b if b.makespan < a.makespan else a


def finalize(problem: Problem, schedule: Schedule, method: str, problem_key: str | None = None,
             timing: Timing | None = None) -> Plan:
    """Time the schedule, refuse it if it breaks a memory limit, and return the validated plan."""
    return evaluate(problem, schedule, method, timing).plan(problem_key)


def in_flight(plan: Plan) -> list[int]:
    """Per device, the most stage-microbatches in flight at once: forward started, W (or BW) not yet
    ended. The measure the published schedules are defined by (1F1B: S-k on stage k; ZB-H1: min(S, M)
    everywhere), independent of the memory figures. Ops at one instant count frees first."""
    out = []
    for device in plan.devices:
        events = sorted([(op.start_ms, 1) for op in device.ops if op.kind == "F"]
                        + [(op.end_ms, 0) for op in device.ops if op.kind in ("W", "BW")])
        level = peak = 0
        for _, up in events:
            level += 1 if up else -1
            peak = max(peak, level)
        out.append(peak)
    return out


def schedule_of(problem: Problem, compute: list[list[Op]], treat: dict[tuple[int, int], str] | None = None,
                gates: Iterable[Gate] = ()) -> Schedule:
    """Turn per-device compute orders (F/B/W/BW only) into a Schedule, adding offload/recompute.

    `treat[(k, i)]` is "offload" or "recompute". A recompute runs right before its backward. Offloads
    copy out in forward order, as soon as the forward ends; reloads copy in in backward order, each gated
    to start with the compute op that leaves just enough compute time before its backward to hide the
    copy (a reload started as soon as possible would hold the memory the offload freed).
    """
    treat = treat or {}
    devices: list[DeviceOrder] = []
    all_gates = list(gates)
    for order in compute:
        out = DeviceOrder()
        for op in order:
            key = (op.stage, op.mb)
            how = treat.get(key)
            if op.kind is Kind.F and how == "offload":
                out.d2h.append(Op(Kind.OFFLOAD, op.stage, op.mb))
            if op.kind in BACKWARD_KINDS and how == "recompute":
                out.compute.append(Op(Kind.RECOMPUTE, op.stage, op.mb))
            if op.kind in BACKWARD_KINDS and how == "offload":
                reload = Op(Kind.RELOAD, op.stage, op.mb)
                out.h2d.append(reload)
                lead = problem.stages[op.stage].reload_ms
                acc = 0.0
                for prev in reversed(out.compute):
                    acc += duration(problem, prev)
                    if acc >= lead - TOL:
                        all_gates.append(Gate(reload, prev, at_end=False))
                        break
                else:
                    if out.compute:
                        all_gates.append(Gate(reload, out.compute[0], at_end=False))
            out.compute.append(op)
        devices.append(out)
    return Schedule(devices, all_gates)
