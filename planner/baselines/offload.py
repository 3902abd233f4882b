"""Offload-based baselines: PipeOffload-style (uniform and selective) and AdaOffload.

Both start from a dense schedule's compute orders and add offload (or recompute) for chosen
activations through `schedule_of`, which gates each reload to start just early enough to hide it
before its backward. AdaOffload picks activations longest-lived first, only where memory is over the
limit, and never offloads one that lives shorter than its round trip: its memory would come back
before the copy out even finished (docs/optimizer.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..contract import Plan, Problem
from ..ops import BACKWARD_KINDS, Kind, Op
from ..simulator import ScheduleError, Timing, simulate
from .attempts import engine_variants
from .classic import gpipe_orders, interleaved_schedule, one_f_one_b_orders
from .common import (
    TOL,
    DoesNotFit,
    NotApplicable,
    Outcome,
    better,
    evaluate,
    is_large,
    over_limit,
    peaks_of,
    schedule_of,
)
from .engine import run_engine
from .zero_bubble import (
    zb_fill_1p_schedule,
    zb_fill_2p_schedule,
    zb_h1_orders,
    zb_v_schedule,
)

Orders = list[list[Op]]
MAX_ROUNDS = 12


def _compute(schedule) -> Orders:
    return [list(d.compute) for d in schedule.devices]


PEER_BASES = ("zb-h1", "1f1b", "interleaved-1f1b", "zb-v")  # the published orders PipeOffload starts from


def dense_bases(problem: Problem) -> list[tuple[str, Orders]]:
    """The dense schedules that apply to this problem, as compute orders (no offload yet): the
    time-filled ones adaoffload starts from first, then the published ones (PEER_BASES)."""
    builders: list[tuple[str, Callable[[], Orders]]] = [
        ("zb-fill 2p", lambda: _compute(zb_fill_2p_schedule(problem))),
        ("zb-fill 1p", lambda: _compute(zb_fill_1p_schedule(problem))),
        ("zb-h1", lambda: zb_h1_orders(problem)),
        ("1f1b", lambda: one_f_one_b_orders(problem)),
        ("interleaved-1f1b", lambda: _compute(interleaved_schedule(problem)[0])),
        ("zb-v", lambda: _compute(zb_v_schedule(problem))),
        ("gpipe", lambda: gpipe_orders(problem)),
    ]
    out: list[tuple[str, Orders]] = []
    for name, build in builders:
        try:
            out.append((name, build()))
        except (NotApplicable, ScheduleError):
            continue
    return out


def _lifetimes(problem: Problem, timing: Timing) -> dict[tuple[int, int], tuple[float, float]]:
    """(F end, backward start) of every activation."""
    out = {}
    for op, (start, _) in timing.times.items():
        if op.kind in BACKWARD_KINDS:
            out[(op.stage, op.mb)] = (timing.times[Op(Kind.F, op.stage, op.mb)][1], start)
    return out


def _saving(problem: Problem, k: int, how: str) -> float:
    s = problem.stages[k]
    return s.offloadable_mib if how == "offload" else s.activation_mib - s.checkpoint_mib


def _how(problem: Problem, k: int, life: float) -> str | None:
    """Offload when it saves memory (lives longer than the round trip); else recompute if allowed."""
    s = problem.stages[k]
    opts = problem.options
    if opts.offload and s.offloadable_mib > 0 and life > s.offload_ms + s.reload_ms + TOL:
        return "offload"  # free when the copies hide behind compute; recompute always costs compute
    if opts.recompute and s.activation_mib - s.checkpoint_mib > 0 and k + 1 < problem.num_stages:
        return "recompute"
    return None


def _grow(problem: Problem, timing: Timing, schedule, treat: dict[tuple[int, int], str],
          peaks: list[float]) -> bool:
    """Add treatments, longest-lived first, at every instant a device is over its limit."""
    from ..memory import memory_curve

    life = _lifetimes(problem, timing)
    added = False
    for d in over_limit(problem, peaks):
        limit = problem.limit_of(d)
        order = schedule.devices[d]
        curve = memory_curve(problem, d, timing.timed(order.compute + order.d2h + order.h2d), timing.choices)
        over = sorted(((level, t) for t, level in curve if level > limit + TOL), reverse=True)
        mine = [(k, i) for k in problem.stages_of(d) for i in range(problem.num_microbatches)]
        for level, t in over:
            # what the treatments chosen so far already save at t (approximately, on this timing)
            excess = level - limit
            for key in mine:
                how = treat.get(key)
                if how and key in life and life[key][0] <= t <= life[key][1]:
                    excess -= 0.0 if timing.choices[key].offload or timing.choices[key].recompute \
                        else _saving(problem, key[0], how)
            if excess <= TOL:
                continue
            alive = [key for key in mine if key not in treat and key in life
                     and life[key][0] - TOL <= t <= life[key][1] + TOL]
            alive.sort(key=lambda key: life[key][1] - life[key][0], reverse=True)
            for key in alive:
                how = _how(problem, key[0], life[key][1] - life[key][0])
                if how is None:
                    continue
                treat[key] = how
                added = True
                excess -= _saving(problem, key[0], how)
                if excess <= TOL:
                    break
    return added


def _label(base: str, treat: dict[tuple[int, int], str]) -> str:
    off = sum(1 for h in treat.values() if h == "offload")
    rec = len(treat) - off
    parts = [f"{off} offloads"] if off else []
    parts += [f"{rec} recomputes"] if rec else []
    return f"adaoffload({base}, {', '.join(parts) or 'no offload'})"


def adaoffload_plan(problem: Problem, problem_key: str | None = None) -> Plan:
    return adaoffload_outcome(problem).plan(problem_key)


def pipeoffload_plan(problem: Problem, problem_key: str | None = None) -> Plan:
    return pipeoffload_outcome(problem).plan(problem_key)


def adaoffload_outcome(problem: Problem) -> Outcome:
    """Dense schedule, then offload/recompute the longest-lived activations until every device fits."""
    opts = problem.options
    if not (opts.offload or opts.recompute):
        raise NotApplicable("adaoffload needs options.offload or options.recompute")
    best: Outcome | None = None
    last_error: DoesNotFit | None = None
    bases = dense_bases(problem)
    if is_large(problem):  # only the most promising bases, to keep best_heuristic quick
        bases = bases[:2]
    for base, orders in bases:
        treat: dict[tuple[int, int], str] = {}
        for _ in range(MAX_ROUNDS):
            schedule = schedule_of(problem, orders, treat)
            timing = simulate(problem, schedule)
            peaks = peaks_of(problem, schedule, timing)
            if not over_limit(problem, peaks):
                best = better(best, evaluate(problem, schedule, _label(base, treat), timing))
                break
            if best is not None and timing.makespan >= best.makespan:
                break  # already slower than a plan that fits; more offload will not help
            if not _grow(problem, timing, schedule, treat, peaks):
                last_error = DoesNotFit(f"adaoffload({base}) cannot fit: " + ", ".join(
                    f"device {d} needs {peaks[d]:.1f} MiB > limit {problem.limit_of(d):.1f} MiB"
                    for d in over_limit(problem, peaks)), peaks)
                break
    if best is None:
        raise last_error or NotApplicable("adaoffload: no dense schedule applies to this placement")
    return best


def _throttled_uniform(problem: Problem) -> Outcome:
    """Uniform offload on 1F1B (one stage per device) where a forward waits until its device has
    memory: what a runtime does when the host link cannot keep up. The fixed orders above simply
    overflow then (at half memory with 3-ms copies none of them fits), so without this the slow-link
    comparison would have no PipeOffload figure at all. W right after B (1F1B) or filling gaps."""
    if problem.chunks != 1 or not problem.options.split_backward:
        raise NotApplicable("throttled uniform offload: one stage per device with split backward")
    uniform = {k for k in range(problem.num_stages - 1) if problem.stages[k].offloadable_mib > 0}
    best: Outcome | None = None
    for variant in engine_variants(problem):
        if variant.cap.name != "1f1b":
            continue  # greedy's engine settings with 1F1B's warm-up cap
        cfg = variant.config(problem)
        treat = replace(cfg.memory, treat=lambda k, i: "offload" if k in uniform else None)
        schedule = run_engine(problem, replace(cfg, memory=treat))
        if schedule is not None:
            try:
                label = f"pipeoffload(uniform, throttled, {variant.label})"
                best = better(best, evaluate(problem, schedule, label, prune_transfers=False))
            except (DoesNotFit, ScheduleError):
                continue
    if best is None:
        raise NotApplicable("throttled uniform offload blocked")
    return best


def pipeoffload_outcome(problem: Problem, uniform_only: bool = False) -> Outcome:
    """PipeOffload (Wan et al., ICML 2025) on the published orders.

    Implemented from the paper: offloading activations to the host while the pipeline computes,
    uniform (every activation but the last stage's, whose backward follows at once) and selective
    (only activations that live longer than their round trip: the long-lived ones of the early
    stages/chunks, the paper's criterion for a better-than-linear peak reduction), on the base orders
    in PEER_BASES (ZB-H1, 1F1B, interleaved 1F1B, ZB-V; GPipe when none applies), with each reload
    started just in time before its backward; and, for slow host links, uniform offload on 1F1B with
    forwards held until memory frees (what a runtime does when the copies cannot keep up). The
    fastest that fits wins (`uniform_only`: of the uniform ones, the reference the benchmark uses).
    Not implemented: the schedules the paper builds around offload and its combination of offload
    with other memory techniques under a throughput/memory trade-off; host-link contention between
    devices is not modelled (each device copies on its own lanes at offload_ms / reload_ms).
    """
    if not problem.options.offload:
        raise NotApplicable("pipeoffload needs options.offload")
    s, m = problem.num_stages, problem.num_microbatches
    best: Outcome | None = None
    last_error: DoesNotFit | None = None
    bases = [b for b in dense_bases(problem) if b[0] in PEER_BASES] \
        or [b for b in dense_bases(problem) if b[0] == "gpipe"]
    if is_large(problem):
        bases = bases[:1]
    for base, orders in bases:
        uniform = {(k, i): "offload" for k in range(s - 1) for i in range(m)
                   if problem.stages[k].offloadable_mib > 0}
        plain = schedule_of(problem, orders)
        life = _lifetimes(problem, simulate(problem, plain))
        selective = {key: "offload" for key in uniform
                     if life[key][1] - life[key][0] > problem.stages[key[0]].offload_ms
                     + problem.stages[key[0]].reload_ms + TOL}
        for kind, treat in (("uniform", uniform), ("selective", selective)):
            if uniform_only and kind != "uniform":
                continue
            try:
                best = better(best, evaluate(problem, schedule_of(problem, orders, treat),
                                             f"pipeoffload({kind}, {base}, {len(treat)} offloads)",
                                             prune_transfers=False))
            except DoesNotFit as exc:
                last_error = exc
    try:
        best = better(best, _throttled_uniform(problem))
    except (DoesNotFit, NotApplicable) as exc:
        last_error = last_error or exc
    if best is None:
        raise last_error or NotApplicable("pipeoffload: no base schedule applies")
    return best
