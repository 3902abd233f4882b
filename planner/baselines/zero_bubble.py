"""Zero-bubble schedules (Qi et al., 2023, "Zero Bubble Pipeline Parallelism").

The published hand-made orders are explicit per-device compute orders, like classic.one_f_one_b_orders;
the simulator times them with the real costs:

- ZB-H1 (paper §2.1): 1F1B's warm-up, the backward split into B and W, and stage k's W's delayed by k
  microbatches (torch's ScheduleInterleavedZeroBubble does the same with num_1f1b_microbatches = rank).
  Every device then holds min(S, M) microbatches in flight (forward done, W not done), as 1F1B's first
  device does, and the uniform-cost makespan drops from (M+S-1)(F+B+W) to M(F+B+W) + (S-1)F.
- ZB-H2 (paper §2.2): twice the warm-up (2(S-k)-1 forwards) and W's delayed by 2k microbatches, so
  every device holds up to min(2S-1, M) in flight and, on uniform costs with free links and M >= 2S,
  never idles between its first and its last op.
- ZB-V (paper §6): two chunks in V placement within 1F1B's peak (`zb_v_schedule`).

The time-filled variants (`zb_fill_*`) are NOT published schedules: the
list-scheduling engine fills gaps with W's by time on the unit-cost twin. The greedy and the offload
baselines start from them; they are not peers and carry no peer's name. Nor is ZB-H1 fitted to
memory (`zb_memory_fit_schedule`), a greedy candidate: ZB-H1's order with shorter W lags.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable

from ..contract import Problem
from ..memory import order_peak
from ..ops import Kind, Op
from ..simulator import Schedule
from .common import NotApplicable, is_v_placement, require_one_chunk, require_split, schedule_of
from .engine import EngineConfig, ForwardPolicy, WPolicy, run_engine

Orders = list[list[Op]]

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
    """The same placement and sizes with F = B = W = 1 and free links: the zb-fill patterns are built
    on it, then re-timed with the real costs (as the peers' generators are)."""
    stages = [s.model_copy(update={"forward_ms": 1.0, "backward_input_ms": 1.0, "backward_weight_ms": 1.0,
                                   "recompute_ms": 1.0})
              for s in problem.stages]
    return problem.model_copy(update={"stages": stages, "p2p_ms": 0.0})


def zb_h1_orders(problem: Problem) -> Orders:
    """ZB-H1 as published: stage k runs S-k forwards before its first B, then B, W of the microbatch
    k earlier, F; the cool-down drains the last k W's.

    Every device peaks at min(S, M) microbatches in flight, 1F1B's first-device peak, so with
    identical stages (same activation, weight_grad and static memory everywhere) and one budget for
    all devices ZB-H1 fits wherever 1F1B fits. With heterogeneous memory figures a later device may
    need more than under 1F1B (1F1B holds S-k there, ZB-H1 holds S). With the same durations on every
    stage it is never slower than 1F1B; with uneven ones this fixed order can be (tests/test_peers.py).
    """
    require_split(problem, "zb-h1")
    require_one_chunk(problem, "zb-h1")
    s = problem.num_stages
    return _lagged_orders(problem, ahead=[s - k for k in range(s)], lag=list(range(s)))


def zb_h2_warmup(problem: Problem) -> list[int]:
    """ZB-H2's forwards before the first B, per stage: 2(S-k)-1, twice 1F1B's count less one."""
    s = problem.num_stages
    return [2 * (s - k) - 1 for k in range(s)]


def zb_h2_orders(problem: Problem) -> Orders:
    """ZB-H2 as published: stage k runs 2(S-k)-1 forwards before its first B (forwards fill the
    start-up bubble) and delays its W's by 2k microbatches (they fill the cool-down: the trapezoid
    becomes a parallelogram). B, W, F in the steady state keeps the first device at 2S-1 in flight.
    """
    require_split(problem, "zb-h2")
    require_one_chunk(problem, "zb-h2")
    lag = [2 * k for k in range(problem.num_stages)]
    return _lagged_orders(problem, ahead=zb_h2_warmup(problem), lag=lag)


def _lagged_orders(problem: Problem, ahead: list[int], lag: list[int]) -> Orders:
    """Stage k: `ahead[k]` forwards, then per microbatch i: B(i), W(i - lag[k]), the next F; then the
    W's still owed. 1F1B's structure with the W's of each stage a fixed number of microbatches late."""
    orders: Orders = [[] for _ in range(problem.num_devices)]
    for k in range(problem.num_stages):
        orders[problem.stages[k].device] = _lagged_order(problem.num_microbatches, k, ahead[k], lag[k])
    return orders


def _lagged_order(m: int, k: int, ahead: int, lag: int) -> list[Op]:
    """One stage's order of `_lagged_orders`."""
    warm = min(m, ahead)
    order = [Op(Kind.F, k, i) for i in range(warm)]
    for i in range(m):
        order.append(Op(Kind.B, k, i))
        if i >= lag:
            order.append(Op(Kind.W, k, i - lag))
        if warm + i < m:
            order.append(Op(Kind.F, k, warm + i))
    order += [Op(Kind.W, k, j) for j in range(max(0, m - lag), m)]
    return order


@cached
def zb_memory_fit_schedule(problem: Problem) -> Schedule:
    """Not a published schedule: ZB-H1 fitted to each device's memory. Stage k runs 1F1B's S-k
    warm-up forwards and delays its W's by ZB-H1's k microbatches, or by as many as its device's
    memory holds if fewer. Not applicable where a device cannot hold 1F1B's warm-up (there offload
    and recompute decide), nor without memory limits (it is ZB-H1 there).

    A device's compute order fixes its peak (`memory.order_peak`) and the peak grows with the lag, so
    the lag is found by bisection on the order alone, before anything is timed. Real models at 1F1B's
    memory need this: ZB-H1 holds S microbatches on every device, which the devices with heavy stages
    (3 layers beside 2) cannot hold, while the list scheduler fills memory with warm-up forwards and
    starves the cool-down. Llama-3-70B on 32 GPUs at 1F1B's peak: 23,675 ms here, 24,964 the best
    engine variant, 23,471 the unlimited bound. Longer lags (up to ZB-H2's 2k, where memory allows)
    gave 24,022: the light stages' extra W's then run past the end of the backward chain."""
    require_split(problem, "zb-fill")
    require_one_chunk(problem, "zb-fill")
    if not problem.limited_devices():
        raise NotApplicable("zb memory-fit: without memory limits it is ZB-H1")
    s = problem.num_stages
    lag: list[int] = []
    for k in range(s):
        if _lag_fits(problem, k, k):
            lag.append(k)  # ZB-H1's own lag: one check (most devices, at P=64, M=512 too)
            continue
        if not _lag_fits(problem, k, 0):
            device = problem.stages[k].device
            raise NotApplicable(f"zb memory-fit: device {device} cannot hold 1F1B's warm-up")
        low, high = 0, k - 1  # bisection: the longest lag that fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if _lag_fits(problem, k, mid) else (low, mid - 1)
        lag.append(low)
    return schedule_of(problem, _lagged_orders(problem, [s - k for k in range(s)], lag))


def _lag_fits(problem: Problem, k: int, lag: int) -> bool:
    """Does stage k's 1F1B warm-up with W's `lag` microbatches late fit its device's limit?"""
    device = problem.stages[k].device
    order = _lagged_order(problem.num_microbatches, k, problem.num_stages - k, lag)
    return order_peak(problem, device, order) <= problem.limit_of(device) + 1e-6


@cached
def zb_fill_1p_schedule(problem: Problem) -> Schedule:
    """Not a published schedule: the engine on the unit-cost twin with 1F1B's warm-up cap, W right
    after its B except the last S microbatches', which fill the cool-down by time (what the ZB
    automatic scheduler answers at 1F1B's memory)."""
    require_split(problem, "zb-fill")
    require_one_chunk(problem, "zb-fill")
    s = problem.num_stages
    cfg = EngineConfig(split=True, forwards=ForwardPolicy(cap=[s - k for k in range(s)]),
                       weights=WPolicy(lag=[10**9] * s, tail=[s] * s))
    return _run(unit_twin(problem), cfg)


@cached
def zb_fill_2p_schedule(problem: Problem) -> Schedule:
    """Not a published schedule: ZB-H2's warm-up cap on the engine, W's filling gaps by time."""
    require_split(problem, "zb-fill")
    require_one_chunk(problem, "zb-fill")
    s = problem.num_stages
    cfg = EngineConfig(split=True, forwards=ForwardPolicy(cap=zb_h2_warmup(problem)),
                       weights=WPolicy(lag=[10**9] * s, tail=[2 * s] * s))
    return _run(unit_twin(problem), cfg)


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


def _run(problem: Problem, cfg: EngineConfig) -> Schedule:
    schedule = run_engine(problem, cfg)
    if schedule is None:
        raise NotApplicable("zb-fill: the list scheduler could not place every op under its caps")
    return schedule


def zb_v_orders(problem: Problem) -> Orders:
    """ZB-V as published (paper §6; torch's ScheduleZBVZeroBubble generates the same order): two
    chunks in V placement, every device at most 2P chunk activations in flight, i.e. P full
    microbatches, what 1F1B's first device holds for the same model on P devices.

    Device i (chunk 0 = stage i, chunk 1 = stage 2P-1-i), with n = max(M, 2P-1) microbatches:
    2(P-i)-1 F0; i x F1 F0; (P-i) x F1 B1 W1; then F0 B0 W0 F1 B1 W1 until every forward is placed
    (F0 left out once all n are done); cool-down i x B0 B1, (P-i) x B0 W0, then the owed W1's and
    W0's. Microbatches beyond M (when M < 2P-1) are dropped: the order stays valid, with bubbles.
    """
    _require_zb_v(problem)
    p, m = problem.num_devices, problem.num_microbatches
    orders: Orders = [[] for _ in range(p)]
    for i in range(p):
        order = _v_device_order(i, p, max(m, 2 * p - 1))
        orders[problem.stages[i].device] = [op for op in order if op.mb < m]
    return orders


@cached
def zb_v_schedule(problem: Problem) -> Schedule:
    """`zb_v_orders` as a (memoized) schedule: the baseline, a greedy candidate and an offload base."""
    return schedule_of(problem, zb_v_orders(problem))


def _v_device_order(i: int, p: int, n: int) -> list[Op]:
    """The compute order of the device holding stages i and 2P-1-i (see zb_v_orders)."""
    stage = {"0": i, "1": 2 * p - 1 - i}
    count = {name: 0 for name in ("F0", "F1", "B0", "B1", "W0", "W1")}
    order: list[Op] = []

    def put(*names: str) -> None:
        for name in names:
            order.append(Op(Kind(name[0]), stage[name[1]], count[name]))
            count[name] += 1

    put(*["F0"] * (2 * (p - i) - 1))
    for _ in range(i):
        put("F1", "F0")
    for _ in range(p - i):
        put("F1", "B1", "W1")
    while count["F1"] < count["F0"] or count["F0"] < n:
        if count["F0"] < n:
            put("F0")
        put("B0", "W0", "F1", "B1", "W1")
    for _ in range(i):
        put("B0", "B1")
    for _ in range(p - i):
        put("B0", "W0")
    put(*["W1"] * (count["B1"] - count["W1"]), *["W0"] * (count["B0"] - count["W0"]))
    return order
