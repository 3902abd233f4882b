"""The memory-occupancy argument (Little's law): memory x time is a budget like compute time.

Every (stage, microbatch) on a device occupies memory for at least a known time: its activation
from the forward's start until its backward ends — at least F + L + B, where L is the round trip
through the later stages (`round_trip`) — then its weight-gradient part
until W ends. Offloading shrinks the held part to the copies around the forward and the backward
(F + offload and reload + B, never less than the round trip allows); recomputing holds only the
checkpoint until the recompute, then everything from the recompute through B. Over a makespan T the
device offers at most (limit - static) x (T - its earliest start) MiB·ms, so

    (limit - static) x (T - t0) >= sum over pairs of their least occupancy,

with each pair's treatment free. Recompute costs compute time and offload costs copy-lane time, so
the treatments are chosen by a small linear program per device (fractions of each stage's
microbatches offloaded or recomputed; a fractional choice only lowers the bound, so it stays a
proof): minimise T subject to the memory budget above, the device's compute (head + work + added
recompute) and both copy lanes. It binds on copy-bound devices and near the least memory, where the
forward-count arguments see plenty of room.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from ..contract import Problem
from .pipeline import backward_ms, forward_head, round_trip


@dataclass(frozen=True)
class _Footprints:
    """Least memory x time of one microbatch of a stage under each treatment (MiB·ms), and costs."""

    keep: float
    offload: float | None  # None: not allowed or nothing to offload
    recompute: float | None
    offload_ms: float
    reload_ms: float
    recompute_ms: float


def _footprints(problem: Problem, k: int) -> _Footprints:
    s = problem.stages[k]
    opts = problem.options
    split = opts.split_backward
    f = s.forward_ms
    b = backward_ms(problem, k)
    w = s.backward_weight_ms if split else 0.0
    wg = min(s.weight_grad_mib, s.activation_mib) if split else 0.0
    act = s.activation_mib
    trip = round_trip(problem, k)
    keep = act * (f + trip + b) + wg * w
    offload = None
    off_ms = s.offload_ms or 0.0
    rel_ms = s.reload_ms if s.reload_ms is not None else off_ms
    moved = min(s.offloadable_mib if s.offloadable_mib is not None else act, act)
    if opts.offload and moved > 0:
        # held whole for F + copy out and copy in + B; the resident rest also across the trip
        offload = act * (f + off_ms + rel_ms + b) + (act - moved) * max(0.0, trip - off_ms - rel_ms) + wg * w
    recompute = None
    rec_ms = s.recompute_ms if s.recompute_ms is not None else f
    if opts.recompute:
        ckpt = min(s.checkpoint_mib, act)
        recompute = ckpt * (f + max(0.0, trip - rec_ms)) + act * (rec_ms + b) + wg * w
    return _Footprints(keep, offload, recompute, off_ms, rel_ms, rec_ms)


def occupancy_bound(problem: Problem) -> float:
    """Max over devices with a memory limit of the LP bound above (0.0 when none applies)."""
    return max((device_bound(problem, d) for d in problem.limited_devices()), default=0.0)


def device_bound(problem: Problem, d: int, lost: float = 0.0, span_min: float = 0.0) -> float:
    """The LP of the module docstring for device d. `lost` (MiB·ms) is taken off the memory x time
    budget and `span_min` (ms) floors T - t0: cool_down.py proves that once T - t0 >= span_min, the
    warm-up and cool-down leave `lost` of it unusable."""
    cap = problem.free_mib(d)
    stages = problem.stages_of(d)
    m = float(problem.num_microbatches)
    t0 = min(forward_head(problem, k) for k in stages)
    work = m * problem.work_ms(d)
    prints = {k: _footprints(problem, k) for k in stages}
    if cap <= 0:
        return 0.0  # min_memory refuses such a device; nothing to prove here
    solver = pywraplp.Solver.CreateSolver("GLOP")
    if solver is None:  # pragma: no cover - GLOP ships with OR-Tools
        return 0.0
    span = solver.NumVar(0.0, solver.infinity(), "span")  # T - t0
    memory = solver.Sum([])
    compute = solver.Sum([])
    d2h = solver.Sum([])
    h2d = solver.Sum([])
    for k, fp in prints.items():
        memory += m * fp.keep
        shares = []
        if fp.offload is not None:
            x = solver.NumVar(0.0, 1.0, f"off{k}")
            shares.append(x)
            memory += m * (fp.offload - fp.keep) * x
            d2h += m * fp.offload_ms * x
            h2d += m * fp.reload_ms * x
        if fp.recompute is not None:
            y = solver.NumVar(0.0, 1.0, f"rec{k}")
            shares.append(y)
            memory += m * (fp.recompute - fp.keep) * y
            compute += m * fp.recompute_ms * y
        if len(shares) > 1:
            solver.Add(solver.Sum(shares) <= 1.0)
    solver.Add(cap * span >= memory + lost)
    solver.Add(span >= span_min)
    solver.Add(span >= work + compute)
    solver.Add(span >= d2h)
    solver.Add(span >= h2d)
    solver.Minimize(span)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return 0.0
    # GLOP works in floating point: step back by a hair so rounding can never overstate the proof
    return t0 + span.solution_value() * (1.0 - 1e-7)
