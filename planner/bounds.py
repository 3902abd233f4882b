"""Lower bounds on the makespan, and the least memory each device needs for any schedule at all.

Both are proofs, not estimates: no valid plan is faster than `lower_bound`, and a device whose limit
is below `min_memory` admits no valid plan, whatever the order, offload or recompute.
"""

from __future__ import annotations

import math

from .contract import Problem
from .ops import residue_mib


def backward_ms(problem: Problem, k: int) -> float:
    """Shortest backward-input op of stage k (B when splitting is allowed, else BW)."""
    s = problem.stages[k]
    return s.backward_input_ms + (0.0 if problem.options.split_backward else s.backward_weight_ms)


def forward_head(problem: Problem, k: int) -> float:
    """Earliest time F(k, i) can start: the forward chain and links of stages 0..k-1."""
    return sum(problem.stages[j].forward_ms + problem.link_ms(j, j + 1) for j in range(k))


def backward_tail(problem: Problem, k: int) -> float:
    """Least time from the end of stage k's backward to the end of stage 0's (links included)."""
    return sum(problem.link_ms(j + 1, j) + backward_ms(problem, j) for j in range(k))


def backward_chain(problem: Problem, k: int) -> float:
    """Least time from the end of B(k, i) (or BW) to the end of microbatch i's last op: the
    backwards of stages k-1..0, then W(0, i) when the backward is split."""
    w0 = problem.stages[0].backward_weight_ms if problem.options.split_backward else 0.0
    return backward_tail(problem, k) + w0


def first_backward_start(problem: Problem, k: int) -> float:
    """Earliest start of any backward of stage k: full forward chain, then backwards S-1..k+1."""
    last = problem.num_stages - 1
    # backwards of stages last..k+1, each followed by its link down to the stage below
    down = sum(backward_ms(problem, j) + problem.link_ms(j, j - 1) for j in range(k + 1, last + 1))
    return forward_head(problem, last) + problem.stages[last].forward_ms + down


def round_trip(problem: Problem, k: int) -> float:
    """Least time from F(k, i)'s end to its backward's start: the later stages both ways, links
    included (0 for the last stage)."""
    after = first_backward_start(problem, k) - forward_head(problem, k) - problem.stages[k].forward_ms
    return max(0.0, after)


def lower_bound(problem: Problem) -> float:
    """max of `free_lower_bound` and `arrival_bound` (no memory limits), `warmup_bound` (memory
    before the first backward) and `exclusive_bound` (room for one activation at a time)."""
    return max(free_lower_bound(problem), arrival_bound(problem), warmup_bound(problem),
               exclusive_bound(problem))


def _device_frame(problem: Problem, d: int) -> tuple[float, float, float, float]:
    """(earliest start, all work, what must follow the last op, earliest backward) of device d.
    Without split, its last op is some BW(k, i), and the backward chain below k follows it."""
    stages = problem.stages_of(d)
    head = min(forward_head(problem, k) for k in stages)
    tail = 0.0 if problem.options.split_backward else min(backward_tail(problem, k) for k in stages)
    first_b = min(first_backward_start(problem, k) for k in stages)
    return head, problem.num_microbatches * problem.work_ms(d), tail, first_b


