"""Zero-bubble schedules (Qi et al., 2023) built by the list-scheduling engine.

ZB-H1 keeps 1F1B's warm-up (at most S-k forwards of stage k ahead of its backwards) and lets W passes
fill the bubbles; ZB-H2 doubles the warm-up (2(S-k)-1) so the start-up bubble is filled with forwards
too. ZB-V places stage k and 2P-1-k on one device and runs both chunks under 1F1B's memory.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable

from ..contract import Problem
from ..ops import Kind, Op
from ..simulator import Schedule
from .common import NotApplicable, is_v_placement, require_one_chunk, require_split, schedule_of
from .engine import EngineConfig, run_engine

_CACHE: OrderedDict[tuple[str, str], Schedule | NotApplicable] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 8  # a few problems x their patterns; large schedules are megabytes each


def cached(build: Callable[[Problem], Schedule]) -> Callable[[Problem], Schedule]:
    """Memoize a pattern builder per problem: best_heuristic asks for the same pattern several times
    (as a baseline, as greedy's candidate, as an offload base). Callers never mutate the schedule."""

    @functools.wraps(build)
    def run(problem: Problem) -> Schedule:
        key = (build.__name__, problem.canonical_json())
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
        if hit is None:
            try:
                hit = build(problem)
            except NotApplicable as exc:
                hit = NotApplicable(exc.reason)  # without the traceback and its frames
            with _CACHE_LOCK:
                _CACHE[key] = hit
                while len(_CACHE) > _CACHE_SIZE:
                    _CACHE.popitem(last=False)
        if isinstance(hit, NotApplicable):
            raise NotApplicable(hit.reason)  # a fresh one: re-raising the cached object grows its traceback
        return hit

    return run



def unit_twin(problem: Problem) -> Problem:
    """The same placement and sizes with F = B = W = 1 and free links: the handcrafted patterns are
    defined on it, then re-timed with the real costs (as the peers' generators are)."""
    stages = [s.model_copy(update={"forward_ms": 1.0, "backward_input_ms": 1.0, "backward_weight_ms": 1.0,
                                   "recompute_ms": 1.0})
              for s in problem.stages]
    return problem.model_copy(update={"stages": stages, "p2p_ms": 0.0})


@cached
def zb_h1_schedule(problem: Problem) -> Schedule:
    """ZB-H1: 1F1B's warm-up, every W deferred into the bubbles (on the unit-cost pattern)."""
    require_split(problem, "zb-h1")
    require_one_chunk(problem, "zb-h1")
    s = problem.num_stages
    return _run(unit_twin(problem), EngineConfig(split=True, cap=[s - k for k in range(s)]))


@cached
def zb_h1_lean_schedule(problem: Problem) -> Schedule:
    """ZB-H1 at 1F1B's memory even when W holds the activation: W right after its B except for the
    last S microbatches, whose W's fill the cool-down (the ZB automatic scheduler's answer at 1p)."""
    require_split(problem, "zb-h1")
    require_one_chunk(problem, "zb-h1")
    s = problem.num_stages
    return _run(unit_twin(problem), EngineConfig(split=True, cap=[s - k for k in range(s)],
                                                 w_lag=[10**9] * s, w_tail=[s] * s))


@cached
def zb_h2_schedule(problem: Problem) -> Schedule:
    """ZB-H2: twice 1F1B's warm-up so forwards fill the start-up bubble; W's fill the rest."""
    require_split(problem, "zb-h2")
    require_one_chunk(problem, "zb-h2")
    s = problem.num_stages
    return _run(unit_twin(problem), EngineConfig(split=True, cap=[2 * (s - k) - 1 for k in range(s)],
                                                 w_lag=[10**9] * s, w_tail=[2 * s] * s))


def one_f_one_b_memory(problem: Problem) -> list[float]:
    """1F1B's per-device activation peak for the same model on P devices: the 1p budget of ZB-V."""
    p = problem.num_devices
    out = []
    for d in range(p):
        stages = problem.stages_of(d)
        mean = sum(problem.stages[k].activation_mib for k in stages) / len(stages)
        out.append(problem.devices[d].static_mib + p * mean * problem.chunks)
    return out


def _require_zb_v(problem: Problem) -> None:
    """ZB-V splits the backward and needs stage k and 2P-1-k on one device."""
    require_split(problem, "zb-v")
    if not is_v_placement(problem):
        raise NotApplicable("zb-v needs V placement: 2 stages per device, stage k and 2P-1-k together")


@cached
def zb_v_schedule(problem: Problem) -> Schedule:
    _require_zb_v(problem)
    budget = one_f_one_b_memory(problem)
    caps = [min(b, problem.limit_of(d)) for d, b in enumerate(budget)]
    return _run(problem, EngineConfig(split=True, mem_cap=caps, prefer_late_forward=True), "zb-v")


@cached
def zb_v_tight_schedule(problem: Problem) -> Schedule:
    """ZB-V without the later-chunk reserve: denser when it does not block (it may, then N/A)."""
    _require_zb_v(problem)
    twin = unit_twin(problem)
    caps = [min(b, problem.limit_of(d)) for d, b in enumerate(one_f_one_b_memory(twin))]
    return _run(twin, EngineConfig(split=True, mem_cap=caps, prefer_late_forward=True,
                                   chunk_reserve=False), "zb-v")


@cached
def zb_v_pattern_schedule(problem: Problem) -> Schedule:
    """ZB-V's pattern on the unit-cost twin (re-timed with the real costs by the caller)."""
    _require_zb_v(problem)
    twin = unit_twin(problem)
    budget = one_f_one_b_memory(twin)
    caps = [min(b, problem.limit_of(d)) for d, b in enumerate(budget)]
    return _run(twin, EngineConfig(split=True, mem_cap=caps, prefer_late_forward=True), "zb-v")


def _run(problem: Problem, cfg: EngineConfig, what: str = "zero-bubble") -> Schedule:
    schedule = run_engine(problem, cfg)
    if schedule is None:
        raise NotApplicable(f"{what}: the list scheduler could not place every op under its caps")
    return schedule


@cached
def zb_v_static_schedule(problem: Problem) -> Schedule:
    return _zb_v_static(problem, ("F0", "B1", "W", "F1", "B0", "W"))


@cached
def zb_v_static_lean_schedule(problem: Problem) -> Schedule:
    """The same order with the steady state as B1 W F0 B0 W F1: never more than 1F1B's memory in the
    W-holds-the-activation model, at about half a microbatch of extra time."""
    return _zb_v_static(problem, ("B1", "W", "F0", "B0", "W", "F1"))


def _zb_v_static(problem: Problem, main: tuple[str, ...]) -> Schedule:
    """ZB-V's hand-made order (after the paper's V schedule), for M >= 2P - 1.

    Device i (chunk 0 = stage i, chunk 1 = stage 2P-1-i): 2(P-i-1) F0; (i+1) x F0 F1;
    (P-i-1) x B1 W F1; (M-2P+i+1) x `main` (F0 B1 W F1 B0 W); (P-i-1) x B1 W F1 B0 W; (i+1) x B1 B0 W;
    (P-i-1) x W B0; then the remaining W's. W is always the oldest pending one. In the memory model
    where W holds the activation it peaks at 1F1B's memory plus one chunk activation.
    """
    _require_zb_v(problem)
    p, m = problem.num_devices, problem.num_microbatches
    if m < 2 * p - 1:
        raise NotApplicable(f"zb-v's hand-made order needs M >= 2P-1 = {2 * p - 1}")
    orders: list[list[Op]] = [[] for _ in range(p)]
    for i in range(p):
        orders[problem.stages[i].device] = _v_device_order(i, p, m, main)
    return schedule_of(problem, orders)


def _v_device_order(i: int, p: int, m: int, main: tuple[str, ...]) -> list[Op]:
    """The compute order of the device holding stages i and 2P-1-i (see _zb_v_static)."""
    chunk = {"0": i, "1": 2 * p - 1 - i}
    count = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}
    pending: list[Op] = []
    order: list[Op] = []

    def put(*names: str) -> None:
        for name in names:
            if name == "W":
                if pending:
                    order.append(pending.pop(0))
                continue
            k, j = chunk[name[1]], count[name]
            count[name] += 1
            if name[0] == "F":
                order.append(Op(Kind.F, k, j))
            else:
                order.append(Op(Kind.B, k, j))
                pending.append(Op(Kind.W, k, j))

    for _ in range(2 * (p - i - 1)):
        put("F0")
    for _ in range(i + 1):
        put("F0", "F1")
    for _ in range(p - i - 1):
        put("B1", "W", "F1")
    for _ in range(m - 2 * p + i + 1):
        put(*main)
    for _ in range(p - i - 1):
        put("B1", "W", "F1", "B0", "W")
    for _ in range(i + 1):
        put("B1", "B0", "W")
    for _ in range(p - i - 1):
        put("W", "B0")
    while pending:
        put("W")
    return order
