"""An event-driven list scheduler: the one engine behind ZB-H1, ZB-H2, ZB-V and the greedy scheduler.

Each device's compute lane, when free, picks among its ready ops by a fixed priority (`_Engine.rules`):
a backward (or the recompute that precedes it) first, because it frees memory and unblocks the stage
below; a W that has waited too long; then a forward, if the stage's in-flight cap and the device's
memory admit it; then a W to fill the bubble. Weight-gradient passes therefore drift into idle time,
which is exactly the zero-bubble idea; the in-flight cap reproduces the ZB-H1 (1F1B's warm-up) and
ZB-H2 (twice that) patterns, and the memory cap makes it the memory-aware greedy. Offloaded
activations are copied out right after their forward and copied back, gated on the backward `lead`
stages up the chain so the copy is hidden yet starts late (with `reload_in_turn`, also not before an
earlier microbatch's backward there). EngineConfig groups the settings by what they decide: forwards,
W's and memory. The engine only decides orders and gates; `simulate` re-times them and the caller
checks memory on that timing, so a mistake here can cost speed but never validity.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..contract import Problem, Stage
from ..ops import Choice, Kind, Op, duration, memory_delta
from ..simulator import DeviceOrder, Gate, Schedule, Timing
from .common import TOL

Treat = Callable[[int, int], str | None]


@dataclass(frozen=True)
class ForwardPolicy:
    """When a forward may start. `cap[k]`: most forwards of stage k whose backward has not started
    (None = no count cap)."""

    cap: Sequence[int] | None = None
    late_first: bool = False  # among a device's stages, run the later stage's F first (V shape)
    # With several stages per device, an earlier stage's forward runs only while that stage is fewer
    # than pace[d] microbatches ahead of the device's last stage: otherwise early-chunk forwards fill
    # the device and crowd out the last chunk's when they come round.
    pace: Sequence[int] | None = None
    # Hold a forward back for an op known to arrive while it would run: the first backward of each of
    # the device's stages (it decides when memory starts coming back) and, with `await_later_forward`,
    # a later chunk's forward (the turn of a V). Only arrivals whose predecessor has been placed count.
    await_first_backward: bool = False
    await_later_forward: bool = False


@dataclass(frozen=True)
class WPolicy:
    """When a weight gradient (W) runs: by default only to fill gaps."""

    lag: Sequence[int] | None = None  # a W jumps ahead of forwards once stage k has this many pending
    tail: Sequence[int] | None = None  # with lag: the last tail[k] W's of stage k only fill gaps
    # Off the busiest device a W waits for a backward known to arrive before it would end: one started
    # just before would delay that backward's whole chain, and there the wait costs nothing.
    yields: bool = False


@dataclass(frozen=True)
class MemoryPolicy:
    """What a device's memory admits. `limits[d]`: memory device d may use, static included (None =
    ignore memory); `treat(k, i)`: "offload", "recompute" or None for the activation of (k, i)."""

    limits: Sequence[float] | None = None
    treat: Treat | None = None
    chunk_reserve: bool = True  # a forward leaves room for the same microbatch's later chunk
    # A reload also waits until the previous offloaded microbatch's backward of its stage has started
    # (or the one its copy's span back, `_turn_of`): reloads come back in the order backwards use
    # them instead of queueing early on a slow link, each holding memory the forwards need.
    reload_in_turn: bool = False
    # An offloaded forward needs room for one reload only once the copies under way have freed theirs
    # (`_forward_fits`): eager forwards, without which a forward waits for its predecessor's copy.
    reserve_after_copies: bool = False
    # Once the last stage's next forward has a known arrival, its device keeps room for that forward
    # and its backward, so a recompute or reload started just before cannot hold the LM head up.
    hold_last: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings, grouped by what they decide. `fixed`: a compute order (F, B and W ops;
    a recompute is added before its backward) for some devices, which then run exactly that order,
    each op once it is ready and fits: a pattern no priority rule finds."""

    split: bool
    forwards: ForwardPolicy = ForwardPolicy()
    weights: WPolicy = WPolicy()
    memory: MemoryPolicy = MemoryPolicy()
    fixed: dict[int, list[Op]] | None = None


