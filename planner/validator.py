"""Checks a plan against its problem exactly as docs/formats.md defines, reporting every violation.

Every plan pipeplan emits passes through `validate_plan` first; `assert_valid` is the gate the
heuristics, solvers, service and worker call.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

from .contract import Plan, Problem
from .iteration import iteration_ms, throughput
from .memory import TimedOp, host_memory, memory_curve, offloaded_mib, recompute_ms
from .ops import COMPUTE_KINDS, LANES, Lane, choices_from_ops, deps, duration, lane_of, op_of

MAX_REPORTED_PER_CHECK = 20
TOLERANCE = 1e-6  # relative, and absolute below 1 (ms, MiB): float noise, not slack


def close(a: float, b: float) -> bool:
    """Equality up to float noise (TOLERANCE)."""
    return abs(a - b) <= TOLERANCE * max(1.0, abs(a), abs(b))


def not_before(later: float, earlier: float) -> bool:
    return later >= earlier or close(later, earlier)


class InvalidPlanError(ValueError):
    """A plan broke the rules of docs/formats.md; `violations` lists every reason."""

    def __init__(self, violations: list[str]):
        self.violations = violations
        shown = "\n  ".join(violations[:10])
        more = f"\n  ... and {len(violations) - 10} more" if len(violations) > 10 else ""
        super().__init__(f"plan violates the contract:\n  {shown}{more}")


def validate_plan(problem: Problem, plan: Plan, problem_key: str | None = None) -> list[str]:
    """Every way `plan` breaks the contract for `problem`, as readable lines ([] = valid)."""
    out: list[str] = []
    key = problem_key or problem.key()
    if plan.problem_key != key:
        out.append(f"problem_key is {plan.problem_key[:12]}… but the problem's key is {key[:12]}…")

    seen_devices = [dp.device for dp in plan.devices]
    if sorted(seen_devices) != list(range(problem.num_devices)):
        out.append(f"devices lists {seen_devices}; expected each of 0..{problem.num_devices - 1} once")

    timed: list[tuple[int, TimedOp]] = []
    for dp in plan.devices:
        previous_start = -math.inf
        for pop in dp.ops:
            op = op_of(pop)
            if not (math.isfinite(pop.start_ms) and math.isfinite(pop.end_ms)):
                out.append(f"{op}: start_ms and end_ms must be finite")
                continue
            if pop.start_ms < previous_start and not close(pop.start_ms, previous_start):
                out.append(f"device {dp.device}: {op} is listed out of start_ms order")
            previous_start = max(previous_start, pop.start_ms)
            timed.append((dp.device, TimedOp(op, pop.start_ms, pop.end_ms)))
    if out and not timed:
        return out

    choices, errors = choices_from_ops(problem, [t.op for _, t in timed])
    out += errors
    valid = [(d, t) for d, t in timed if t.op.stage < problem.num_stages and t.op.mb < problem.num_microbatches]
    by_op = {t.op: t for _, t in valid}

    def report(lines: list[str]) -> None:
        out.extend(lines[:MAX_REPORTED_PER_CHECK])
        if len(lines) > MAX_REPORTED_PER_CHECK:
            out.append(f"... {len(lines) - MAX_REPORTED_PER_CHECK} more like the above")

    placement, durations, precedence = [], [], []
    for device, t in valid:
        stage_device = problem.stages[t.op.stage].device
        if device != stage_device:
            placement.append(f"{t.op} is on device {device} but its stage is on device {stage_device}")
        expected = duration(problem, t.op)
        if not close(t.end - t.start, expected):
            durations.append(f"{t.op} lasts {t.end - t.start:.6g} ms; its duration is {expected:.6g} ms")
    if not errors:
        for _, t in valid:
            for dep in deps(problem, t.op, choices):
                before = by_op.get(dep.before)
                if before and not not_before(t.start, before.end + dep.lag_ms):
                    precedence.append(
                        f"{t.op} starts at {t.start:.6g} ms, before {dep.before} ends"
                        f" ({before.end:.6g} ms) + link {dep.lag_ms:.6g} ms"
                    )
    report(placement)
    report(durations)
    report(precedence)

    per_device: dict[int, list[TimedOp]] = defaultdict(list)
    for device, t in valid:
        per_device[device].append(t)
    overlaps = []
    for device, ops in sorted(per_device.items()):
        by_lane: dict[Lane, list[TimedOp]] = defaultdict(list)
        for t in ops:
            by_lane[lane_of(t.op.kind)].append(t)
        for lane in LANES:
            on_lane = sorted(by_lane[lane], key=lambda t: (t.start, t.end))
            for a, b in itertools.pairwise(on_lane):
                if not not_before(b.start, a.end):
                    overlaps.append(f"device {device} {lane.value} lane: {b.op} starts at {b.start:.6g} ms"
                                    f" while {a.op} runs until {a.end:.6g} ms")
    report(overlaps)

    if not errors:
        memory = []
        for device in range(problem.num_devices):
            limit = problem.limit_of(device)
            curve = memory_curve(problem, device, per_device.get(device, []), choices)
            peak = max(level for _, level in curve)
            over = next(((t, m) for t, m in curve if m > limit and not close(m, limit)), None)
            if over:
                memory.append(f"device {device} uses {over[1]:.6g} MiB at {over[0]:.6g} ms,"
                              f" over its limit {limit:.6g} MiB (peak {peak:.6g} MiB)")
            if device < len(plan.peak_memory_mib) and not close(plan.peak_memory_mib[device], peak):
                memory.append(f"peak_memory_mib[{device}] is {plan.peak_memory_mib[device]:.6g};"
                              f" the ops give {peak:.6g}")
        if len(plan.peak_memory_mib) != problem.num_devices:
            memory.append(f"peak_memory_mib has {len(plan.peak_memory_mib)} entries; expected {problem.num_devices}")
        report(memory)
        report(_transfer_violations(problem, plan, per_device, choices))

    if valid:
        makespan = max(t.end for _, t in valid) - min(t.start for _, t in valid)
        if not close(plan.makespan_ms, makespan):
            out.append(f"makespan_ms is {plan.makespan_ms:.6g}; the ops give {makespan:.6g}")
        busy = sum(t.end - t.start for _, t in valid if t.op.kind in COMPUTE_KINDS)
        bubble = 1.0 - busy / (problem.num_devices * makespan) if makespan > 0 else 0.0
        if not close(plan.bubble_ratio, bubble):
            out.append(f"bubble_ratio is {plan.bubble_ratio:.6g}; the ops give {bubble:.6g}")
        if plan.lower_bound_ms > makespan and not close(plan.lower_bound_ms, makespan):
            out.append(f"lower_bound_ms {plan.lower_bound_ms:.6g} exceeds the makespan {makespan:.6g}")
        out += _iteration_violations(problem, plan, valid)
    return out


def _iteration_violations(problem: Problem, plan: Plan, valid: list[tuple[int, TimedOp]]) -> list[str]:
    """The whole-iteration figures the plan reports (when it reports them) against its ops."""
    iteration = iteration_ms(problem, ((d, t.op.kind, t.op.stage, t.start, t.end) for d, t in valid))
    tokens, mfu = throughput(problem, iteration)
    out = []
    for name, actual in (("iteration_ms", iteration), ("tokens_per_s_per_gpu", tokens), ("mfu", mfu)):
        said = getattr(plan, name)
        if said is None:
            continue
        if actual is None:
            out.append(f"{name} is {said:.6g} but the problem has no workload to measure it by")
        elif not close(said, actual):
            out.append(f"{name} is {said:.6g}; the ops give {actual:.6g}")
    said = plan.iteration_bound_ms
    if said is not None and said > iteration and not close(said, iteration):
        out.append(f"iteration_bound_ms {said:.6g} exceeds the iteration {iteration:.6g}")
    return out


def _transfer_violations(problem: Problem, plan: Plan, per_device: dict[int, list[TimedOp]],
                         choices: dict) -> list[str]:
    """The host memory cap, and the transfer figures the plan reports (when it reports them)."""
    out = []
    host = [host_memory(problem, per_device.get(d, [])) for d in range(problem.num_devices)]
    for d, need in enumerate(host):
        cap = problem.host_limit_of(d)
        if need > cap and not close(need, cap):
            out.append(f"device {d} needs {need:.6g} MiB of pinned host memory for its offloads, over its"
                       f" host_memory_limit_mib {cap:.6g}")
    if plan.host_memory_mib is not None:
        if len(plan.host_memory_mib) != problem.num_devices:
            out.append(f"host_memory_mib has {len(plan.host_memory_mib)} entries; expected {problem.num_devices}")
        out += [f"host_memory_mib[{d}] is {said:.6g}; the ops give {need:.6g}"
                for d, (said, need) in enumerate(zip(plan.host_memory_mib, host)) if not close(said, need)]
    for name, actual in (("offloaded_mib", offloaded_mib(problem, choices)),
                         ("recompute_ms", recompute_ms(problem, choices))):
        said = getattr(plan, name)
        if said is not None and not close(said, actual):
            out.append(f"{name} is {said:.6g}; the ops give {actual:.6g}")
    return out


def assert_valid(problem: Problem, plan: Plan, problem_key: str | None = None) -> Plan:
    """Return `plan` unchanged if it satisfies the contract, else raise InvalidPlanError."""
    violations = validate_plan(problem, plan, problem_key)
    if violations:
        raise InvalidPlanError(violations)
    return plan
