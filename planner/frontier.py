"""The time-memory frontier of a configuration: the fastest plan at every per-GPU memory budget.

A budget is one number, a factor f, that sets every device's limit (`Budgets`). By default the limit
is one uniform cap per GPU, f x the GPU's memory, on every device: the unit users have (a cluster has
one HBM size, and a job caps memory per GPU), so "GiB per GPU", dominance and the queries all mean
that cap. For clusters of mixed GPUs the limits can instead scale every device's free memory
(limit - static) by f, so uneven devices keep their ratios.

The frontier runs from the least f at which any schedule fits (planner.bounds.min_memory) to the least
f at which the unlimited-memory optimum fits. Each point is a validated plan for its own problem (its
own key) with its proven bound. Why the construction is monotone: a plan that fits a smaller budget
fits every larger one, so every point is offered the plans of all smaller points (and of every peer
that fits) and keeps the fastest; bounds go the other way (a bound at a larger budget holds at every
smaller one). Peers (the published schedules, torch's generators) sit at their own peak memory; a
point is placed at each peer's budget, so the frontier dominates them by construction.

Pure: no I/O; progress goes to a callback. The solver is injected (`solve_fn`; `plan_fn` in
heuristic_points) so the service can place points with its cheap first plans and leave the solving to
its workers.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .bounds import ALL, lower_bound, min_memory
from .contract import Plan, Problem
from .simulator import build_plan, schedule_from_plan, simulate
from .validator import assert_valid, validate_plan

FRONTIER_FORMAT = "pipeplan.frontier/v1"
EPS_MS = 1e-6
# The published schedules and torch's generators (when torch is installed): what users compare with.
PUBLISHED_PEERS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "pipeoffload")
PEER_NAMES = PUBLISHED_PEERS + ("torch-1f1b", "torch-interleaved-1f1b", "torch-interleaved-zb", "torch-zbv",
                                "torch-dualpipev")
# PipeOffload adapts its offloads to the limit: besides its unlimited point it is run at these shares
# of the frontier's range, so its memory-saving points are on the picture too.
ADAPTIVE_PEERS = ("pipeoffload",)
ADAPTIVE_PEER_SHARES = (0.0, 0.25, 0.5)
SAME_FACTOR = 1e-3  # factors closer than this share of the range are one point
BUDGET_MODES = ("uniform", "scaled")
Progress = Callable[[dict[str, Any]], None]


# -- budgets ------------------------------------------------------------------------------------------
def unlimited(problem: Problem) -> Problem:
    """The same problem with every memory limit lifted."""
    return problem.model_copy(update={"devices": [d.model_copy(update={"memory_limit_mib": None})
                                                  for d in problem.devices]})


def device_memory(problem: Problem) -> tuple[float, str] | None:
    """One GPU's memory and where it comes from: the larger of the hardware preset's HBM (a problem
    converted from a spec names its hardware in `metadata.hardware`) and the problem's largest finite
    device limit; None when neither is known."""
    from .spec import HARDWARE

    known = []
    preset = HARDWARE.get(str(problem.metadata.get("hardware", "")))
    if preset is not None:
        known.append((preset.hbm_gib * 1024.0, preset.name))
    limits = [problem.limit_of(d) for d in range(problem.num_devices)]
    if finite := [x for x in limits if math.isfinite(x)]:
        known.append((max(finite), "the problem's device limit"))
    return max(known, key=lambda k: k[0]) if known else None


@dataclass
class Budgets:
    """How a budget factor f sets every device's limit: `base_mib[d] + f * unit_mib[d]`.

    mode "uniform": base 0 and one unit (the GPU's memory) on every device, so every limit is the
    same cap and f = 1 is the GPU's memory. mode "scaled": base = static memory and unit = free
    memory (limit - static) per device."""

    mode: str
    base_mib: list[float]
    unit_mib: list[float]

    @classmethod
    def of(cls, problem: Problem, mode: str = "uniform", peak_mib: list[float] | None = None) -> Budgets:
        """The budgets of `problem`; `peak_mib` (an unlimited plan's peaks) stands in for what the
        problem does not say: the GPU's memory (uniform), or a limit at or below static (scaled)."""
        if mode not in BUDGET_MODES:
            raise ValueError(f"budgets: expected one of {', '.join(BUDGET_MODES)}, got {mode!r}")
        n = problem.num_devices
        if mode == "uniform":
            memory = device_memory(problem)
            if memory is not None and memory[0] <= 0:  # a zero limit is no unit to scale budgets by
                memory = None
            if memory is None and peak_mib is None:
                raise ValueError("the problem names no GPU memory and no limit: give the unlimited peak")
            unit = memory[0] if memory is not None else max(max(peak_mib or [0.0]), 1.0)
            return cls("uniform", [0.0] * n, [unit] * n)
        statics = [d.static_mib for d in problem.devices]
        limits = [problem.limit_of(d) for d in range(n)]
        if all(math.isfinite(lim) and lim > s for lim, s in zip(limits, statics)):
            return cls("scaled", statics, [lim - s for lim, s in zip(limits, statics)])
        if peak_mib is None:
            raise ValueError("the problem has no finite memory limit on some device: give the unlimited peak")
        return cls("scaled", statics, [max(p - s, 1.0) for p, s in zip(peak_mib, statics)])

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Budgets:
        """From a frontier document (or a stored setup); documents written before budgets had a
        mode were scaled, and carry only `free_mib` and `static_mib`."""
        if "budgets" in doc:
            b = doc["budgets"]
            return cls(b["mode"], list(b["base_mib"]), list(b["unit_mib"]))
        return cls("scaled", list(doc["static_mib"]), list(doc["free_mib"]))

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "base_mib": self.base_mib, "unit_mib": self.unit_mib}

    def limits(self, factor: float) -> list[float]:
        return [b + factor * u for b, u in zip(self.base_mib, self.unit_mib)]

    def factor_of(self, peak_mib: list[float]) -> float:
        """The least factor at which a plan with these per-device peaks fits: stepped up by the
        float's last digit until no limit is below its peak, so a peer's point is at its peak."""
        f = max(0.0, max((p - b) / u for p, b, u in zip(peak_mib, self.base_mib, self.unit_mib)))
        while any(lim < p for lim, p in zip(self.limits(f), peak_mib)):
            f = math.nextafter(f, math.inf)
        return f

    def apply(self, problem: Problem, factor: float) -> Problem:
        """The problem with every device's limit at the budget `factor`."""
        return problem.model_copy(update={"devices": [
            d.model_copy(update={"memory_limit_mib": lim})
            for d, lim in zip(problem.devices, self.limits(factor))]})


def within(budget_mib: float, cap_mib: float) -> bool:
    """`budget_mib` is at most `cap_mib` per GPU (up to float noise: a millionth of a MiB)."""
    return budget_mib <= cap_mib + 1e-6


def rekey(problem: Problem, plan: Plan, key: str | None = None) -> Plan | None:
    """`plan` as a plan of `problem` (same ops, its key), or None when it does not fit there."""
    key = key or problem.key()
    candidate = plan.model_copy(update={"problem_key": key, "revision": 1, "status": "feasible",
                                        "solver_bound_ms": None})
    if not validate_plan(problem, candidate, key):
        return candidate
    try:
        schedule = schedule_from_plan(plan)
        timed = build_plan(problem, schedule, simulate(problem, schedule), plan.method, key)
    except Exception:  # noqa: BLE001 - orders that do not apply here simply do not fit
        return None
    return timed if not validate_plan(problem, timed, key) else None


# -- the points ---------------------------------------------------------------------------------------
@dataclass
class PeerPoint:
    """A peer schedule at its own peak memory."""

    name: str
    method: str
    peak_mib: list[float]
    makespan_ms: float
    factor: float
    plan: Plan | None = field(default=None, repr=False)

    @property
    def budget_mib(self) -> float:
        """Its memory per GPU: the largest device peak."""
        return max(self.peak_mib)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "method": self.method, "peak_mib": self.peak_mib,
                "budget_mib": self.budget_mib, "makespan_ms": self.makespan_ms, "factor": self.factor}