def free_lower_bound(problem: Problem) -> float:
    """max of: one microbatch's critical path; per device, the earliest it can start plus all its
    work plus what must follow its last op; per device, the earliest backward plus all backward work.
    Memory limits play no part.
    """
    m = problem.num_microbatches
    best = first_backward_start(problem, 0) + backward_ms(problem, 0) + backward_chain(problem, 0)
    for d in range(problem.num_devices):
        head, work, tail, first_b = _device_frame(problem, d)
        work_bw = work - m * sum(problem.stages[k].forward_ms for k in problem.stages_of(d))
        best = max(best, head + work + tail, first_b + work_bw + tail)
    return best


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
    arrival, so at most the forward time that has arrived can fill the wait; memory plays no part.
    On an interleaved device holding the LM head, the head's forward comes round long after the
    device's first-chunk forwards, which arrive only as fast as the slowest stage before them:
    Nemotron-H-8B-like interleaved on 16 GPUs, 5,803 -> 5,850 ms (device 15 idles >= 48 ms)."""
    arrivals = forward_arrivals(problem)
    best = 0.0
    for d in range(problem.num_devices):
        head, work, tail, first_b = _device_frame(problem, d)
        fill = sum(min(problem.stages[k].forward_ms, max(0.0, first_b - a)) for k in problem.stages_of(d)
                   for a in arrivals[k])
        best = max(best, head + work + max(0.0, first_b - head - fill) + tail)
    return best


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


def one_stage_limited(problem: Problem) -> list[tuple[int, int]]:
    """(device, its stage) for every device with a memory limit and one stage."""
    return [(d, problem.stages_of(d)[0]) for d in problem.limited_devices() if len(problem.stages_of(d)) == 1]


def warmup_bound(problem: Problem) -> float:
    """Per device with one stage k and a memory limit: until the first backward can start (t_b),
    the device runs only forwards (and recomputes), and every forward that is not recomputed holds
    its activation past t_b, as does every recompute; so only as many of them fit as memory and the
    offloads finished by then allow (`_slot_starts`). A recomputed forward needs no room but costs
    its recompute later: it turns at most F - R of idle into work. So the device wastes at least
    (t_b - head - F x holders) x min(1, R / F) before t_b, and makespan >= head + work + waste
    (+ the backward chain below k after its last BW, without split backward).
    Qwen2.5-3B on 8 GPUs at 70% of 1F1B's memory: device 0 holds four activations, and a copy takes
    five forwards, so at most seven forwards fill the 155 ms before the first backward."""
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


def _least_split(kinds: list[tuple[float, float, float]], m: float, outside: float) -> float:
    """min over n_t >= 0, sum n_t = m, of max(L1, L2): L1 = sum n_t stretch_t, L2 = L1 + outside +
    sum n_t (forward_t - idle_t). Both are linear, so the minimum lies at a vertex of the simplex or
    where L1 = L2 on one of its edges."""
    def value(x: list[float]) -> float:
        stretch = sum(n * kd[0] for n, kd in zip(x, kinds))
        spill = outside + sum(n * (kd[2] - kd[1]) for n, kd in zip(x, kinds))
        return stretch + max(0.0, spill)

    points = []
    for i in range(len(kinds)):
        points.append([m if j == i else 0.0 for j in range(len(kinds))])
        for j in range(i + 1, len(kinds)):
            gi, gj = kinds[i][2] - kinds[i][1], kinds[j][2] - kinds[j][1]
            if abs(gi - gj) > 1e-12:  # outside + n gi + (m - n) gj = 0
                n = -(outside + m * gj) / (gi - gj)
                if 0.0 <= n <= m:
                    points.append([n if t == i else (m - n if t == j else 0.0) for t in range(len(kinds))])
    return min(value(x) for x in points)


def exclusive_bound(problem: Problem) -> float:
    """Per device with one stage k whose memory holds one activation at a time (two of them, or an
    activation beside the weight gradient another microbatch holds until its W, do not fit): every
    microbatch then holds the device's memory alone for a while, and those stretches are disjoint:
    kept, from its forward's start through the round trip to its backward's end; offloaded, for its
    forward and copy out, then its copy in and backward; recomputed, for the recompute and backward
    (each + W when weight gradients cannot coexist either). The compute lane is busy throughout a
    recompute's stretch, so only the forwards of recomputed microbatches (and W's outside the
    stretches) can fill the copies and round trips of the others:

        makespan >= head + sum of stretches + max(0, outside work - idle inside the stretches),

    minimised over how many microbatches take each treatment (a fractional split, so it stays a
    proof). When nothing may run after the last stretch (its W's are inside the stretches, or there
    are none), that microbatch's backward chain still runs down to stage 0 and its W after it: the
    bound adds that tail, less the stretch's own W (Llama-3-8B on the 40/26-GiB cluster, device 6:
    7,232 -> 7,574 ms). Qwen2.5-3B on 8 GPUs at half of 1F1B's memory: device 0 has 3,566 MiB for
    activations of 2,220 MiB and weight gradients of 1,790 MiB, so recomputing every microbatch costs
    311 ms and a copy round trip takes ten forwards."""
    best = 0.0
    opts = problem.options
    m = float(problem.num_microbatches)
    for d, k in one_stage_limited(problem):
        if k + 1 == problem.num_stages:
            continue  # the last stage's backward follows its forward: no round trip to fill
        s = problem.stages[k]
        cap = problem.free_mib(d)
        act = s.activation_mib
        if 2 * act <= cap + 1e-9:
            continue
        split = opts.split_backward
        grad = s.weight_grad_mib if split else 0.0
        w_alone = split and 2 * grad > cap + 1e-9 and act + grad > cap + 1e-9
        b = backward_ms(problem, k)
        w = s.backward_weight_ms if split else 0.0
        tail = w if w_alone else 0.0
        outside_w = 0.0 if w_alone else m * w  # W's that may run anywhere
        trip = round_trip(problem, k)
        rec_ms = s.recompute_ms if s.recompute_ms is not None else s.forward_ms
        off_ms = s.offload_ms or 0.0
        rel_ms = s.reload_ms if s.reload_ms is not None else off_ms
        # (stretch, idle inside it, forward outside it) per microbatch of each treatment
        kinds = [(s.forward_ms + trip + b + tail, trip, 0.0)]
        if opts.offload and (s.offloadable_mib or 0.0) > 0:
            kinds.append((s.forward_ms + off_ms + rel_ms + b + tail, off_ms + rel_ms, 0.0))
        if opts.recompute and act - s.checkpoint_mib > 0:
            kinds.append((rec_ms + b + tail, 0.0, s.forward_ms))
        least = _least_split(kinds, m, outside_w)
        head = forward_head(problem, k)
        # the device ends with a stretch when nothing may run after it; its B's chain then follows
        after = max(0.0, backward_chain(problem, k) - w) if w_alone or not split else 0.0
        best = max(best, head + least + after)
    return best


def min_memory(problem: Problem) -> list[float]:
    """Least peak memory per device over all valid schedules (MiB), static memory included.

    When device d starts the backward of stage k for a microbatch, that stage's activation is fully
    resident, and every earlier stage j < k on d still holds that microbatch's activation at least
    at its residue (what stays after offload or with recompute). Running microbatches one at a time
    with every activation reduced to its residue reaches exactly this, so the bound is tight: a
    budget at or above it is always feasible.
    """
    needed = []
    for d in range(problem.num_devices):
        worst, held = 0.0, 0.0
        for k in problem.stages_of(d):
            worst = max(worst, held + problem.stages[k].activation_mib)
            held += residue_mib(problem, k)
        needed.append(problem.devices[d].static_mib + worst)
    return needed


class MemoryInfeasibleError(ValueError):
    """Some device's memory limit is below what any schedule needs."""

    def __init__(self, needed_mib: list[float], limits: list[float]):
        self.needed_mib = needed_mib
        self.limits = limits
        short = [f"device {d} needs at least {n:.1f} MiB but its limit is {lim:.1f} MiB"
                 for d, (n, lim) in enumerate(zip(needed_mib, limits)) if n > lim + 1e-9]
        super().__init__("infeasible memory budget: " + "; ".join(short))

    def to_dict(self) -> dict:
        return {"error": "infeasible", "message": str(self), "min_memory_mib": self.needed_mib,
                "memory_limit_mib": [None if math.isinf(lim) else lim for lim in self.limits]}


def check_memory_feasible(problem: Problem) -> list[float]:
    """Return min_memory per device, or raise MemoryInfeasibleError naming the short devices."""
    needed = min_memory(problem)
    limits = [problem.limit_of(d) for d in range(problem.num_devices)]
    if any(n > lim + 1e-9 for n, lim in zip(needed, limits)):
        raise MemoryInfeasibleError(needed, limits)
    return needed
