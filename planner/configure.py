"""Plan the whole run: the parallel layout, the microbatching and the schedule, chosen together.

Given a spec (model, hardware, precision, sequence, framework settings) and a request (GPUs, GPUs per
node, global batch, constraints), the search enumerates every valid layout (planner.configure_space),
costs each one as an ordinary problem v1 (planner.costmodel), drops the layouts no schedule can fit
(planner.bounds.min_memory: a proof, not a guess), and ranks the rest by an upper bound on their
tokens/s per GPU -- the proven lower bound on the pipeline plus the smallest optimizer step. It then
schedules layouts in that order with the fast first plan (the published schedules that fit, else the
memory-aware greedy's top variant, else the serialized schedule) and stops as soon as the next
layout's upper bound cannot beat the `top`-th plan found: branch and bound, so the ranking of the
top is exact for the fast first plans, and no layout is skipped on a guess. Every skipped or lost
layout family gets its reason (out of memory with the least memory it needs, a bound below the
best, or the part of the iteration it loses: bubble, TP / EP / CP collectives, gradient reduction).

Ranking: tokens/s per GPU, higher first; ties (within 1e-9) by lower peak memory, then by the layout
tuple (planner.configure_space.Layout: less TP, CP, EP, PP first). The same input gives the same
document: nothing depends on time or on the order of threads (a count cap, `max_scheduled`, bounds
the work instead of a clock).

Pure: no I/O. Progress goes to a callback; the scheduler is injected (`plan_fn`) so the service can
store each candidate's first plan under its own key and leave refinement to its workers.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .baselines import DoesNotFit, NotApplicable, baseline_outcome
from .baselines.classic import serialized_schedule
from .baselines.common import evaluate
from .bounds import lower_bound, min_memory
from .configure_space import ConfigureRequest, Layout, enumerate_layouts, nearest_batches, spec_of
from .contract import DEFAULT_LIMITS, Limits, Plan, Problem
from .costmodel import LayerCost, build_problem, layer_costs, partition_for
from .iteration import iteration_ms
from .spec import CLUSTERS, MIB, Spec
from .validator import assert_valid

CONFIGURATIONS_FORMAT = "pipeplan.configurations/v1"
GIB = 1024.0
# The published schedules the fast first plan tries (as the service's first plan does), fastest
# iteration kept.
FAST = ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v")
REFINE_BOUND = ("memory_free",)
# The first layout scheduled (a ranked answer within seconds) is the best-bounded one whose memory with
# a 1F1B-like number of microbatches in flight is at most this share of the limit (likely to fit the
# published schedules), and whose pipeline has at most DIVE_OPS ops (scheduled in a second) when there
# is one.
DIVE_MEMORY = 0.8
DIVE_OPS = 16_384
Progress = Callable[[dict[str, Any]], None]
PlanFn = Callable[[Problem, str], Plan]


class ConfigureError(ValueError):
    """The request cannot be met: `field` names what to change, `hint` the nearest valid values."""

    def __init__(self, field: str, reason: str, **hint: Any):
        self.field, self.reason, self.hint = field, reason, hint
        super().__init__(f"{field}: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {"error": "bad_request", "field": self.field, "message": str(self), **self.hint}


# -- the fast first plan ------------------------------------------------------------------------------
def fast_plan(problem: Problem, key: str, validate: bool = True) -> Plan:
    """The fastest iteration among the published schedules that fit; else the greedy's most
    promising variant; else the serialized schedule (fits any budget above min_memory). Validated
    unless the caller validates it itself (the service's repository validates what it stores)."""
    best, best_rank = None, None
    for name in FAST:
        try:
            outcome = baseline_outcome(problem, name)
        except (NotApplicable, DoesNotFit):
            continue
        it = iteration_ms(problem, ((problem.stages[op.stage].device, op.kind, op.stage, s, e)
                                    for op, (s, e) in outcome.timing.times.items()))
        rank = (round(it, 9), round(outcome.makespan, 9), outcome.transfer_cost)
        if best_rank is None or rank < best_rank:
            best, best_rank = outcome, rank
    if best is None:
        from .baselines.greedy import greedy_tries, run_try, treatments

        best = run_try(problem, greedy_tries(problem, treatments(problem, pattern_fits=False))[0])
    if best is None:
        best = evaluate(problem, serialized_schedule(problem), "serialized")
    return best.plan(key, validate=validate)


# -- one scored layout --------------------------------------------------------------------------------
@dataclass
class Candidate:
    """A layout costed as a problem: its bounds, and its plan once scheduled."""

    layout: Layout
    spec: dict[str, Any]
    problem: Problem | None = None
    key: str = ""
    min_memory_mib: float = 0.0
    limit_mib: float = math.inf
    bound_ms: float = 0.0  # proven lower bound on the pipeline (makespan)
    iteration_bound_ms: float = 0.0  # ... on the whole iteration
    plan: Plan | None = None
    rejected: str | None = None  # why it is out of the ranking (None: ranked, or not reached)
    costs: list[LayerCost] = field(default_factory=list)

    @property
    def tokens_bound(self) -> float:
        """Upper bound on tokens/s per GPU (no plan of this layout does better): the tokens of one
        iteration, the same for every layout of a request, over its least iteration time."""
        tokens = self.layout.microbatches * self.layout.dp * self.layout.mbs * self.spec["model"]["seq_len"]
        gpus = self.layout.tp * self.layout.cp * self.layout.pp * self.layout.dp
        return tokens / (self.iteration_bound_ms / 1e3) / gpus

    @property
    def tokens(self) -> float:
        return self.plan.tokens_per_s_per_gpu or 0.0

    @property
    def peak_mib(self) -> float:
        return max(self.plan.peak_memory_mib)

    def rank_key(self) -> tuple:
        return (-round(self.tokens, 6), round(self.peak_mib, 3), self.layout)

    def breakdown(self) -> dict[str, float]:
        """Where the busiest device's iteration goes (ms): compute, exposed TP / EP / CP collectives,
        pipeline p2p (volume, per device), idle (bubble), and the tail after the pipeline (gradient
        reduction and optimizer step that did not hide)."""
        p, m = self.problem, self.problem.num_microbatches
        busy, comm = [0.0] * p.num_devices, [[0.0, 0.0, 0.0] for _ in range(p.num_devices)]
        part = p.metadata["partition"]
        for k, s in enumerate(p.stages):
            busy[s.device] += m * (s.forward_ms + s.backward_input_ms + s.backward_weight_ms)
            for c in self.costs[part[k][0]:part[k][1]]:
                for i in range(3):
                    comm[s.device][i] += m * c.comm_ms[i]
        d = max(range(p.num_devices), key=lambda i: busy[i])
        stages_per_device = p.num_stages // p.num_devices
        out = {"compute_ms": busy[d] - sum(comm[d]), "tp_ms": comm[d][0], "ep_ms": comm[d][1], "cp_ms": comm[d][2],
               "pipeline_p2p_ms": 2 * m * stages_per_device * p.p2p_ms if p.num_devices > 1 else 0.0,
               "dp_reduce_ms": max(sum(p.reduce_of(k) for k in p.stages_of(i)) for i in range(p.num_devices)),
               "optimizer_ms": max(p.optimizer_of(i) for i in range(p.num_devices))}
        if self.plan is not None:
            out["bubble_ms"] = max(0.0, self.plan.makespan_ms - busy[d])
            out["tail_ms"] = max(0.0, self.plan.end_ms - self.plan.makespan_ms)
        return {k: round(v, 3) for k, v in out.items()}


# -- the search ---------------------------------------------------------------------------------------
@dataclass
class Configurations:
    """The search's result: ranked candidates (best first), every scheduled one, and the rest."""

    request: ConfigureRequest
    spec: Spec
    gpus_per_node: int
    ranked: list[Candidate]
    scheduled: list[Candidate]
    rejected: list[Candidate]
    enumerated: int
    elapsed_s: float
    first_ranked_s: float | None
    complete: bool  # False when max_scheduled stopped the search before the bound did

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def to_document(self) -> dict[str, Any]:
        return configurations_document(self)


def _cluster(spec: Spec, request: ConfigureRequest) -> dict[str, Any]:
    cluster = spec.cluster_or_default
    if cluster is None:
        raise ConfigureError("cluster", "needed to place GPUs on custom hardware: give a preset"
                             f" ({', '.join(CLUSTERS)}) or the links")
    doc = cluster.model_dump(mode="json")
    if request.gpus_per_node is not None:
        doc["gpus_per_node"] = request.gpus_per_node
    return doc


def _check(spec: Spec, request: ConfigureRequest, gpus_per_node: int) -> None:
    if spec.model.dtype != "bf16":
        raise ConfigureError("model.dtype", f"the search costs bf16 / fp8 training (the calibrated estimate);"
                             f" got {spec.model.dtype}")
    if "fp8" in (request.precisions or [spec.precision]) and spec.hardware.fp8_tflops is None:
        raise ConfigureError("precisions", f"fp8 needs hardware.fp8_tflops ({spec.hardware.name} has none)")
    if request.gpus > gpus_per_node and request.gpus % gpus_per_node:
        raise ConfigureError("gpus", f"{request.gpus} GPUs do not fill whole nodes of {gpus_per_node};"
                             f" nearest: {request.gpus // gpus_per_node * gpus_per_node} or"
                             f" {(request.gpus // gpus_per_node + 1) * gpus_per_node}")


def _no_layout(spec: Spec, request: ConfigureRequest, gpus_per_node: int) -> ConfigureError:
    """Why the space is empty: the global batch (with the nearest batches that work), else the rest."""
    nearest = nearest_batches(request, spec, gpus_per_node)
    if nearest:
        return ConfigureError("global_batch", f"{request.global_batch} sequences do not split into data-parallel"
                              f" replicas x micro-batch sizes {sorted(set(request.micro_batch_sizes))} x microbatches"
                              f" for any layout on {request.gpus} GPUs; nearest valid: "
                              + " or ".join(map(str, nearest)), nearest_global_batch=nearest)
    return ConfigureError("gpus", f"no parallel layout of {spec.model.name} runs on {request.gpus} GPUs under the"
                          " constraints (tensor parallelism must divide the heads and fit a node, pipeline"
                          " parallelism the blocks)")


def configure(spec: Spec, request: ConfigureRequest, on_progress: Progress | None = None,
              plan_fn: PlanFn | None = None, limits: Limits = DEFAULT_LIMITS, max_scheduled: int = 200,
              stop: Callable[[], bool] | None = None) -> Configurations:
    """Search the configurations of `spec` for `request` (module docstring). Raises ConfigureError
    for a request no layout meets (naming the field and the nearest valid batch or least memory).

    Best-first branch and bound, lazily refined: every layout starts with a cheap bound from its
    layer costs alone (no partition: the busiest device does at least the average work, holds at
    least the average memory); the best one is costed in full (partition, problem, min_memory, the
    proven pipeline bound) and goes back with its tighter bound; a fully costed layout at the head of
    the queue is scheduled. The search ends when the head's bound cannot beat the `top`-th plan."""
    started = time.monotonic()
    report = on_progress or (lambda _event: None)
    validate = plan_fn is None  # an injected plan_fn validates (or its caller does, as the service's store)
    plan_fn = plan_fn or (lambda problem, key: fast_plan(problem, key, validate=False))
    cluster = _cluster(spec, request)
    gpus_per_node = cluster["gpus_per_node"]
    _check(spec, request, gpus_per_node)
    layouts = list(enumerate_layouts(spec, request, gpus_per_node))
    if not layouts:
        raise _no_layout(spec, request, gpus_per_node)
    report({"event": "space", "layouts": len(layouts)})

    shapes: dict[tuple, _Shape] = {}
    partitions: dict[tuple, list[list[int]]] = {}
    candidates, queue = [], []
    for layout in layouts:
        c = Candidate(layout, spec_of(spec, layout, request, cluster))
        candidates.append(c)
        ops = 4 * layout.stages * layout.microbatches
        if ops > limits.max_ops or layout.microbatches > limits.max_microbatches:
            c.rejected = f"too large to schedule: {ops} ops (limit {limits.max_ops})"
            continue
        try:
            shape = _shape(c, shapes)
        except ValueError as exc:  # never expected: the space keeps to the spec's rules
            c.rejected = f"not a valid spec: {exc}"
            continue
        c.costs = shape.costs
        c.min_memory_mib, c.limit_mib = shape.memory_floor(layout), shape.limit_mib
        if c.min_memory_mib > c.limit_mib + 1e-6:
            c.rejected = _oom(c)
            continue
        c.iteration_bound_ms = shape.work_floor(layout)
        heapq.heappush(queue, (-round(c.tokens_bound, 6), c.layout, c))
    report({"event": "bounded", "fitting": len(queue), "out_of_memory": sum(1 for c in candidates if _is_oom(c))})

    scheduled: list[Candidate] = []
    seen: dict[str, Candidate] = {}
    first_ranked = None
    complete = True

    def _schedule(c: Candidate) -> None:
        nonlocal first_ranked
        c.plan = plan_fn(c.problem, c.key)
        scheduled.append(c)
        first_ranked = first_ranked if first_ranked is not None else time.monotonic() - started
        ranked = sorted(scheduled, key=Candidate.rank_key)
        report({"event": "scored", "index": len(scheduled), "candidate": c.layout.name, "problem_key": c.key,
                "tokens_per_s_per_gpu": round(c.tokens, 1), "iteration_ms": round(c.plan.iteration_ms or 0.0, 3),
                "peak_memory_mib": round(c.peak_mib, 1), "rank": ranked.index(c) + 1,
                "best": ranked[0].layout.name, "best_tokens_per_s_per_gpu": round(ranked[0].tokens, 1),
                "elapsed_s": round(time.monotonic() - started, 3)})

    # A first answer within seconds: the layout with the best cheap bound among those whose average
    # memory leaves room is costed and scheduled at once. It only raises the bar the bound must beat,
    # so the ranking is the same with or without it.
    roomy = [c for _, _, c in sorted(queue) if shapes[_shape_key(c.layout)].in_flight_mib(c.layout)
             <= DIVE_MEMORY * c.limit_mib]
    dive = next((c for c in roomy if 4 * c.layout.stages * c.layout.microbatches <= DIVE_OPS), None) or \
        next(iter(roomy), None)
    if dive is not None:
        _refine(dive, shapes, partitions)
        if dive.min_memory_mib > dive.limit_mib + 1e-6:
            dive.rejected = dive.rejected or _oom(dive)
        elif not dive.rejected:
            seen[dive.key] = dive
            _schedule(dive)
    while queue:
        _, _, c = heapq.heappop(queue)
        if c.plan is not None or c.rejected:  # the dive's
            continue
        ranked = sorted(scheduled, key=Candidate.rank_key)
        if len(ranked) >= request.top and c.tokens_bound <= ranked[request.top - 1].tokens + 1e-9:
            bar = ranked[request.top - 1]
            for _, _, rest in [(None, None, c), *queue]:
                if rest.plan is None and not rest.rejected:
                    rest.rejected = (f"bound: at most {rest.tokens_bound:,.0f} tokens/s/GPU, not above the"
                                     f" {_ordinal(request.top)} best found ({bar.tokens:,.0f})")
            break
        if c.problem is None:  # cost it in full and put it back with its tighter bound
            _refine(c, shapes, partitions)
            if c.rejected:
                continue
            if c.min_memory_mib > c.limit_mib + 1e-6:
                c.rejected = _oom(c)
            elif c.key in seen:
                c.rejected = f"the same problem as {seen[c.key].layout.name}"
            else:
                seen[c.key] = c
                if scheduled:
                    heapq.heappush(queue, (-round(c.tokens_bound, 6), c.layout, c))
                    continue
                # the first layout that fits is scheduled at once: a ranked answer within seconds,
                # and a first bar for the bound (the ranking does not depend on it)
                _schedule(c)
            continue
        if len(scheduled) >= max_scheduled or (stop is not None and stop()):
            for _, _, rest in [(None, None, c), *queue]:
                if rest.plan is None and not rest.rejected:
                    rest.rejected = "not scheduled: the search's budget of scheduled layouts was spent"
            complete = False
            break
        _schedule(c)
    if not scheduled:
        raise _nothing_fits(candidates, limits)
    ranked = sorted(scheduled, key=Candidate.rank_key)
    if validate:  # what is returned: the ranked plans (the rest only give their figures to the document)
        for c in ranked[:request.top]:
            assert_valid(c.problem, c.plan, c.key)
    for i, c in enumerate(ranked[request.top:], start=request.top + 1):
        c.rejected = f"ranked {i}"
    result = Configurations(request, spec, gpus_per_node, ranked[:request.top], ranked,
                            [c for c in candidates if c.plan is None], len(layouts),
                            time.monotonic() - started, first_ranked, complete)
    report({"event": "done", "elapsed_s": round(result.elapsed_s, 3), "scheduled": len(scheduled),
            "best": result.best.layout.name, "tokens_per_s_per_gpu": round(result.best.tokens, 1)})
    return result


def score(spec: Spec, request: ConfigureRequest, layout: Layout, plan_fn: PlanFn | None = None) -> Candidate:
    """One layout costed and scheduled as the search would (e.g. a published layout, to say where it
    loses against the search's best). Raises ConfigureError when it does not fit in memory."""
    cluster = _cluster(spec, request)
    c = Candidate(layout, spec_of(spec, layout, request, cluster))
    _refine(c, {}, {})
    if c.rejected:
        raise ConfigureError("layout", c.rejected)
    if c.min_memory_mib > c.limit_mib + 1e-6:
        raise ConfigureError("layout", _oom(c), least_memory_mib=round(c.min_memory_mib, 1))
    c.plan = (plan_fn or fast_plan)(c.problem, c.key)
    return c


def refine(result: Configurations, seconds: float, count: int | None = None,
           on_progress: Progress | None = None, solve_fn: Callable[..., Plan] | None = None) -> Configurations:
    """Solve the best `count` candidates (default: the ranked ones) for `seconds` each, starting from
    their first plans, keep each solver plan whose iteration is shorter, and rank again. Timed, so,
    unlike the search, its outcome may differ between runs; the service does the same with one refine
    job per candidate on its workers."""
    if solve_fn is None:
        from .solver import solve

        def solve_fn(problem: Problem, key: str, hint: Plan, limit: float) -> Plan:
            return solve(problem, limit, hint=hint, problem_key=key).plan

    report = on_progress or (lambda _event: None)
    for c in result.ranked[:count if count is not None else len(result.ranked)]:
        plan = solve_fn(c.problem, c.key, c.plan, seconds)
        better = plan.end_ms < c.plan.end_ms - 1e-9
        if better:
            c.plan = plan
        report({"event": "refined", "candidate": c.layout.name, "improved": better,
                "tokens_per_s_per_gpu": round(c.tokens, 1), "method": c.plan.method})
    ranked = sorted(result.scheduled, key=Candidate.rank_key)
    result.scheduled, result.ranked = ranked, ranked[:result.request.top]
    return result


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _oom(c: Candidate) -> str:
    return (f"out of memory: any schedule needs at least {c.min_memory_mib / GIB:.1f} GiB per GPU, the limit is"
            f" {c.limit_mib / GIB:.1f} GiB")


def _is_oom(c: Candidate) -> bool:
    return (c.rejected or "").startswith("out of memory")


def _nothing_fits(candidates: list[Candidate], limits: Limits) -> ConfigureError:
    costed = [c for c in candidates if c.costs]
    if not costed:
        return ConfigureError("global_batch", "every layout has more microbatches than can be scheduled"
                              f" ({limits.max_ops} ops); use a smaller global batch or larger micro-batch sizes")
    least = min(costed, key=lambda c: (c.min_memory_mib, c.layout))
    return ConfigureError(
        "gpus", f"no layout fits in memory: every layout needs at least {least.min_memory_mib / GIB:.1f} GiB per"
        f" GPU (the least: {least.layout.name}), the limit is {least.limit_mib / GIB:.1f} GiB; use more GPUs, or"
        " allow offload and recompute", least_memory_mib=round(least.min_memory_mib, 1), least_memory_layout=least.layout.name)


@dataclass
class _Shape:
    """What every layout with the same per-GPU shape (tp, cp, ep, dp, micro-batch size, precision)
    shares: the layer costs, and from them floors that need no partition."""

    spec: Spec
    costs: list[LayerCost]
    limit_mib: float

    def memory_floor(self, layout: Layout) -> float:
        """MiB some device needs at least: the average over pp devices of the static memory, plus the
        activations of one microbatch when they can neither be offloaded nor recomputed (then
        min_memory of a device is its static memory plus all its stages' activations)."""
        t = self.spec.training
        static = sum(c.static_bytes for c in self.costs)
        act = 0.0 if (t.offload or t.recompute) else sum(c.activation_bytes for c in self.costs)
        return (static + act) / MIB / layout.pp * (1 - 1e-6)

    def in_flight_mib(self, layout: Layout) -> float:
        """An estimate, not a bound (it only picks the first layout to schedule): the average static
        memory plus min(pp, microbatches) microbatches' activations of a device's share, as 1F1B keeps
        on its first device."""
        static = sum(c.static_bytes for c in self.costs)
        act = sum(c.activation_bytes for c in self.costs)
        return (static + act * min(layout.pp, layout.microbatches)) / MIB / layout.pp

    def work_floor(self, layout: Layout) -> float:
        """ms the iteration lasts at least: the busiest device computes at least the average work of
        its microbatches (F + B + W of every layer over pp devices)."""
        work = sum(c.forward_ms + c.backward_input_ms + c.backward_weight_ms for c in self.costs)
        slack = 3 * 1e-4 * layout.stages  # stage times are rounded to 4 decimals in the problem
        return max(1e-9, (work - slack) * layout.microbatches / layout.pp * (1 - 1e-6))


def _shape_key(lay: Layout) -> tuple:
    return (lay.tp, lay.cp, lay.ep, lay.dp, lay.mbs, lay.precision)


def _shape(c: Candidate, shapes: dict[tuple, _Shape]) -> _Shape:
    key = _shape_key(c.layout)
    if key not in shapes:
        spec = Spec.model_validate(c.spec)
        t = spec.training
        budget = t.memory_budget_gib if t.memory_budget_gib is not None else spec.hardware.hbm_gib
        shapes[key] = _Shape(spec, layer_costs(spec), (budget - t.reserved_gib) * 1024)
    return shapes[key]


def _refine(c: Candidate, shapes: dict[tuple, _Shape], partitions: dict[tuple, list[list[int]]]) -> None:
    """Cost `c` in full: its partition (shared by layouts of one shape and stage count), problem,
    least memory and proven bound (the critical-path and device-work argument: the other quick
    arguments cost several times more and the plan carries them all anyway)."""
    lay = c.layout
    try:
        shape = _shape(c, shapes)
        spec = Spec.model_validate(c.spec)
    except ValueError as exc:  # never expected: the space keeps to the spec's rules
        c.rejected = f"not a valid spec: {exc}"
        return
    c.costs = shape.costs
    # the balanced partition reads only the layer times: layouts that differ in dp share it
    weights = tuple(round(x.total_ms, 12) for x in c.costs) if lay.partition == "balanced" else lay.partition
    part_key = (lay.stages, weights)
    if part_key not in partitions:
        partitions[part_key] = partition_for(spec, spec.partition, costs=c.costs)
    c.problem = build_problem(spec, partitions[part_key], costs=c.costs)
    c.key = c.problem.key()
    c.min_memory_mib = max(min_memory(c.problem))
    c.limit_mib = min(c.problem.limit_of(d) for d in range(c.problem.num_devices))
    if c.min_memory_mib <= c.limit_mib + 1e-6:
        c.bound_ms = lower_bound(c.problem, REFINE_BOUND)
        c.iteration_bound_ms = c.bound_ms + min(c.problem.optimizer_of(d) for d in range(c.problem.num_devices))


# -- the document ---------------------------------------------------------------------------------------
def candidate_document(c: Candidate, rank: int | None) -> dict[str, Any]:
    """One candidate as the configurations document lists it (docs/formats.md)."""
    lay, plan = c.layout, c.plan
    return {
        "rank": rank, "name": c.layout.name, "family": lay.family, "problem_key": c.key,
        "parallel": {k: v for k, v in c.spec["parallel"].items()},
        "training": {k: c.spec["training"][k] for k in ("devices", "microbatches", "placement", "chunks",
                                                       "offload", "recompute") if k in c.spec["training"]},
        "micro_batch_size": lay.mbs, "precision": lay.precision, "partition": c.spec["partition"],
        "tokens_per_s_per_gpu": round(c.tokens, 2), "iteration_ms": round(plan.end_ms, 3),
        "makespan_ms": round(plan.makespan_ms, 3), "lower_bound_ms": round(plan.lower_bound_ms, 3),
        "mfu": round(plan.mfu or 0.0, 4), "peak_memory_mib": round(c.peak_mib, 1),
        "min_memory_mib": round(c.min_memory_mib, 1), "bubble_ratio": round(plan.bubble_ratio, 4),
        "method": plan.method, "offloaded_mib": plan.offloaded_mib or 0.0, "recompute_ms": plan.recompute_ms or 0.0,
        "breakdown": c.breakdown(),
    }


LOSSES = {
    "compute_ms": "compute on the busiest GPU (its stages, micro-batch size, host floor)",
    "tp_ms": "TP collectives",
    "ep_ms": "expert all-to-alls",
    "cp_ms": "context-parallel ring",
    "bubble_ms": "pipeline bubble",
    "tail_ms": "gradient reduction and optimizer step after the pipeline",
}


def why_lost(c: Candidate, best: Candidate) -> str:
    """The part of the iteration where `c` loses most against the best (ms per iteration)."""
    mine, theirs = c.breakdown(), best.breakdown()
    excess = {k: mine.get(k, 0.0) - theirs.get(k, 0.0) for k in LOSSES}
    worst = max(excess, key=lambda k: (excess[k], k))
    return (f"{LOSSES[worst]}: {mine.get(worst, 0.0):,.0f} ms per iteration against {theirs.get(worst, 0.0):,.0f}"
            f" for the best")


def families(result: Configurations) -> list[dict[str, Any]]:
    """Every layout family (degrees) without a candidate in the ranking, and why it lost: its best
    scheduled layout's largest loss against the winner, else its best bound, else out of memory."""
    best = result.best
    top = {c.layout.family for c in result.ranked}
    groups: dict[str, list[Candidate]] = {}
    for c in result.scheduled + result.rejected:
        if c.layout.family not in top:
            groups.setdefault(c.layout.family, []).append(c)
    out = []
    for fam, members in sorted(groups.items()):
        planned = [c for c in members if c.plan is not None]
        bounded = [c for c in members if c.iteration_bound_ms > 0 and not _is_oom(c)]
        oom = [c for c in members if _is_oom(c)]
        if planned:
            c = min(planned, key=Candidate.rank_key)
            out.append({"family": fam, "reason": "slower", "best": c.layout.name,
                        "tokens_per_s_per_gpu": round(c.tokens, 1), "why": why_lost(c, best)})
        elif bounded:
            c = max(bounded, key=lambda c: (c.tokens_bound, c.layout))
            out.append({"family": fam, "reason": "bound", "best": c.layout.name,
                        "tokens_bound": round(c.tokens_bound, 1), "why": c.rejected})
        elif oom:
            c = min(oom, key=lambda c: (c.min_memory_mib, c.layout))
            out.append({"family": fam, "reason": "out_of_memory", "best": c.layout.name,
                        "least_memory_mib": round(c.min_memory_mib, 1), "why": c.rejected})
        else:
            out.append({"family": fam, "reason": "too_large", "best": members[0].layout.name,
                        "why": members[0].rejected})
    return out


def configurations_document(result: Configurations) -> dict[str, Any]:
    """The configurations document (`pipeplan.configurations/v1`, docs/formats.md)."""
    ranked = [candidate_document(c, i + 1) for i, c in enumerate(result.ranked)]
    return {
        "format": CONFIGURATIONS_FORMAT,
        "model": result.spec.model.name,
        "hardware": result.spec.hardware.name,
        "request": result.request.model_dump(mode="json"),
        "gpus_per_node": result.gpus_per_node,
        "candidates": ranked,
        "scored": [{"rank": i + 1, "name": c.layout.name, "problem_key": c.key,
                    "tokens_per_s_per_gpu": round(c.tokens, 2), "peak_memory_mib": round(c.peak_mib, 1),
                    "iteration_ms": round(c.plan.end_ms, 3)}
                   for i, c in enumerate(result.scheduled)],
        "rejected_families": families(result),
        "best_spec": result.best.spec,
        "stats": {"layouts": result.enumerated, "scheduled": len(result.scheduled),
                  "out_of_memory": sum(1 for c in result.rejected if (c.rejected or "").startswith("out of memory")),
                  "bounded": sum(1 for c in result.rejected if (c.rejected or "").startswith("bound")),
                  "complete": result.complete, "elapsed_s": round(result.elapsed_s, 3),
                  "first_ranked_s": None if result.first_ranked_s is None else round(result.first_ranked_s, 3)},
    }


__all__ = [
    "CONFIGURATIONS_FORMAT",
    "Candidate",
    "Configurations",
    "ConfigureError",
    "ConfigureRequest",
    "configurations_document",
    "configure",
    "fast_plan",
    "refine",
    "score",
    "why_lost",
]