BUSIEST_SHARE = 0.99  # with WPolicy.yields, devices with this share of the most work or more never wait


class _Failed(Exception):
    pass


def run_engine(problem: Problem, cfg: EngineConfig, give_up_after: float = math.inf) -> Schedule | None:
    """Schedule every op; None when the engine blocks (memory it cannot free), so callers fall back,
    or once it starts an op after `give_up_after` (ms): a caller that would drop any schedule whose
    own timing ends later need not wait for the rest."""
    try:
        return _Engine(problem, cfg).run(give_up_after)
    except _Failed:
        return None


class _Engine:
    def __init__(self, problem: Problem, cfg: EngineConfig):
        self.p = problem
        self.cfg = cfg
        self.S = problem.num_stages
        self.M = problem.num_microbatches
        self.split = cfg.split and problem.options.split_backward
        self.dev_of = [s.device for s in problem.stages]
        self.stages_on = [problem.stages_of(d) for d in range(problem.num_devices)]
        if cfg.forwards.late_first:
            self.f_order = [sorted(st, reverse=True) for st in self.stages_on]
        else:
            self.f_order = self.stages_on
        self.nf = [0] * self.S
        self.nb = [0] * self.S
        self.nw = [0] * self.S
        self.times: dict[Op, tuple[float, float]] = {}
        self.choice: dict[tuple[int, int], Choice] = {}
        D = problem.num_devices
        self.lane_free = [0.0] * D
        self.d2h_free = [0.0] * D
        self.h2d_free = [0.0] * D
        self.orders = [DeviceOrder() for _ in range(D)]
        self.gates: list[Gate] = []
        self.mem_on = cfg.memory.limits is not None
        self.cap_mem = list(cfg.memory.limits or [math.inf] * D)
        self.level = [problem.devices[d].static_mib for d in range(D)]
        self.future: list[list[tuple[float, int, float, Op]]] = [[] for _ in range(D)]
        self.last_free: list[Op | None] = [None] * D
        self.pending_restore: list[dict[tuple[int, int], float]] = [{} for _ in range(D)]
        # (reload, the backward up the chain that triggers it, the in-turn backward it also waits for)
        self.pending_reload: list[list[tuple[Op, Op, Op | None]]] = [[] for _ in range(D)]
        self.recompute_ready: dict[tuple[int, int], float] = {}
        self.trigger: dict[tuple[int, int], list[int]] = {}
        self.lead = [self._lead(k) for k in range(self.S)]
        # how many microbatches of its device's work a stage's reload spans, at least 1
        self.reload_span = [max(1, math.ceil(s.reload_ms / problem.work_ms(s.device) - 1e-9))
                            for s in problem.stages]
        self.wake: set[int] = set()
        top = max(problem.work_ms(x) for x in range(D))  # devices whose W's yield (WPolicy.yields)
        self.yielding = {x for x in range(D)
                         if cfg.weights.yields and problem.work_ms(x) < BUSIEST_SHARE * top}
        self.fixed_at = {d: 0 for d in (cfg.fixed or {})}  # next op of each fixed order
        # the choice rule, highest priority first (see `_choose`)
        self.rules = (self._backward, self._recompute, self._overdue_w, self._forward, self._gap_w)
        # room a forward of stage k must leave so the same microbatch can still run its forward on
        # the device's later stages (else a V / looped device can fill up with early-chunk work)
        self.later_act = [max((problem.stages[j].activation_mib for j in self.stages_on[self.dev_of[k]]
                               if j > k), default=0.0) for k in range(self.S)]

    # -- helpers ---------------------------------------------------------------------------------
    def _bwd(self, k: int, i: int) -> Op:
        return Op(Kind.B if self.split else Kind.BW, k, i)

    def _lead(self, k: int) -> int:
        """The stage whose backward start triggers (k)'s reload: far enough up to hide the copy."""
        need = self.p.stages[k].reload_ms
        acc = 0.0
        for j in range(k + 1, self.S):
            s = self.p.stages[j]
            acc += (self.p.link_ms(j, j - 1) + s.backward_input_ms
                    + (0.0 if self.split else s.backward_weight_ms))
            if acc >= need - TOL:
                return j
        return self.S - 1 if k + 1 < self.S else k

    def _fold(self, d: int, t: float) -> None:
        fut = self.future[d]
        if not fut:
            return
        keep = []
        for ev in fut:
            if ev[0] <= t + TOL:
                self.level[d] += ev[2]
                if ev[2] < 0:
                    self.last_free[d] = ev[3]
            else:
                keep.append(ev)
        self.future[d] = keep

    def _peak_from(self, d: int, s: float, held: bool = True) -> float:
        """Highest known level at or after time s (events at s included), with the room `hold_last`
        keeps unless `held` is False."""
        level = self.level[d]
        later = []
        events = self.future[d]
        if held and self.cfg.memory.hold_last:  # no list copy on the common path
            events = events + self._held(d, s)
        for ev in events:
            if ev[0] <= s + TOL:
                level += ev[2]
            else:
                later.append(ev)
        peak = level
        later.sort(key=lambda e: (e[0], e[1]))
        for ev in later:
            level += ev[2]
            peak = max(peak, level)
        return peak

    def _held(self, d: int, s: float) -> list[tuple[float, int, float, Op]]:
        """`hold_last`'s room on device d as memory events: the last stage's next forward from its
        arrival (or s, if that has passed) to its backward's end; none before the arrival is known,
        nor on a device with a fixed order (the order says when the head runs)."""
        z = self.S - 1
        if self.dev_of[z] != d or d in self.fixed_at:
            return []
        r = self._ready_f(z)
        if r is None:
            return []
        st = self.p.stages[z]
        op = Op(Kind.F, z, self.nf[z])
        amount = self._forward_mib(z, self._choice_of(z, op.mb))
        start = max(r, s)
        return [(start, 1, amount, op), (start + st.forward_ms + st.backward_input_ms, 0, -amount, op)]

    def _next_free_time(self, d: int, t: float) -> float:
        return min((ev[0] for ev in self.future[d] if ev[2] < 0 and ev[0] > t + TOL), default=math.inf)

    def _forward_mib(self, k: int, ch: Choice) -> float:
        """What a forward of stage k holds from its start, as the engine counts it: its activation
        (its checkpoint if recomputed) and its B's output gradients, counted from F rather than from
        B's start so that a B, which is never held back for memory, never needs room nobody kept."""
        s = self.p.stages[k]
        return (s.checkpoint_mib if ch.recompute else s.activation_mib) + self._output_grad(k)

    def _output_grad(self, k: int) -> float:
        return self.p.output_grad_of(k) if self.split else 0.0

    def _add_mem(self, d: int, op: Op, start: float, end: float) -> None:
        if not self.mem_on:
            return
        delta = memory_delta(self.p, op, self.choice[(op.stage, op.mb)])
        if op.kind in (Kind.F, Kind.B):  # B's output gradients from F (see _forward_mib)
            moved = self._output_grad(op.stage) * (1 if op.kind is Kind.F else -1)
            delta = delta._replace(at_start=delta.at_start + moved)
        if delta.at_start:
            self.future[d].append((start, 1, delta.at_start, op))
        if delta.at_end:
            self.future[d].append((end, 0, delta.at_end, op))

    def _under_cap(self, d: int, level: float) -> bool:
        return level <= self.cap_mem[d] + TOL * max(1.0, self.cap_mem[d])

    def _fits(self, d: int, s: float, amount: float, reserve: float = 0.0, held: bool = True) -> bool:
        return not self.mem_on or self._under_cap(d, self._peak_from(d, s, held) + amount + reserve)

    def _forward_fits(self, d: int, t: float, s: Stage, ch: Choice, alloc: float, reserve: float,
                      held: bool = True) -> bool:
        """Room for a forward now, and for the reserve (one restore) too. With `reserve_after_copies`
        an offloaded forward needs the reserve only once the copies under way, its own included,
        have freed their memory: a reload comes later than that, and the copies always finish."""
        if not (self.cfg.memory.reserve_after_copies and ch.offload):
            return self._fits(d, t, alloc, reserve, held)
        if not self._fits(d, t, alloc, held=held):
            return False
        settled = self.level[d] + sum(ev[2] for ev in self.future[d]) + alloc - s.offloadable_mib
        return self._under_cap(d, settled + reserve)

    def _dep_ready(self, op: Op, lag: float) -> float | None:
        t = self.times.get(op)
        return None if t is None else t[1] + lag

    # -- readiness of the next candidates --------------------------------------------------------
    def _ready_f(self, k: int) -> float | None:
        i = self.nf[k]
        if i >= self.M:
            return None
        if k == 0:
            return 0.0
        return self._dep_ready(Op(Kind.F, k - 1, i), self.p.link_ms(k - 1, k))

    def _ready_b(self, k: int) -> float | None:
        i = self.nb[k]
        if i >= self.nf[k]:
            return None
        r = self.times[Op(Kind.F, k, i)][1]
        if k + 1 < self.S:
            up = self._dep_ready(self._bwd(k + 1, i), self.p.link_ms(k + 1, k))
            if up is None:
                return None
            r = max(r, up)
        ch = self.choice[(k, i)]
        if ch.offload:
            rl = self._dep_ready(Op(Kind.RELOAD, k, i), 0.0)
            if rl is None:
                return None
            r = max(r, rl)
        if ch.recompute:
            rc = self._dep_ready(Op(Kind.RECOMPUTE, k, i), 0.0)
            if rc is None:
                return None
            r = max(r, rc)
        return r

    def _ready_w(self, k: int) -> float | None:
        if not self.split or self.nw[k] >= self.nb[k]:
            return None
        return self.times[Op(Kind.B, k, self.nw[k])][1]

    def _ready_recompute(self, k: int) -> float | None:
        """When the recompute before stage k's next backward may start (its trigger fired and its
        forward ended); None when it has no recompute, it has run, or its trigger has not fired."""
        i = self.nb[k]
        if i >= self.nf[k] or (k, i) not in self.recompute_ready or Op(Kind.RECOMPUTE, k, i) in self.times:
            return None
        return max(self.recompute_ready[(k, i)], self.times[Op(Kind.F, k, i)][1])

    def _recompute_mib(self, k: int) -> float:
        s = self.p.stages[k]
        return s.activation_mib - s.checkpoint_mib

    def _choice_of(self, k: int, i: int) -> Choice:
        """(k, i)'s treatment, decided when its forward is first considered."""
        if (k, i) not in self.choice:
            self.choice[(k, i)] = self._decide(k, i)
        return self.choice[(k, i)]

    # -- scheduling ------------------------------------------------------------------------------
    def _start_backward(self, d: int, k: int, t: float) -> None:
        i = self.nb[k]
        op = self._bwd(k, i)
        self._place(d, op, t)
        self.nb[k] += 1
        self.pending_restore[d].pop((k, i), None)
        self._fire(k, i, op)

    def _start_recompute(self, d: int, k: int, t: float) -> None:
        i = self.nb[k]
        self.pending_restore[d].pop((k, i), None)
        self._place(d, Op(Kind.RECOMPUTE, k, i), t)

    def _start_w(self, d: int, k: int, t: float) -> None:
        self._place(d, Op(Kind.W, k, self.nw[k]), t)
        self.nw[k] += 1

    def _place(self, d: int, op: Op, start: float) -> float:
        k = op.stage
        if op.kind is Kind.F and k + 1 < self.S:
            self.wake.add(self.dev_of[k + 1])
        elif op.kind in (Kind.B, Kind.BW) and k > 0:
            self.wake.add(self.dev_of[k - 1])
        end = start + duration(self.p, op)
        self.times[op] = (start, end)
        self.orders[d].compute.append(op)
        self.lane_free[d] = end
        self._add_mem(d, op, start, end)
        return end

    def _start_forward(self, d: int, k: int, t: float, gate_on: Op | None) -> None:
        i = self.nf[k]
        op = Op(Kind.F, k, i)
        if gate_on is not None:
            self.gates.append(Gate(op, gate_on, at_end=True))
        self._place(d, op, t)
        self.nf[k] += 1
        s = self.p.stages[k]
        ch = self.choice[(k, i)]
        end = self.times[op][1]
        if ch.offload:
            off = Op(Kind.OFFLOAD, k, i)
            start = max(end, self.d2h_free[d])
            self.times[off] = (start, start + s.offload_ms)
            self.d2h_free[d] = start + s.offload_ms
            self.orders[d].d2h.append(off)
            self._add_mem(d, off, start, start + s.offload_ms)
            self.pending_restore[d][(k, i)] = s.offloadable_mib
            self.trigger.setdefault((self.lead[k], i), []).append(k)
        elif ch.recompute:
            self.pending_restore[d][(k, i)] = s.activation_mib - s.checkpoint_mib
            if k + 1 < self.S:
                self.trigger.setdefault((k + 1, i), []).append(k)
            else:
                self.recompute_ready[(k, i)] = end
        if k + 1 == self.S:
            self._fire(k, i, op)

    def _fire(self, j: int, i: int, trig: Op) -> None:
        """`trig` (stage j's backward, or the last stage's forward) of microbatch i started: start the
        restores it leads."""
        for k in self.trigger.pop((j, i), []):
            d = self.dev_of[k]
            self.wake.add(d)
            ch = self.choice[(k, i)]
            if ch.offload:
                self.pending_reload[d].append((Op(Kind.RELOAD, k, i), trig, self._turn_of(k, i)))
            else:
                self.recompute_ready[(k, i)] = self.times[trig][0]
                self.gates.append(Gate(Op(Kind.RECOMPUTE, k, i), trig, at_end=False))

    def _turn_of(self, k: int, i: int) -> Op | None:
        """With `reload_in_turn`, the backward reload (k, i) also waits for: the stage's previous
        offloaded microbatch's, or the one `reload_span` microbatches back if that is later (None:
        none). With every microbatch offloaded, or a copy no longer than a microbatch's work on the
        device, that is the previous microbatch's. Every earlier forward of the stage has run by the
        time the reload is queued, so their choices are known."""
        if not self.cfg.memory.reload_in_turn:
            return None
        floor = max(i - self.reload_span[k], -1)
        j = i - 1
        while j > floor and not self.choice[(k, j)].offload:
            j -= 1
        return self._bwd(k, j) if j >= 0 else None

    def _reload_gate(self, trig: Op, turn: Op | None) -> Op | None:
        """The op whose start gates a reload: `trig`, or `turn` when it starts later (None: `turn`
        has not started yet)."""
        if turn is None:
            return trig
        if turn not in self.times:
            return None
        return turn if self.times[turn][0] > self.times[trig][0] else trig

    def _next_reload(self, queue: list[tuple[Op, Op, Op | None]]) -> tuple[int, Op, Op] | None:
        """(position, reload, gating op) of the first queued reload whose turn has come: one waiting
        for its stage's previous backward must not hold up another stage's on a device with several."""
        for n, (rl, trig, turn) in enumerate(queue):
            gate = self._reload_gate(trig, turn)
            if gate is not None:
                return n, rl, gate
        return None

    def _issue_reloads(self, d: int, now: float) -> None:
        queue = self.pending_reload[d]
        while (turn := self._next_reload(queue)) is not None:
            n, rl, trig = turn
            off = self.times[Op(Kind.OFFLOAD, rl.stage, rl.mb)]
            start = max(self.h2d_free[d], off[1], self.times[trig][0])
            if self.mem_on and self.cfg.memory.reserve_after_copies:
                # Eager forwards fill memory to the brim, so ASAP re-timing breaks limits and the
                # engine's own timing must be exact: no reload checked at a past time, whose level
                # is folded away. (Held forwards leave slack, and checking in the past there is
                # faster: docs/research/heuristics.md.)
                start = max(start, now)
            amount = self.p.stages[rl.stage].offloadable_mib
            gate_free = None
            if not self._fits(d, start, amount):
                start = max(start, now)
                if not self._fits(d, start, amount):
                    return
                gate_free = self.last_free[d]
            queue.pop(n)
            self.gates.append(Gate(rl, trig, at_end=False))
            if gate_free is not None:
                self.gates.append(Gate(rl, gate_free, at_end=True))
            dur = self.p.stages[rl.stage].reload_ms
            self.times[rl] = (start, start + dur)
            self.h2d_free[d] = start + dur
            self.orders[d].h2d.append(rl)
            self._add_mem(d, rl, start, start + dur)
            self.pending_restore[d].pop((rl.stage, rl.mb), None)

    def _tail(self, k: int) -> int:
        return self.cfg.weights.tail[k] if self.cfg.weights.tail is not None else self.M

    def _choose(self, d: int, t: float) -> tuple[float, bool]:
        """Start one op on device d at time t if any is ready; else return the next time to look.
        The rules of `self.rules` in turn: the first that starts an op, or holds the lane for an
        arrival, decides; each one that does neither may name a time worth looking again."""
        if d in self.fixed_at:
            return self._choose_fixed(d, t)
        nxt = math.inf
        for rule in self.rules:
            nxt, started = rule(d, t, nxt)
            if started is not None:
                return nxt, started
        if self.mem_on:
            nxt = min(nxt, self._next_free_time(d, t))
        return nxt, False

    # -- the choice rules, in priority order (self.rules): each returns (time, started), started None
    # when it leaves the choice to the next rule (time: the earliest it knows of to look again) ------
    def _backward(self, d: int, t: float, nxt: float) -> tuple[float, bool | None]:
        """A ready backward, most advanced microbatch first (lowest mb, then latest stage): it frees
        memory and unblocks the stage below."""
        best = None
        for k in self.stages_on[d]:
            r = self._ready_b(k)
            if r is None:
                continue
            if r <= t + TOL:
                key = (self.nb[k], -k)
                if best is None or key < best[0]:
                    best = (key, k)
            else:
                nxt = min(nxt, r)
        if best is not None:
            self._start_backward(d, best[1], t)
            return t, True
        return nxt, None

    def _recompute(self, d: int, t: float, nxt: float) -> tuple[float, bool | None]:
        """The recompute of a backward that is on its way, if it fits."""
        for k in self.stages_on[d]:
            r = self._ready_recompute(k)
            if r is None:
                continue
            if r > t + TOL:
                nxt = min(nxt, r)
                continue
            if self._fits(d, t, self._recompute_mib(k)):
                self._start_recompute(d, k, t)
                return t, True
        return nxt, None

    def _overdue_w(self, d: int, t: float, nxt: float) -> tuple[float, bool | None]:
        """A W that has waited long enough (WPolicy.lag): bounds the memory W-deferral holds."""
        lag = self.cfg.weights.lag
        if lag is not None:
            for k in self.stages_on[d]:
                r = self._ready_w(k)
                if r is not None and r <= t + TOL and (self.nb[k] - self.nw[k] >= lag[k]
                                                       or self.nw[k] < self.M - self._tail(k)):
                    self._start_w(d, k, t)
                    return t, True
        return nxt, None

    def _forward(self, d: int, t: float, nxt: float) -> tuple[float, bool | None]:
        """A forward within its stage's cap and pace and the device's memory (keeping room for one
        restore), unless an urgent arrival should go first (ForwardPolicy.await_*)."""
        for k in self.f_order[d]:
            r = self._ready_f(k)
            if r is None:
                continue
            if self._capped(k) or self._paced(d, k):
                continue
            if r > t + TOL:
                nxt = min(nxt, r)
                continue
            ch = self._choice_of(k, self.nf[k])
            s = self.p.stages[k]
            alloc = self._forward_mib(k, ch)
            # The last stage's forward needs no reserve: its own B follows with no restore in between,
            # so its memory always comes back (reserving one there can deadlock a device that barely
            # fits the LM head's activation).
            reserve = 0.0 if k == self.S - 1 else (
                max(self.pending_restore[d].values(), default=0.0)
                + (self.later_act[k] if self.cfg.memory.chunk_reserve else 0.0))
            if not self._forward_fits(d, t, s, ch, alloc, reserve, held=k != self.S - 1):
                continue
            urgent = self._urgent_arrival(d, k, t, t + s.forward_ms)
            if urgent is not None:
                return min(nxt, urgent), False
            self._start_forward(d, k, t, self.last_free[d] if self.mem_on else None)
            return t, True
        return nxt, None

    def _gap_w(self, d: int, t: float, nxt: float) -> tuple[float, bool | None]:
        """A W to fill the gap (the zero-bubble idea), unless it should yield to an arriving
        backward (WPolicy.yields)."""
        for k in self.stages_on[d]:
            r = self._ready_w(k)
            if r is None:
                continue
            if r <= t + TOL:
                if d in self.yielding:
                    arrival = self._next_backward_arrival(d, t)
                    if arrival < t + self.p.stages[k].backward_weight_ms - TOL:
                        return arrival, False
                self._start_w(d, k, t)
                return t, True
            nxt = min(nxt, r)
        return nxt, None

    def _next_backward_arrival(self, d: int, t: float) -> float:
        """The earliest known arrival after t of a backward on device d (inf: none known)."""
        arrivals = (self._ready_b(k) for k in self.stages_on[d])
        return min((r for r in arrivals if r is not None and r > t + TOL), default=math.inf)

    def _choose_fixed(self, d: int, t: float) -> tuple[float, bool]:
        """`_choose` for a device with a fixed order: its next op (after its recompute, if it has one)
        once ready and fitting; else the next time to look."""
        order = self.cfg.fixed[d]  # type: ignore[index]
        n = self.fixed_at[d]
        if n == len(order):
            return math.inf, False
        op = order[n]
        k, i = op.stage, op.mb
        done = self.nf if op.kind is Kind.F else self.nw if op.kind is Kind.W else self.nb
        if done[k] != i:
            raise _Failed(f"fixed order on device {d}: {op} out of turn")
        recompute_first = op.kind in (Kind.B, Kind.BW) and self._ready_recompute(k) is not None
        if op.kind is Kind.F:
            r = self._ready_f(k)
            amount = self._forward_mib(k, self._choice_of(k, i))
        elif op.kind is Kind.W:
            r, amount = self._ready_w(k), 0.0
        elif recompute_first:
            r, amount = self._ready_recompute(k), self._recompute_mib(k)
        else:
            r, amount = self._ready_b(k), 0.0
        wait = self._next_free_time(d, t) if self.mem_on else math.inf
        if r is None or r > t + TOL:
            return min(wait, r if r is not None else math.inf), False
        if not self._fits(d, t, amount):
            return wait, False
        if op.kind is Kind.F:
            self._start_forward(d, k, t, self.last_free[d] if self.mem_on else None)
        elif op.kind is Kind.W:
            self._start_w(d, k, t)
        elif recompute_first:
            self._start_recompute(d, k, t)
            return t, True  # the backward is still next
        else:
            self._start_backward(d, k, t)
        self.fixed_at[d] = n + 1
        return t, True

    def _urgent_arrival(self, d: int, k: int, t: float, until: float) -> float | None:
        """When a forward of stage k started at t would still run: the earliest known arrival in (t,
        until) of an op to wait for instead (ForwardPolicy.await_*), else None."""
        cfg = self.cfg.forwards
        if not (cfg.await_first_backward or cfg.await_later_forward):
            return None
        arrivals = []
        for j in self.stages_on[d]:
            if cfg.await_first_backward and self.nb[j] == 0:
                arrivals.append(self._ready_b(j))
            if cfg.await_later_forward and j > k and not self._capped(j):
                arrivals.append(self._ready_f(j))
        return min((r for r in arrivals if r is not None and t + TOL < r < until - TOL), default=None)

    def _capped(self, k: int) -> bool:
        """Has stage k as many forwards in flight as its cap allows?"""
        cap = self.cfg.forwards.cap
        return cap is not None and self.nf[k] - self.nb[k] >= cap[k]

    def _paced(self, d: int, k: int) -> bool:
        """Is stage k, an earlier stage of device d, as far ahead of d's last stage as its pace allows?"""
        last = self.stages_on[d][-1]
        pace = self.cfg.forwards.pace
        return pace is not None and k != last and self.nf[k] - self.nf[last] >= pace[d]

    def _decide(self, k: int, i: int) -> Choice:
        treat = self.cfg.memory.treat
        how = treat(k, i) if treat else None
        opts = self.p.options
        return Choice(split=self.split, offload=how == "offload" and opts.offload,
                      recompute=how == "recompute" and opts.recompute)

    def run(self, give_up_after: float = math.inf) -> Schedule:
        D = self.p.num_devices
        heap = [(0.0, d) for d in range(D)]
        heapq.heapify(heap)
        sleeping: set[int] = set()
        total = self.S * self.M
        done_devices = 0
        while heap:
            t, d = heapq.heappop(heap)
            if t < self.lane_free[d] - TOL:
                heapq.heappush(heap, (self.lane_free[d], d))
                continue
            if self.mem_on:
                self._fold(d, t)
            self._issue_reloads(d, t)
            when, started = self._choose(d, t)
            if started and t > give_up_after:
                raise _Failed(f"an op starts at {t:.1f} ms, after {give_up_after:.1f}")
            if started:
                heapq.heappush(heap, (self.lane_free[d], d))
                for other in self.wake:
                    if other in sleeping:
                        sleeping.discard(other)
                        heapq.heappush(heap, (max(t, self.lane_free[other]), other))
                self.wake.clear()
                continue
            if all(self.nw[k] == self.M if self.split else self.nb[k] == self.M for k in self.stages_on[d]):
                done_devices += 1
                continue
            if math.isfinite(when):
                heapq.heappush(heap, (when, d))
            else:
                sleeping.add(d)
        finished = sum(self.nw[k] if self.split else self.nb[k] for k in range(self.S))
        if finished < total:
            raise _Failed(f"engine blocked with {total - finished} backwards left")
        schedule = Schedule(self.orders, self.gates)
        # The engine's own timing, which its memory checks used: ASAP re-timing of the same orders
        # and gates is never later (callers may skip simulating a variant already slower than a plan
        # they hold), but may start an op before memory the engine waited for is free; then this
        # timing stands.
        schedule.engine_timing = Timing(dict(self.times), dict(self.choice))  # type: ignore[attr-defined]
        return schedule
