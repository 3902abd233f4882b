"""Device and pinned host memory over time for a timed set of ops (docs/formats.md: frees count before
allocations), and the transfer figures a plan reports (docs/transfers.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .contract import Problem
from .ops import Choice, Kind, MemoryDelta, Op, memory_delta


class TimedOp(NamedTuple):
    op: Op
    start: float
    end: float


def _tick(t: float) -> int:
    """Event times on a 1 ns grid so float noise cannot reorder a free and an allocation."""
    return round(t * 1e6)


def _step_curve(events: list[tuple[int, int, float, float]], base: float) -> list[tuple[float, float]]:
    """[(time_ms, level)] from (tick, 0 = free / 1 = allocation, time, delta) events: one point per
    instant, after that instant's frees and then its allocations (which is also its peak)."""
    events.sort(key=lambda e: (e[0], e[1]))
    level = base
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


def _events(ops: Iterable[TimedOp], delta_of) -> list[tuple[int, int, float, float]]:
    events = []
    for t in ops:
        delta = delta_of(t.op)
        if delta.at_start:
            events.append((_tick(t.start), 1, t.start, delta.at_start))
        if delta.at_end:
            events.append((_tick(t.end), 0, t.end, delta.at_end))
    return events


def memory_curve(
    problem: Problem, device: int, ops: Iterable[TimedOp], choices: dict[tuple[int, int], Choice]
) -> list[tuple[float, float]]:
    """Step curve [(time_ms, mib)] of `device`'s memory, from its static memory."""
    events = _events(ops, lambda op: memory_delta(problem, op, choices[(op.stage, op.mb)]))
    return _step_curve(events, problem.devices[device].static_mib)


def order_peak(problem: Problem, device: int, compute: Iterable[Op]) -> float:
    """`device`'s peak memory from its compute order alone, for a device without copies.

    Ops on one lane run one after another, so each op's frees come before the next op's allocation
    whatever the times (and docs/formats.md counts frees first at equal times): the order fixes the
    curve. A schedule that cannot fit is thus refused before it is simulated or even checked."""
    compute = list(compute)
    # a choice matters to memory_delta only for F's allocation, and a device's own order shows it
    recomputed = {(op.stage, op.mb) for op in compute if op.kind == Kind.RECOMPUTE}
    level = peak = problem.devices[device].static_mib
    for op in compute:
        alloc, free = memory_delta(problem, op, _RECOMPUTED if (op.stage, op.mb) in recomputed else _KEPT)
        level += alloc
        peak = max(peak, level)
        level += free
    return peak


_KEPT, _RECOMPUTED = Choice(split=False), Choice(split=False, recompute=True)


def peak_memory(
    problem: Problem, device: int, ops: Iterable[TimedOp], choices: dict[tuple[int, int], Choice]
) -> float:
    return max(level for _, level in memory_curve(problem, device, ops, choices))


def host_delta(problem: Problem, op: Op) -> MemoryDelta:
    """Pinned host memory an op takes or gives back.

    The host buffer must exist when the device-to-host copy starts (it is its target), and it can be
    reused once the host-to-device copy has finished reading it: so an offload holds host memory from
    its OFFLOAD's start to its RELOAD's end, the longest interval any runtime needs.
    """
    if op.kind is Kind.OFFLOAD:
        return MemoryDelta(problem.stages[op.stage].offloadable_mib, 0.0)
    if op.kind is Kind.RELOAD:
        return MemoryDelta(0.0, -problem.stages[op.stage].offloadable_mib)
    return MemoryDelta(0.0, 0.0)


def host_memory(problem: Problem, ops: Iterable[TimedOp]) -> float:
    """Peak pinned host memory (MiB) of one device's timed ops (frees before allocations)."""
    copies = [t for t in ops if t.op.kind in (Kind.OFFLOAD, Kind.RELOAD)]
    return max(level for _, level in _step_curve(_events(copies, lambda op: host_delta(problem, op)), 0.0))


def offloaded_mib(problem: Problem, choices: dict[tuple[int, int], Choice]) -> float:
    """MiB copied device-to-host per iteration (the same comes back host-to-device)."""
    return sum(problem.stages[k].offloadable_mib for (k, _), c in choices.items() if c.offload)


def recompute_ms(problem: Problem, choices: dict[tuple[int, int], Choice]) -> float:
    """Compute time spent recomputing forwards per iteration."""
    return sum(problem.stages[k].recompute_ms for (k, _), c in choices.items() if c.recompute)


def held_until_w(problem: Problem, stages: Iterable[int] | None = None,
                 whole_in_w: Iterable[int] = (0,)) -> Problem:
    """`problem` as torch's split backward holds memory: each of `stages` (default every stage)
    keeps a microbatch's saved activations from its B to its W (`weight_grad_mib` =
    `activation_mib`). torch's B computes the input gradients with the autograd graph retained for
    W, so it frees nothing, and keeps the output gradients W needs (`output_grad_mib`, kept). On
    the stages of `whole_in_w` (the first, whose input needs no gradient) B does nothing at all and
    W runs the whole backward, freeing as it goes: no output gradients are held there.
    docs/torch.md, "On a GPU"."""
    held, whole = set(range(problem.num_stages) if stages is None else stages), set(whole_in_w)
    if not held:
        return problem
    doc = problem.model_dump(mode="json")
    for k in held:
        doc["stages"][k]["weight_grad_mib"] = doc["stages"][k]["activation_mib"]
        if k in whole:
            doc["stages"][k]["output_grad_mib"] = None
    return Problem.model_validate(doc)
