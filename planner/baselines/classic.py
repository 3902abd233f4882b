"""Fixed-pattern schedules as per-device compute orders: GPipe, 1F1B, interleaved 1F1B, serialized.

These are the textbook orders; they decide no memory trade-off (offload/recompute sets are added by
`schedule_of` when a caller wants them).
"""

from __future__ import annotations

from ..contract import Problem
from ..ops import Kind, Op
from ..simulator import DeadlockError, Gate, Schedule, simulate
from .common import NotApplicable, backward_ops, is_loop_placement, require_one_chunk, schedule_of

Orders = list[list[Op]]


def gpipe_orders(problem: Problem, split: bool = False) -> Orders:
    """All forwards (stage, then microbatch order), then all backwards (latest stage first).

    Valid for any placement: every device's order follows one global topological order.
    """
    orders: Orders = [[] for _ in range(problem.num_devices)]
    m = problem.num_microbatches
    for k in range(problem.num_stages):
        for i in range(m):
            orders[problem.stages[k].device].append(Op(Kind.F, k, i))
    for k in reversed(range(problem.num_stages)):
        for i in range(m):
            orders[problem.stages[k].device] += backward_ops(problem, k, i, split)
    return orders


def one_f_one_b_orders(problem: Problem, warmup: list[int] | None = None) -> Orders:
    """1F1B with a combined backward: stage k runs S-k-1 warm-up forwards, then F/BW pairs, then drains.

    `warmup` overrides the warm-up count per stage (1 each = one microbatch at a time per stage).
    """
    require_one_chunk(problem, "1f1b")
    s, m = problem.num_stages, problem.num_microbatches
    orders: Orders = [[] for _ in range(problem.num_devices)]
    for k in range(s):
        warm = min(m, s - k - 1 if warmup is None else warmup[k] - 1)
        order = [Op(Kind.F, k, i) for i in range(warm)]
        for i in range(m):
            if warm + i < m:
                order.append(Op(Kind.F, k, warm + i))
            order += backward_ops(problem, k, i, split=False)
        orders[problem.stages[k].device] = order
    return orders


def interleaved_orders(problem: Problem, extra_warmup: int = 0) -> Orders:
    """Megatron's interleaved 1F1B for loop placement (device d holds stages d, d+P, d+2P, ...).

    Microbatches go in groups of P through each chunk in turn; device d warms up with
    2(P-d-1) + (v-1)P virtual forwards, then alternates forward and backward.
    """
    if problem.chunks < 2:
        raise NotApplicable("interleaved-1f1b needs at least 2 stages per device; this problem has 1")
    if not is_loop_placement(problem):
        raise NotApplicable("interleaved-1f1b needs loop placement (stage k on device k mod P)")
    p, v, m = problem.num_devices, problem.chunks, problem.num_microbatches
    orders: Orders = []
    for d0 in range(p):
        dev = problem.stages[d0].device
        fwd, bwd = [], []
        for g in range(0, m, p):
            group = range(g, min(g + p, m))
            for c in range(v):
                fwd += [Op(Kind.F, c * p + d0, i) for i in group]
            for c in reversed(range(v)):
                bwd += [(c * p + d0, i) for i in group]
        total = len(fwd)
        warm = min(total, 2 * (p - d0 - 1) + (v - 1) * p + extra_warmup)
        order = fwd[:warm]
        fi = warm
        for k, i in bwd:
            if fi < total:
                order.append(fwd[fi])
                fi += 1
            order += backward_ops(problem, k, i, split=False)
        orders.append((dev, order))
    out: Orders = [[] for _ in range(p)]
    for dev, order in orders:
        out[dev] = order
    return out


def interleaved_schedule(problem: Problem) -> tuple[Schedule, int]:
    """The interleaved orders, with extra warm-up only if uneven groups make the plain one deadlock."""
    extra = 0
    limit = problem.num_microbatches * problem.chunks
    while True:
        schedule = schedule_of(problem, interleaved_orders(problem, extra))
        try:
            simulate(problem, schedule)
            return schedule, extra
        except DeadlockError:
            if extra > limit:
                raise
            extra = max(1, extra * 2)


def serialized_schedule(problem: Problem) -> Schedule:
    """One microbatch at a time through the whole pipeline; while a microbatch waits on a device,
    every activation of it that is not the device's last stage on the way down is reduced to its
    residue (offloaded, gated so the next forward waits for the copy, or recomputed just in time).

    This is the schedule behind bounds.min_memory's tightness: it fits whenever every limit is at
    least min_memory, which makes it the fallback that lets best_heuristic always answer.
    """
    s, m = problem.num_stages, problem.num_microbatches
    split = problem.options.split_backward
    last_on_device = {max(problem.stages_of(d)) for d in range(problem.num_devices)}
    mode: dict[int, str | None] = {}
    for k in range(s):
        st = problem.stages[k]
        keep = st.activation_mib
        off = keep - st.offloadable_mib if problem.options.offload else keep
        rec = st.checkpoint_mib if problem.options.recompute else keep
        if k in last_on_device:
            mode[k] = None
        elif off < min(keep, rec):
            mode[k] = "offload"
        elif rec < keep:
            mode[k] = "recompute"
        else:
            mode[k] = None
    # the next stage up on the same device: its forward must wait for this offload, and this
    # restore must wait until its backward (and W) have freed their memory
    above: dict[int, int | None] = {}
    for k in range(s):
        same = [j for j in problem.stages_of(problem.stages[k].device) if j > k]
        above[k] = min(same) if same else None
    orders: Orders = [[] for _ in range(problem.num_devices)]
    treat: dict[tuple[int, int], str] = {}
    gates: list[Gate] = []
    for i in range(m):
        for k in range(s):
            orders[problem.stages[k].device].append(Op(Kind.F, k, i))
            if mode[k]:
                treat[(k, i)] = mode[k]
            if mode[k] == "offload" and above[k] is not None:
                gates.append(Gate(Op(Kind.F, above[k], i), Op(Kind.OFFLOAD, k, i), at_end=True))
        for k in reversed(range(s)):
            orders[problem.stages[k].device] += backward_ops(problem, k, i, split)
            j = above[k]
            last = backward_ops(problem, j, i, split)[-1] if j is not None else None
            if last is not None and mode[k] == "offload":
                gates.append(Gate(Op(Kind.RELOAD, k, i), last, at_end=True))
            if last is not None and mode[k] == "recompute":
                gates.append(Gate(Op(Kind.RECOMPUTE, k, i), last, at_end=True))
        if i + 1 < m:
            gates.append(Gate(Op(Kind.F, 0, i + 1), backward_ops(problem, 0, i, split)[-1], at_end=True))
    schedule = schedule_of(problem, orders, treat)
    # schedule_of's prefetch gates would let a reload start before the later stages freed memory;
    # keep only the serialized schedule's own gates.
    schedule.gates = gates
    return schedule
