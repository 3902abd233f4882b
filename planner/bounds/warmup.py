"""The warm-up argument, for a device with one stage and a memory limit: until its first backward
can start only forwards (and recomputes) run there, and memory caps how many of them can hold an
activation by then; the rest of the wait is idle no later work makes up."""

from __future__ import annotations

import math

from ..contract import Problem
from .pipeline import backward_tail, first_backward_start, forward_head, one_stage_limited


def _slot_starts(problem: Problem, k: int, cap: float) -> list[float]:
    """Earliest start of the j-th op (j = 1, 2, ...) on stage k's device that holds an activation of
    k until after its first backward can start: a forward that is not recomputed (it allocates the
    activation) or a RECOMPUTE (activation minus checkpoint). Before any backward, memory comes back
    only when an OFFLOAD ends, and the D2H lane ends the q-th no earlier than q copies after the
    first forward (and q forwards before the last copy); the j-th such op needs enough of them."""
    s = problem.stages[k]
    opts = problem.options
    held = s.activation_mib - (s.checkpoint_mib if opts.recompute else 0.0)
    head = forward_head(problem, k)
    freed = (s.offloadable_mib or 0.0) if opts.offload else 0.0
    off = s.offload_ms or 0.0
    starts = []
    for j in range(1, problem.num_microbatches + 1):
        excess = j * held - cap
        q = 0 if excess <= 1e-9 else (math.ceil(excess / freed - 1e-9) if freed > 0 else None)
        if q is None:
            break  # no more such ops before the first backward
        serial = head + (j - 1) * s.forward_ms
        copies = head + max(s.forward_ms + q * off, q * s.forward_ms + off) if q else head
        starts.append(max(serial, copies))
    return starts


def warmup_bound(problem: Problem) -> float:
    """Per device with one stage k and a memory limit: until the first backward can start (t_b),
    the device runs only forwards (and recomputes), and every forward that is not recomputed holds
    its activation past t_b, as does every recompute; so only as many of them fit as memory and the
    offloads finished by then allow (`_slot_starts`). A recomputed forward needs no room but costs
    its recompute later: it turns at most F - R of idle into work. So the device wastes at least
    (t_b - head - F x holders) x min(1, R / F) before t_b, and makespan >= head + work + waste
    (+ the backward chain below k after its last BW, without split backward)."""
    best = 0.0
    for d, k in one_stage_limited(problem):
        work = problem.num_microbatches * problem.work_ms(d)
        tail = 0.0 if problem.options.split_backward else backward_tail(problem, k)  # after its last BW
        best = max(best, forward_head(problem, k) + work + warmup_waste(problem, d, k) + tail)
    return best


def warmup_waste(problem: Problem, d: int, k: int) -> float:
    """warmup_bound's idle for device d with its one stage k: time before the first backward that no
    later work makes up (0.0 without a memory limit)."""
    if problem.limit_of(d) == float("inf"):
        return 0.0
    opts = problem.options
    s = problem.stages[k]
    head = forward_head(problem, k)
    t_b = first_backward_start(problem, k)
    cap = problem.free_mib(d)
    starts = [t for t in _slot_starts(problem, k, cap) if t < t_b]
    if opts.recompute:  # a recompute's forward ran whole before it
        useful = s.forward_ms * len(starts)
    else:
        useful = sum(min(s.forward_ms, t_b - t) for t in starts)
    factor = min(1.0, (s.recompute_ms if s.recompute_ms is not None else s.forward_ms) / s.forward_ms) \
        if opts.recompute else 1.0
    return max(0.0, t_b - head - useful) * factor
