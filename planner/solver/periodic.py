"""Periodic steady states: a modulo schedule of one microbatch, repeated every C ms.

The middle of a memory-bound pipeline repeats, so instead of placing M x stages ops, place the ops
of one microbatch (F, B, W and, per stage, an optional OFFLOAD/RELOAD pair or RECOMPUTE) at absolute
times a_o, and run microbatch i's op o at a_o + i x C. A small CP-SAT model whose size does not
depend on M finds the a_o for a fixed cycle time C: the one-microbatch precedences of the contract,
each lane's ops disjoint modulo C (phase a_o - q_o x C in [0, C - duration), no op wraps), and each
device's memory: at each piece's start (a piece is what one microbatch holds between two of its ops),
every piece's count of microbatches holding it then is a floor difference, linear for a fixed C,
and their sum must fit the free memory. Warm-up and cool-down are the repetition's first and
last microbatches: fewer ops in flight, so every constraint still holds there.

The cycle time is searched upward from the busiest lane's work per microbatch; each feasible C's
repetition for M microbatches becomes per-lane orders (reloads gated on the compute op planned
just before them, so they do not run early and crowd memory), which the simulator re-times (ops
move earlier where the orders allow) and `baselines.common.evaluate` checks, prunes and times like
any heuristic's schedule; the caller validates the plan it keeps. Not a seed of `solve`: measured
there at 60 s it cost more search time than it gave (docs/optimizer.md, "Periodic steady states").
"""

from __future__ import annotations

import math
import time

from ortools.sat.python import cp_model

from ..contract import Problem
from ..ops import Kind, Op, duration
from ..simulator import DeviceOrder, Gate, Schedule

TICKS_PER_MS = 10  # model durations are rounded up to 0.1 ms: the simulator re-times with the true ones
FACTORS = (1.0, 1.1, 1.25, 1.4, 1.6, 2.0)  # cycle times tried, x the least (an infeasible one costs its try's time)
ORDER = {Kind.B: 0, Kind.BW: 0, Kind.W: 1, Kind.RECOMPUTE: 2, Kind.F: 3, Kind.OFFLOAD: 4, Kind.RELOAD: 5}


def _ticks(ms: float) -> int:
    return max(0, math.ceil(ms * TICKS_PER_MS - 1e-9))


def least_cycle_ms(problem: Problem) -> float:
    """No repetition is faster: every device runs each microbatch's compute once per cycle."""
    return max(problem.work_ms(d) for d in range(problem.num_devices))


