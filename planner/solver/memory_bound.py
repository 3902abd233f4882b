"""A memory-aware lower bound on the makespan (the solver's own, next to planner.bounds').

planner.bounds ignores memory limits, so at 1F1B's memory the gap it reports stays ~3.5% even when
the schedule is close to optimal. The argument here: until the first memory is freed on a device
(the end of its first backward, at the earliest `first_backward_start + backward` — or of its first
W when B frees nothing), nothing allocated there comes back, so the forwards run on it before then
are limited by its free memory; backward work cannot start before `first_backward_start`. So the
device is busy at most `F_max + (T_free - T_b)` before `T_free`, and all the rest of its work comes
after: makespan >= T_free + work - busy_before. With offload allowed, an OFFLOAD end can be the
first free (at the earliest forward end plus the copy); with recompute allowed, a forward may hold
only its checkpoint.
"""

from __future__ import annotations

from ..bounds import first_backward_start, forward_head
from ..contract import Problem


def memory_lower_bound(problem: Problem) -> float:
    """A proven lower bound (ms), 0.0 when the argument does not apply."""
    m = problem.num_microbatches
    opts = problem.options
    split = problem.options.split_backward
    best = 0.0
    for d in range(problem.num_devices):
        limit = problem.limit_of(d)
        if limit == float("inf"):
            continue
        cap = limit - problem.devices[d].static_mib
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
        # Forward work that fits in `cap` before any free: fractional knapsack, capped at M per stage.
        by_ratio = sorted(stages, key=lambda k: problem.stages[k].forward_ms / held[k], reverse=True)
        room, forward = cap, 0.0
        for k in by_ratio:
            s = problem.stages[k]
            n = min(float(m), room / held[k])
            forward += n * s.forward_ms
            room -= n * held[k]
            if room <= 0:
                break
        busy_before = min(t_free, forward + max(0.0, t_free - t_b))
        work = m * sum(problem.stages[k].forward_ms + problem.stages[k].backward_input_ms
                       + problem.stages[k].backward_weight_ms for k in stages)
        best = max(best, t_free + work - busy_before)
    return best


def combined_lower_bound(problem: Problem) -> float:
    """max(planner.bounds.lower_bound, memory_lower_bound): what the solvers may assume."""
    from ..bounds import lower_bound

    return max(lower_bound(problem), memory_lower_bound(problem))
