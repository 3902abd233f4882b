"""The ends argument: memory x time is a budget (occupancy.py), but not all of it can be used. At the
start memory fills no faster than forwards arrive, and at the end it drains no slower than the
device can run the backwards and W's that still hold it, so near both ends a device holds less than
its limit whatever the schedule.

Warm-up: every MiB held on device d at time t belongs to a (stage, microbatch) whose forward has
started by t, and holds at most that stage's activation; the n-th forward of stage k starts no
earlier than `forward_arrivals`' a[k][n]. So d holds at most up(t) = sum_k act_k x #{n: a[k][n] <= t}.

Cool-down: at t = T - x, a pair holding memory on d has its B still to end (it holds at most its
activation) or only its W (at most its weight gradient). Those ops run one at a time on d after t,
except one that may be running at t, so their durations sum to at most x + the longest of them; and
stage k's B's end by T - backward_chain(k), so at most (x - chain_k) / B_k + 1 of them are pending.
The most memory those counts allow (a fractional knapsack: never less than the truth) is down(x).

So over [t0, T] the device offers at most the integral of min(free, up, down), which is free x (T -
t0) less the two losses once T - t0 is at least the two ramps' lengths (then they cannot overlap).
The occupancy LP with that smaller budget, and with recompute still charged as compute and copies
as lane time, is a bound for such T; a shorter T already satisfies the plain occupancy LP, so the
argument keeps the ends only when the plain LP itself rules the short T out. It binds where memory
holds a few activations: recompute-only long context, fine-grained MoE below 1F1B's memory.
"""

from __future__ import annotations

from ..contract import Problem
from .arrivals import forward_arrivals
from .forward_count import _knapsack
from .occupancy import device_bound
from .pipeline import backward_chain, backward_ms, backward_tail, forward_head

STEPS = 200  # samples of the cool-down ramp: each loses at most 1/STEPS of its area, never overstates


def cool_down_bound(problem: Problem) -> float:
    """Max over devices with a memory limit of the occupancy LP with the ends' losses."""
    arrivals = forward_arrivals(problem)
    return max((_device(problem, d, arrivals) for d in problem.limited_devices()), default=0.0)


def _device(problem: Problem, d: int, arrivals: list[list[float]]) -> float:
    cap = problem.free_mib(d)
    stages = problem.stages_of(d)
    m = problem.num_microbatches
    if cap <= 0 or cap >= m * sum(problem.stages[k].activation_mib for k in stages):
        return 0.0  # nothing fits, or everything does: the ends cost nothing
    t0 = min(forward_head(problem, k) for k in stages)
    up_len, up_lost = warm_up_loss(problem, stages, arrivals, cap, t0)
    down_len, down_lost = cool_down_loss(problem, stages, cap)
    plain = device_bound(problem, d)
    if plain < t0 + up_len + down_len:
        return plain  # a schedule this short may overlap the ramps: no loss is proven for it
    return device_bound(problem, d, lost=up_lost + down_lost, span_min=up_len + down_len)


def warm_up_loss(problem: Problem, stages: list[int], arrivals: list[list[float]], cap: float,
                 t0: float) -> tuple[float, float]:
    """(length, MiB·ms) of the warm-up ramp: from t0 until up(t) reaches `cap`, the area between."""
    events = sorted((a, problem.stages[k].activation_mib) for k in stages for a in arrivals[k])
    held, t, lost = 0.0, t0, 0.0
    for at, act in events:
        lost += (cap - held) * max(0.0, at - t)
        t = max(t, at)
        held += act
        if held >= cap:
            return t - t0, lost
    return t - t0, lost  # unreachable: the caller checked that m activations exceed cap


def _pending(problem: Problem, stages: list[int]) -> list[tuple[float, float, float, float, float]]:
    """Per stage: (activation, B, W, backward chain after its B, weight gradient), as the cool-down
    sees them (without split: BW, no W, nothing held after it)."""
    split = problem.options.split_backward
    out = []
    for k in stages:
        s = problem.stages[k]
        chain = backward_chain(problem, k) if split else backward_tail(problem, k)
        out.append((s.activation_mib, backward_ms(problem, k), s.backward_weight_ms if split else 0.0, chain,
                    s.weight_grad_mib if split else 0.0))
    return out


def down_mib(problem: Problem, stages: list[int], x: float,
             pending: list[tuple[float, float, float, float, float]] | None = None) -> float:
    """Most memory device (stages) can hold at time T - x (module docstring, cool-down)."""
    m = problem.num_microbatches
    items, longest = [], 0.0
    for act, b, w, chain, wg in pending or _pending(problem, stages):
        longest = max(longest, b, w)
        pending_b = 0 if x < chain else min(m, int((x - chain) / b + 1e-9) + 1)
        items.append((act, b + w, float(pending_b)))
        if wg > 0:
            items.append((wg, w, float(m)))
    return _knapsack(x + longest, items)


def cool_down_loss(problem: Problem, stages: list[int], cap: float) -> tuple[float, float]:
    """(length, MiB·ms) of the cool-down ramp: the x until down(x) reaches `cap` (doubling), and the
    area between, each step counted at its right end (down grows with x, so that is an upper bound
    of the memory held and the loss is never overstated)."""
    pending = _pending(problem, stages)
    hi = max(backward_ms(problem, k) for k in stages)
    while down_mib(problem, stages, hi, pending) < cap:
        hi *= 2.0
    lo = 0.0
    for _ in range(30):  # the ramp's end, to well under a step
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if down_mib(problem, stages, mid, pending) < cap else (lo, mid)
    step = hi / STEPS
    lost = sum((cap - min(cap, down_mib(problem, stages, step * j, pending))) * step for j in range(1, STEPS + 1))
    return hi, lost

