"""The stage-tail argument: each stage's last backward has that stage's backward chain after it, and
before it its device has run everything that backward waits for.

For stage k on device d, take the end of its last B (or BW). By then d has run every forward of k
and of the earlier stages it holds (each F(k, i) precedes B(k, i), and the forwards below precede
it), every backward of k and of the later stages it holds (B(j, i) precedes B(k, i) for j > k), and
every W of k but those that wait past it. A W waiting there keeps its weight gradient through that
last B, beside the B's own activation, so memory lets at most 1 + (free - activation) / weight
gradient of them wait (the last microbatch's own among them). These ops run one at a time on d,
none before its release (a forward of stage j from `forward_head(j)`, a backward of k or later
after the forwards above), so the last B ends no earlier than the best release threshold plus the
work released after it; then the chain down to stage 0 and its W follows (`backward_chain`).

`forward_count`'s tail is this for the device's last backward of any stage, with the shortest chain
there; per stage, the chain is the stage's own, which is what binds in V placements: device 0 holds
stage 0 (the shortest chain) and the LM head (the longest), whose last B must come before a
backward chain through every other stage, with its W's held back by memory.
"""

from __future__ import annotations

from ..contract import Problem
from .pipeline import backward_chain, backward_ms, backward_tail, forward_head, waiting_ws


def stage_tail_bound(problem: Problem) -> float:
    """Max over stages of the module docstring's bound (ms)."""
    m = problem.num_microbatches
    split = problem.options.split_backward
    best = 0.0
    for d in range(problem.num_devices):
        stages = problem.stages_of(d)
        for k in stages:
            w = problem.stages[k].backward_weight_ms if split else 0.0
            # released once the forwards are done: backwards of k and later stages, k's W's
            backward = (m * sum(backward_ms(problem, j) for j in stages if j >= k)
                        + (m - waiting_ws(problem, d, k)) * w)
            forwards = [(forward_head(problem, j), m * problem.stages[j].forward_ms)
                        for j in stages if j <= k]
            released = max(r + sum(work for head, work in forwards if head >= r) for r, _ in forwards)
            last_b = released + backward
            chain = backward_chain(problem, k) if split else backward_tail(problem, k)
            best = max(best, last_b + chain)
    return best
