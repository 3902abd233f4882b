"""Idle forced before the first backward on a device that holds several stages (V or interleaved).

Let U be the start of the device's first backward-input op (B, or BW without split). It is one of
its last stage k*: every earlier stage's backward follows k*'s on the same microbatch, here. So
U >= first_backward_start(k*), and before U the compute lane runs only forwards and recomputes. At U
the pair whose backward starts holds its whole activation, and so does every pair whose forward ran
before U unless it was offloaded (its OFFLOAD ended by U: it holds activation - offloadable_mib) or
recomputed later (it holds its checkpoint, and its recompute after U costs R, so its forward did
only F - R of the device's work). Counting those forwards (h kept, q offloaded, n recomputed per
stage), with every other op after U:

    makespan >= U + work - sum_k [F_k (h_k + q_k) + max(0, F_k - R_k) n_k]

subject to memory at U (sum act h + (act - offloadable) q + checkpoint n <= free, h_{k*} >= 1), the
compute lane (the forwards fit between the device's earliest forward and U, each stage's after its
own earliest start), the device-to-host lane (the offloads fit between the first forward's end and
U) and M per stage. Memory must also hold at the start of the last of those forwards, t* <= U -
(the shortest forward): every one of them has allocated by then, and only the copies the lane has
ended by t* have freed anything (c_k <= q_k of them: sum act (h + q) + checkpoint n - offloadable c
<= free, their copies within t* - the first forward's end). A small integer program minimises the
right-hand side over U and the counts; its proven bound is used, so a time-out only weakens it.

It binds where the LM head shares device 0 with the embedding stage: no embedding activation can
stay beside the head's at its first backward, so only embedding forwards whose offloads have ended
count. The single-stage case is warmup.warmup_waste, with the copies' timing in more detail.
"""

from __future__ import annotations

from ortools.linear_solver import pywraplp

from ..contract import Problem
from .pipeline import first_backward_start, forward_head

# the program has three integer variables per stage and solves in milliseconds; a limit keeps a
# pathological case from stalling the bound (its proven bound stays valid, only weaker)
TIME_LIMIT_MS = 2_000


def chunked_warmup_waste(problem: Problem, d: int) -> float:
    """Least time device d (several stages, a memory limit) spends before its first backward on
    anything but its own work: idle, or forwards undone by a later recompute (0.0 if none)."""
    stages = problem.stages_of(d)
    cap = problem.free_mib(d)
    if len(stages) < 2 or cap == float("inf"):
        return 0.0
    solver = pywraplp.Solver.CreateSolver("SCIP")
    if solver is None:  # pragma: no cover - SCIP ships with OR-Tools
        return 0.0
    solver.SetTimeLimit(TIME_LIMIT_MS)
    opts = problem.options
    m = float(problem.num_microbatches)
    last = max(stages)
    head = min(forward_head(problem, k) for k in stages)
    first_end = min(forward_head(problem, k) + problem.stages[k].forward_ms for k in stages)
    shortest = min(problem.stages[k].forward_ms for k in stages)
    u = solver.NumVar(first_backward_start(problem, last), solver.infinity(), "U")
    useful, compute, allocated = [], [], []
    # (stage, how many of its copies have ended) by U, and by the last forward's start
    ended_by_u, ended_by_last = [], []
    for k in stages:
        s = problem.stages[k]
        kept = solver.IntVar(1.0 if k == last else 0.0, m, f"kept{k}")
        counts = [kept]
        useful.append(s.forward_ms * kept)
        allocated.append(s.activation_mib * kept)
        if opts.offload and (s.offloadable_mib or 0.0) > 0:
            off = solver.IntVar(0.0, m, f"off{k}")
            ended = solver.IntVar(0.0, m, f"ended{k}")  # its copies ended by the last forward's start
            solver.Add(ended <= off)
            counts.append(off)
            useful.append(s.forward_ms * off)
            allocated.append(s.activation_mib * off)
            ended_by_u.append((s, off))
            ended_by_last.append((s, ended))
        if opts.recompute:
            rec = solver.IntVar(0.0, m, f"rec{k}")
            counts.append(rec)
            recompute_ms = s.recompute_ms if s.recompute_ms is not None else s.forward_ms
            useful.append(max(0.0, s.forward_ms - recompute_ms) * rec)
            allocated.append(s.checkpoint_mib * rec)
        forwards = solver.Sum(counts)
        solver.Add(forwards <= m)
        solver.Add(s.forward_ms * forwards <= u - forward_head(problem, k))
        compute.append(s.forward_ms * forwards)
    solver.Add(solver.Sum(compute) <= u - head)
    # every forward before U has allocated by the last one's start; copies free memory as they end:
    # all of them by U, those ended by then by the last forward's start (at U - shortest at the latest)
    for copies, moment in ((ended_by_u, u), (ended_by_last, u - shortest)):
        freed = solver.Sum([st.offloadable_mib * n for st, n in copies])
        solver.Add(solver.Sum(allocated) - freed <= cap)
        if copies:
            solver.Add(solver.Sum([(st.offload_ms or 0.0) * n for st, n in copies]) <= moment - first_end)
    solver.Minimize(u - solver.Sum(useful))
    status = solver.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return 0.0  # infeasible: no schedule fits at all (min_memory says so elsewhere)
    return max(0.0, solver.Objective().BestBound() - head)
