"""The CP-SAT model of a problem (docs/formats.md; intervals, no-overlap per lane, cumulative memory:
docs/optimizer.md).

Per (stage k, microbatch i): F, the backward (B then W when splitting is allowed, else BW), and,
where the options and a finite memory limit allow, an optional OFFLOAD/RELOAD pair or an optional
RECOMPUTE, chosen by literals. When splitting is allowed every backward is split: B followed at once
by W has BW's timing and frees memory no later, so BW never helps the makespan.

Memory is a cumulative over *live* intervals (never the reservoir constraint, which presolve expands
into tens of thousands of Booleans): the activation held by (k, i) is cut into pieces, each a
non-negative amount held from one op's start to another's end, with one set of pieces per mode
(plain, offloaded, recomputed) made optional on that mode's literal. The pieces sum exactly to the
contract's memory deltas (see `_pieces`).

When something follows the pipeline (planner.iteration: each stage's gradient reduction after its
last W, on its device's reduce lane, then the device's optimizer step), the objective is the makespan
first and the iteration second: among plans of one makespan, the one whose stages finish their
weight gradients in time for their reductions to hide behind later compute wins (docs/decisions.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from ortools.sat.python import cp_model

from ..contract import Problem
from ..iteration import has_tail
from ..ops import Choice, Kind, Op
from ..validator import TOLERANCE
from .scaling import Scale


@dataclass
class PairVars:
    """Variables of one (stage, microbatch)."""

    f: cp_model.IntVar
    b: cp_model.IntVar
    w: cp_model.IntVar | None = None
    off: cp_model.IntVar | None = None
    o: cp_model.IntVar | None = None
    r: cp_model.IntVar | None = None
    rc: cp_model.IntVar | None = None
    c: cp_model.IntVar | None = None
    plain: object = None  # literal of "neither offloaded nor recomputed" (or None: always plain)
    sizes: list[tuple[cp_model.IntVar, object, object]] = field(default_factory=list)  # (size, start, end)
    fixed: Choice | None = None  # the mode, when the model was built with it fixed (no literals)

    def mode(self, boolean) -> tuple[bool, bool]:
        """(offloaded, recomputed) in a solution (`boolean`: a solver's or callback's reader)."""
        if self.fixed is not None:
            return self.fixed.offload, self.fixed.recompute
        return (self.off is not None and bool(boolean(self.off)),
                self.rc is not None and bool(boolean(self.rc)))


@dataclass(frozen=True)
class ModelOptions:
    fifo: bool = False  # every stage runs F, B and W in microbatch order (a restriction, no proof)
    offload: bool = True
    recompute: bool = True
    compress: bool = False  # secondary objective: every start as early as possible (LNS only)
    tail: bool = True  # secondary objective: the iteration, when something follows the pipeline


class CpsatModel:
    """Builds the model; `hint`, `fix_outside` and `read` speak in ops and integer ticks.

    `fixed`: pairs whose mode a large-neighbourhood step keeps. They get only that mode's variables
    and intervals, no literals: fixing the literals afterwards left presolve to delete the other
    modes' thousands of optional intervals, half of a step's overhead (DeepSeek-like V at 70%:
    0.6 s of a 1.0-s presolve)."""

    def __init__(self, problem: Problem, scale: Scale, horizon: int, lower: int = 0,
                 options: ModelOptions | None = None, fixed: dict[tuple[int, int], Choice] | None = None):
        options = options or ModelOptions()
        self.p = problem
        self.sc = scale
        self.h = horizon
        self.opt = options
        self.model = cp_model.CpModel()
        self.split = problem.options.split_backward
        S, M = problem.num_stages, problem.num_microbatches
        st = problem.stages
        t = scale.t
        self.dF = [t(s.forward_ms) for s in st]
        self.dB = [t(s.backward_input_ms) if self.split else t(s.backward_input_ms + s.backward_weight_ms)
                   for s in st]
        self.dW = [t(s.backward_weight_ms) for s in st]
        self.dO = [t(s.offload_ms or 0.0) for s in st]
        self.dR = [t(s.reload_ms or 0.0) for s in st]
        self.dC = [t(s.recompute_ms or 0.0) for s in st]
        self.link = [t(problem.link_ms(k, k + 1)) for k in range(S - 1)]
        finite = [problem.limit_of(d) != float("inf") for d in range(problem.num_devices)]
        self.finite = finite
        self.can_off = [problem.options.offload and options.offload and finite[s.device]
                        and (s.offloadable_mib or 0.0) > 0 for s in st]
        self.can_rc = [problem.options.recompute and options.recompute and finite[s.device]
                       and s.checkpoint_mib < s.activation_mib for s in st]
        self.v: dict[tuple[int, int], PairVars] = {}
        self.lanes: dict[tuple[int, str], list] = {}
        self.mem: dict[int, list[tuple[object, int]]] = {d: [] for d in range(problem.num_devices)}
        self.edges: list[tuple[int, int, int]] = []  # (before, lag, after) variable indices
        m = self.model
        fixed = fixed or {}
        for k in range(S):
            for i in range(M):
                self._pair(k, i, fixed.get((k, i)))
        for k in range(S):
            for i in range(M):
                pv = self.v[(k, i)]
                if k > 0:
                    self._precede(self.v[(k - 1, i)].f, self.dF[k - 1] + self.link[k - 1], pv.f)
                if k + 1 < S:
                    self._precede(self.v[(k + 1, i)].b, self.dB[k + 1] + self.link[k], pv.b)
        for lane_ivs in self.lanes.values():
            m.add_no_overlap(lane_ivs)
        for d, pieces in self.mem.items():
            if not finite[d] or not pieces:
                continue
            # half the validator's tolerance more: memory rounds to the nearest unit, so a plan that
            # fills a device exactly (as the lean greedy seeds do) can sum a few units over the
            # rounded cap and be refused as the hint (docs/optimizer.md); what the slack lets
            # through, the validator still judges
            cap = scale.m(problem.free_mib(d) + TOLERANCE / 2 * max(1.0, problem.limit_of(d)))
            m.add_cumulative([iv for iv, _ in pieces], [dem for _, dem in pieces], max(0, cap))
        # Symmetry: microbatches are interchangeable, so stage 0's forwards may be taken in order.
        for i in range(M - 1):
            self._precede(self.v[(0, i)].f, self.dF[0], self.v[(0, i + 1)].f)
        if options.fifo:
            for k in range(S):
                for i in range(M - 1):
                    a, b = self.v[(k, i)], self.v[(k, i + 1)]
                    self._precede(a.f, self.dF[k], b.f)
                    self._precede(a.b, self.dB[k], b.b)
                    if self.split:
                        self._precede(a.w, self.dW[k], b.w)
        self.makespan = m.new_int_var(max(0, lower), horizon, "makespan")
        for (k, _), pv in self.v.items():
            last, length = (pv.w, self.dW[k]) if self.split else (pv.b, self.dB[k])
            self._precede(last, length, self.makespan)
        self.dRed = [t(problem.reduce_of(k)) for k in range(S)]
        self.dOpt = [t(problem.optimizer_of(d)) for d in range(problem.num_devices)]
        latest = horizon + sum(self.dRed) + max(self.dOpt)  # no iteration ends later
        self.iteration = (self._tail(latest) if options.tail and has_tail(problem) and not options.compress
                          else None)
        self.weight = 1  # the makespan's coefficient in the objective
        if options.compress:
            starts = [pv.b for pv in self.v.values()] + ([pv.w for pv in self.v.values()] if self.split else [])
            self.weight = len(starts) * horizon + 1
            m.minimize(self.makespan * self.weight + sum(starts))
        elif self.iteration is not None:  # lexicographic: one tick of makespan outweighs any iteration
            self.weight = latest + 1
            m.minimize(self.makespan * self.weight + self.iteration)
        else:
            m.minimize(self.makespan)

    def makespan_bound(self, objective_bound: float) -> int:
        """The makespan bound (ticks) that a proven objective bound implies."""
        return int(objective_bound // self.weight)

    def _tail(self, top: int) -> cp_model.IntVar:
        """The iteration's end: per stage, its reduction (an interval on the device's reduce lane)
        after its last W; per device, the optimizer step after its last op and its last reduction."""
        m, p = self.model, self.p
        self.ready: dict[int, cp_model.IntVar] = {}
        self.reduce_at: dict[int, cp_model.IntVar] = {}
        self.done = [m.new_int_var(0, self.h, f"done{d}") for d in range(p.num_devices)]
        iteration = m.new_int_var(0, top, "iteration")
        lanes: dict[int, list] = {}
        for k in range(p.num_stages):
            d = p.stages[k].device
            ready = m.new_int_var(0, self.h, f"ready{k}")
            for i in range(p.num_microbatches):
                pv = self.v[(k, i)]
                last, length = (pv.w, self.dW[k]) if self.split else (pv.b, self.dB[k])
                m.add(ready >= last + length)
            m.add(self.done[d] >= ready)
            self.ready[k] = ready
            if self.dRed[k] > 0:
                at = m.new_int_var(0, top, f"reduce{k}")
                m.add(at >= ready)
                lanes.setdefault(d, []).append(m.new_fixed_size_interval_var(at, self.dRed[k], f"R{k}"))
                m.add(iteration >= at + self.dRed[k] + self.dOpt[d])
                self.reduce_at[k] = at
        for d in range(p.num_devices):
            m.add(iteration >= self.done[d] + self.dOpt[d])
        for ivs in lanes.values():
            m.add_no_overlap(ivs)
        return iteration

    # -- construction ------------------------------------------------------------------------------
    def _precede(self, before: cp_model.IntVar, lag: int, after: cp_model.IntVar) -> None:
        """after >= before + lag, kept as an edge for `tighten`."""
        self.model.add(after >= before + lag)
        self.edges.append((before.index, lag, after.index))

    def _lane(self, d: int, lane: str, iv) -> None:
        self.lanes.setdefault((d, lane), []).append(iv)

    def _pair(self, k: int, i: int, fixed: Choice | None = None) -> None:
        m, h = self.model, self.h
        d = self.p.stages[k].device
        name = f"{k}_{i}"
        if fixed is not None and ((fixed.offload and not self.can_off[k])
                                  or (fixed.recompute and not self.can_rc[k])):
            fixed = None  # a mode the model does not offer: the pair stays free (its hint is refused)
        f = m.new_int_var(0, h, f"f{name}")
        b = m.new_int_var(0, h, f"b{name}")
        pv = PairVars(f=f, b=b, fixed=fixed)
        self.v[(k, i)] = pv
        self._lane(d, "c", m.new_fixed_size_interval_var(f, self.dF[k], f"F{name}"))
        self._lane(d, "c", m.new_fixed_size_interval_var(b, self.dB[k], f"B{name}"))
        self._precede(f, self.dF[k], b)
        if self.split:
            pv.w = m.new_int_var(0, h, f"w{name}")
            self._lane(d, "c", m.new_fixed_size_interval_var(pv.w, self.dW[k], f"W{name}"))
            self._precede(b, self.dB[k], pv.w)
        self._modes(k, name, pv)
        if self.finite[d]:
            self._memory(k, i, pv)

    def _modes(self, k: int, name: str, pv: PairVars) -> None:
        """The copy pair and the recompute the pair may take, each on its own literal (at most one
        of them); for a kept mode (`pv.fixed`) only that one, always present."""
        m, h, d = self.model, self.h, self.p.stages[k].device
        fixed, f, b = pv.fixed, pv.f, pv.b
        if self.can_off[k] and (fixed is None or fixed.offload):
            pv.off = m.new_bool_var(f"off{name}") if fixed is None else None
            pv.o = m.new_int_var(0, h, f"o{name}")
            pv.r = m.new_int_var(0, h, f"r{name}")
            self._lane(d, "d2h", self._interval(pv.o, self.dO[k], pv.off, f"O{name}"))
            self._lane(d, "h2d", self._interval(pv.r, self.dR[k], pv.off, f"R{name}"))
            self._precede(f, self.dF[k], pv.o)
            self._precede(pv.o, self.dO[k], pv.r)
            if pv.off is None:
                self._precede(pv.r, self.dR[k], b)
            else:
                m.add(b >= pv.r + self.dR[k]).only_enforce_if(pv.off)
                m.add(pv.o == f + self.dF[k]).only_enforce_if(~pv.off)
                m.add(pv.r == pv.o + self.dO[k]).only_enforce_if(~pv.off)
        if self.can_rc[k] and (fixed is None or fixed.recompute):
            pv.rc = m.new_bool_var(f"rc{name}") if fixed is None else None
            pv.c = m.new_int_var(0, h, f"c{name}")
            self._lane(d, "c", self._interval(pv.c, self.dC[k], pv.rc, f"C{name}"))
            self._precede(f, self.dF[k], pv.c)
            if pv.rc is None:
                self._precede(pv.c, self.dC[k], b)
            else:
                m.add(b >= pv.c + self.dC[k]).only_enforce_if(pv.rc)
                m.add(pv.c == f + self.dF[k]).only_enforce_if(~pv.rc)
        literals = [lit for lit in (pv.off, pv.rc) if lit is not None]
        if len(literals) == 2:
            pv.plain = m.new_bool_var(f"plain{name}")
            m.add(pv.plain + pv.off + pv.rc == 1)
        elif len(literals) == 1:
            pv.plain = ~literals[0]

    def _interval(self, start: cp_model.IntVar, size: int, present, name: str):
        """A fixed-size interval, optional on `present` unless that is None."""
        if present is None:
            return self.model.new_fixed_size_interval_var(start, size, name)
        return self.model.new_optional_fixed_size_interval_var(start, size, present, name)

    def _pieces(self, k: int, pv: PairVars) -> list[tuple[object, object, int, object]]:
        """(start, end, demand, presence) pieces whose sum is (k, i)'s live activation memory.

        Level over time, per mode (a = activation, g = weight-grad part, o = offloadable, c = checkpoint;
        bend/wend = ends of B and W): plain a on [F, bend), g on [bend, wend); offloaded as plain but
        a - o on [OFFLOAD end, RELOAD start); recomputed c on [F, RECOMPUTE start), then as plain. In
        every mode, B's output gradients on [B start, wend).
        """
        s = self.p.stages[k]
        sm = self.sc.m
        a, g = sm(s.activation_mib), sm(s.weight_grad_mib) if self.split else 0
        f = (pv.f, 0)
        bend = (pv.b, self.dB[k])
        wend = (pv.w, self.dW[k]) if self.split else bend
        modes = _presence(pv)
        out = []
        if "plain" in modes:
            lit = modes["plain"]
            out += [(f, bend, a - g, lit), (f, wend, g, lit)]
        if "offload" in modes:
            lit = modes["offload"]
            r = a - sm(s.offloadable_mib or 0.0)
            lo, oend, rs = min(r, g), (pv.o, self.dO[k]), (pv.r, 0)
            out += [(f, wend, lo, lit), (f, bend, r - lo, lit),
                    (f, oend, g - lo, lit), (rs, wend, g - lo, lit),
                    (f, oend, a - max(r, g), lit), (rs, bend, a - max(r, g), lit)]
        if "recompute" in modes:
            lit = modes["recompute"]
            c = sm(s.checkpoint_mib)
            lo, cs = min(c, g), (pv.c, 0)
            out += [(f, wend, lo, lit), (f, bend, c - lo, lit),
                    (cs, wend, g - lo, lit), (cs, bend, a - max(c, g), lit)]
        if self.split:
            out.append(((pv.b, 0), wend, sm(self.p.output_grad_of(k)), None))
        return [p for p in out if p[2] > 0]

    def _memory(self, k: int, i: int, pv: PairVars) -> None:
        m, d = self.model, self.p.stages[k].device
        for n, (start, end, demand, lit) in enumerate(self._pieces(k, pv)):
            size = m.new_int_var(0, self.h, f"m{k}_{i}_{n}")
            s_expr, e_expr = start[0] + start[1], end[0] + end[1]
            if lit is None:
                iv = m.new_interval_var(s_expr, size, e_expr, f"L{k}_{i}_{n}")
            else:
                iv = m.new_optional_interval_var(s_expr, size, e_expr, lit, f"L{k}_{i}_{n}")
            pv.sizes.append((size, start, end))
            self.mem[d].append((iv, demand))

    # -- hints, neighbourhoods, solutions -----------------------------------------------------------
    def start_vars(self, k: int, i: int) -> dict[Kind, cp_model.IntVar]:
        pv = self.v[(k, i)]
        out = {Kind.F: pv.f, (Kind.B if self.split else Kind.BW): pv.b}
        if self.split:
            out[Kind.W] = pv.w
        if pv.o is not None:
            out[Kind.OFFLOAD], out[Kind.RELOAD] = pv.o, pv.r
        if pv.c is not None:
            out[Kind.RECOMPUTE] = pv.c
        return out

    def assignment(self, starts: dict[Op, int], choices: dict[tuple[int, int], Choice]) -> dict | None:
        """Complete variable values for integer `starts` (None when the op set does not fit the model)."""
        vals: dict = {}
        for (k, i), pv in self.v.items():
            ch = choices[(k, i)]
            if pv.fixed is not None:
                if (ch.offload, ch.recompute) != (pv.fixed.offload, pv.fixed.recompute):
                    return None
            elif (ch.offload and pv.off is None) or (ch.recompute and pv.rc is None):
                return None
            vals[pv.f] = starts[Op(Kind.F, k, i)]
            vals[pv.b] = starts[Op(Kind.B if self.split else Kind.BW, k, i)]
            if self.split:
                vals[pv.w] = starts[Op(Kind.W, k, i)]
            if pv.off is not None:
                vals[pv.off] = int(ch.offload)
            if pv.o is not None:
                vals[pv.o] = starts[Op(Kind.OFFLOAD, k, i)] if ch.offload else vals[pv.f] + self.dF[k]
                vals[pv.r] = starts[Op(Kind.RELOAD, k, i)] if ch.offload else vals[pv.o] + self.dO[k]
            if pv.rc is not None:
                vals[pv.rc] = int(ch.recompute)
            if pv.c is not None:
                vals[pv.c] = starts[Op(Kind.RECOMPUTE, k, i)] if ch.recompute else vals[pv.f] + self.dF[k]
            if pv.plain is not None and isinstance(pv.plain, cp_model.IntVar):
                vals[pv.plain] = int(not ch.offload and not ch.recompute)
            for size, start, end in pv.sizes:
                vals[size] = max(0, _eval(end, vals) - _eval(start, vals))
        vals[self.makespan] = max(vals[pv.w] + self.dW[k] if self.split else vals[pv.b] + self.dB[k]
                                  for (k, _), pv in self.v.items())
        if self.iteration is not None:
            self._tail_values(vals)
        return vals

    def _tail_values(self, vals: dict) -> None:
        """The tail's variables for given op starts: reductions in the order their stages get ready
        (the earliest end of one lane's jobs with release times), as planner.iteration times them."""
        p, end = self.p, 0
        for k, ready in self.ready.items():
            vals[ready] = max(vals[pv.w] + self.dW[k] if self.split else vals[pv.b] + self.dB[k]
                              for pv in (self.v[(k, i)] for i in range(p.num_microbatches)))
        for d in range(p.num_devices):
            stages = sorted(p.stages_of(d), key=lambda k: (vals[self.ready[k]], k))
            vals[self.done[d]] = max((vals[self.ready[k]] for k in stages), default=0)
            lane = 0
            for k in stages:
                if k in self.reduce_at:
                    vals[self.reduce_at[k]] = max(lane, vals[self.ready[k]])
                    lane = vals[self.reduce_at[k]] + self.dRed[k]
                    end = max(end, lane + self.dOpt[d])
            end = max(end, vals[self.done[d]] + self.dOpt[d])
        vals[self.iteration] = end

    def hint(self, vals: dict) -> None:
        self.model.clear_hints()
        for var, value in vals.items():
            self.model.add_hint(var, int(value))

    def fix_outside(self, free: set[tuple[int, int]], starts: dict[Op, int], free_ops: set[Op] | None = None,
                    fix_before: int | None = None) -> None:
        """Large-neighbourhood step (the pairs outside `free` keep their modes through the
        constructor's `fixed`): ops keep, per lane, their relative order (only their times move)
        unless free: every op of a free pair, or with `free_ops`, just those ops (plus the copies and
        recomputes of free pairs). Fixed ops that start before `fix_before` keep their exact start
        (they cannot help; fewer variables move)."""
        lanes: dict[tuple[int, str], list[tuple[int, object, int]]] = {}
        optional = (Kind.OFFLOAD, Kind.RELOAD, Kind.RECOMPUTE)
        for op, s in starts.items():
            pair_free = (op.stage, op.mb) in free
            if (free_ops is None and pair_free) or (free_ops is not None and (
                    op in free_ops or (pair_free and op.kind in optional))):
                continue
            var = self.start_vars(op.stage, op.mb)[op.kind]
            if fix_before is not None and s < fix_before:
                domain = self.model.proto.variables[var.index].domain
                domain[0], domain[1] = s, s  # tighten reads it from there
            lane = "d2h" if op.kind is Kind.OFFLOAD else "h2d" if op.kind is Kind.RELOAD else "c"
            lanes.setdefault((self.p.stages[op.stage].device, lane), []).append((s, var, self._dur(op)))
        for seq in lanes.values():
            seq.sort(key=lambda x: x[0])
            for (_, va, da), (_, vb, _) in pairwise(seq):
                self._precede(va, da, vb)

    def tighten(self) -> bool:
        """Narrow every start to [earliest, latest] along the model's precedences (longest paths
        from each start's lower bound, a pinned one included, and back from the horizon). Presolve
        finds the same bounds, but one propagation loop at a time along the lane chains a step
        keeps: 216 loops, 0.6 s of a DeepSeek-like V step's 1-s presolve. False (nothing changed)
        if a window is empty."""
        domains = self.model.proto.variables
        nodes = {u for a, _, b in self.edges for u in (a, b)}
        succ: dict[int, list[tuple[int, int]]] = {u: [] for u in nodes}
        pending = dict.fromkeys(nodes, 0)
        for a, lag, b in self.edges:
            succ[a].append((b, lag))
            pending[b] += 1
        early = {u: domains[u].domain[0] for u in nodes}
        late = {u: domains[u].domain[1] for u in nodes}
        order = [u for u in nodes if not pending[u]]
        for u in order:  # Kahn's topological order, grown while walked
            for v, lag in succ[u]:
                early[v] = max(early[v], early[u] + lag)
                pending[v] -= 1
                if not pending[v]:
                    order.append(v)
        if len(order) < len(nodes):
            return False  # a cycle: the kept orders contradict the precedences
        for u in reversed(order):
            for v, lag in succ[u]:
                late[u] = min(late[u], late[v] - lag)
        if any(early[u] > late[u] for u in nodes):
            return False
        for u in nodes:
            domain = domains[u].domain
            domain[0], domain[1] = early[u], late[u]  # every start is one interval [0, horizon]
        return True

    def _dur(self, op: Op) -> int:
        k = op.stage
        return {Kind.F: self.dF, Kind.B: self.dB, Kind.BW: self.dB, Kind.W: self.dW, Kind.OFFLOAD: self.dO,
                Kind.RELOAD: self.dR, Kind.RECOMPUTE: self.dC}[op.kind][k]

    def read(self, value, boolean) -> tuple[dict[Op, int], dict[tuple[int, int], Choice]]:
        """Integer op starts and choices from a solution (`value`/`boolean`: a solver or callback)."""
        starts: dict[Op, int] = {}
        choices: dict[tuple[int, int], Choice] = {}
        for (k, i), pv in self.v.items():
            off, rc = pv.mode(boolean)
            choices[(k, i)] = Choice(self.split, off, rc)
            starts[Op(Kind.F, k, i)] = value(pv.f)
            starts[Op(Kind.B if self.split else Kind.BW, k, i)] = value(pv.b)
            if self.split:
                starts[Op(Kind.W, k, i)] = value(pv.w)
            if off:
                starts[Op(Kind.OFFLOAD, k, i)] = value(pv.o)
                starts[Op(Kind.RELOAD, k, i)] = value(pv.r)
            if rc:
                starts[Op(Kind.RECOMPUTE, k, i)] = value(pv.c)
        return starts, choices


def _presence(pv: PairVars) -> dict[str, object]:
    """The modes a pair may take, each with its presence literal (None: always present)."""
    if pv.fixed is not None:
        return {"offload" if pv.fixed.offload else "recompute" if pv.fixed.recompute else "plain": None}
    modes = {"plain": pv.plain}
    if pv.off is not None:
        modes["offload"] = pv.off
    if pv.rc is not None:
        modes["recompute"] = pv.rc
    return modes


def _eval(term: tuple, vals: dict) -> int:
    """Value of a (var, offset) pair under `vals`."""
    return int(vals[term[0]]) + term[1]
