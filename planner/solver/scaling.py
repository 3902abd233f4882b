"""Integer units for the solvers: CP-SAT needs integer times and memory amounts.

Times are multiplied by `time_scale` and rounded *up*, so a solution's integer times, read back as
`start / time_scale` with the true float durations, always respect precedence and lane order (every
op really ends no later than the model says) and memory (frees come no later). When every duration
is a multiple of 1/time_scale the scaling is exact and the solver's bound is a bound of the problem.
Memory is rounded to the nearest unit; the validator has the last word on every plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..contract import Problem

_TIME_SCALES = (1, 2, 4, 5, 10, 20, 25, 40, 50, 100, 200, 250, 500, 1000)
# Without an exact scale, the shortest duration spans this many ticks: rounding then adds at most
# 0.1% per op; a seed's hint (convert._order_kept) gains about a tick per op of its longest chain.
TICKS_PER_SHORTEST = 1000.0
_MEM_SCALES = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 1000)


def _exact_scale(values: list[float], candidates: tuple[int, ...]) -> int | None:
    for s in candidates:
        if all(abs(v * s - round(v * s)) <= 1e-9 * max(1.0, abs(v * s)) for v in values):
            return s
    return None


@dataclass(frozen=True)
class Scale:
    time_scale: int
    time_exact: bool
    mem_scale: int

    def t(self, ms: float) -> int:
        """Duration in ticks, rounded up (see module docstring)."""
        x = ms * self.time_scale
        r = round(x)
        return r if abs(x - r) <= 1e-9 * max(1.0, abs(x)) else math.ceil(x)

    def m(self, mib: float) -> int:
        return round(mib * self.mem_scale)

    def ms(self, ticks: float) -> float:
        return ticks / self.time_scale


def time_values(problem: Problem) -> list[float]:
    vals = [problem.p2p_ms]
    for s in problem.stages:
        vals += [s.forward_ms, s.backward_input_ms, s.backward_weight_ms, s.recompute_ms or 0.0,
                 s.offload_ms or 0.0, s.reload_ms or 0.0]
    return vals


def scale_for(problem: Problem) -> Scale:
    """The smallest exact scale when there is one, else ticks fine enough for ~0.1% rounding."""
    tv = time_values(problem)
    ts = _exact_scale(tv, _TIME_SCALES)
    exact = ts is not None
    if ts is None:
        smallest = min((v for v in tv if v > 0), default=1.0)
        ts = int(min(1e5, max(1.0, TICKS_PER_SHORTEST / smallest)))
    mv = []
    for s in problem.stages:
        mv += [s.activation_mib, s.weight_grad_mib, s.offloadable_mib or 0.0, s.checkpoint_mib,
               s.output_grad_mib or 0.0]
    for d in problem.devices:
        mv += [d.static_mib] + ([d.memory_limit_mib] if d.memory_limit_mib is not None else [])
    ms = _exact_scale(mv, _MEM_SCALES)
    if ms is None:
        biggest = max(mv + [1.0])
        ms = int(max(1, min(1000, 1e7 / biggest)))
    return Scale(ts, exact, ms)
