"""What every argument measures the pipeline with: the shortest paths along the stage chain (memory
ignored), a device's frame, and the devices the one-stage memory arguments look at."""

from __future__ import annotations

import math

from ..contract import Problem


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
    included (0 for the last stage). The one formula for it: the bounds and the greedy use it."""
    after = first_backward_start(problem, k) - forward_head(problem, k) - problem.stages[k].forward_ms
    return max(0.0, after)


def waiting_ws(problem: Problem, d: int, k: int) -> int:
    """How many of stage k's W's can still be pending at the end of one of its B's on device d: each
    keeps its weight gradient beside that B's activation, so at most 1 + (free - activation) /
    weight gradient (the B's own among them), and never fewer than that one; all m without a split
    or a weight gradient. (Memory over a vanishing gradient overflows to infinity: all m.)"""
    s, m = problem.stages[k], problem.num_microbatches
    grad = s.weight_grad_mib if problem.options.split_backward else 0.0
    room = math.inf if grad <= 0 else (problem.free_mib(d) - s.activation_mib) / grad
    return m if room >= m - 1 else max(1, 1 + math.floor(room + 1e-9))


def device_frame(problem: Problem, d: int) -> tuple[float, float, float, float]:
    """(earliest start, all work, what must follow the last op, earliest backward) of device d.
    Without split, its last op is some BW(k, i), and the backward chain below k follows it."""
    stages = problem.stages_of(d)
    head = min(forward_head(problem, k) for k in stages)
    tail = 0.0 if problem.options.split_backward else min(backward_tail(problem, k) for k in stages)
    first_b = min(first_backward_start(problem, k) for k in stages)
    return head, problem.num_microbatches * problem.work_ms(d), tail, first_b


def one_stage_limited(problem: Problem) -> list[tuple[int, int]]:
    """(device, its stage) for every device with a memory limit and one stage."""
    return [(d, problem.stages_of(d)[0]) for d in problem.limited_devices() if len(problem.stages_of(d)) == 1]
