"""OptPipe-style MILP (OR-Tools pywraplp with SCIP), kept for fidelity and comparison.

Continuous start times; one ordering binary per pair of ops on a device's compute lane that the
precedence closure (with the valid symmetry "stage 0 forwards in microbatch order") leaves
unordered; big-M disjunctions with the horizon as M; triangle (transitivity) cuts; memory checked at
every allocation event (a forward's or a reload's start) as a linear sum over the ordering binaries
and cross-lane indicator binaries; offload binaries with conditional copy-lane disjunctions; warm
start from the incumbent. Honest limits: recompute is not modelled (its plans never recompute, so
with that option it proves nothing), and it is meant for modest sizes — above MAX_LANE_OPS ops per
compute lane it declines and the caller keeps the incumbent. CP-SAT is the default engine.
"""

from __future__ import annotations

import itertools
import threading
import time

from ortools.linear_solver import pywraplp

from ..contract import Problem
from ..ops import Choice, Kind, Op, duration
from ..simulator import Timing, build_plan, schedule_from_plan, simulate
from ..validator import validate_plan
from .convert import plan_times, schedule_of
from .incumbent import Incumbent

MAX_LANE_OPS = 72
MAX_TRIANGLES = 20000


class MilpNotApplicable(ValueError):
    pass


def _ops(problem: Problem) -> list[Op]:
    split = problem.options.split_backward
    out = []
    for k in range(problem.num_stages):
        for i in range(problem.num_microbatches):
            out.append(Op(Kind.F, k, i))
            out += [Op(Kind.B, k, i), Op(Kind.W, k, i)] if split else [Op(Kind.BW, k, i)]
    return out


def _preds(problem: Problem, op: Op) -> list[tuple[Op, float]]:
    k, i, S = op.stage, op.mb, problem.num_stages
    bk = Kind.B if problem.options.split_backward else Kind.BW
    if op.kind is Kind.F:
        out = [(Op(Kind.F, k - 1, i), problem.link_ms(k - 1, k))] if k > 0 else []
        if k == 0 and i > 0:
            out.append((Op(Kind.F, 0, i - 1), 0.0))  # symmetry: valid, microbatches are interchangeable
        return out
    if op.kind in (Kind.B, Kind.BW):
        out = [(Op(Kind.F, k, i), 0.0)]
        if k + 1 < S:
            out.append((Op(bk, k + 1, i), problem.link_ms(k + 1, k)))
        return out
    return [(Op(Kind.B, k, i), 0.0)]


def _closure(ops: list[Op], preds: dict[Op, list[Op]]) -> dict[Op, int]:
    """Bitset of every op that must precede each op (ops are listed in a topological order)."""
    index = {op: n for n, op in enumerate(ops)}
    before: dict[Op, int] = {}
    for op in sorted(ops, key=_topo_key):
        bits = 0
        for p in preds[op]:
            bits |= before[p] | (1 << index[p])
        before[op] = bits
    return before


def _topo_key(op: Op):
    # F by (mb, stage) ascending, then backwards by (mb, -stage), W after its B: a topological order.
    if op.kind is Kind.F:
        return (0, op.mb, op.stage, 0)
    return (1, op.mb, -op.stage, 0 if op.kind in (Kind.B, Kind.BW) else 1)


def run(problem: Problem, inc: Incumbent, deadline: float, stop: threading.Event | None,
        notes: list[str]) -> tuple[float | None, bool]:
    """Solve with SCIP until the deadline; offer its plan; return (bound, proven optimal)."""
    try:
        return _run(problem, inc, deadline, stop, notes)
    except MilpNotApplicable as exc:
        notes.append(f"milp declined: {exc}")
        return None, False


