"""One engine run of the greedy, as a typed record: a treatment, a point of the engine-settings grid,
and what later passes changed. Its label and its engine settings are derived from those fields."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from itertools import zip_longest

from ..contract import Problem
from ..ops import Op
from .engine import EngineConfig, ForwardPolicy, MemoryPolicy, Treat, WPolicy
from .treatments import Reduce, Treatment
from .zero_bubble import zb_h2_warmup


@dataclass(frozen=True)
class Cap:
    """A warm-up cap: its name and each stage's most forwards in flight (None: memory alone)."""

    name: str
    counts: tuple[int, ...] | None


@dataclass(frozen=True)
class WFill:
    """When W's run: "lean" right after their B except each stage's last few, which fill the
    cool-down; "fill" only in gaps (WPolicy)."""

    name: str
    lag: tuple[int, ...] | None = None
    tail: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Variant:
    """A point of the engine-settings grid: warm-up cap, W's, the later chunk's forward first
    (`late`) and room kept for it (`reserve`)."""

    cap: Cap
    w: WFill
    late: bool
    reserve: bool
    split: bool

    @property
    def parts(self) -> list[str]:
        """The label's parts: cap, W's (when split), "late", "tight" (no reserve)."""
        return ([self.cap.name] + ([self.w.name] if self.split else []) + (["late"] if self.late else [])
                + ([] if self.reserve else ["tight"]))

    @property
    def label(self) -> str:
        return ",".join(self.parts)

    def config(self, problem: Problem) -> EngineConfig:
        """The engine settings of this point alone (no treatment)."""
        limited = problem.limited_devices()
        limits = [problem.limit_of(d) for d in range(problem.num_devices)] if limited else None
        return EngineConfig(
            split=self.split,
            forwards=ForwardPolicy(cap=self.cap.counts, late_first=self.late),
            weights=WPolicy(lag=self.w.lag, tail=self.w.tail),
            memory=MemoryPolicy(limits=limits, chunk_reserve=self.reserve))


@dataclass(frozen=True)
class Pace:
    """ForwardPolicy.pace per device, under its label."""

    label: str
    per_device: tuple[int, ...]


@dataclass(frozen=True)
class FixedOrders:
    """Fixed compute orders for some devices (EngineConfig.fixed) and the pairs they recompute: groups
    of one kept microbatch and `q` recomputed ones."""

    q: int
    orders: dict[int, list[Op]]
    recomputed: frozenset[tuple[int, int]]

    @property
    def label(self) -> str:
        return f"exclusive q={self.q}"

    def treat(self, base: Treat | None) -> Treat:
        """`base`, except on the stages of the orders: recomputed where they say, else kept."""
        stages = {op.stage for ops in self.orders.values() for op in ops}

        def treat(k: int, i: int) -> str | None:
            if k in stages:
                return "recompute" if (k, i) in self.recomputed else None
            return base(k, i) if base is not None else None
        return treat


class Await(Enum):
    """Which urgent arrivals a forward waits for (ForwardPolicy.await_*)."""

    FIRST_BACKWARD = "await B"
    AND_LATER_FORWARD = "await B+F"


@dataclass(frozen=True)
class Attempt:
    """One engine run: a treatment, a grid point, and the passes' changes. `busiest`: (stage, cap)
    raising one stage's warm-up cap; `held`: MemoryPolicy.hold_last; `yields`: WPolicy.yields."""

    treatment: Treatment
    variant: Variant
    busiest: tuple[int, int] | None = None
    pace: Pace | None = None
    held: bool = False
    exclusive: FixedOrders | None = None
    awaits: Await | None = None
    yields: bool = False

    @property
    def name(self) -> str:
        """The engine settings' part of the label, e.g. "mid,fill,late,tight,pace 2x,await B"."""
        cap, *rest = self.variant.parts
        if self.busiest is not None:
            cap += ", busiest 2x"
        changes = [self.pace.label if self.pace else None, "held" if self.held else None,
                   self.exclusive.label if self.exclusive else None,
                   self.awaits.value if self.awaits else None, "W yields" if self.yields else None]
        return ",".join([cap, *rest] + [c for c in changes if c is not None])

    @property
    def label(self) -> str:
        """What `Plan.method` says, e.g. "greedy(2x,lean, offload, eager)"."""
        treatment = self.treatment.label
        return f"greedy({self.name}{', ' + treatment if treatment else ''})"

    def config(self, problem: Problem) -> EngineConfig:
        """The engine settings: the grid point's, then the treatment and every change."""
        cfg = self.variant.config(problem)
        forwards, weights, memory = cfg.forwards, cfg.weights, cfg.memory
        if self.busiest is not None and forwards.cap is not None:
            k, cap = self.busiest
            forwards = replace(forwards, cap=tuple(cap if j == k else c for j, c in enumerate(forwards.cap)))
        if self.pace is not None:
            forwards = replace(forwards, pace=self.pace.per_device)
        if self.awaits is not None:
            forwards = replace(forwards, await_first_backward=True,
                               await_later_forward=self.awaits is Await.AND_LATER_FORWARD)
        treat = self.treatment.treat
        if self.exclusive is not None:
            treat = self.exclusive.treat(treat)
        memory = replace(memory, treat=treat, reload_in_turn=True, reserve_after_copies=self.treatment.eager,
                         hold_last=self.held)
        return replace(cfg, forwards=forwards, weights=replace(weights, yields=self.yields), memory=memory,
                       fixed=self.exclusive.orders if self.exclusive else None)


def engine_variants(problem: Problem) -> list[Variant]:
    """The engine-settings grid, most promising first. One stage per device: 1F1B's cap, twice it
    and (with offload under a limit) memory alone, each with lean and filling W's. Several: midway
    between 1F1B's count over all stages and one pass over the devices, memory alone and twice
    1F1B's, each with filling and lean W's, with and without the later chunk first and its reserve."""
    s = problem.num_stages
    split = problem.options.split_backward
    limited = bool(problem.limited_devices())
    lean = WFill("lean", (10**9,) * s, (s,) * s)
    fill = WFill("fill")
    twice = Cap("2x", tuple(zb_h2_warmup(problem)))
    memory = Cap("mem", None)
    if problem.chunks == 1:
        caps = [Cap("1f1b", tuple(s - k for k in range(s))), twice]
        if limited and problem.options.offload:
            caps.append(memory)
        grid = [(cap, w, False, True) for w in (lean, fill) for cap in caps]
    else:
        mid = Cap("mid", tuple((s - k + problem.num_devices) // 2 for k in range(s)))
        grid = [(cap, w, late, reserve)
                for late, reserve in ((True, False), (True, True), (False, True), (False, False))
                for w in (fill, lean) for cap in (mid, memory, twice)]
    return [Variant(cap, w, late, reserve, split) for cap, w, late, reserve in grid if split or w is not fill]


def greedy_tries(problem: Problem, treats: list[Treatment]) -> list[Attempt]:
    """Every treatment under every grid point, in the order the greedy runs them (the inline run
    stops after a few): the fractional shares round-robin among themselves, every other treatment
    variant by variant in its own order, and the two streams alternate (all fractional ones first
    spent the inline budget on them; a plain round-robin missed a treatment's later variants)."""
    variants = engine_variants(problem)
    shares = [Attempt(t, v) for v in variants for t in treats if t.reduce is Reduce.FRACTIONAL]
    others = [Attempt(t, v) for t in treats if t.reduce is not Reduce.FRACTIONAL for v in variants]
    return [x for pair in zip_longest(shares, others) for x in pair if x is not None]
