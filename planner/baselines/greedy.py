"""The memory-aware greedy scheduler: the list-scheduling engine on the real costs, told every device's
memory limit, tried with a few warm-up caps, W policies and offload/recompute sets (reloads always come
back in turn, see EngineConfig.reload_in_turn); the fastest variant that fits wins. When none fits,
the serialized schedule (which fits whenever the limits are at least bounds.min_memory) answers, so
greedy always returns a plan for a feasible budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from itertools import zip_longest
from typing import NamedTuple

from ..bounds.pipeline import first_backward_start, forward_head, one_stage_limited, round_trip
from ..contract import Plan, Problem
from ..ops import Kind, Op
from ..simulator import ScheduleError
from .classic import serialized_schedule
from .common import TIE_TOLERANCE, DoesNotFit, NotApplicable, Outcome, better, evaluate
from .engine import EngineConfig, Treat, run_engine
from .zero_bubble import (
    zb_fill_1p_schedule,
    zb_fill_2p_schedule,
    zb_h2_warmup,
    zb_memory_fit_schedule,
    zb_v_schedule,
)


def min_lifetime(problem: Problem, k: int) -> float:
    """Least time from F(k, i)'s end to its backward's start: the rest of the pipeline, both ways."""
    t = 0.0
    for j in range(k + 1, problem.num_stages):
        s = problem.stages[j]
        t += 2 * problem.link_ms(j - 1, j) + s.forward_ms + s.backward_input_ms
    return t


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


def reducing_treat(problem: Problem, mode: str) -> Treat | None:
    """Which activations the greedy reduces: every stage but the last whose activation waits longer
    than the offload round trip (for offload) or whose recompute frees memory (for recompute);
    "offload, crowded recompute" recomputes the crowded stages (`crowded`) and offloads the rest.
    Llama-3-8B in V placement over 8 GPUs at half of 1F1B's memory (the LM head beside the
    embedding stage on device 0): 7733 ms offloading or recomputing everything, 6761 ms so."""
    opts = problem.options
    chosen: dict[int, str] = {}
    for k in range(problem.num_stages - 1):
        s = problem.stages[k]
        wait = 2 * min_lifetime(problem, k)
        can_off = opts.offload and s.offloadable_mib > 0 and s.offload_ms + s.reload_ms < wait
        can_rec = opts.recompute and s.activation_mib - s.checkpoint_mib > 0
        if mode == "offload, crowded recompute" and can_rec and crowded(problem, k):
            chosen[k] = "recompute"
        elif mode in ("offload", "offload, crowded recompute") and can_off:
            chosen[k] = "offload"
        elif mode == "recompute" and can_rec:
            chosen[k] = "recompute"
        elif mode == "mixed" and (can_off or can_rec):
            chosen[k] = "offload" if can_off else "recompute"
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
    microbatches. Measured on the half-memory slow-link case (het P=8, M=32): 141.8 ms against 175.7
    for offloading every activation that waits longer than its round trip (115.0 against 117.0 since
    reloads come back in turn).
    """
    opts = problem.options
    if not (opts.offload or opts.recompute):
        return None
    period = _period(problem)
    chosen: dict[tuple[int, int], str] = {}
    for k in range(problem.num_stages - 1):
        s = problem.stages[k]
        d = s.device
        budget = slack * period * problem.free_mib(d) / problem.chunks
        to_b = first_backward_start(problem, k) - forward_head(problem, k) + s.backward_input_ms
        rest = s.weight_grad_mib * s.backward_weight_ms
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


def _period(problem: Problem) -> float:
    """Steady-state time per microbatch: the busiest device's compute for one microbatch."""
    return max(problem.work_ms(d) for d in range(problem.num_devices))


def slow_copies(problem: Problem) -> bool:
    """Would offloading every microbatch keep a copy lane at least half busy? Only then do shares
    beat offloading everything (measured: never with copies as fast as a forward)."""
    period = _period(problem)
    return problem.options.offload and any(
        problem.chunks * max(s.offload_ms or 0.0, s.reload_ms or 0.0) >= 0.5 * period for s in problem.stages)