def _run(problem, inc, deadline, stop, notes):
    ops = _ops(problem)
    lanes: dict[int, list[Op]] = {}
    for op in ops:
        lanes.setdefault(problem.stages[op.stage].device, []).append(op)
    biggest = max(len(v) for v in lanes.values())
    if biggest > MAX_LANE_OPS:
        raise MilpNotApplicable(f"{biggest} ops on one compute lane (limit {MAX_LANE_OPS})")
    solver = pywraplp.Solver.CreateSolver("SCIP")
    if solver is None:
        raise MilpNotApplicable("SCIP is not available in this OR-Tools build")
    horizon = inc.makespan if inc.plan is not None else sum(duration(problem, op) for op in ops) * 2
    preds = {op: [p for p, _ in _preds(problem, op)] for op in ops}
    s = {op: solver.NumVar(0.0, horizon, f"s_{op.kind.value}_{op.stage}_{op.mb}") for op in ops}
    dur = {op: duration(problem, op) for op in ops}
    cmax = solver.NumVar(0.0, horizon, "makespan")
    for op in ops:
        for p, lag in _preds(problem, op):
            solver.Add(s[op] >= s[p] + dur[p] + lag)
        solver.Add(cmax >= s[op] + dur[op])
    before = _closure(ops, preds)
    index = {op: n for n, op in enumerate(ops)}

    def ordered(a: Op, b: Op) -> bool:  # a must precede b
        return bool(before[b] >> index[a] & 1)

    y: dict[tuple[Op, Op], object] = {}  # y[(a, b)] = 1 when a runs before b (a listed first)
    for lane_ops in lanes.values():
        for a, b in itertools.combinations(lane_ops, 2):
            if ordered(a, b) or ordered(b, a):
                continue
            v = solver.BoolVar(f"y_{len(y)}")
            y[(a, b)] = v
            solver.Add(s[b] >= s[a] + dur[a] - horizon * (1 - v))
            solver.Add(s[a] >= s[b] + dur[b] - horizon * v)

    def prec(a: Op, b: Op):
        """1 when a precedes b on their lane: a constant or an ordering binary (expression)."""
        if ordered(a, b):
            return 1
        if ordered(b, a):
            return 0
        return y[(a, b)] if (a, b) in y else 1 - y[(b, a)]

    triangles = 0
    for lane_ops in lanes.values():
        free = [o for o in lane_ops]
        for a, b, c in itertools.combinations(free, 3):
            if triangles >= MAX_TRIANGLES:
                break
            pairs = [(a, b), (b, c), (a, c)]
            if not all((p in y) for p in pairs):
                continue
            solver.Add(y[(a, b)] + y[(b, c)] - y[(a, c)] <= 1)
            solver.Add(-y[(a, b)] - y[(b, c)] + y[(a, c)] <= 0)
            triangles += 2
    off = _offload_vars(problem, solver, lanes, s, dur, horizon)
    memory_rows = _memory_rows(problem, solver, lanes, s, dur, prec, off, horizon)
    solver.Minimize(cmax)
    _warm_start(problem, inc, solver, s, y, cmax, off)
    remaining = deadline - time.monotonic()
    if remaining <= 0.1:
        return None, False
    solver.SetTimeLimit(int(remaining * 1000))
    done = threading.Event()
    if stop is not None:
        def watch() -> None:
            while not done.is_set():
                if stop.wait(0.1):
                    solver.InterruptSolve()
                    return
        threading.Thread(target=watch, daemon=True).start()
    try:
        status = solver.Solve()
    finally:
        done.set()
    notes.append(f"milp (SCIP): {len(y)} ordering binaries, {triangles} triangle cuts, {memory_rows}"
                 f" memory rows, status {status}")
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None, False
    times = {op: (s[op].solution_value(), s[op].solution_value() + dur[op]) for op in ops}
    for (k, i), (x, so, sr) in off.items():
        if x.solution_value() > 0.5:
            st = problem.stages[k]
            times[Op(Kind.OFFLOAD, k, i)] = (so.solution_value(), so.solution_value() + st.offload_ms)
            times[Op(Kind.RELOAD, k, i)] = (sr.solution_value(), sr.solution_value() + st.reload_ms)
    _offer(problem, inc, times)
    bound = solver.Objective().BestBound()
    exact = not problem.options.recompute or not problem.limited_devices()
    proven = status == pywraplp.Solver.OPTIMAL and exact
    return (bound if exact else None), proven


def _offer(problem: Problem, inc: Incumbent, times: dict[Op, tuple[float, float]]) -> None:
    """Re-time the MILP's lane orders ASAP (its floats carry solver tolerance) and offer the plan."""
    t0 = min(a for a, _ in times.values())
    times = {op: (a - t0, b - t0) for op, (a, b) in times.items()}
    schedule = schedule_of(problem, times)
    offloaded = {(op.stage, op.mb) for op in times if op.kind is Kind.OFFLOAD}
    choices = {(op.stage, op.mb): Choice(problem.options.split_backward, (op.stage, op.mb) in offloaded)
               for op in times}
    exact = build_plan(problem, schedule, Timing(times, choices), "milp (scip)", inc.key)
    inc.offer(exact)
    try:  # ASAP by the MILP's orders, reloads kept behind the compute op they followed
        retimed = schedule_from_plan(exact)
        plan = build_plan(problem, retimed, simulate(problem, retimed), "milp (scip)", inc.key)
        if not validate_plan(problem, plan, inc.key):  # pulling an allocation earlier may not fit
            inc.offer(plan)
    except ValueError:
        pass


def _warm_start(problem: Problem, inc: Incumbent, solver, s, y, cmax, off) -> None:
    """Hint the incumbent (its offloads included) when it does not recompute."""
    if inc.plan is None:
        return
    try:
        times, choices = plan_times(inc.plan, problem.options.split_backward, problem)
    except ValueError:
        return
    if any(c.recompute or (c.offload and pair not in off) for pair, c in choices.items()):
        return
    variables, values = [cmax], [inc.makespan]
    for (k, i), (x, so, sr) in off.items():
        present = choices[(k, i)].offload
        variables += [x]
        values += [1.0 if present else 0.0]
        if present:
            variables += [so, sr]
            values += [times[Op(Kind.OFFLOAD, k, i)][0], times[Op(Kind.RELOAD, k, i)][0]]
    for op, var in s.items():
        variables.append(var)
        values.append(times[op][0])
    for (a, b), var in y.items():
        variables.append(var)
        values.append(1.0 if times[a][0] < times[b][0] else 0.0)
    solver.SetHint(variables, values)


