"""Which activations a greedy attempt offloads or recomputes: its treatment.

A treatment is a typed record; its label (shown in `Plan.method`) is derived from it, never parsed.
Whole-stage treatments reduce every microbatch of the stages that need it; the fractional ones only
the share of each stage's microbatches that a steady-state memory estimate asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..bounds.pipeline import first_backward_start, forward_head, round_trip
from ..contract import Problem
from .engine import Treat


class Reduce(Enum):
    """What a treatment does to the activations, by its label."""

    NOTHING = ""
    FRACTIONAL = "fractional"  # offload, then recompute, the share memory needs
    CROWDED = "offload, crowded recompute"  # recompute the crowded stages, offload the rest
    OFFLOAD = "offload"  # every activation that waits longer than its copies
    RECOMPUTE = "recompute"  # every activation whose recompute frees memory


@dataclass(frozen=True)
class Treatment:
    """`treat(k, i)` gives "offload", "recompute" or None for (stage, microbatch); `eager`: offloaded
    forwards start once the copies under way will leave room for a reload
    (MemoryPolicy.reserve_after_copies); `slack`: the fractional estimate's share of free memory."""

    reduce: Reduce
    treat: Treat | None = None
    eager: bool = False
    slack: float | None = None

    @property
    def label(self) -> str:
        what = f"fractional {self.slack:g}" if self.reduce is Reduce.FRACTIONAL else self.reduce.value
        return what + (", eager" if self.eager else "")


PLAIN = Treatment(Reduce.NOTHING)
# Shares of free memory the fractional estimate may fill: it ignores warm-up and queueing, so the
# whole of it (1.0) never won; docs/research/heuristics.md has the rows each one won.
FRACTIONAL_SLACKS = (0.4, 0.6, 0.8)


def crowded(problem: Problem, k: int) -> bool:
    """Can stage k's whole activation never sit beside a later stage's on its device? Then every
    microbatch of k is reduced (the later stage runs between its forward and backward), and an
    offloaded one holds its activation through both copies, which must fit between the later stage's
    holdings; a recompute holds it only from the recompute to the backward."""
    s = problem.stages[k]
    d = s.device
    free = problem.free_mib(d)
    return any(s.activation_mib + problem.stages[j].activation_mib > free
               for j in problem.stages_of(d) if j > k)


def stage_treat(problem: Problem, reduce: Reduce) -> Treat | None:
    """Whole-stage treatment: every stage but the last whose activation waits longer than its copies,
    twice over (OFFLOAD), or whose recompute frees memory (RECOMPUTE); CROWDED recomputes the crowded
    stages (`crowded`) and offloads the rest. None when no stage qualifies."""
    opts = problem.options
    chosen: dict[int, str] = {}
    for k in range(problem.num_stages - 1):
        s = problem.stages[k]
        wait = 2 * round_trip(problem, k)
        can_off = opts.offload and s.offloadable_mib > 0 and s.offload_ms + s.reload_ms < wait
        can_rec = opts.recompute and s.activation_mib - s.checkpoint_mib > 0
        if reduce is Reduce.CROWDED and can_rec and crowded(problem, k):
            chosen[k] = "recompute"
        elif reduce in (Reduce.OFFLOAD, Reduce.CROWDED) and can_off:
            chosen[k] = "offload"
        elif reduce is Reduce.RECOMPUTE and can_rec:
            chosen[k] = "recompute"
    if not chosen:
        return None
    return lambda k, i: chosen.get(k)


