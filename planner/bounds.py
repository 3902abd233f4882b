"""Lower bounds on the makespan, and the least memory each device needs for any schedule at all.

Both are proofs, not estimates: no valid plan is faster than `lower_bound`, and a device whose limit
is below `min_memory` admits no valid plan, whatever the order, offload or recompute.
"""

from __future__ import annotations

import math

from .contract import Problem
from .ops import residue_mib


def _backward_ms(problem: Problem, k: int) -> float:
    """Shortest backward-input op of stage k (B when splitting is allowed, else BW)."""
    s = problem.stages[k]
    return s.backward_input_ms + (0.0 if problem.options.split_backward else s.backward_weight_ms)


def forward_head(problem: Problem, k: int) -> float:
    """Earliest time F(k, i) can start: the forward chain and links of stages 0..k-1."""
    return sum(problem.stages[j].forward_ms + problem.link_ms(j, j + 1) for j in range(k))


def backward_tail(problem: Problem, k: int) -> float:
    """Least time from the end of stage k's backward to the end of stage 0's (links included)."""
    return sum(problem.link_ms(j + 1, j) + _backward_ms(problem, j) for j in range(k))


def first_backward_start(problem: Problem, k: int) -> float:
    """Earliest start of any backward of stage k: full forward chain, then backwards S-1..k+1."""
    last = problem.num_stages - 1
    # backwards of stages last..k+1, each followed by its link down to the stage below
    down = sum(_backward_ms(problem, j) + problem.link_ms(j, j - 1) for j in range(k + 1, last + 1))
    return forward_head(problem, last) + problem.stages[last].forward_ms + down


def lower_bound(problem: Problem) -> float:
    """max of: one microbatch's critical path; per device, the earliest it can start plus all its
    work plus what must follow its last op; per device, the earliest backward plus all backward work.
    """
    m = problem.num_microbatches
    split = problem.options.split_backward
    w0 = problem.stages[0].backward_weight_ms if split else 0.0
    critical = first_backward_start(problem, 0) + _backward_ms(problem, 0) + w0
    best = critical
    for d in range(problem.num_devices):
        stages = problem.stages_of(d)
        work_f = m * sum(problem.stages[k].forward_ms for k in stages)
        work_bw = m * sum(problem.stages[k].backward_input_ms + problem.stages[k].backward_weight_ms
                          for k in stages)
        # Without split, the device's last op is some BW(k, i); the backward chain below k follows.
        tail = 0.0 if split else min(backward_tail(problem, k) for k in stages)
        head = min(forward_head(problem, k) for k in stages)
        best = max(best, head + work_f + work_bw + tail,
                   min(first_backward_start(problem, k) for k in stages) + work_bw + tail)
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