EPS_MS = 1e-4  # an allocation counted as "after" an event starts at least this much later


def _offload_vars(problem: Problem, solver, lanes, s, dur, horizon) -> dict:
    """(presence, OFFLOAD start, RELOAD start) per offloadable pair on a device with a finite limit,
    with conditional precedences and big-M disjunctions on the two copy lanes."""
    off: dict[tuple[int, int], tuple] = {}
    if not problem.options.offload:
        return off
    big = 2 * horizon + 1
    for d, lane_ops in lanes.items():
        if problem.limit_of(d) == float("inf"):
            continue
        mine = []
        for op in lane_ops:
            st = problem.stages[op.stage]
            if op.kind is not Kind.F or (st.offloadable_mib or 0.0) <= 0:
                continue
            k, i = op.stage, op.mb
            x = solver.BoolVar(f"x_{k}_{i}")
            so = solver.NumVar(0.0, horizon, f"so_{k}_{i}")
            sr = solver.NumVar(0.0, horizon, f"sr_{k}_{i}")
            back = Op(Kind.B if problem.options.split_backward else Kind.BW, k, i)
            solver.Add(so >= s[op] + dur[op] - big * (1 - x))
            solver.Add(sr >= so + st.offload_ms - big * (1 - x))
            solver.Add(s[back] >= sr + st.reload_ms - big * (1 - x))
            off[(k, i)] = (x, so, sr)
            mine.append((k, i))
        for n, p in enumerate(mine):
            for q in mine[n + 1:]:
                xp, xq = off[p][0], off[q][0]
                for idx, length in ((1, "offload_ms"), (2, "reload_ms")):
                    a, b = off[p][idx], off[q][idx]
                    da, db = getattr(problem.stages[p[0]], length), getattr(problem.stages[q[0]], length)
                    z = solver.BoolVar("")
                    solver.Add(b >= a + da - big * (1 - z) - big * (2 - xp - xq))
                    solver.Add(a >= b + db - big * z - big * (2 - xp - xq))
    return off


def _memory_rows(problem: Problem, solver, lanes, s, dur, prec, off, horizon) -> int:
    """Memory at every allocation event (forward starts, reload starts) as a linear sum: same-lane
    order from the ordering binaries, across lanes from indicator binaries that may only under-count
    frees and over-count allocations (each tied to the times by one big-M row)."""
    big = 2 * horizon + 1
    split = problem.options.split_backward
    rows = 0

    def freed(end, at, present=None):
        u = solver.BoolVar("")
        solver.Add(end <= at + big * (1 - u))
        if present is not None:
            solver.Add(u <= present)
        return u

    def allocated(start, at, present=None):
        v = solver.BoolVar("")
        slack = 0 if present is None else big * (1 - present)
        solver.Add(start >= at + EPS_MS - big * v - slack)
        return v

    for d, lane_ops in lanes.items():
        cap = problem.free_mib(d)
        if cap == float("inf"):
            continue
        pairs = sorted({(o.stage, o.mb) for o in lane_ops})
        total = sum(problem.stages[k].activation_mib + (problem.stages[k].offloadable_mib or 0.0)
                    + problem.output_grad_of(k) for k, _ in pairs)
        events = [(Op(Kind.F, k, i), None) for k, i in pairs] + [(None, p) for p in pairs if p in off]
        for fwd, rel in events:
            at = s[fwd] if fwd is not None else off[rel][2]
            terms = []
            for k, i in pairs:
                st = problem.stages[k]
                # B's output gradients counted from F (only F and RELOAD starts are checked), so the
                # rows may only over-count: a + o_g on [F, B), g + o_g on [B, W)
                o_g = problem.output_grad_of(k) if split else 0.0
                a, g = st.activation_mib + o_g, (st.weight_grad_mib + o_g if split else 0.0)
                f_op = Op(Kind.F, k, i)
                b_op = Op(Kind.B if split else Kind.BW, k, i)
                if fwd is not None:
                    terms.append(a * (1 if f_op == fwd else prec(f_op, fwd)))
                    terms.append(-(a - g) * prec(b_op, fwd))
                    if split and g:
                        terms.append(-g * prec(Op(Kind.W, k, i), fwd))
                else:
                    terms.append(a * allocated(s[f_op], at))
                    terms.append(-(a - g) * freed(s[b_op] + dur[b_op], at))
                    if split and g:
                        w_op = Op(Kind.W, k, i)
                        terms.append(-g * freed(s[w_op] + dur[w_op], at))
                if (k, i) in off:
                    x, so, sr = off[(k, i)]
                    o = st.offloadable_mib or 0.0
                    terms.append(-o * freed(so + st.offload_ms, at, x))
                    if rel == (k, i):
                        terms.append(o * x)
                    else:
                        terms.append(o * allocated(sr, at, x))
            slack = 0 if rel is None else total * (1 - off[rel][0])
            solver.Add(solver.Sum(terms) <= cap + slack)
            rows += 1
    return rows