@dataclass
class FrontierPoint:
    """One budget: its limits, its best validated plan and the proven bound there."""

    factor: float
    limits_mib: list[float]
    key: str
    plan: Plan
    bound_ms: float
    source: str = "solver"  # where the plan came from: solver | point f=… | peer NAME | unlimited
    outcome: str = ""
    solve_s: float = 0.0
    problem: Problem | None = field(default=None, repr=False)

    @property
    def makespan_ms(self) -> float:
        return self.plan.makespan_ms

    @property
    def budget_mib(self) -> float:
        """The memory per GPU this point allows: its largest device limit (with uniform budgets,
        every device's)."""
        return max(self.limits_mib)

    def to_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "limits_mib": self.limits_mib, "budget_mib": self.budget_mib,
                "makespan_ms": self.makespan_ms, "bound_ms": self.bound_ms, "problem_key": self.key,
                "status": "optimal" if self.makespan_ms <= self.bound_ms + EPS_MS else "feasible",
                "peak_mib": self.plan.peak_memory_mib, "method": self.plan.method, "source": self.source,
                "outcome": self.outcome, "solve_s": round(self.solve_s, 3)}


@dataclass
class Frontier:
    base_key: str
    budgets: Budgets
    static_mib: list[float]
    hbm: tuple[float, str] | None  # one GPU's memory and its source (device_memory)
    factor_min: float
    factor_max: float
    points: list[FrontierPoint]
    peers: list[PeerPoint]
    unlimited_makespan_ms: float
    elapsed_s: float = 0.0

    def at(self, factor: float) -> FrontierPoint | None:
        """The frontier's plan at budget factor `factor`: the largest point at or below it."""
        below = [p for p in self.points if p.factor <= factor * (1 + 1e-9) + 1e-12]
        return max(below, key=lambda p: p.factor) if below else None

    def least_memory(self, target_ms: float) -> FrontierPoint | None:
        """The smallest budget whose plan runs in at most `target_ms`."""
        return next((p for p in self.points if p.makespan_ms <= target_ms + EPS_MS), None)

    def fastest(self, budget_mib: float) -> FrontierPoint | None:
        """The fastest plan whose every device limit is at most `budget_mib`."""
        fits = [p for p in self.points if within(p.budget_mib, budget_mib)]
        return min(fits, key=lambda p: (p.makespan_ms, p.factor)) if fits else None

    def dominance(self) -> list[dict[str, Any]]:
        """Per peer: the frontier's makespan at the peer's memory and the margin in % of the peer's.

        With uniform budgets the peer's memory is its per-GPU peak and the frontier's value there is
        its fastest point within that much per GPU; with scaled budgets, the point at the peer's factor
        (mixed GPUs have no one figure per GPU)."""
        out = []
        for peer in self.peers:
            point = self.fastest(peer.budget_mib) if self.budgets.mode == "uniform" else self.at(peer.factor)
            ms = None if point is None else point.makespan_ms
            out.append({"peer": peer.name, "peer_ms": peer.makespan_ms, "budget_mib": peer.budget_mib,
                        "frontier_ms": ms, "dominated": ms is not None and ms <= peer.makespan_ms + EPS_MS,
                        "margin_pct": None if ms is None else 100.0 * (peer.makespan_ms - ms) / peer.makespan_ms})
        return out

    def to_document(self) -> dict[str, Any]:
        return frontier_document(self.base_key, self.budgets, self.static_mib, self.hbm, self.factor_min,
                                 self.factor_max, [p.to_dict() for p in self.points],
                                 [p.to_dict() for p in self.peers], self.unlimited_makespan_ms,
                                 {"elapsed_s": round(self.elapsed_s, 3)})


