"""The greedy's passes over engine settings, as data: PASSES, in the order they run.

A pass starts from some attempts (its bases: the grid, or the best attempts so far) and tries each
with every value of one engine setting it varies; `applies` says where it can gain at all, and
`solver_only` passes run only when the solver widens the greedy (the inline run must answer fast).
docs/research/heuristics.md has the rows each pass won on the benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..bounds.pipeline import forward_head, one_stage_limited, round_trip
from ..contract import Problem
from ..ops import Kind, Op
from .attempts import Attempt, Await, FixedOrders, Pace, engine_variants, greedy_tries
from .treatments import Treatment, steady_period
from .zero_bubble import zb_h2_warmup

HOLD_SHARE = 0.25  # the head's activation, as a share of its device's free memory, from which `held` runs
YIELD_TRIES = 8  # how many of the fastest attempts `yielding` reruns


@dataclass
class Search:
    """What the passes start from: the problem, its treatments, the late-forward attempts of the
    pass before (with their makespans; inf when they blocked or were skipped) and every attempt that
    fit so far."""

    problem: Problem
    treatments: list[Treatment]
    late: list[tuple[float, Attempt]] = field(default_factory=list)
    ranked: list[tuple[float, Attempt]] = field(default_factory=list)

    @property
    def reducing(self) -> list[Treatment]:
        return [t for t in self.treatments if t.treat is not None]


def _always(search: Search) -> bool:
    return True


def _every_attempt(problem: Problem, inline: bool) -> float:
    return math.inf


@dataclass(frozen=True)
class Pass:
    """`starts_from` gives the bases; `varies` names the Attempt field the pass sets, to each of
    `values(problem)` in turn: every base with one value before the next value, or (`by_base`) every
    value of one base before the next base. `at_most(problem, inline)`: attempts per run.
    `until_one_fits`: neither that budget nor the caller's stop ends it before a plan fits."""

    name: str
    why: str
    starts_from: Callable[[Search], list[Attempt]]
    varies: str | None = None
    values: Callable[[Problem], list[Any]] = lambda problem: []
    by_base: bool = False
    applies: Callable[[Search], bool] = _always
    solver_only: bool = False
    at_most: Callable[[Problem, bool], float] = _every_attempt
    until_one_fits: bool = False

    def attempts(self, search: Search) -> list[Attempt]:
        bases = self.starts_from(search)
        if self.varies is None:
            return bases
        values = self.values(search.problem)
        if self.by_base:
            pairs = [(b, v) for b in bases for v in values]
        else:
            pairs = [(b, v) for v in values for b in bases]
        return [replace(b, **{self.varies: v}) for b, v in pairs]


OPS_BUDGET = 40_000  # engine runs x ops: bounds the inline greedy to a few engine runs at P=32, M=128


