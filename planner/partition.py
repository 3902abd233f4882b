"""Partitions: which contiguous layers form each pipeline stage, and which device runs each stage.

Why here: cutting a model into stages is a concept of its own, used by the cost model's problem
assembly (a fixed strategy) and by the adaptive search (candidates to time). Layers are indexed over
the whole stack, embedding first and heads last; a partition is a list of [first, end) ranges, one per
stage. The partitioners read only what a costed layer tells them (`CostedLayer`), so they sit below
planner.costmodel.
"""

from __future__ import annotations

import math
from typing import Protocol

from .spec import Spec


class CostedLayer(Protocol):
    """What a partitioner needs to know of one layer (planner.costmodel.LayerCost has it)."""

    type: str
    forward_ms: float
    backward_input_ms: float
    activation_bytes: float
    static_bytes: float

    @property
    def total_ms(self) -> float: ...


def stage_device(stage: int, devices: int, placement: str) -> int:
    """Loop: stage k on device k mod P (Megatron interleaving). V: chunk c runs forward on even c
    and backward on odd c, so stage k and stage 2P-1-k share a device (ZB-V)."""
    chunk, pos = divmod(stage, devices)
    if placement == "v" and chunk % 2 == 1:
        return devices - 1 - pos
    return pos


def counts_to_ranges(counts: list[int]) -> list[list[int]]:
    """[first, end) ranges of consecutive layers from layers per stage."""
    ranges, start = [], 0
    for c in counts:
        ranges.append([start, start + c])
        start += c
    return ranges


def uniform_partition(types: list[str], stages: int) -> list[list[int]]:
    """Megatron-LM's default: the blocks split evenly (earlier stages take the remainder), the
    embedding joins the first stage and the LM head / MTP heads the last."""
    head = sum(1 for t in types[:1] if t == "embedding")
    tail = 0
    while tail < len(types) - head and types[len(types) - 1 - tail] in ("lm_head", "mtp_head"):
        tail += 1
    blocks = len(types) - head - tail
    if blocks < stages:  # too few blocks: fall back to spreading every layer
        base, extra = divmod(len(types), stages)
        return counts_to_ranges([base + (i < extra) for i in range(stages)])
    base, extra = divmod(blocks, stages)
    counts = [base + (i < extra) for i in range(stages)]
    counts[0] += head
    counts[-1] += tail
    return counts_to_ranges(counts)


