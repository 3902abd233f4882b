"""The backward-stretches argument: on a one-stage device whose memory holds one activation at a
time, every microbatch's stretch but one lies after the stage's first possible backward.

As in one_at_a_time.py, each microbatch holds the whole activation, alone, for a stretch ending at
its backward's end: kept, from its forward's start (at least F + round trip + B); offloaded, from
its copy in (at least reload + B), and before that for its forward and copy out (F + offload);
recomputed, from its recompute (at least R + B). Every backward ends after `first_backward_start` +
B, so of the stretches that end with a backward at most one can contain that instant and all the
others lie wholly after it. What the one-at-a-time sum spends on the head and on the forwards that
fill the round trips is then measured against the time that is really left:

* a recomputed microbatch's forward runs outside its own stretch, in another's idle (a round trip
  or a copy) or outside every stretch: forwards that could not start before the first backward
  (their arrivals, arrivals.py) take idle of stretches after it, or add their own time;
* before the first backward, offloads' forwards and copies out (one at a time, like every
  stretch) and the crossing stretch's first part share the time since the stage's first forward;
* when an activation beside another microbatch's weight gradient does not fit, every W runs
  outside the stretches; otherwise W's fill idle like those forwards;
* after the last backward's end only W's remain on the device: its own and those whose weight
  gradients were held beside its stretch's activation; the backward chain below the stage runs
  down to stage 0 meanwhile.

So makespan >= first backward + sum of the stretches after it + the work no idle could take + the
end, minimised over how many microbatches take each treatment, how many offloads copy out before
the first backward, which kind of stretch may cross it and how many W's follow the last backward:
a small integer program per choice of the last two (counts of microbatches are whole).
It binds on the half-memory devices of an uneven cluster, where every schedule recomputes most
microbatches (the forward-count head argument lets each forward hold only its checkpoint, free).
"""

from __future__ import annotations

import math

from ortools.linear_solver import pywraplp

from ..contract import Problem
from .arrivals import forward_arrivals
from .chunk_warmup import TIME_LIMIT_MS
from .pipeline import backward_chain, backward_ms, backward_tail, first_backward_start, forward_head, \
    one_stage_limited, round_trip, waiting_ws


def backward_stretches_bound(problem: Problem) -> float:
    """Max over one-stage devices holding one activation at a time of the program above."""
    arrivals = forward_arrivals(problem)
    best = 0.0
    for d, k in one_stage_limited(problem):
        if 2 * problem.stages[k].activation_mib > problem.free_mib(d) + 1e-9:
            best = max(best, _device(problem, d, k, arrivals[k]))
    return best


def _device(problem: Problem, d: int, k: int, arrivals: list[float]) -> float:
    s = problem.stages[k]
    opts = problem.options
    split = opts.split_backward
    m = problem.num_microbatches
    cap = problem.free_mib(d)
    f, b = s.forward_ms, backward_ms(problem, k)
    w = s.backward_weight_ms if split else 0.0
    off, rel, rec = s.offload_ms, s.reload_ms, s.recompute_ms  # the contract fills what was left out
    trip = round_trip(problem, k)
    first = first_backward_start(problem, k)
    chain = backward_chain(problem, k) if split else backward_tail(problem, k)
    early = sum(a < first - 1e-9 for a in arrivals)  # forwards that can start before the first backward
    w_alone = split and s.activation_mib + s.weight_grad_mib > cap + 1e-9  # a pending W beside an activation
    # per kind: (least stretch, idle inside it that others' light work may fill)
    kinds = {"keep": (f + trip + b, trip)}
    if opts.offload and s.offloadable_mib > 0:
        kinds["offload"] = (rel + b, rel)
    if opts.recompute and s.activation_mib - s.checkpoint_mib > 0:
        kinds["recompute"] = (rec + b, 0.0)
    # the W's pending at the last backward's end: its own, and those held through its whole stretch
    # beside the activation (none when w_alone)
    most_after = waiting_ws(problem, d, k)
    # One more W after the last backward saves at most w before it and costs w at the end once
    # after x w passes the chain: the best count is the knee of the chain or one past it.
    knee = max(1, min(most_after, math.floor(min(chain / w, most_after) + 1e-9))) if w > 0 else most_after
    after_choices = sorted({knee, min(most_after, knee + 1)}) if split else [0]
    head_room = first - forward_head(problem, k)
    best = math.inf
    for crossing in [None, *kinds, *(["copy_out"] if "offload" in kinds else [])]:
        for after in after_choices:
            rest = _program(kinds, crossing, after, m=m, f=f, b=b, w=w, off=off, early=early,
                            head_room=head_room, w_alone=w_alone)
            best = min(best, rest + max(chain, after * w))
    return first + best if best < math.inf else 0.0


def _program(kinds: dict[str, tuple[float, float]], crossing: str | None, after: int, *, m: int, f: float,
             b: float, w: float, off: float, early: int, head_room: float, w_alone: bool) -> float:
    """Least time from the first backward to the makespan with `crossing` the kind of the one stretch
    (or an offload's forward and copy out, "copy_out") that starts before it and ends after it (None:
    none does), and `after` W's after the last backward (module docstring)."""
    solver = pywraplp.Solver.CreateSolver("SCIP")
    if solver is None:  # pragma: no cover - SCIP ships with OR-Tools
        return math.inf
    solver.SetTimeLimit(TIME_LIMIT_MS)
    n = {kind: solver.IntVar(1.0 if kind == crossing else 0.0, m, kind) for kind in kinds}
    solver.Add(solver.Sum(n.values()) == m)
    # offloads whose forward and copy out lie wholly before the first backward, beside the part of
    # the crossing stretch (or copy out) before it: all in the head room, one at a time
    out_early = solver.IntVar(0.0, m, "out_early")
    out_late = n["offload"] - out_early if "offload" in n else 0.0
    if "offload" in n:
        solver.Add(out_late >= (1.0 if crossing == "copy_out" else 0.0))
    else:
        solver.Add(out_early == 0.0)
    reach = 0.0 if crossing is None else f + off if crossing == "copy_out" else kinds[crossing][0] - b
    before = solver.NumVar(0.0, reach, "before")
    solver.Add(out_early * (f + off) + before <= head_room)
    stretches = solver.Sum([n[kind] * kinds[kind][0] for kind in n]) + out_late * (f + off) - before
    # the crossing one's idle may lie before the first backward: none of it is counted
    idle = solver.Sum([(n[kind] - (1.0 if kind == crossing else 0.0)) * kinds[kind][1] for kind in n])
    idle += out_late * off - (off if crossing == "copy_out" else 0.0)
    ws_before = (m - after) * w
    light_forwards = solver.NumVar(0.0, solver.infinity(), "light_forwards")
    if "recompute" in n:  # recomputed forwards that no arrival let start before the first backward,
        # beside the forwards that did: the early offloads' and a crossing stretch's that starts with one
        starts_with_f = 1.0 if crossing in ("keep", "copy_out") else 0.0
        solver.Add(light_forwards >= f * (n["recompute"] - early + out_early + starts_with_f))
    unfilled = solver.NumVar(0.0, solver.infinity(), "unfilled")
    solver.Add(unfilled >= light_forwards + (0.0 if w_alone else ws_before) - idle)
    solver.Minimize(stretches + unfilled + (ws_before if w_alone else 0.0))
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return math.inf  # no schedule has such a crossing
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return 0.0  # unsolved: this choice proves nothing, so the argument keeps only its end
    # SCIP's proven bound (its optimum when it finishes), in floating point: step back by a hair so
    # rounding can never overstate the proof
    return solver.Objective().BestBound() * (1.0 - 1e-7)
