"""The forward-count arguments (head, drain, tail) for a device with a memory limit.

Head: until the first memory is freed on a device (the end of its first backward, at the earliest
`first_backward_start + backward`, or of its first W when B frees nothing), nothing allocated there
comes back, so the forwards run on it before then are limited by its free memory; backward work
cannot start before `first_backward_start`. So the device is busy at most `F_max + (T_free - T_b)`
before `T_free`, and all the rest of its work comes after: makespan >= T_free + work - busy_before.
With offload allowed, an OFFLOAD end can be the first free (at the earliest forward end plus the
copy); with recompute allowed, a forward may hold only its checkpoint.

Drain: between a device's last forward and that microbatch's backward, only microbatches still
holding memory have work left there, so memory caps the work that can fill the wait.

Tail: after a device's last backward-input op ends, only W's remain there, and each pending W still
holds its `weight_grad_mib`, so at most a memory's worth of W work can follow; meanwhile the
backward chain of that microbatch runs down to stage 0 and its W. With an activation held until W
this is what keeps memory below 1F1B's from reaching the unlimited makespan.

The warm-up idle before the first backward (warmup.warmup_waste for one stage,
chunk_warmup.chunked_warmup_waste for several) joins the head + work argument and the tail.
"""

from __future__ import annotations

import math

from ..contract import Problem
from .chunk_warmup import chunked_warmup_waste
from .pipeline import backward_chain, first_backward_start, forward_head, round_trip
from .warmup import warmup_waste


def _knapsack(capacity: float, items: list[tuple[float, float, float]]) -> float:
    """Most value from (value per unit, size per unit, units available) items, fractionally, within
    `capacity`; an item of size 0 is taken whole."""
    value = 0.0
    for per, size, count in sorted(items, key=lambda x: x[0] / x[1] if x[1] > 0 else float("inf"),
                                   reverse=True):
        n = count if size <= 0 else min(count, max(0.0, capacity) / size)
        value += n * per
        capacity -= n * size
    return value


def _whole_knapsack(capacity: float, items: list[tuple[float, float, float]]) -> float:
    """_knapsack counted in whole items, for ops that hold all their memory or none: a forward from
    its start (before the first free only whole ones can have started), a pending W until it ends.
    Exact for the one or two stages a device usually holds (the first one's count enumerated); with
    more, the fractional value, never lower."""
    if len(items) > 2:
        return _knapsack(capacity, items)

    def most(room: float, size: float, count: float) -> int:
        return int(count) if size <= 0 else int(min(count, math.floor(max(0.0, room) / size + 1e-9)))

    (per, size, count), rest = items[0], items[1:]
    best = 0.0
    for n in range(most(capacity, size, count) + 1):
        value = n * per
        if rest:
            per2, size2, count2 = rest[0]
            value += most(capacity - n * size, size2, count2) * per2
        best = max(best, value)
    return best


