"""The one-activation-at-a-time argument, for a one-stage device whose memory holds a single
activation: each microbatch then holds the device's memory alone for a while, and those stretches
are disjoint."""

from __future__ import annotations

import itertools
import math

from ..contract import Problem
from .pipeline import backward_chain, backward_ms, forward_head, one_stage_limited, round_trip


def _least_split(kinds: list[tuple[float, float, float]], m: int, outside: float) -> float:
    """min over whole n_t >= 0, sum n_t = m, of L1 + max(0, L2 - L1): L1 = sum n_t stretch_t, L2 =
    L1 + outside + sum n_t (forward_t - idle_t). With the other counts fixed, the value is convex in
    how the last two kinds share the rest, and linear on either side of where L2 = L1: its least
    whole point is an end of that range or next to the crossing."""
    def value(x: list[int]) -> float:
        stretch = sum(n * kd[0] for n, kd in zip(x, kinds))
        spill = outside + sum(n * (kd[2] - kd[1]) for n, kd in zip(x, kinds))
        return stretch + max(0.0, spill)

    if len(kinds) == 1:
        return value([m])
    gain = [kd[2] - kd[1] for kd in kinds]
    best = math.inf
    for fixed in itertools.product(range(m + 1), repeat=len(kinds) - 2):
        rest = m - sum(fixed)
        if rest < 0:
            continue
        # spill = at + slope x t, t of kind -2 and rest - t of kind -1
        at = outside + sum(n * g for n, g in zip(fixed, gain)) + rest * gain[-1]
        slope = gain[-2] - gain[-1]
        ts = {0, rest}
        if abs(slope) > 1e-12:
            cross = -at / slope
            ts |= {min(rest, max(0, math.floor(cross))), min(rest, max(0, math.ceil(cross)))}
        best = min(best, *(value([*fixed, t, rest - t]) for t in ts))
    return best


def one_at_a_time_bound(problem: Problem) -> float:
    """Per device with one stage k whose memory holds one activation at a time (two of them, or an
    activation beside the weight gradient another microbatch holds until its W, do not fit): every
    microbatch holds the device's memory alone for a stretch, and those stretches are disjoint:
    kept, from its forward's start through the round trip to its backward's end; offloaded, for its
    forward and copy out, then its copy in and backward; recomputed, for the recompute and backward
    (each + W when weight gradients cannot coexist either). The compute lane is busy throughout a
    recompute's stretch, so only the forwards of recomputed microbatches (and W's outside the
    stretches) can fill the copies and round trips of the others:

        makespan >= head + sum of stretches + max(0, outside work - idle inside the stretches),

    minimised over how many microbatches take each treatment (whole counts). When nothing may run
    after the last stretch (its W's are inside the stretches, or there are none), that microbatch's
    backward chain still runs down to stage 0 and its W after it: the bound adds that tail, less
    the stretch's own W."""
    best = 0.0
    opts = problem.options
    m = problem.num_microbatches
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
        rec_ms, off_ms, rel_ms = s.recompute_ms, s.offload_ms, s.reload_ms  # the contract fills them
        # (stretch, idle inside it, forward outside it) per microbatch of each treatment
        kinds = [(s.forward_ms + trip + b + tail, trip, 0.0)]
        if opts.offload and s.offloadable_mib > 0:
            kinds.append((s.forward_ms + off_ms + rel_ms + b + tail, off_ms + rel_ms, 0.0))
        if opts.recompute and act - s.checkpoint_mib > 0:
            kinds.append((rec_ms + b + tail, 0.0, s.forward_ms))
        least = _least_split(kinds, m, outside_w)
        head = forward_head(problem, k)
        # the device ends with a stretch when nothing may run after it; its B's chain then follows
        after = max(0.0, backward_chain(problem, k) - w) if w_alone or not split else 0.0
        best = max(best, head + least + after)
    return best
