"""The whole training iteration around a pipeline schedule: gradient reduction, optimizer step,
and what the iteration's time is worth in tokens/s per GPU and MFU.

Why: a pipeline schedule is not the iteration. With data parallelism each stage's gradients are
reduced once its last weight gradient (W, or BW) is done; the reductions of one device run one after
another on that device's reduce lane, beside whatever compute is left, in the order their stages
finish; the device's optimizer step follows its last reduction (and its last op). The iteration
ends when the last optimizer step does. A schedule that finishes a stage's weight gradients early
hides that stage's reduction behind later compute; one that pushes every W to the end exposes it.

This is the rule the simulator times plans by and the validator checks them against. The solvers
minimise the makespan first and the iteration second (docs/decisions.md), and `iteration_bound`
turns a proven makespan bound into a proven iteration bound.
"""

from __future__ import annotations

from collections.abc import Iterable

from .contract import Plan, Problem
from .ops import Kind


def iteration_end(problem: Problem, stage_ready: list[float], device_done: list[float]) -> float:
    """When the last optimizer step ends, given when each stage's last weight gradient ends
    (`stage_ready`) and when each device's last op ends (`device_done`)."""
    end = 0.0
    for d in range(problem.num_devices):
        lane = 0.0
        for k in sorted(problem.stages_of(d), key=lambda k: (stage_ready[k], k)):
            reduce = problem.reduce_of(k)
            if reduce > 0:
                lane = max(lane, stage_ready[k]) + reduce
        end = max(end, max(lane, device_done[d]) + problem.optimizer_of(d))
    return end


def has_tail(problem: Problem) -> bool:
    """Does anything follow the pipeline (a gradient reduction or an optimizer step)?"""
    return (any(problem.reduce_of(k) > 0 for k in range(problem.num_stages))
            or any(problem.optimizer_of(d) > 0 for d in range(problem.num_devices)))


def tail_floor(problem: Problem) -> float:
    """The least time any plan's iteration lasts beyond its makespan.

    Proof: every B is followed by its W (or is a BW) on the same device, so a device's last compute
    op is the last weight gradient of one of its stages k; that stage's reduction starts no earlier
    and the device's optimizer step follows it. The device whose last op ends the makespan therefore
    ends its optimizer step at least `reduce_of(k) + optimizer_of(d)` later, and no less than the
    smallest such sum over devices (a device without stages adds its optimizer step alone)."""
    return min((min((problem.reduce_of(k) for k in problem.stages_of(d)), default=0.0)
                + problem.optimizer_of(d)) for d in range(problem.num_devices))


def iteration_bound(problem: Problem, makespan_bound: float) -> float:
    """A proven lower bound of the iteration, from a proven lower bound of the makespan."""
    return makespan_bound + tail_floor(problem)


def meets_bounds(problem: Problem, plan: Plan, makespan_bound: float, eps_ms: float = 1e-6) -> bool:
    """Is `plan` proven optimal by `makespan_bound`: its makespan meets it, and its iteration (the
    makespan where the plan reports none) meets the iteration bound it implies?"""
    return (plan.makespan_ms <= makespan_bound + eps_ms
            and plan.end_ms <= iteration_bound(problem, makespan_bound) + eps_ms)


def iteration_ms(problem: Problem, ops: Iterable[tuple[int, Kind, int, float, float]]) -> float:
    """The iteration of a timed plan: `ops` are (device, kind, stage, start, end) of every op."""
    ready = [0.0] * problem.num_stages
    done = [0.0] * problem.num_devices
    start = None
    for device, kind, stage, s, e in ops:
        start = s if start is None else min(start, s)
        done[device] = max(done[device], e)
        if kind in (Kind.W, Kind.BW):
            ready[stage] = max(ready[stage], e)
    if start is None:
        return 0.0
    return iteration_end(problem, ready, done) - start


def throughput(problem: Problem, iteration: float) -> tuple[float | None, float | None]:
    """(tokens/s per GPU, MFU) of an iteration of `iteration` ms; None without a workload."""
    w = problem.workload
    if w is None or iteration <= 0:
        return None, None
    seconds = iteration / 1e3
    return w.tokens / seconds / w.gpus, w.model_flops / seconds / w.gpus / (w.peak_tflops * 1e12)
