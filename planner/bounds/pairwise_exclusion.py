"""The pairwise-exclusion argument: residency that cannot coexist on a device.

On a device with free memory `cap` (limit - static), two things whose held amounts sum above `cap`
can never be live at one instant, whatever else is resident. Per (stage k, microbatch i) on the
device we use two windows during which the pair surely holds at least a known amount, whatever its
treatment (kept, offloaded or recomputed):

* A(k,i) = [B_end - B - x, B_end], holding the whole activation, with x = the least of F + trip
  (kept: allocated at F's start, and B starts at least F + trip later; trip = the round trip through
  the later stages), the recompute (RECOMPUTE allocates it, B starts after it ends) and the reload
  (RELOAD allocates it back, likewise). A pair's real window is at least this long and contains it.
* AW(k,i) = [B_end - B - x, B_end + W] (split backward): as A, then the weight gradient until W
  ends; it holds min(activation, weight gradient).

Compute ops hold memory too: during B (or BW) and during whichever of F (kept or offloaded) or
RECOMPUTE a pair runs, its whole activation is resident; during W its weight gradient is.

Take a set of window classes whose levels pairwise sum above `cap` (a class with 2 x level > cap
gives all M windows, one that fits twice gives a single window), and every compute op of the other
pairs whose own holding exceeds `cap` minus each chosen level. These jobs are pairwise disjoint in
time: windows by memory, an op and a window by memory, two ops by the compute lane. Each has a
release r (earliest start), a length p and a tail q (least time from its end to the makespan's end),
so they form a one-machine problem 1|r,q|Cmax, and the makespan is at least its optimum, hence at
least its preemptive relaxation (Jackson's schedule, exact for the relaxation). The tails come from
the backward chain: after B(k,i) the backwards of stages k-1..0 and W(0,i) must follow; AW's tail is
that chain minus W (its B ends W before the window's end at the latest). It binds where a heavy
last stage shares a device with the first (V placement): two head windows cannot overlap, nor a
head window and an embedding backward.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from ..contract import Problem
from .pipeline import backward_chain, backward_ms, first_backward_start, forward_head, round_trip

MAX_CLASSES = 10  # window classes per device enumerated as subsets (2 per stage)


@dataclass(frozen=True)
class _Job:
    """r: earliest start; p: least length; q: least time from its end to the makespan's end."""

    r: float
    p: float
    q: float


@dataclass(frozen=True)
class _Class:
    """The windows of one stage of one kind: held level and their (r, p, q)."""

    stage: int
    level: float
    job: _Job


@dataclass(frozen=True)
class _OpKind:
    """Compute ops of one stage that hold at least `hold` MiB while they run, one per microbatch."""

    stage: int
    hold: float
    job: _Job


def jackson_preemptive(jobs: list[_Job]) -> float:
    """Makespan of Jackson's preemptive schedule (always run the released job with the longest tail):
    optimal for preemptive 1|r,q|Cmax, hence a lower bound for the non-preemptive problem."""
    order = sorted(jobs, key=lambda j: j.r)
    ready: list[tuple[float, float]] = []  # (-q, remaining p)
    t, i, best, n = 0.0, 0, 0.0, len(order)
    while i < n or ready:
        if not ready:
            t = max(t, order[i].r)
        while i < n and order[i].r <= t:
            heapq.heappush(ready, (-order[i].q, order[i].p))
            i += 1
        neg_q, rem = heapq.heappop(ready)
        run = min(rem, (order[i].r - t) if i < n else rem)
        t += run
        if rem - run > 1e-12:
            heapq.heappush(ready, (neg_q, rem - run))
        else:
            best = max(best, t - neg_q)
    return best


def _stage_parts(problem: Problem, k: int) -> tuple[list[_Class], list[_OpKind]]:
    s = problem.stages[k]
    opts = problem.options
    split = opts.split_backward
    f = s.forward_ms
    b = backward_ms(problem, k)
    w = s.backward_weight_ms if split else 0.0
    head, fbs = forward_head(problem, k), first_backward_start(problem, k)
    x = f + round_trip(problem, k)
    if opts.recompute:
        x = min(x, s.recompute_ms if s.recompute_ms is not None else f)
    if opts.offload and (s.offloadable_mib if s.offloadable_mib is not None else s.activation_mib) > 0:
        off = s.offload_ms or 0.0
        x = min(x, s.reload_ms if s.reload_ms is not None else off)
    chain = backward_chain(problem, k)  # after B(k,i): the backwards below, then W(0,i)
    q_b = max(chain, w)  # W(k,i) follows B(k,i) too
    start = max(head, fbs - x)
    act = s.activation_mib
    classes = [_Class(k, act, _Job(start, x + b, q_b))]
    wg = min(s.weight_grad_mib, act) if split else 0.0
    if split and wg > 0:
        classes.append(_Class(k, wg, _Job(start, x + b + w, max(0.0, chain - w))))
    rec = (s.recompute_ms if s.recompute_ms is not None else f) if opts.recompute else f
    ops = [
        # F (kept or offloaded) or RECOMPUTE: the whole activation while it runs
        _OpKind(k, act, _Job(head, min(f, rec), b + q_b)),
        _OpKind(k, act, _Job(fbs, b, q_b)),  # B or BW
    ]
    if split and wg > 0 and w > 0:
        ops.append(_OpKind(k, wg, _Job(fbs + b, w, 0.0)))
    return classes, ops


def _device_bound(problem: Problem, d: int) -> float:
    cap = problem.free_mib(d)
    m = problem.num_microbatches
    classes: list[_Class] = []
    ops: list[_OpKind] = []
    for k in problem.stages_of(d):
        c, o = _stage_parts(problem, k)
        classes += c
        ops += o
    classes = [c for c in classes if c.level > 0][:MAX_CLASSES]
    best = 0.0
    for size in range(1, len(classes) + 1):
        for chosen in itertools.combinations(classes, size):
            if len({c.stage for c in chosen}) < size:
                continue  # one class per stage: a single window then has a known pair
            if any(a.level + b.level <= cap for a, b in itertools.combinations(chosen, 2)):
                continue
            jobs: list[_Job] = []
            single: set[int] = set()
            for c in chosen:
                many = 2 * c.level > cap
                jobs += [c.job] * (m if many else 1)
                if not many:
                    single.add(c.stage)
            windowed = {c.stage for c in chosen}
            for o in ops:
                if all(o.hold + c.level > cap for c in chosen):
                    if o.stage not in windowed:
                        jobs += [o.job] * m
                    elif o.stage in single:
                        jobs += [o.job] * (m - 1)  # the other pairs' ops; the window's own lie inside it
            best = max(best, jackson_preemptive(jobs))
    return best


def pairwise_exclusion_bound(problem: Problem) -> float:
    """Max over devices with a memory limit of the bound above (0.0 when none applies)."""
    return max((_device_bound(problem, d) for d in problem.limited_devices()), default=0.0)
