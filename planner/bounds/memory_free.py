"""The memory-free argument: a microbatch's critical path, and each device's work between the
earliest it can start and what must follow its last op. Memory limits play no part."""

from __future__ import annotations

from ..contract import Problem
from .pipeline import backward_chain, backward_ms, device_frame, first_backward_start


def memory_free_bound(problem: Problem) -> float:
    """max of: one microbatch's critical path; per device, the earliest it can start plus all its
    work plus what must follow its last op; per device, the earliest backward plus all backward work.
    """
    m = problem.num_microbatches
    best = first_backward_start(problem, 0) + backward_ms(problem, 0) + backward_chain(problem, 0)
    for d in range(problem.num_devices):
        head, work, tail, first_b = device_frame(problem, d)
        work_bw = work - m * sum(problem.stages[k].forward_ms for k in problem.stages_of(d))
        best = max(best, head + work + tail, first_b + work_bw + tail)
    return best
