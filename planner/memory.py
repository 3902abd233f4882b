"""Device memory over time for a timed set of ops (CONTRACT.md: frees count before allocations)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .contract import Problem
from .ops import Choice, Op, memory_delta


class TimedOp(NamedTuple):
    op: Op
    start: float
    end: float


def _tick(t: float) -> int:
    """Event times on a 1 ns grid so float noise cannot reorder a free and an allocation."""
    return round(t * 1e6)


def memory_curve(
    problem: Problem, device: int, ops: Iterable[TimedOp], choices: dict[tuple[int, int], Choice]
) -> list[tuple[float, float]]:
    """Step curve [(time_ms, mib)] of `device`'s memory, from its static memory: one point per
    instant, after that instant's frees and then its allocations (which is also its peak)."""
    events: list[tuple[int, int, float, float]] = []
    for t in ops:
        delta = memory_delta(problem, t.op, choices[(t.op.stage, t.op.mb)])
        if delta.at_start:
            events.append((_tick(t.start), 1, t.start, delta.at_start))
        if delta.at_end:
            events.append((_tick(t.end), 0, t.end, delta.at_end))
    events.sort(key=lambda e: (e[0], e[1]))
    level = problem.devices[device].static_mib
    curve = [(events[0][2] if events else 0.0, level)]
    last_tick = None
    for tick, _, time, delta in events:
        level += delta
        if tick == last_tick:
            curve[-1] = (curve[-1][0], level)
        else:
            curve.append((time, level))
            last_tick = tick
    return curve


def peak_memory(
    problem: Problem, device: int, ops: Iterable[TimedOp], choices: dict[tuple[int, int], Choice]
) -> float:
    return max(level for _, level in memory_curve(problem, device, ops, choices))