class _Model:
    """The modulo model for one period (ticks) of `unroll` microbatches: microbatch q x unroll + r
    runs copy r's ops q periods later, so copies may take different modes (every other microbatch
    recomputed, say) where one copy would have to treat all of them alike."""

    def __init__(self, problem: Problem, period: int, unroll: int = 1):
        self.problem, self.cycle, self.unroll = problem, period, unroll
        opts = problem.options
        self.split = opts.split_backward
        m = cp_model.CpModel()
        self.model = m
        one = sum(_ticks(duration(problem, Op(kind, k, 0))) for k in range(problem.num_stages)
                  for kind in (Kind.F, Kind.B, Kind.W, Kind.RECOMPUTE, Kind.OFFLOAD, Kind.RELOAD))
        horizon = (one + _ticks(problem.p2p_ms) * 2 * problem.num_stages) * unroll \
            + period * (2 * problem.num_stages + 4)
        self.most = horizon // max(1, period) + 2  # periods any piece can span
        self.starts: dict[tuple[Kind, int, int], cp_model.IntVar] = {}
        self.present: dict[tuple[Kind, int, int], object] = {}
        lanes: dict[tuple[int, str], list] = {}
        self.off: dict[tuple[int, int], object] = {}
        self.rec: dict[tuple[int, int], object] = {}
        for r in range(unroll):
            for k, s in enumerate(problem.stages):
                kinds = [Kind.F] + ([Kind.B, Kind.W] if self.split else [Kind.BW])
                if math.isfinite(problem.limit_of(s.device)):
                    if opts.offload and (s.offload_ms or 0.0) > 0 and (s.offloadable_mib or 0.0) > 0:
                        self.off[(k, r)] = m.NewBoolVar("off")
                        kinds += [Kind.OFFLOAD, Kind.RELOAD]
                    if opts.recompute and s.activation_mib - s.checkpoint_mib > 0:
                        self.rec[(k, r)] = m.NewBoolVar("rec")
                        kinds.append(Kind.RECOMPUTE)
                    if (k, r) in self.off and (k, r) in self.rec:
                        m.AddBoolOr([self.off[(k, r)].Not(), self.rec[(k, r)].Not()])
                for kind in kinds:
                    dur = _ticks(duration(problem, Op(kind, k, 0)))
                    start = m.NewIntVar(0, horizon, "a")
                    q = m.NewIntVar(0, self.most, "q")
                    phase = m.NewIntVar(0, max(0, period - dur), "p")
                    m.Add(start == phase + period * q)
                    lit = (self.off[(k, r)] if kind in (Kind.OFFLOAD, Kind.RELOAD)
                           else self.rec[(k, r)] if kind is Kind.RECOMPUTE else None)
                    lane = "d2h" if kind is Kind.OFFLOAD else "h2d" if kind is Kind.RELOAD else "compute"
                    if lit is None:
                        iv = m.NewIntervalVar(phase, dur, phase + dur, "i")
                    else:
                        iv = m.NewOptionalIntervalVar(phase, dur, phase + dur, lit, "i")
                    lanes.setdefault((s.device, lane), []).append(iv)
                    self.starts[(kind, k, r)] = start
                    self.present[(kind, k, r)] = lit
        for ivs in lanes.values():
            m.AddNoOverlap(ivs)
        for r in range(1, unroll):  # copies enter in microbatch order (symmetry)
            m.Add(self.starts[(Kind.F, 0, r)] >= self.end(Kind.F, 0, r - 1))
        self._precedences()
        self._memory()
        ends = [self.end(*key) for key in self.starts if self.present[key] is None]
        self.latency = m.NewIntVar(0, 2 * horizon, "latency")
        m.AddMaxEquality(self.latency, ends)
        m.Minimize(self.latency)

    def end(self, kind: Kind, k: int, r: int):
        return self.starts[(kind, k, r)] + _ticks(duration(self.problem, Op(kind, k, 0)))

    def _after(self, later: tuple, earlier: tuple, lag: int = 0, lit=None) -> None:
        c = self.model.Add(self.starts[later] >= self.end(*earlier) + lag)
        if lit is not None:
            c.OnlyEnforceIf(lit)

    def _precedences(self) -> None:
        p = self.problem
        back = Kind.B if self.split else Kind.BW
        last = p.num_stages - 1
        for r in range(self.unroll):
            for k in range(p.num_stages):
                if k > 0:
                    self._after((Kind.F, k, r), (Kind.F, k - 1, r), _ticks(p.link_ms(k - 1, k)))
                self._after((back, k, r), (Kind.F, k, r))
                if k < last:
                    self._after((back, k, r), (back, k + 1, r), _ticks(p.link_ms(k + 1, k)))
                if self.split:
                    self._after((Kind.W, k, r), (Kind.B, k, r))
                if (k, r) in self.off:
                    lit = self.off[(k, r)]
                    self._after((Kind.OFFLOAD, k, r), (Kind.F, k, r), 0, lit)
                    self._after((Kind.RELOAD, k, r), (Kind.OFFLOAD, k, r), 0, lit)
                    self._after((back, k, r), (Kind.RELOAD, k, r), 0, lit)
                if (k, r) in self.rec:
                    lit = self.rec[(k, r)]
                    self._after((Kind.RECOMPUTE, k, r), (Kind.F, k, r), 0, lit)
                    self._after((back, k, r), (Kind.RECOMPUTE, k, r), 0, lit)

    def _pieces(self, d: int) -> list[tuple[int, object, object, object]]:
        """Device d's memory as pieces (MiB, start, end, literal or None): what one microbatch holds
        there from one op's start or end to another's, as the contract's deltas say."""
        p = self.problem
        back = Kind.B if self.split else Kind.BW
        out = []
        for r in range(self.unroll):
            for k in p.stages_of(d):
                s = p.stages[k]
                f_s, b_e = self.starts[(Kind.F, k, r)], self.end(back, k, r)
                grad = s.weight_grad_mib if self.split else 0.0
                off, rec = self.off.get((k, r)), self.rec.get((k, r))
                modes = [lit for lit in (off, rec) if lit is not None]
                plain = None
                if modes:
                    plain = self.model.NewBoolVar("plain")
                    self.model.Add(sum(modes) + plain == 1)
                out.append((s.activation_mib - grad, f_s, b_e, plain))
                w_e = self.end(Kind.W, k, r) if self.split else None
                if off is not None:
                    moved = min(s.offloadable_mib or 0.0, s.activation_mib)
                    off_e, rel_s = self.end(Kind.OFFLOAD, k, r), self.starts[(Kind.RELOAD, k, r)]
                    out.append((s.activation_mib - grad, f_s, off_e, off))
                    out.append((max(0.0, s.activation_mib - grad - moved), off_e, rel_s, off))
                    out.append((s.activation_mib - grad, rel_s, b_e, off))
                if rec is not None:
                    rec_s = self.starts[(Kind.RECOMPUTE, k, r)]
                    out.append((min(s.checkpoint_mib, s.activation_mib), f_s, rec_s, rec))
                    out.append((s.activation_mib - grad, rec_s, b_e, rec))
                    if grad > 0:
                        out.append((grad, rec_s, w_e, rec))
                        out.append((grad, f_s, w_e, rec.Not()))
                elif grad > 0:
                    out.append((grad, f_s, w_e, None))
                if self.split:
                    out.append((p.output_grad_of(k), self.starts[(Kind.B, k, r)], w_e, None))
        return [(math.ceil(a), st, en, lit) for a, st, en, lit in out if a > 0]

    def _memory(self) -> None:
        """A piece held L ticks is held by at most ceil(L / period) copies of it at once, so the sum
        of amount x ceil(L / period) over a device's pieces is never below its peak: it must fit.
        (The exact count at each piece's start, a floor difference per pair of pieces, is linear too,
        but CP-SAT then found no repetition in seconds where this finds one at once.)"""
        p, m = self.problem, self.model
        for d in range(p.num_devices):
            cap = p.free_mib(d)
            if not math.isfinite(cap):
                continue
            terms = []
            for amount, st, en, lit in self._pieces(d):
                n = m.NewIntVar(0, self.most, "n")
                held = m.Add(n * self.cycle >= en - st)
                if lit is not None:
                    held.OnlyEnforceIf(lit)
                terms.append(amount * n)
            m.Add(sum(terms) <= math.floor(cap))

    def solve(self, seconds: float, workers: int, seed: int) -> dict[tuple[Kind, int, int], int] | None:
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.05, seconds)
        solver.parameters.num_workers = max(1, workers)
        solver.parameters.random_seed = seed
        status = solver.Solve(self.model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return {key: solver.Value(v) for key, v in self.starts.items()
                if self.present[key] is None or solver.BooleanValue(self.present[key])}


def expand(problem: Problem, starts: dict[tuple[Kind, int, int], int], period: int, unroll: int) -> Schedule:
    """Microbatch q x unroll + r's op (kind, k) at copy r's start + q x period, as per-lane orders,
    reloads gated on the compute op planned last at or before them (earlier, the simulator's
    as-soon-as-possible reload would take room the plan gave to other microbatches' forwards)."""
    devices = [DeviceOrder() for _ in range(problem.num_devices)]
    planned: list[tuple[int, int, int, int, Op]] = []
    for (kind, k, r), a in starts.items():
        for i in range(r, problem.num_microbatches, unroll):
            planned.append((a + (i // unroll) * period, ORDER[kind], i, k, Op(kind, k, i)))
    planned.sort()
    gates = []
    last_compute: list[Op | None] = [None] * problem.num_devices
    for _, _, _, k, op in planned:
        d = problem.stages[k].device
        if op.kind is Kind.OFFLOAD:
            devices[d].d2h.append(op)
        elif op.kind is Kind.RELOAD:
            devices[d].h2d.append(op)
            if last_compute[d] is not None:
                gates.append(Gate(op, last_compute[d]))
        else:
            devices[d].compute.append(op)
            last_compute[d] = op
    return Schedule(devices, gates)


def periodic_outcome(problem: Problem, seconds: float = 10.0, workers: int = 1, seed: int = 0,
                     tries: int = 2, unroll: int = 1):
    """The best of the first `tries` feasible cycle times' repetitions (an Outcome), or None when no
    cycle time up to twice the least gives one that fits within `seconds`."""
    from ..baselines.common import DoesNotFit, better, evaluate
    from ..simulator import ScheduleError

    deadline = time.monotonic() + seconds
    base = _ticks(least_cycle_ms(problem))
    best, found = None, 0
    for factor in FACTORS:
        left = deadline - time.monotonic()
        if left <= 0.05 or found >= tries:
            break
        period = math.ceil(base * factor) * unroll
        starts = _Model(problem, period, unroll).solve(min(left, max(1.0, seconds / 4)), workers, seed)
        if starts is None:
            continue
        try:
            label = (f"cycle {period / TICKS_PER_MS:g} ms" if unroll == 1
                     else f"{unroll} microbatches per {period / TICKS_PER_MS:g} ms")
            out = evaluate(problem, expand(problem, starts, period, unroll), f"periodic ({label})")
        except (DoesNotFit, ScheduleError):
            continue
        found += 1
        best = better(best, out)
    return best