def fractional_treat(problem: Problem, slack: float) -> Treat | None:
    """Offload (then recompute) just the share of each stage's activations that memory needs.

    A steady-state estimate: with one microbatch per period T (the busiest device's work per
    microbatch), a stage's activations occupy memory x time at a rate that must stay within its share
    of the device's free memory (times `slack`, for the warm-up and queueing the estimate ignores).
    Offloading a microbatch shortens its hold to the copies around its forward and backward;
    recomputing, to the recompute and backward. The offloaded share is capped by the copy lane's
    throughput (a saturated slow link holds memory in its queue), and shares are spread evenly over
    microbatches.
    """
    opts = problem.options
    if not (opts.offload or opts.recompute):
        return None
    period = steady_period(problem)
    chosen: dict[tuple[int, int], str] = {}
    for k in range(problem.num_stages - 1):
        s = problem.stages[k]
        d = s.device
        budget = slack * period * problem.free_mib(d) / problem.chunks
        to_b = first_backward_start(problem, k) - forward_head(problem, k) + s.backward_input_ms
        rest = (s.weight_grad_mib + problem.output_grad_of(k)) * s.backward_weight_ms
        resident = s.activation_mib * to_b + rest
        need = resident - budget
        share_off = share_rec = 0.0
        if need > 0 and opts.offload and s.offloadable_mib > 0:
            off = ((s.activation_mib - s.offloadable_mib) * to_b + rest
                   + s.offloadable_mib * (s.forward_ms + s.offload_ms + s.reload_ms + s.backward_input_ms))
            lane = period / (problem.chunks * max(s.offload_ms, s.reload_ms, 1e-9))
            if off < resident:
                share_off = min(1.0, lane, need / (resident - off))
                need -= share_off * (resident - off)
        if need > 0 and opts.recompute:
            rec = (s.checkpoint_mib * to_b + (s.activation_mib - s.checkpoint_mib)
                   * (s.recompute_ms + s.backward_input_ms) + rest)
            if rec < resident:
                share_rec = min(1.0 - share_off, need / (resident - rec))
                need -= share_rec * (resident - rec)
            if need > 0 and share_off > 0 and rec < off:  # every offload is not enough: swap some
                swap = min(share_off, need / (off - rec))
                share_off, share_rec = share_off - swap, share_rec + swap
        acc_off = acc_rec = 0.0
        for i in range(problem.num_microbatches):
            acc_off += share_off
            acc_rec += share_rec
            if acc_off >= 1.0 - 1e-9:
                chosen[(k, i)], acc_off = "offload", acc_off - 1.0
            elif acc_rec >= 1.0 - 1e-9:
                chosen[(k, i)], acc_rec = "recompute", acc_rec - 1.0
    if not chosen:
        return None
    return lambda k, i: chosen.get((k, i))


def steady_period(problem: Problem) -> float:
    """Steady-state time per microbatch: the busiest device's compute for one microbatch."""
    return max(problem.work_ms(d) for d in range(problem.num_devices))


def slow_copies(problem: Problem) -> bool:
    """Would offloading every microbatch keep a copy lane at least half busy? Only then do shares
    beat offloading everything."""
    period = steady_period(problem)
    return problem.options.offload and any(
        problem.chunks * max(s.offload_ms or 0.0, s.reload_ms or 0.0) >= 0.5 * period for s in problem.stages)


def reducing_treatments(problem: Problem) -> list[Treatment]:
    """The treatments that reduce activations, tried under a memory limit in the order they won:
    on slow links the fractional shares, then the whole-stage ones, each with forwards held for a
    reload's room as usual and then eager, then recompute. On big problems only the first few
    attempts run, so the likely winner comes first."""
    if not problem.limited_devices():
        return []
    opts = problem.options
    offload = stage_treat(problem, Reduce.OFFLOAD)
    crowd = None
    if opts.offload and opts.recompute and any(crowded(problem, k) for k in range(problem.num_stages - 1)):
        crowd = stage_treat(problem, Reduce.CROWDED)
    fractional = []
    if slow_copies(problem):
        fractional = [Treatment(Reduce.FRACTIONAL, fractional_treat(problem, slack), eager, slack)
                      for slack in FRACTIONAL_SLACKS for eager in (False, True)]
    candidates = fractional + [Treatment(Reduce.CROWDED, crowd), Treatment(Reduce.CROWDED, crowd, True),
                               Treatment(Reduce.OFFLOAD, offload), Treatment(Reduce.OFFLOAD, offload, True),
                               Treatment(Reduce.RECOMPUTE, stage_treat(problem, Reduce.RECOMPUTE))]
    return [t for t in candidates if t.treat is not None]


def treatments(problem: Problem, pattern_fits: bool) -> list[Treatment]:
    """reducing_treatments plus none at all: first when a zero-bubble pattern already fits the limits."""
    reducing = reducing_treatments(problem)
    return reducing + [PLAIN] if reducing and not pattern_fits else [PLAIN] + reducing