def inline_runs(problem: Problem) -> int:
    """How many grid attempts the inline greedy makes (at least two): OPS_BUDGET ops in all."""
    return max(2, OPS_BUDGET // max(1, 3 * problem.num_stages * problem.num_microbatches))


# -- bases ------------------------------------------------------------------------------------------
def _grid(search: Search) -> list[Attempt]:
    return greedy_tries(search.problem, search.treatments)


def _late_of_two_best_treatments(search: Search) -> list[Attempt]:
    """The previous pass's late-forward attempts under its two best treatments, fastest first (then
    those that blocked or were skipped as slower, in their own order: a variant a few percent behind
    may lead once it waits)."""
    best_of: dict[Treatment, float] = {}
    for makespan, attempt in search.late:
        best_of[attempt.treatment] = min(makespan, best_of.get(attempt.treatment, makespan))
    top = sorted(best_of, key=best_of.__getitem__)[:2]
    return [a for _, a in sorted((x for x in search.late if x[1].treatment in top), key=lambda x: x[0])]


def _late_reducing(search: Search, fill_tight: bool = False) -> list[Attempt]:
    """Every reducing treatment under every late-forward grid point (`fill_tight`: only those that
    fill gaps with W's and keep no reserve for the later chunk)."""
    late = [v for v in engine_variants(search.problem) if v.late
            and (not fill_tight or (v.w.lag is None and not v.reserve))]
    return [Attempt(t, v) for t in search.reducing for v in late]


def _one_f_one_b_grid(search: Search) -> list[Attempt]:
    return [Attempt(t, v) for v in engine_variants(search.problem) if v.cap.name == "1f1b"
            for t in search.treatments]


def _whole_grid(search: Search) -> list[Attempt]:
    return [Attempt(t, v) for v in engine_variants(search.problem) for t in search.treatments]


def _fastest_so_far(search: Search) -> list[Attempt]:
    return [a for _, a in sorted(search.ranked, key=lambda x: x[0])[:YIELD_TRIES]]


# -- when a pass applies -----------------------------------------------------------------------------
def _reduces_on_shared_devices(search: Search) -> bool:
    """Several stages per device, and memory asks for offload or recompute."""
    return search.problem.chunks > 1 and bool(search.reducing)


def _head_crowds_its_device(search: Search) -> bool:
    """As `_reduces_on_shared_devices`, and the last stage's activation is HOLD_SHARE or more of its
    device's free memory."""
    head = search.problem.stages[-1]
    return (head.activation_mib >= HOLD_SHARE * search.problem.free_mib(head.device)
            and _reduces_on_shared_devices(search))


def busiest_stage(problem: Problem) -> int | None:
    """The stage of a uniquely busiest device (5% above the rest) in mid-chain, with one stage per
    device; None when there is none."""
    if problem.chunks != 1 or problem.num_devices < 2:
        return None
    work = sorted(((problem.work_ms(d), d) for d in range(problem.num_devices)), reverse=True)
    if work[0][0] < 1.05 * work[1][0]:
        return None
    k = problem.stages_of(work[0][1])[0]
    return None if k == problem.num_stages - 1 else k


# -- values ------------------------------------------------------------------------------------------
def forward_pipe_depths(problem: Problem) -> list[int]:
    """Per device, how many microbatch periods a microbatch takes from the end of the device's first
    stage's forward to the start of its last stage's, with nobody in the way (at least 1)."""
    period = steady_period(problem)
    depths = []
    for d in range(problem.num_devices):
        first, last = problem.stages_of(d)[0], problem.stages_of(d)[-1]
        pipe = forward_head(problem, last) - forward_head(problem, first) - problem.stages[first].forward_ms
        depths.append(max(1, math.ceil(pipe / period - 1e-9)))
    return depths


def paces(problem: Problem) -> list[Pace]:
    """Twice and three times each device's forward-pipe depth, and twice the deepest on every device
    (each won a row the others lost); no value twice."""
    depths = forward_pipe_depths(problem)
    out: dict[tuple[int, ...], str] = {}
    for label, pace in (("pace 2x", [2 * x for x in depths]), ("pace 3x", [3 * x for x in depths]),
                        ("pace 2x deepest", [2 * max(depths)] * len(depths))):
        out.setdefault(tuple(pace), label)
    return [Pace(label, pace) for pace, label in out.items()]


def _busiest_doubled(problem: Problem) -> list[tuple[int, int]]:
    """(stage, cap): the busiest stage's warm-up cap at twice 1F1B's."""
    k = busiest_stage(problem)
    return [] if k is None else [(k, zb_h2_warmup(problem)[k])]


def exclusive_orders(problem: Problem) -> list[FixedOrders]:
    """For the one-stage devices, not the last, whose memory holds one activation at a time, where
    recompute is allowed: groups of one kept microbatch and q recomputed ones (forwards, then each
    backward and W), so the kept one's round trip is filled with the others' forwards; q from the
    trip in forwards, and one more."""
    opts = problem.options
    if problem.chunks != 1 or not (opts.recompute and opts.split_backward):
        return []

    def one_at_a_time(d: int, k: int) -> bool:
        s = problem.stages[k]
        return 2 * (s.activation_mib - s.checkpoint_mib) > problem.free_mib(d)

    devices = [(d, k) for d, k in one_stage_limited(problem)
               if k + 1 < problem.num_stages and one_at_a_time(d, k)]
    if not devices:
        return []
    m = problem.num_microbatches
    out = []
    fits = {min(max(1, math.floor(round_trip(problem, k) / problem.stages[k].forward_ms)), m - 1)
            for _, k in devices}
    for q in sorted(fits | {q + 1 for q in fits}):
        fixed: dict[int, list[Op]] = {}
        recomputed: set[tuple[int, int]] = set()
        for d, k in devices:
            ops = []
            for first in range(0, m, q + 1):
                group = range(first, min(m, first + q + 1))
                recomputed |= {(k, i) for i in group if i != first}
                ops += [Op(Kind.F, k, i) for i in group]
                ops += [op for i in group for op in (Op(Kind.B, k, i), Op(Kind.W, k, i))]
            fixed[d] = ops
        out.append(FixedOrders(q, fixed, frozenset(recomputed)))
    return out


def _inline_budget(problem: Problem, inline: bool) -> float:
    return inline_runs(problem) if inline else math.inf


_AWAIT = Pass(
    name="await", why="a forward started just before an urgent arrival makes it wait for all of it",
    starts_from=_late_of_two_best_treatments, varies="awaits", values=lambda problem: list(Await),
    by_base=True, at_most=lambda problem, inline: inline_runs(problem))

PASSES: tuple[Pass, ...] = (
    Pass(name="grid", why="every treatment under every engine-settings grid point, most promising first",
         starts_from=_grid, at_most=_inline_budget, until_one_fits=True),
    _AWAIT,
    Pass(name="paced", why="unpaced, early-chunk forwards fill a device and crowd out the last chunk's",
         starts_from=lambda search: _late_reducing(search, fill_tight=True), varies="pace", values=paces,
         applies=_reduces_on_shared_devices, solver_only=True),
    _AWAIT,
    Pass(name="held", why="a recompute or reload started just before the LM head's forward holds it up",
         starts_from=_late_reducing, varies="held", values=lambda problem: [True],
         applies=_head_crowds_its_device, solver_only=True),
    _AWAIT,
    Pass(name="busiest", why="a heavier device in mid-chain idles under 1F1B's cap until its first backward",
         starts_from=_one_f_one_b_grid, varies="busiest", values=_busiest_doubled,
         applies=lambda search: busiest_stage(search.problem) is not None, solver_only=True),
    Pass(name="exclusive", why="where memory holds one activation, no priority rule fills a kept "
         "microbatch's round trip with recomputed forwards",
         starts_from=_whole_grid, varies="exclusive", values=exclusive_orders, solver_only=True),
    Pass(name="yielding", why="a W started just before a backward arrives delays that backward's chain",
         starts_from=_fastest_so_far, varies="yields", values=lambda problem: [True], solver_only=True),
)