# 1.0 never won: the estimate ignores warm-up and queueing. 0.4 won on real-model problems, where a
# copy takes 2-3 forwards (Llama-2-7B on 8 GPUs at 70% of 1F1B's memory: 2664 -> 2415 ms;
# Nemotron-H hybrid at 70%: 6298 -> 6013), eager or held depending on the case.
FRACTIONAL_SLACKS = (0.4, 0.6, 0.8)


def engine_variants(problem: Problem) -> list[tuple[str, EngineConfig]]:
    """Engine settings to try, most promising first (measured on the DESIGN.md section 4 cases)."""
    s = problem.num_stages
    split = problem.options.split_backward
    mem = [problem.limit_of(d) for d in range(problem.num_devices)] if problem.limited_devices() else None
    one_f_one_b = [s - k for k in range(s)]
    twice = zb_h2_warmup(problem)
    # several stages per device: midway between 1F1B's count over all S stages and one pass over
    # the P devices. A count cap keeps the warm-up from filling memory with early-chunk forwards
    # that starve the cool-down; "mem" alone does that, "2x" allows too many. First-plan gains
    # (greedy, every variant): Gemma-2-9B-like V at 40 GiB 3,582 -> 3,101 ms, Nemotron-H
    # interleaved at 70% 6,013 -> 5,889, Qwen2.5-7B interleaved at 70% 2,506 -> 2,380, at 1F1B's
    # memory 2,294 -> 2,233; no multi-chunk row got worse. With one stage per device it won
    # nothing and cost inline runs.
    mid = [(s - k + problem.num_devices) // 2 for k in range(s)]
    lean = ("lean", [10**9] * s, [s] * s)
    fill = ("fill", None, None)
    out = []
    if problem.chunks == 1:
        caps = [("1f1b", one_f_one_b), ("2x", twice)]
        if mem is not None and problem.options.offload:
            # memory alone as the cap: with offload, as many forwards run as copies make room for
            # (het P=8, M=32, half memory, fast link: 109.8 against 110.1 with a count cap)
            caps.append(("mem", None))
        grid = [(cap_name, cap, w, False, True) for w in (lean, fill) for cap_name, cap in caps]
    else:
        # several stages per device: finishing a microbatch's later chunk first (late) and letting
        # forwards use all memory (no later-chunk reserve) is usually fastest, but may block
        grid = [(cap_name, cap, w, late, reserve)
                for late, reserve in ((True, False), (True, True), (False, True), (False, False))
                for w in (fill, lean) for cap_name, cap in (("mid", mid), ("mem", None), ("2x", twice))]
    for cap_name, cap, (w_name, lag, tail), late, reserve in grid:
        if not split and w_name == "fill":
            continue
        name = f"{cap_name},{w_name}" if split else cap_name
        name += ",late" if late else ""
        name += "" if reserve or problem.chunks == 1 else ",tight"
        out.append((name, EngineConfig(split=split, cap=cap, mem_cap=mem, w_lag=lag, w_tail=tail,
                                       prefer_late_forward=late, chunk_reserve=reserve)))
    return out


def reducing_treatments(problem: Problem) -> list[tuple[str, Treat, bool]]:
    """(label, treatment, eager forwards) to try under a memory limit, in the order they won on the
    benchmark: on slow links the fractional shares, then offloading every long-lived activation, with
    forwards held for a reload's room as usual and then eager (`reserve_after_copies`: het P=8, M=32,
    quarter memory, 1-ms copies: 151.2 -> 111.3, the memory bound), then recompute. On big problems
    only the first few (treatment, variant) pairs run, so the likely winner comes first."""
    if not problem.limited_devices():
        return []
    offload = reducing_treat(problem, "offload")
    crowd = None
    if problem.options.offload and problem.options.recompute and any(
            crowded(problem, k) for k in range(problem.num_stages - 1)):
        crowd = reducing_treat(problem, "offload, crowded recompute")
    fractional = []
    if slow_copies(problem):
        fractional = [(f"fractional {slack:g}" + (", eager" if eager else ""),
                       fractional_treat(problem, slack), eager)
                      for slack in FRACTIONAL_SLACKS for eager in (False, True)]
    candidates = fractional + [("offload, crowded recompute", crowd, False),
                               ("offload, crowded recompute, eager", crowd, True),
                               ("offload", offload, False), ("offload, eager", offload, True),
                               ("recompute", reducing_treat(problem, "recompute"), False)]
    return [c for c in candidates if c[1] is not None]


def greedy_plan(problem: Problem, problem_key: str | None = None) -> Plan:
    return greedy_outcome(problem).plan(problem_key)


OPS_BUDGET = 40_000  # engine runs x ops: bounds greedy to a few engine runs at P=32, M=128


PATTERNS = (("greedy(zb-fill 1p pattern)", zb_fill_1p_schedule),
            ("greedy(zb-fill 2p pattern)", zb_fill_2p_schedule),
            ("greedy(zb-v pattern)", zb_v_schedule),
            ("greedy(zb memory-fit pattern)", zb_memory_fit_schedule))


def inline_runs(problem: Problem) -> int:
    """How many engine variants the inline greedy tries (at least two): OPS_BUDGET ops in all."""
    return max(2, OPS_BUDGET // max(1, 3 * problem.num_stages * problem.num_microbatches))


class Attempt(NamedTuple):
    """One engine run of the greedy: a treatment (its label, the function, eager forwards) and an
    engine variant (its name, the config)."""

    treat_name: str
    treat: Treat | None
    eager: bool
    name: str
    config: EngineConfig


def greedy_tries(problem: Problem, treats: list[tuple[str, Treat | None, bool]]) -> list[Attempt]:
    """The attempts in the order greedy runs them (the inline run stops after `inline_runs`): the
    fractional shares round-robin among themselves, every other treatment variant by variant in its
    own order, and the two streams alternate.

    All fractional variants first spent the whole inline budget on them on real-model problems
    (Llama-2-13B on 16 GPUs at 24 GiB: 13 runs, 5126 ms, where plain offload's fifth variant gives
    4856); a plain round-robin over every treatment instead missed offload's third variant at
    P=32, M=128, half memory (455.3 against 443.8 with three inline runs)."""
    variants = engine_variants(problem)
    shares = [(name, cfg, t) for name, cfg in variants for t in treats if t[0].startswith("fractional")]
    others = [(name, cfg, t) for t in treats if not t[0].startswith("fractional") for name, cfg in variants]
    merged = [x for pair in zip_longest(shares, others) for x in pair if x is not None]
    return [Attempt(t[0], t[1], t[2], name, cfg) for name, cfg, t in merged]


def greedy_outcome(problem: Problem, inline: bool = True, keep_going: Callable[[], bool] = lambda: True,
                   skip: int = 0, tolerance: float = TIE_TOLERANCE,
                   on_better: Callable[[Outcome], None] | None = None) -> Outcome:
    """Fastest fitting variant of the memory-aware engine, else the serialized schedule; among
    variants within `tolerance` (relative) of the fastest, the one that offloads fewer MiB, then
    recomputes less (common.better; each already pruned by common.evaluate).

    The zero-bubble patterns (the unit-cost ones re-timed, and ZB-H1 fitted to memory) are tried
    first: at 1F1B's memory they are often best. Engine variants follow, most promising first
    (reducing activations first when no pattern fits the limits); `inline` tries only
    `inline_runs` of them (and always until one fits), else all
    (for the solver, which has the time; `skip` leaves out the first ones, which the inline run
    already tried); `keep_going()` returning False ends the search with the best so far. With
    several stages per device the best late-forward variants then run again, waiting for urgent
    arrivals (`awaiting_tries`): as many runs again as inline, also for the solver, whose search
    needs the time more (all of them left none at P=16 under a memory limit: Qwen2.5-14B V at 70%
    stayed at its first plan, 5,362 ms, where the search had reached 5,338). The solver's run ends
    with the paced variants (`paced_tries`) and those holding room for the last stage (`held_tries`),
    each with its own awaiting pass, the busiest device's doubled cap (`busiest_tries`), the
    fixed orders of devices that hold one activation (`exclusive_tries`) and, last, the fastest
    attempts again with W's yielding to arriving backwards (`yielding_tries`). `on_better` sees each
    outcome that becomes the best, the last of them the result (the solver streams them: its extra
    passes take tens of seconds); only the serialized fallback is not seen.
    """
    best: Outcome | None = None

    def take(outcome: Outcome | None) -> None:
        """Keep `outcome` if it is better, and tell `on_better`."""
        nonlocal best
        previous, best = best, better(best, outcome, tolerance)
        if on_better is not None and best is not previous:
            on_better(best)

    pattern_fits = False
    for label, build in PATTERNS:
        try:
            take(evaluate(problem, build(problem), label))
            pattern_fits = True
        except (NotApplicable, DoesNotFit, ScheduleError):
            continue
    treats = treatments(problem, pattern_fits)
    tries = greedy_tries(problem, treats)
    inline_count = inline_runs(problem)
    budget = inline_count if inline else len(tries)

    def run(attempt: Attempt, late: list[tuple[float, Attempt]]) -> None:
        """Keep the attempt's outcome if it is better; note a late-forward variant's makespan in
        `late` (inf: it blocked, or was skipped as slower)."""
        # variants whose own timing is clearly slower are skipped (OWN_TIMING_SLACK): speed only
        outcome = run_try(problem, attempt, slower_than=best)
        take(outcome)
        if outcome is not None:
            ranked.append((outcome.makespan, attempt))
        if attempt.config.prefer_late_forward:
            late.append((outcome.makespan if outcome is not None else math.inf, attempt))

    def run_all(attempts: list[Attempt], late: list[tuple[float, Attempt]]) -> None:
        for attempt in attempts:
            if not keep_going():
                return
            run(attempt, late)

    late: list[tuple[float, Attempt]] = []
    ranked: list[tuple[float, Attempt]] = []  # every attempt that fit, with its makespan
    for runs, attempt in enumerate(tries[skip:], start=skip):
        if (runs >= budget or not keep_going()) and best is not None:
            break
        run(attempt, late)
    run_all(awaiting_tries(late)[:inline_count], [])
    if not inline:  # the solver's: paced, held (each awaiting too), busiest, fixed orders, yielding
        for extra in (paced_tries, held_tries):
            extra_late: list[tuple[float, Attempt]] = []
            run_all(extra(problem, treats), extra_late)
            run_all(awaiting_tries(extra_late)[:inline_count], [])
        run_all(busiest_tries(problem, treats), [])
        run_all(exclusive_tries(problem, treats), [])
        run_all(yielding_tries(ranked), [])
    if best is not None:
        return best
    return evaluate(problem, serialized_schedule(problem), "greedy(serialized)")


# Holding a forward back for an urgent arrival (EngineConfig.await_first_backward) was faster on 10 of
# the 15 solvable rows with several stages per device in bench/models.py and no faster on the other 5,
# so it is a second pass over the late-forward variants that ran, ranked by their own makespans, for
# the two best treatments only (that caught every gain but one of 0.4%, against every variant under
# every treatment). The first backward alone and with the later chunk's forward each won rows the
# other lost (Qwen2.5-14B V at 1F1B's memory 5,236 against 5,292 ms; Gemma-2-9B-like V there 2,929
# against 2,954); the later forward alone added 0.2% on one row.
AWAITS = (("await B", {"await_first_backward": True}),
          ("await B+F", {"await_first_backward": True, "await_later_forward": True}))


def awaiting_tries(late: list[tuple[float, Attempt]]) -> list[Attempt]:
    """The AWAITS versions of the late-forward attempts of the two best treatments, fastest first
    (then those that blocked or were skipped as slower, in their own order: a variant a few percent
    behind may lead once it waits)."""
    best_of: dict[str, float] = {}
    for makespan, attempt in late:
        best_of[attempt.treat_name] = min(makespan, best_of.get(attempt.treat_name, makespan))
    top = sorted(best_of, key=best_of.__getitem__)[:2]
    ranked = [a for _, a in sorted((x for x in late if x[1].treat_name in top), key=lambda x: x[0])]
    return [a._replace(name=f"{a.name},{label}", config=replace(a.config, **fields))
            for a in ranked for label, fields in AWAITS]


# The solver's last pass: the fastest attempts so far again, their W's yielding to arriving
# backwards off the busiest device (EngineConfig.w_yields). Its winners are rarely the winners
# without it, so it reruns several. The solver's greedy: Nemotron-H-8B-like interleaved at half memory
# 6,045 -> 6,023 ms, Llama-3-8B V at 70% 5,952 -> 5,922, at half memory 6,409 -> 6,392; 16 attempts
# found nothing more, and yielding in every attempt lost elsewhere (Qwen2.5-7B interleaved at 70%
# 2,338 -> 2,410, DeepSeek-like V 1,117 -> 1,121, Gemma-2-9B-like V 3,256 -> 3,262).
YIELD_TRIES = 8


def yielding_tries(ranked: list[tuple[float, Attempt]]) -> list[Attempt]:
    """The YIELD_TRIES fastest of `ranked` (makespan, attempt) again, their W's yielding."""
    top = sorted(ranked, key=lambda x: x[0])[:YIELD_TRIES]
    return [a._replace(name=f"{a.name},W yields", config=replace(a.config, w_yields=True)) for _, a in top]


def forward_pipe_depths(problem: Problem) -> list[int]:
    """Per device, how many microbatch periods a microbatch takes from the end of the device's first
    stage's forward to the start of its last stage's, with nobody in the way (at least 1)."""
    period = _period(problem)
    depths = []
    for d in range(problem.num_devices):
        first, last = problem.stages_of(d)[0], problem.stages_of(d)[-1]
        pipe = forward_head(problem, last) - forward_head(problem, first) - problem.stages[first].forward_ms
        depths.append(max(1, math.ceil(pipe / period - 1e-9)))
    return depths


def paces(problem: Problem) -> list[tuple[str, list[int]]]:
    """(label, EngineConfig.pace) to try: twice and three times each device's forward-pipe depth, and
    twice the deepest on every device (each won a row the others lost, below); no value twice."""
    depths = forward_pipe_depths(problem)
    out: dict[tuple[int, ...], str] = {}
    for label, pace in (("pace 2x", [2 * x for x in depths]), ("pace 3x", [3 * x for x in depths]),
                        ("pace 2x deepest", [2 * max(depths)] * len(depths))):
        out.setdefault(tuple(pace), label)
    return [(label, list(pace)) for pace, label in out.items()]


# Pacing is a third pass, for the solver only, over the late-forward variants that fill with W's and
# keep no later-chunk reserve ("fill,late,tight"), which won every paced row, then the awaiting pass
# over the paced ones. Its winners can be poor unpaced (Gemma at 70%: 26th-41st of 288 attempts;
# Qwen2.5-7B: one that blocks), so no shortlist of the first pass finds them. The solver's greedy on
# the 15 solvable rows of bench/models.py with several stages per device: Gemma-2-9B-like V at 70%
# 3,333 -> 3,256 ms, at 40 GiB 3,094 -> 3,049, Qwen2.5-7B interleaved at 70% 2,380 -> 2,349,
# Qwen2.5-14B V at 70% 5,362 -> 5,317. It won nothing on the other 11 rows and lost on every row whose
# memory needs no offload or recompute, so it runs only where activations must be offloaded or
# recomputed. Its cost: the solver's greedy takes 21-22 s at P=16 instead of 14-15 (25-29 with the
# variants that are not "late" paced too, which won nothing).
def _late_reducing(problem: Problem, treats: list[tuple[str, Treat | None, bool]]
                   ) -> tuple[list[tuple[str, Treat | None, bool]], list[tuple[str, EngineConfig]]]:
    """(reducing treatments, late-forward variants) for the solver's extra passes over several
    stages per device; nothing when there is one stage per device or nothing to reduce."""
    reducing = [t for t in treats if t[1] is not None]
    if problem.chunks == 1 or not reducing:
        return [], []
    return reducing, [(name, cfg) for name, cfg in engine_variants(problem) if cfg.prefer_late_forward]


def paced_tries(problem: Problem, treats: list[tuple[str, Treat | None, bool]]) -> list[Attempt]:
    """Paced versions of the "fill,late,tight" variants under every reducing treatment, pace by pace."""
    reducing, late = _late_reducing(problem, treats)
    variants = [(name, cfg) for name, cfg in late if cfg.w_lag is None and not cfg.chunk_reserve]
    return [Attempt(t[0], t[1], t[2], f"{name},{label}", replace(cfg, pace=pace))
            for label, pace in paces(problem) for t in reducing for name, cfg in variants]


# Where the last stage's activation is a large share of its device's free memory (the LM head beside
# the embedding stage in a V), a recompute or reload that starts there just before the head's forward
# arrives holds it up until that microbatch's backward; holding room for the head
# (EngineConfig.hold_last) is a fourth pass for the solver, over the late-forward variants under
# every reducing treatment, then its awaiting pass. The solver's greedy on bench/models.py: Llama-3-8B
# V at half 1F1B's memory (the head's activation 97% of device 0's free memory) 6,563 -> 6,408 ms,
# at 70% (30%) 5,986 -> 5,952; nothing on Gemma-2-9B-like V at 70% (86%), DeepSeek-like V (10%),
# Qwen2.5-7B interleaved (23%), and on the P=16 rows (20%) it cost 10-17 s of a 60-s solve for
# nothing, hence the share below which it is not tried.
HOLD_SHARE = 0.25


def held_tries(problem: Problem, treats: list[tuple[str, Treat | None, bool]]) -> list[Attempt]:
    """The late-forward variants under every reducing treatment, holding room for the last stage's
    forwards, where its device holds other stages too and its activation is HOLD_SHARE or more of
    that device's free memory."""
    head = problem.stages[-1]
    if head.activation_mib < HOLD_SHARE * problem.free_mib(head.device):
        return []
    reducing, late = _late_reducing(problem, treats)
    return [Attempt(t[0], t[1], t[2], f"{name},held", replace(cfg, hold_last=True))
            for t in reducing for name, cfg in late]


# One heavier device in the middle of a chain (Llama-3-70B's 80 layers over 16 GPUs: device 10 has
# 1.2x the others' work) idles under 1F1B's cap until its first backward comes back (1,068 ms there),
# and everything waits on it. Raising its cap alone to twice 1F1B's fills that wait: the solver's
# greedy 52,644 -> 52,521 ms, 52,416 at 60 s against 52,539. Raising the caps upstream as well, to
# feed it, was slower (52,950-53,149). No other row of bench/models.py and none of bench/quality.py's
# cases has such a device (where one stage is heavier it is the last, whose cap is 1 either way).
def busiest_tries(problem: Problem, treats: list[tuple[str, Treat | None, bool]]) -> list[Attempt]:
    """The "1f1b" variants with the cap of a uniquely busiest device's stage doubled, under every
    treatment (none for several stages per device, or when the busiest is not 5% above the rest)."""
    if problem.chunks != 1 or problem.num_devices < 2:
        return []
    work = sorted(((problem.work_ms(d), d) for d in range(problem.num_devices)), reverse=True)
    if work[0][0] < 1.05 * work[1][0]:
        return []
    k = problem.stages_of(work[0][1])[0]
    if k == problem.num_stages - 1:
        return []
    doubled = zb_h2_warmup(problem)[k]
    tries = []
    for name, cfg in engine_variants(problem):
        if name.startswith("1f1b") and cfg.cap is not None:
            cap = [doubled if j == k else c for j, c in enumerate(cfg.cap)]
            label = name.replace("1f1b", "1f1b, busiest 2x")
            tries += [Attempt(t[0], t[1], t[2], label, replace(cfg, cap=cap)) for t in treats]
    return tries


# A device whose memory holds one activation at a time (Llama-3-8B on the 40/26-GiB cluster, device
# 6: 9,983 MiB free, activations of 6,496) can keep a microbatch only if nothing else holds memory
# until its backward; what fits beside it are checkpoints. So the round trip of a kept microbatch is
# best filled with the forwards of q recomputed ones, whose recompute, backward and W follow its
# own, one at a time (bounds.exclusive_bound's argument: q = 2 where the trip is 2.1 forwards). No
# priority rule finds that order: the list scheduler recomputed everything there (8,192 ms) and the
# search reached 7,789-7,917 from it; the fixed order gives 7,651, against a bound of 7,574.
def exclusive_orders(problem: Problem) -> list[tuple[str, dict[int, list[Op]], set[tuple[int, int]]]]:
    """(label, fixed orders, recomputed pairs) for the one-stage devices, not the last, whose memory
    holds one activation at a time, where recompute is allowed: groups of one kept microbatch and q
    recomputed ones (forwards, then each backward and W), q from the trip in forwards."""
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
        out.append((f"exclusive q={q}", fixed, recomputed))
    return out


def exclusive_tries(problem: Problem, treats: list[tuple[str, Treat | None, bool]]) -> list[Attempt]:
    """Every engine variant under every treatment with the exclusive devices' fixed orders
    (`exclusive_orders`), their stages kept or recomputed as the orders say."""
    tries = []
    variants = engine_variants(problem)
    for label, fixed, recomputed in exclusive_orders(problem):
        stages = {op.stage for ops in fixed.values() for op in ops}
        for name, cfg in variants:
            tries += [Attempt(t[0], _fixed_treat(t[1], stages, recomputed), t[2], f"{name},{label}",
                              replace(cfg, fixed=fixed)) for t in treats]
    return tries


def _fixed_treat(base: Treat | None, stages: set[int], recomputed: set[tuple[int, int]]) -> Treat:
    """`base`, except on the stages of fixed orders: recomputed where the orders say, else kept."""
    def treat(k: int, i: int) -> str | None:
        if k in stages:
            return "recompute" if (k, i) in recomputed else None
        return base(k, i) if base is not None else None
    return treat


def treatments(problem: Problem, pattern_fits: bool) -> list[tuple[str, Treat | None, bool]]:
    """reducing_treatments plus none at all: first when a zero-bubble pattern already fits the limits."""
    reducing = reducing_treatments(problem)
    plain = ("", None, False)
    return reducing + [plain] if reducing and not pattern_fits else [plain] + reducing


# The engine's own timing is never earlier than the ASAP re-timing of its orders, and up to 1.3%
# later on the real-model suite (Llama-3-70B on 16 GPUs at 72 GiB: 53,128 own, 52,644 re-timed, which
# a 0% margin skipped). A variant is skipped only when its own timing is this much slower.
OWN_TIMING_SLACK = 0.03


def run_try(problem: Problem, attempt: Attempt, slower_than: Outcome | None = None) -> Outcome | None:
    """One attempt of greedy_tries, evaluated (pruned, memory checked): ASAP re-timing first, the
    engine's own timing if that breaks a limit. None when the engine blocks, nothing fits, or its own
    timing is clearly slower than `slower_than`."""
    treat_name, treat, eager, name, cfg = attempt
    # an op starting after the horizon ends after it too, so the engine may stop there
    # (against the best's makespan before its re-timing: this attempt's own timing is before one too)
    horizon = ((slower_than.before_retime_ms or slower_than.makespan) * (1 + OWN_TIMING_SLACK)
               if slower_than is not None else math.inf)
    schedule = run_engine(problem, replace(cfg, treat=treat, reload_in_turn=True, reserve_after_copies=eager),
                          give_up_after=horizon)
    if schedule is None:
        return None
    own = schedule.engine_timing  # type: ignore[attr-defined]
    if own.makespan > horizon:
        return None
    label = f"greedy({name}{', ' + treat_name if treat_name else ''})"
    for timing in (None, own):
        try:
            return evaluate(problem, schedule, label, timing)
        except (DoesNotFit, ScheduleError):
            continue
    return None