def forward_count_bound(problem: Problem, chunked_warmup: bool = True) -> float:
    """The head, drain and tail arguments of the module docstring, max over devices with a limit.
    `chunked_warmup=False` leaves out the idle before the first backward on devices with several
    stages (a weaker bound, for tests that isolate another argument from chunk_warmup.py's)."""
    m = problem.num_microbatches
    opts = problem.options
    split = problem.options.split_backward
    best = 0.0
    for d in problem.limited_devices():
        cap = problem.free_mib(d)
        stages = problem.stages_of(d)
        t_b = min(first_backward_start(problem, k) for k in stages)
        t_free = float("inf")
        for k in stages:
            s = problem.stages[k]
            first = first_backward_start(problem, k)
            if not split:
                t_free = min(t_free, first + s.backward_input_ms + s.backward_weight_ms)
            elif s.activation_mib - s.weight_grad_mib > 0:
                t_free = min(t_free, first + s.backward_input_ms)
            else:
                t_free = min(t_free, first + s.backward_input_ms + s.backward_weight_ms)
            if opts.offload and (s.offloadable_mib or 0.0) > 0:
                t_free = min(t_free, forward_head(problem, k) + s.forward_ms + (s.offload_ms or 0.0))
        held = {k: (min(problem.stages[k].activation_mib, problem.stages[k].checkpoint_mib)
                    if opts.recompute else problem.stages[k].activation_mib) for k in stages}
        if any(held[k] <= 0 for k in stages):
            continue  # a forward that holds nothing is not limited by memory
        # Forward work that fits in `cap` before any free, capped at M per stage.
        forward = _whole_knapsack(cap, [(problem.stages[k].forward_ms, held[k], float(m)) for k in stages])
        busy_before = min(t_free, forward + max(0.0, t_free - t_b))
        work = m * problem.work_ms(d)
        idle_head = max(0.0, t_free - busy_before)
        idle_drain = _drain_idle(problem, stages, cap)
        # the drain's idle lies after the last forward's start, which is past the first free once
        # more forwards are needed than memory holds; otherwise the two may overlap
        disjoint = all(m * held[k] > cap for k in stages)
        best = max(best, work + (idle_head + idle_drain if disjoint else max(idle_head, idle_drain)))
        if len(stages) == 1:
            waste = warmup_waste(problem, d, stages[0])
        else:
            waste = chunked_warmup_waste(problem, d) if chunked_warmup else 0.0
        best = max(best, min(forward_head(problem, k) for k in stages) + work + waste)
        if split:
            best = max(best, _tail_bound(problem, stages, cap, work, t_free, busy_before, waste))
    return best


def _drain_idle(problem: Problem, stages: list[int], cap: float) -> float:
    """Idle forced on a one-stage device between its last forward and that microbatch's backward.

    From the last forward's start x to its backward's start (at least F + `round_trip`, the later
    stages both ways), every other forward is done, so the device can only work on microbatches
    still pending at x, and each of them still holds memory there: its
    activation (its checkpoint if it may recompute, its resident part if it may offload) until its
    B, then its weight gradient until its W. Memory minus the last forward's own allocation caps
    that work; the rest of the round trip is idle."""
    if len(stages) != 1:
        return 0.0  # another chunk's forwards could fill the wait
    k = stages[0]
    s = problem.stages[k]
    opts = problem.options
    m = problem.num_microbatches
    recompute = s.recompute_ms if opts.recompute else 0.0
    hold_b = s.activation_mib
    if opts.recompute:
        hold_b = min(hold_b, s.checkpoint_mib)
    if opts.offload:
        hold_b = min(hold_b, s.activation_mib - s.offloadable_mib)
    own = min(s.activation_mib, s.checkpoint_mib) if opts.recompute else s.activation_mib
    per_mb = s.backward_input_ms + s.backward_weight_ms + recompute
    items = [(per_mb, hold_b, m - 1.0)]
    if opts.split_backward:
        items.append((s.backward_weight_ms, s.weight_grad_mib, m - 1.0))
    pending = min(_knapsack(cap - own, items), (m - 1) * per_mb)
    return max(0.0, round_trip(problem, k) - pending)


def _tail_bound(problem: Problem, stages: list[int], cap: float, work: float, t_free: float,
                busy_before: float, waste: float) -> float:
    """makespan >= T + chain, where T (the device's last backward-input end) is at least the work
    that cannot come after it: everything but the W's whose weight gradients fit in memory at T,
    whole ones (a pending W holds all of its own). Before min(t_free, earliest possible T) the
    device is busy at most `busy_before`, and before its first backward it idles at least `waste`
    (the warm-up idle)."""
    m = float(problem.num_microbatches)
    pending = [(problem.stages[k].backward_weight_ms, problem.stages[k].weight_grad_mib, m) for k in stages]
    after = _whole_knapsack(cap, pending)
    head = min(forward_head(problem, k) for k in stages)
    earliest_t = min(first_backward_start(problem, k) + problem.stages[k].backward_input_ms for k in stages)
    t_known = min(t_free, earliest_t)
    last_b_end = max(head + waste + work - after, t_known + work - after - min(t_known, busy_before))
    chain = min(backward_chain(problem, k) for k in stages)
    return last_b_end + chain
