"""The least memory any schedule needs on each device, and the error for a budget below it."""

from __future__ import annotations

import math

from ..contract import Problem
from ..ops import residue_mib


def min_memory(problem: Problem) -> list[float]:
    """Least peak memory per device over all valid schedules (MiB), static memory included.

    When device d starts the backward of stage k for a microbatch, that stage's activation is fully
    resident, and every earlier stage j < k on d still holds that microbatch's activation at least
    at its residue (what stays after offload or with recompute). Running microbatches one at a time
    with every activation reduced to its residue reaches exactly this, so the bound is tight: a
    budget at or above it is always feasible. With `split_backward` B also allocates its output
    gradients (`output_grad_mib`) beside the activation: counted, since the solvers split every
    backward the problem lets them (a problem whose schedules should run BW's says split_backward
    false).
    """
    needed = []
    for d in range(problem.num_devices):
        worst, held = 0.0, 0.0
        for k in problem.stages_of(d):
            during_b = problem.output_grad_of(k) if problem.options.split_backward else 0.0
            worst = max(worst, held + problem.stages[k].activation_mib + during_b)
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