def frontier_document(base_key: str, budgets: Budgets, static: list[float], hbm: tuple[float, str] | None,
                      f_min: float, f_max: float, points: list[dict[str, Any]], peers: list[dict[str, Any]],
                      unlimited_ms: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `pipeplan.frontier/v1` document (docs/frontier.md), shared by the CLI and the service;
    each point says whether it needs more memory than the GPU has (`beyond_hbm`)."""
    hbm_mib = None if hbm is None else hbm[0]
    points = [{**p, "beyond_hbm": hbm_mib is not None and not within(p["budget_mib"], hbm_mib)} for p in points]
    doc = {"format": FRONTIER_FORMAT, "problem_key": base_key, "budgets": budgets.to_dict(),
           "static_mib": static, "hbm_mib": hbm_mib, "hbm_of": None if hbm is None else hbm[1],
           "factor_min": f_min, "factor_max": f_max, "unlimited_makespan_ms": unlimited_ms,
           "points": points, "peers": peers}
    if budgets.mode == "scaled":
        doc["free_mib"] = budgets.unit_mib  # what the factor scales (the field before budgets had modes)
    return {**doc, "dominance": view_of(doc).dominance(), **(extra or {})}


class _Row:
    """A point or peer dict seen through FrontierPoint's/PeerPoint's attributes (for the queries)."""

    def __init__(self, doc: dict[str, Any]):
        self.doc = doc
        self.name = doc.get("name", "")
        self.factor = doc["factor"]
        self.makespan_ms = doc["makespan_ms"]
        self.budget_mib = doc["budget_mib"]


def view_of(doc: dict[str, Any]) -> Frontier:
    """A frontier document as a Frontier whose points/peers answer at/least_memory/fastest (dicts
    inside `.doc`)."""
    hbm = None if doc.get("hbm_mib") is None else (doc["hbm_mib"], doc.get("hbm_of") or "")
    view = Frontier(doc["problem_key"], Budgets.from_doc(doc), doc["static_mib"], hbm, doc["factor_min"],
                    doc["factor_max"], [], [], doc["unlimited_makespan_ms"])
    view.points = sorted((_Row(p) for p in doc["points"]), key=lambda r: r.factor)  # type: ignore[misc]
    view.peers = [_Row(p) for p in doc["peers"]]  # type: ignore[misc]
    return view


def monotone(makespans: list[float], bounds: list[float]) -> tuple[list[float], list[float]]:
    """Makespans non-increasing with the budget (a smaller budget's plan fits a larger one) and bounds
    non-increasing too (a bound at a larger budget holds at a smaller one); lists sorted by factor."""
    ms = list(makespans)
    for i in range(1, len(ms)):
        ms[i] = min(ms[i], ms[i - 1])
    bd = list(bounds)
    for i in range(len(bd) - 2, -1, -1):
        bd[i] = max(bd[i], bd[i + 1])
    return ms, [min(b, m) for b, m in zip(bd, ms)]


@dataclass
class ChartWindow:
    """What a frontier chart shows (the CLI's plot and the dashboard's SVG): axes spanning the
    frontier's points, stretched only for the GPU's memory and the peers near them. Peers far outside
    are listed beside the chart instead, so one outlier (GPipe at 314 GiB per GPU) cannot squash the
    curve into a corner."""

    x_mib: tuple[float, float]
    y_ms: tuple[float, float]
    peers: list[dict[str, Any]]  # drawn
    off_chart: list[dict[str, Any]]  # listed
    hbm_mib: float | None  # the GPU's memory, when inside the window


def chart_window(doc: dict[str, Any], reach: float = 0.25) -> ChartWindow:
    """The window of a frontier document: its points' budgets and makespans (bounds included), and
    the peers within `reach` of that span beyond them (in time, at least 15% slower than the slowest
    point: 1F1B beside a flat curve is worth the room, a serialized 4x is not)."""
    pts = doc["points"]
    xs = [p["budget_mib"] for p in pts]
    ys = [p["makespan_ms"] for p in pts] + [p["bound_ms"] for p in pts]
    x_lo, x_hi, y_lo, y_hi = min(xs), max(xs), min(ys), max(ys)
    dx, dy = max(x_hi - x_lo, 0.05 * x_hi, 1.0), max(y_hi - y_lo, 0.02 * y_hi, 1e-3)

    def near_x(x: float) -> bool:
        return x_lo - reach * dx <= x <= x_hi + reach * dx

    slowest = y_hi + max(reach * dy, 0.15 * y_hi)
    peers = [q for q in doc["peers"] if near_x(q["budget_mib"]) and q["makespan_ms"] <= slowest]
    off = [q for q in doc["peers"] if q not in peers]
    hbm = doc.get("hbm_mib")
    hbm = hbm if hbm is not None and near_x(hbm) else None
    all_x = xs + [q["budget_mib"] for q in peers] + ([hbm] if hbm is not None else [])
    all_y = ys + [q["makespan_ms"] for q in peers]
    pad_x, pad_y = 0.03 * (max(all_x) - min(all_x) or dx), 0.05 * (max(all_y) - min(all_y) or dy)
    return ChartWindow((min(all_x) - pad_x, max(all_x) + pad_x), (min(all_y) - pad_y, max(all_y) + pad_y),
                       peers, off, hbm)


def x_label(doc: dict[str, Any]) -> str:
    """The budget axis' label, which says what "per GPU" means in the document's mode."""
    if doc.get("budgets", {}).get("mode", "scaled") == "uniform":
        return "memory per GPU (GiB, the same limit on every device)"
    return "memory per GPU (GiB, largest device limit; each device's free memory scaled)"


def off_chart_note(off: list[dict[str, Any]]) -> str:
    """"Off the chart: gpipe 7,620 ms at 314.1 GiB; …" for the peers the window leaves out."""
    if not off:
        return ""
    return "off the chart: " + "; ".join(f"{q['name']} {q['makespan_ms']:,.0f} ms at {q['budget_mib'] / 1024:.1f} GiB"
                                         for q in sorted(off, key=lambda q: q["budget_mib"]))


# -- peers and the budget range ------------------------------------------------------------------------
def peer_points(problem: Problem, names: tuple[str, ...] = PEER_NAMES) -> list[PeerPoint]:
    """Every applicable peer's plan on the problem without memory limits (factor not yet known: 0)."""
    from .baselines import NAMES, DoesNotFit, NotApplicable, run_baseline

    free_problem = unlimited(problem)
    key = free_problem.key()
    out = []
    for name in names:
        if name not in NAMES:
            continue
        try:
            plan = run_baseline(free_problem, name, key)
        except (NotApplicable, DoesNotFit):
            continue
        out.append(PeerPoint(name, plan.method, list(plan.peak_memory_mib), plan.makespan_ms, 0.0, plan))
    return out


def adaptive_peer_points(problem: Problem, budgets: Budgets, factors: list[float],
                         known: list[PeerPoint] | None = None) -> list[PeerPoint]:
    """Limit-adaptive peers (PipeOffload) run at the given budgets, one point per distinct peak."""
    from .baselines import DoesNotFit, NotApplicable, run_baseline

    out: list[PeerPoint] = []
    seen = list(known or [])
    for name in ADAPTIVE_PEERS:
        for f in factors:
            sub = budgets.apply(problem, f)
            try:
                plan = run_baseline(sub, name, sub.key())
            except (NotApplicable, DoesNotFit, ValueError):
                continue
            if any(abs(max(p.peak_mib) - max(plan.peak_memory_mib)) < 1.0 and p.name == name
                   for p in out + seen):
                continue
            out.append(PeerPoint(name, plan.method, list(plan.peak_memory_mib), plan.makespan_ms,
                                 budgets.factor_of(plan.peak_memory_mib), plan))
    return out


@dataclass
class Setup:
    """Everything fixed before any point is solved: budget unit, range, peers, the top plan."""

    budgets: Budgets
    hbm: tuple[float, str] | None
    factor_min: float
    factor_max: float
    peers: list[PeerPoint]
    top: Plan  # the unlimited-memory plan the range ends at (a plan of the unlimited problem)
    top_bound_ms: float


def setup(problem: Problem, top: Plan, top_bound_ms: float, peers: list[PeerPoint],
          mode: str = "uniform") -> Setup:
    """Fix the budget unit and range from the unlimited plan and the peers, and place the peers."""
    candidates = [top] + [p.plan for p in peers if p.plan is not None]
    best_ms = min(c.makespan_ms for c in candidates)
    budgets = Budgets.of(problem, mode, top.peak_memory_mib)
    fastest = [c for c in candidates if c.makespan_ms <= best_ms + EPS_MS]
    top = min(fastest, key=lambda c: budgets.factor_of(c.peak_memory_mib))
    f_min = budgets.factor_of(min_memory(problem))
    f_max = max(f_min, budgets.factor_of(top.peak_memory_mib))
    for p in peers:
        p.factor = budgets.factor_of(p.peak_mib)
    peers += adaptive_peer_points(problem, budgets, [f_min + s * (f_max - f_min) for s in ADAPTIVE_PEER_SHARES],
                                  peers)
    return Setup(budgets, device_memory(problem), f_min, f_max, peers, top, min(top_bound_ms, top.makespan_ms))


def setup_document(problem: Problem, s: Setup) -> dict[str, Any]:
    """What the service stores of a setup (frontier_document's fields but the points)."""
    return {"problem_key": problem.key(), "budgets": s.budgets.to_dict(),
            "static_mib": [d.static_mib for d in problem.devices],
            "hbm_mib": None if s.hbm is None else s.hbm[0], "hbm_of": None if s.hbm is None else s.hbm[1],
            "factor_min": s.factor_min, "factor_max": s.factor_max, "unlimited_makespan_ms": s.top.makespan_ms,
            "peers": [p.to_dict() for p in s.peers]}


def initial_factors(s: Setup) -> list[float]:
    """The two ends and every peer's budget inside the range, even beyond the frontier's `points`.

    Decision: dominating every peer is the frontier's promise, and only a point at (or below) a
    peer's memory, hinted with the peer's plan, keeps it; so `points` is a minimum. (Spreading fewer
    points over the peers left 3 of 10 undominated for Llama-2-7B at 4 points, -11% at worst.)"""
    span = max(s.factor_max - s.factor_min, 1e-12)
    chosen = [s.factor_min, s.factor_max]
    inside = sorted({p.factor for p in s.peers if s.factor_min < p.factor < s.factor_max})
    distinct: list[float] = []
    for f in inside:
        if all(abs(f - g) > SAME_FACTOR * span for g in chosen + distinct):
            distinct.append(f)
    return sorted(chosen + distinct)


def next_factor(solved: list[tuple[float, float]], s: Setup) -> float | None:
    """Where the curve bends most: the midpoint of the step (between neighbouring solved points) with
    the largest area between the step and its chord, in range-normalized units; None when every
    interval is too narrow to split."""
    pts = sorted(solved)
    span_f = max(s.factor_max - s.factor_min, 1e-12)
    ms = [m for _, m in pts]
    span_m = max(max(ms) - min(ms), 1e-9)
    best, where = -1.0, None
    for (f0, m0), (f1, m1) in itertools.pairwise(pts):
        width = (f1 - f0) / span_f
        if width <= 2 * SAME_FACTOR:
            continue
        score = width * (max(0.0, m0 - m1) / span_m) + 1e-6 * width  # flat steps: widest first
        if score > best:
            best, where = score, (f0 + f1) / 2
    return where


def choose_factors(s: Setup, points: int, probe: Callable[[float], float],
                   stop: threading.Event | None = None) -> list[float]:
    """All `points` factors, the adaptive ones placed with `probe(factor) -> makespan` (the service
    probes with the best heuristic; compute_frontier solves); no adaptive one once `stop` is set."""
    solved = [(f, probe(f)) for f in initial_factors(s)]
    while len(solved) < points and not (stop is not None and stop.is_set()):
        f = next_factor(solved, s)
        if f is None:
            break
        solved.append((f, probe(f)))
    return sorted(f for f, _ in solved)


PlanFn = Callable[[Problem, str], Plan]


def fastest_fit(problem: Problem, key: str, offers: list[tuple[str, Plan]]) -> tuple[str, Plan] | None:
    """The fastest offered plan that fits `problem`, re-keyed; None when none fits. Offers are tried
    fastest first and the first that fits wins (a plan that fits as it is keeps its timing; trying
    every offer at every point cost O(points x offers) re-timings)."""
    for source, plan in sorted(offers, key=lambda o: o[1].makespan_ms):
        moved = rekey(problem, plan, key)
        if moved is not None:
            return source, moved
    return None


def heuristic_points(problem: Problem, points: int, mode: str = "uniform", plan_fn: PlanFn | None = None,
                     peers: tuple[str, ...] = PEER_NAMES) -> tuple[Setup, list[FrontierPoint]]:
    """The service's frontier before any solving: budgets placed along the curve of `plan_fn`
    (default: the best heuristic; the service passes its cheap first plan), and per point a first
    plan, the fastest of plan_fn's there, the next smaller point's plan and every peer that fits (so
    the curve is monotone from the first answer), with its status against the proven bound there.
    Each point's problem is `point.problem`."""
    from .baselines import best_heuristic

    first = plan_fn or (lambda sub, key: best_heuristic(sub, problem_key=key))
    free_problem = unlimited(problem)
    s = setup(problem, first(free_problem, free_problem.key()), lower_bound(free_problem),
              peer_points(problem, peers), mode)
    probes: dict[float, Plan] = {}

    def probe(f: float) -> float:
        sub = s.budgets.apply(problem, f)
        probes[f] = first(sub, sub.key())
        return probes[f].makespan_ms

    out: list[FrontierPoint] = []
    for f in choose_factors(s, points, probe):
        sub = s.budgets.apply(problem, f)
        key = sub.key()
        offers = [("heuristic", probes[f])] if f in probes else []
        offers += [(f"point f={out[-1].factor:.4f}", out[-1].plan)] if out else []
        offers += [(f"peer {p.name}", p.plan) for p in s.peers if p.plan is not None and p.factor <= f]
        offers += [("unlimited", s.top)] if f >= s.factor_max else []
        source, plan = fastest_fit(sub, key, offers) or ("heuristic", first(sub, key))
        bound = lower_bound(sub, ALL)
        if plan.makespan_ms <= bound + EPS_MS:
            extra = bound if bound > plan.lower_bound_ms + EPS_MS else plan.solver_bound_ms
            plan = plan.model_copy(update={"status": "optimal", "solver_bound_ms": extra})
        out.append(FrontierPoint(f, s.budgets.limits(f), key, plan, bound, source, problem=sub))
    return s, out


# -- the whole computation -----------------------------------------------------------------------------
SolveFn = Callable[..., Any]


def _default_solve() -> SolveFn:
    from .solver import solve

    return solve


def compute_frontier(problem: Problem, points: int = 12, time_limit_s: float = 10.0,
                     on_progress: Progress | None = None, stop: threading.Event | None = None,
                     solve_fn: SolveFn | None = None, peers: list[PeerPoint] | None = None,
                     workers: int | None = None, budgets: str = "uniform") -> Frontier:
    """The frontier with `points` points, each solved for `time_limit_s` (plus one unlimited solve),
    over `budgets` ("uniform": one cap per GPU; "scaled": each device's free memory scaled).

    Raises ValueError for points < 2 or an unknown mode. Every point's plan is validated against its
    own problem.
    """
    if points < 2:
        raise ValueError(f"points: {points} is too few; a frontier needs at least 2 (its two ends)")
    if budgets not in BUDGET_MODES:
        raise ValueError(f"budgets: expected one of {', '.join(BUDGET_MODES)}, got {budgets!r}")
    solve = solve_fn or _default_solve()
    report = on_progress or (lambda _e: None)
    started = time.monotonic()
    peers = peer_points(problem) if peers is None else peers
    report({"event": "peers", "peers": [p.to_dict() for p in peers]})
    free_problem = unlimited(problem)
    free_key = free_problem.key()
    hint = min((p.plan for p in peers if p.plan is not None), key=lambda p: p.makespan_ms, default=None)
    kw = {} if workers is None else {"workers": workers}
    top = solve(free_problem, time_limit_s=time_limit_s, stop=stop, hint=hint, problem_key=free_key, **kw)
    top_bound = max(top.lower_bound_ms, top.solver_bound_ms or 0.0)
    s = setup(problem, top.plan, top_bound, peers, budgets)
    report({"event": "range", "mode": s.budgets.mode, "factor_min": s.factor_min, "factor_max": s.factor_max,
            "budget_min_mib": max(s.budgets.limits(s.factor_min)),
            "budget_max_mib": max(s.budgets.limits(s.factor_max)), "hbm_mib": None if s.hbm is None else s.hbm[0],
            "hbm_of": None if s.hbm is None else s.hbm[1],
            "unlimited_makespan_ms": s.top.makespan_ms, "unlimited_s": round(top.elapsed_s, 2)})

    done: dict[float, FrontierPoint] = {}

    def candidates_for(f: float) -> list[tuple[str, Plan]]:
        out = [(f"point f={g:.4f}", p.plan) for g, p in done.items() if g < f]
        out += [(f"peer {p.name}", p.plan) for p in s.peers if p.plan is not None and p.factor <= f]
        if f >= s.factor_max:
            out.append(("unlimited", s.top))
        return out

    def run_point(f: float) -> float:
        sub = s.budgets.apply(problem, f)
        key = sub.key()
        prior = fastest_fit(sub, key, candidates_for(f))
        t0 = time.monotonic()
        bound = max(lower_bound(sub, ALL), s.top_bound_ms if f >= s.factor_max else 0.0)
        stopped = stop is not None and stop.is_set()
        if prior is not None and (prior[1].makespan_ms <= bound + EPS_MS or stopped):
            plan, source = prior[1], prior[0]  # proven already (or stopped): no solve needed
            outcome = "stopped" if stopped and prior[1].makespan_ms > bound + EPS_MS else "optimal"
        else:
            index = len(done)

            def improved(plan: Plan) -> None:
                report({"event": "improvement", "index": index, "factor": f, "makespan_ms": plan.makespan_ms})

            res = solve(sub, time_limit_s=time_limit_s, on_improvement=improved, stop=stop,
                        hint=None if prior is None else prior[1], problem_key=key, **kw)
            plan, source, outcome = res.plan, "solver", res.outcome
            bound = max(bound, res.lower_bound_ms, res.solver_bound_ms or 0.0)
            if prior is not None and prior[1].makespan_ms < plan.makespan_ms - EPS_MS:
                plan, source = prior[1], prior[0]
        point = FrontierPoint(f, s.budgets.limits(f), key, plan, bound, source, outcome,
                              time.monotonic() - t0, sub)
        done[f] = point
        report({"event": "point", "index": len(done) - 1, **point.to_dict()})
        return plan.makespan_ms

    choose_factors(s, points, run_point, stop)
    result = finish(problem, s, done)
    result.elapsed_s = time.monotonic() - started
    return result


def finish(problem: Problem, s: Setup, done: dict[float, FrontierPoint]) -> Frontier:
    """Enforce monotonicity (a smaller point's plan re-keyed into a larger one when it is faster),
    tighten the bounds, set each plan's status, and validate every plan against its own problem."""
    pts = [done[f] for f in sorted(done)]
    for i, p in enumerate(pts):
        sub = p.problem or s.budgets.apply(problem, p.factor)
        for q in pts[:i]:
            if q.plan.makespan_ms < p.plan.makespan_ms - EPS_MS:
                moved = rekey(sub, q.plan, p.key)
                if moved is not None and moved.makespan_ms < p.plan.makespan_ms - EPS_MS:
                    p.plan, p.source = moved, f"point f={q.factor:.4f}"
    _, bounds = monotone([p.makespan_ms for p in pts], [p.bound_ms for p in pts])
    for p, b in zip(pts, bounds):
        p.bound_ms = b
        optimal = p.makespan_ms <= b + EPS_MS
        extra = b if b > p.plan.lower_bound_ms + EPS_MS else p.plan.solver_bound_ms
        p.plan = p.plan.model_copy(update={"status": "optimal" if optimal else "feasible",
                                           "solver_bound_ms": extra})
        assert_valid(p.problem or s.budgets.apply(problem, p.factor), p.plan, p.key)
    return Frontier(problem.key(), s.budgets, [d.static_mib for d in problem.devices], s.hbm, s.factor_min,
                    s.factor_max, pts, s.peers, s.top.makespan_ms)
