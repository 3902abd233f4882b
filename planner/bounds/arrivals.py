"""The arrival argument: before a device's first backward can start, only forwards run there, and
they arrive no faster than the stages before them produce them. Memory plays no part."""

from __future__ import annotations

from ..contract import Problem
from .pipeline import device_frame


def forward_arrivals(problem: Problem) -> list[list[float]]:
    """`a[k][n]`: earliest start of the (n+1)-th forward of stage k to start, whichever microbatch it
    is. It needs n+1 distinct microbatches through stage k-1 (the (n+1)-th forward there ended, plus
    the link), and stage k's device runs its forwards one at a time."""
    arrivals: list[list[float]] = []
    for k, s in enumerate(problem.stages):
        row: list[float] = []
        for n in range(problem.num_microbatches):
            t = 0.0 if k == 0 else (arrivals[k - 1][n] + problem.stages[k - 1].forward_ms
                                    + problem.link_ms(k - 1, k))
            row.append(max(t, row[-1] + s.forward_ms) if row else t)
        arrivals.append(row)
    return arrivals


def arrival_bound(problem: Problem) -> float:
    """Per device: its earliest start, all its work, and the idle forced before its first backward
    can start by the rate at which forwards reach it (`forward_arrivals`). Before that backward only
    forwards run there (W's follow backwards, recomputes are not work), each no earlier than its
    arrival, so at most the forward time that has arrived can fill the wait. It binds on an
    interleaved device holding the LM head, whose first-chunk forwards arrive only as fast as the
    slowest stage before them."""
    arrivals = forward_arrivals(problem)
    best = 0.0
    for d in range(problem.num_devices):
        head, work, tail, first_b = device_frame(problem, d)
        fill = sum(min(problem.stages[k].forward_ms, max(0.0, first_b - a)) for k in problem.stages_of(d)
                   for a in arrivals[k])
        best = max(best, head + work + max(0.0, first_b - head - fill) + tail)
    return best