def balanced_partition(weights: list[float], stages: int) -> list[list[int]]:
    """Contiguous split of `weights` into `stages` non-empty ranges minimising the largest sum
    (exact dynamic programme, O(stages·L²)); among optimal splits it prefers the smallest sum of
    squares so the slack is spread instead of piled onto the last stage."""
    n = len(weights)
    if n < stages:
        raise ValueError(f"partition: {n} layers cannot fill {stages} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (math.inf, math.inf)
    # best[j][i]: (max, sumsq) splitting the first i layers into j stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(1, stages + 1):
        for i in range(j, n - (stages - j) + 1):
            for p in range(j - 1, i):
                prev = best[j - 1][p]
                if prev[0] == math.inf:
                    continue
                w = prefix[i] - prefix[p]
                cand = (max(prev[0], w), prev[1] + w * w)
                if cand[0] < best[j][i][0] - 1e-12 or (
                        abs(cand[0] - best[j][i][0]) <= 1e-12 and cand[1] < best[j][i][1]):
                    best[j][i] = cand
                    cut[j][i] = p
    ranges, i = [], n
    for j in range(stages, 0, -1):
        p = cut[j][i]
        ranges.append([p, i])
        i = p
    return ranges[::-1]


def _inflight(stage: int, spec: Spec, placement: str, chunks: int) -> float:
    """Microbatches whose activation a stage holds at its peak under the usual schedules: 1F1B/ZB-H1:
    S - k; interleaved 1F1B: Megatron's warm-up (P-d-1)·2 + (c-1)·P + 1 forward chunks over the c
    stages of device d; ZB-V: about P per stage (its peak equals 1F1B's)."""
    p, m = spec.training.devices, spec.training.microbatches
    s = p * chunks
    if chunks == 1:
        return min(m, s - stage)
    if placement == "v":
        return min(m, p)
    d = stage_device(stage, p, placement)
    return min(m, ((p - d - 1) * 2 + (chunks - 1) * p + 1) / chunks)


class _MemoryModel:
    """Estimated peak memory of each device for a partition: static (weights, gradients, optimizer) plus
    each stage's activation times its in-flight microbatches (only the checkpointed stage input for
    all but one when offload/recompute are allowed). A pre-filter; the heuristics check the truth."""

    def __init__(self, spec: Spec, costs: list[CostedLayer], placement: str, chunks: int):
        t, p = spec.training, spec.training.devices
        self.placement, self.chunks, self.p = placement, chunks, p
        budgets = t.memory_budget_gib if isinstance(t.memory_budget_gib, list) else [t.memory_budget_gib] * p
        self.limit = [((b if b is not None else spec.hardware.hbm_gib) - t.reserved_gib) * 2.0**30
                      for b in budgets]
        self.reduce = t.offload or t.recompute
        par = spec.parallel_or_default
        # the stage input a recomputing stage keeps (per GPU: split over tp x cp)
        self.boundary = spec.model.micro_batch_size * spec.model.seq_len * spec.model.hidden * 2 / (par.tp * par.cp)
        self.held = [_inflight(k, spec, placement, chunks) for k in range(p * chunks)]
        self.static = _prefix([c.static_bytes for c in costs])
        self.act = _prefix([c.activation_bytes for c in costs])

    def stage(self, k: int, lo: int, hi: int) -> float:
        act = self.act[hi] - self.act[lo]
        extra = (min(self.boundary, act) if self.reduce else act) * max(0.0, self.held[k] - 1)
        return self.static[hi] - self.static[lo] + act + extra

    def excess(self, ranges: list[list[int]]) -> float:
        used = [0.0] * self.p
        for k, (lo, hi) in enumerate(ranges):
            used[stage_device(k, self.p, self.placement)] += self.stage(k, lo, hi)
        return sum(max(0.0, u - lim) for u, lim in zip(used, self.limit))


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def bottleneck_partition(spec: Spec, costs: list[CostedLayer], placement: str, chunks: int,
                         memory_aware: bool = True) -> list[list[int]] | None:
    """Contiguous split minimising the largest stage F+B+W time such that (when memory_aware) each
    device's estimated static + peak activation memory stays under its limit.

    Binary search on the bottleneck T; feasibility of T by a greedy pass that fills stage after stage
    as far as T and the device's memory allow (the classic min-max partition check, exact for time
    alone). Returns None when no T fits the memory estimate."""
    p = spec.training.devices
    n, stages = len(costs), p * chunks
    w = [c.total_ms for c in costs]
    mem = _MemoryModel(spec, costs, placement, chunks)

    def greedy(bound: float) -> list[list[int]] | None:
        used = [0.0] * p
        ranges, i = [], 0
        for k in range(stages):
            d = stage_device(k, p, placement)
            last_allowed = n - (stages - k - 1)
            j, total = i, 0.0
            while j < last_allowed:
                nt = total + w[j]
                if nt > bound + 1e-9 or (memory_aware and used[d] + mem.stage(k, i, j + 1) > mem.limit[d]):
                    break
                total, j = nt, j + 1
            if j == i or (k == stages - 1 and j < n):
                return None
            used[d] += mem.stage(k, i, j)
            ranges.append([i, j])
            i = j
        return ranges

    lo, hi = max(w), sum(w)
    if greedy(hi) is None:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        if greedy(mid) is None:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-6 * hi:
            break
    return greedy(hi)


class Proxy:
    """Analytic pipeline time of a partition, to rank partitions before simulating any.

    (memory excess MiB, M x max device load + fill, sum of squared device loads): the steady state of
    any 1F1B-like schedule is M times the busiest device's F+B+W per microbatch; the fill is about one
    microbatch's F+B chain x (P-1)/(P·chunks) (interleaving and V shrink it by the chunks); memory
    (the _MemoryModel estimate) is a hard constraint, hence first."""

    def __init__(self, spec: Spec, costs: list[CostedLayer], placement: str, chunks: int):
        self.p, self.m, self.n = spec.training.devices, spec.training.microbatches, len(costs)
        self.tot = _prefix([c.total_ms for c in costs])
        chain = sum(c.forward_ms + c.backward_input_ms for c in costs)
        self.fill = chain * (self.p - 1) / (self.p * chunks)
        self.mem = _MemoryModel(spec, costs, placement, chunks)
        self.dev = [stage_device(k, self.p, placement) for k in range(self.p * chunks)]

    def loads(self, cuts: list[int]) -> list[float]:
        load = [0.0] * self.p
        for k, (a, b) in enumerate(zip([0] + cuts, cuts + [self.n])):
            load[self.dev[k]] += self.tot[b] - self.tot[a]
        return load

    def score_cuts(self, cuts: list[int]) -> tuple[float, float, float]:
        load = self.loads(cuts)
        ranges = [[a, b] for a, b in zip([0] + cuts, cuts + [self.n])]
        return (round(self.mem.excess(ranges) / 2**20, 3), self.m * max(load) + self.fill,
                sum(x * x for x in load))

    def score(self, ranges: list[list[int]]) -> tuple[float, float, float]:
        return self.score_cuts([r[1] for r in ranges[:-1]])


def device_balanced_partition(spec: Spec, costs: list[CostedLayer], placement: str, chunks: int,
                              start: list[list[int]], max_rounds: int = 2000) -> list[list[int]]:
    """Local moves of layer boundaries minimising the analytic `Proxy` from `start`.

    With several stages per device the bottleneck is a device's *sum* of stages (a heavy LM-head stage
    should share its device with a light stage), which a per-stage min-max cannot see. Steepest
    descent over boundary moves; pure arithmetic, so thousands of moves cost milliseconds."""
    proxy = Proxy(spec, costs, placement, chunks)
    p, n, dev = proxy.p, proxy.n, proxy.dev
    score, loads = proxy.score_cuts, proxy.loads

    def neighbours(cuts: list[int]):
        """Every boundary +-1, and moving one layer from a stage of the busiest device to any other
        stage (the stages between keep their sizes and slide by one layer)."""
        bounds = [0] + cuts + [n]
        for i in range(len(cuts)):
            for delta in (-1, 1):
                c = cuts[i] + delta
                if bounds[i] < c < bounds[i + 2]:
                    yield cuts[:i] + [c] + cuts[i + 1:]
        load = loads(cuts)
        hot = max(range(p), key=load.__getitem__)
        for k in (k for k in range(len(dev)) if dev[k] == hot and bounds[k + 1] - bounds[k] >= 2):
            for t in range(len(dev)):
                if t < k:  # stage t grows at its end, stages t+1..k slide right
                    yield [c + 1 if t <= i < k else c for i, c in enumerate(cuts)]
                elif t > k:  # stage t grows at its start, stages k+1..t-1 slide left
                    yield [c - 1 if k <= i < t else c for i, c in enumerate(cuts)]

    cuts = [r[1] for r in start[:-1]]
    best = score(cuts)
    for _ in range(max_rounds):
        step = None
        for trial in neighbours(cuts):
            s = score(trial)
            if s < best and (step is None or s < step[0]):
                step = (s, trial)
        if step is None:
            break
        best, cuts = step
    return [[a, b] for a, b in zip([0] + cuts, cuts + [n])]


def partitions_for(spec: Spec, costs: list[CostedLayer], placement: str, chunks: int) -> dict[str, list[list[int]]]:
    """The starting partitions of one placement, by strategy name (duplicates dropped)."""
    stages = spec.training.devices * chunks
    out: dict[str, list[list[int]]] = {"uniform": uniform_partition([c.type for c in costs], stages)}
    out["balanced"] = balanced_partition([c.total_ms for c in costs], stages)
    mem = bottleneck_partition(spec, costs, placement, chunks)
    if mem is not None:
        out["bottleneck"] = mem
    for name in list(out):  # the device-level refinement of every start
        out[f"dev-{name}"] = device_balanced_partition(spec, costs, placement, chunks, out[name])
    seen, unique = set(), {}
    for name, ranges in out.items():
        key = tuple(map(tuple, ranges))
        if key not in seen:
            seen.add(key)
            unique[name] = ranges
    return unique

