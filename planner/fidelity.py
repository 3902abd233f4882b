"""Predicted vs measured: how well a plan held when it ran, and a problem calibrated from the run.

Pure functions over (problem, plan, trace). `fidelity` compares makespans and op durations per kind
and per stage and walks the measured critical path (which wait made each op on it start when it did);
`calibrated_problem` rewrites the problem's costs with the measured ones, so planning it again plans
for the hardware as it behaved, not as the cost model predicted.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any

from .contract import Plan, Problem
from .memory import held_until_w
from .ops import COMPUTE_KINDS, Kind, Op, choices_from_ops, deps, lane_of
from .trace import PIPEPLAN_RUNTIME, Trace, TraceOp

# a wait this much longer than every dependency explains is runtime overhead, not the plan's doing
SLACK_MS = 0.05


@dataclass
class KindError:
    """Planned vs measured duration of one op kind (or one stage), summed over its ops."""

    count: int
    planned_ms: float
    measured_ms: float

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.measured_ms - self.planned_ms) / self.planned_ms if self.planned_ms else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "planned_ms": self.planned_ms, "measured_ms": self.measured_ms,
                "error_pct": self.error_pct}


@dataclass
class PathStep:
    """One op of the measured critical path and what it waited for."""

    op: str
    device: int
    start_ms: float
    end_ms: float
    planned_start_ms: float
    planned_end_ms: float
    waited_for: str  # "lane" (the op before it on its lane), "dependency", or "start"
    gap_ms: float  # measured start minus what its binding predecessor allowed (runtime overhead)


@dataclass
class Fidelity:
    predicted_ms: float
    measured_ms: float
    by_kind: dict[str, KindError] = field(default_factory=dict)
    by_stage: dict[int, KindError] = field(default_factory=dict)
    critical_path: list[PathStep] = field(default_factory=list)

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.measured_ms - self.predicted_ms) / self.predicted_ms if self.predicted_ms else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "predicted_ms": self.predicted_ms, "measured_ms": self.measured_ms, "error_pct": self.error_pct,
            "by_kind": {k: e.to_dict() for k, e in self.by_kind.items()},
            "by_stage": {str(k): e.to_dict() for k, e in self.by_stage.items()},
            "critical_path": [vars(s) for s in self.critical_path],
        }


def _op(kind: str, stage: int, mb: int) -> Op:
    return Op(Kind(kind), stage, mb)


def fidelity(problem: Problem, plan: Plan, trace: Trace) -> Fidelity:
    """Compare `trace` with `plan` (check them with `planner.trace.check_trace` first)."""
    measured = trace.plan_ops()
    planned = {(p.kind, p.stage, p.mb): (dp.device, p) for dp in plan.devices for p in dp.ops}
    report = Fidelity(predicted_ms=plan.makespan_ms, measured_ms=trace.makespan_ms)
    for key, (_, p) in planned.items():
        m = measured.get(key)
        if m is None:
            continue
        for table, index in ((report.by_kind, p.kind), (report.by_stage, p.stage)):
            entry = table.setdefault(index, KindError(0, 0.0, 0.0))
            entry.count += 1
            entry.planned_ms += p.end_ms - p.start_ms
            entry.measured_ms += m.end_ms - m.start_ms
    report.by_stage = dict(sorted(report.by_stage.items()))
    report.critical_path = critical_path(problem, plan, trace)
    return report


def critical_path(problem: Problem, plan: Plan, trace: Trace) -> list[PathStep]:
    """From the op that ended last, back through whatever each op waited for, to the first op.

    An op's binding predecessor is the one (the previous op on its lane, or a dependency plus its
    link time) that allowed the latest start; the gap between that and the measured start is time
    the runtime added on its own.
    """
    measured = trace.plan_ops()
    if not measured:
        return []
    device_of = {(p.kind, p.stage, p.mb): dp.device for dp in plan.devices for p in dp.ops}
    planned_at = {(p.kind, p.stage, p.mb): p for dp in plan.devices for p in dp.ops}
    choices, _ = choices_from_ops(problem, [_op(*k) for k in device_of])
    previous: dict[tuple, tuple] = {}
    for d in trace.devices:
        lanes: dict[Any, list[TraceOp]] = {}
        for op in d.ops:
            if (op.kind, op.stage, op.mb) in planned_at:
                lanes.setdefault(lane_of(Kind(op.kind)), []).append(op)
        for ops in lanes.values():
            ops.sort(key=lambda o: o.start_ms)
            for before, after in itertools.pairwise(ops):
                previous[(after.kind, after.stage, after.mb)] = (before.kind, before.stage, before.mb)
    key = max(measured, key=lambda k: measured[k].end_ms)
    path: list[PathStep] = []
    seen: set = set()
    while key is not None and key not in seen and key in measured:
        seen.add(key)
        m = measured[key]
        candidates: list[tuple[float, str, tuple]] = []
        if key in previous:
            candidates.append((measured[previous[key]].end_ms, "lane", previous[key]))
        if (key[1], key[2]) in choices:
            for dep in deps(problem, _op(*key), choices):
                dk = (dep.before.kind.value, dep.before.stage, dep.before.mb)
                if dk in measured:
                    candidates.append((measured[dk].end_ms + dep.lag_ms, "dependency", dk))
        binding = max(candidates, default=None, key=lambda c: c[0])
        p = planned_at[key]
        path.append(PathStep(op=f"{key[0]}({key[1]},{key[2]})", device=device_of[key], start_ms=m.start_ms,
                             end_ms=m.end_ms, planned_start_ms=p.start_ms, planned_end_ms=p.end_ms,
                             waited_for=binding[1] if binding else "start",
                             gap_ms=max(0.0, m.start_ms - binding[0]) if binding else 0.0))
        key = binding[2] if binding else None
    path.reverse()
    return path


_FIELDS = {"F": "forward_ms", "B": "backward_input_ms", "W": "backward_weight_ms",
           "RECOMPUTE": "recompute_ms", "OFFLOAD": "offload_ms", "RELOAD": "reload_ms"}


def runtime_overhead_samples(problem: Problem, trace: Trace) -> list[float]:
    """Gaps between back-to-back compute ops on one device whose next op was ready: the time the
    runtime itself keeps the device between ops (dispatch, the sends it issues, its own bookkeeping).

    The next op counts as ready when every op it depends on had ended by the time the op before it
    ended (one on another device at least the problem's link time earlier), so a gap is not a wait.
    """
    measured = trace.plan_ops()
    keys = [k for k in measured if k[1] < problem.num_stages]
    choices, _ = choices_from_ops(problem, [_op(*k) for k in keys])
    device_of = {k: problem.stages[k[1]].device for k in keys}
    samples: list[float] = []
    for d in trace.devices:
        compute = sorted((o for o in d.ops if o.kind in _FIELDS or o.kind == "BW"), key=lambda o: o.start_ms)
        compute = [o for o in compute if Kind(o.kind) in COMPUTE_KINDS]
        for before, after in itertools.pairwise(compute):
            key = (after.kind, after.stage, after.mb)
            if key not in device_of or (after.stage, after.mb) not in choices:
                continue
            ready = True
            for dep in deps(problem, _op(*key), choices):
                dk = (dep.before.kind.value, dep.before.stage, dep.before.mb)
                if dk not in measured:
                    continue
                lag = dep.lag_ms if device_of.get(dk) != device_of[key] else 0.0
                if measured[dk].end_ms + lag > before.end_ms + 1e-9:
                    ready = False
                    break
            if ready:
                samples.append(max(0.0, after.start_ms - before.end_ms))
    return samples


def measured_costs(problem: Problem, traces: list[Trace]
                   ) -> tuple[list[dict[str, float]], float | None, float]:
    """Per stage, the median measured cost of each op kind; the measured link time; the runtime's
    overhead per compute op.

    The overhead is the median gap the runtime leaves between a compute op and the next one when
    that one was ready (`runtime_overhead_samples`); it is time the device is not free for the plan,
    so it is counted into every compute op's cost. A full backward (BW) counts as B + W in the
    planned ratio of the two. The link time is the median of cross-device waits: a consumer that sat
    idle until its producer on another device ended shows the link's real latency (end of producer
    to start of consumer, less the overhead already counted into the producer's cost).
    """
    samples: list[dict[str, list[float]]] = [{} for _ in problem.stages]
    gaps = [g for trace in traces for g in runtime_overhead_samples(problem, trace)]
    overhead = statistics.median(gaps) if gaps else 0.0
    links: list[float] = []
    for trace in traces:
        measured = trace.plan_ops()
        device_ops = {d.device: sorted((o for o in d.ops if o.kind in _FIELDS or o.kind == "BW"),
                                       key=lambda o: o.start_ms) for d in trace.devices}
        for (kind, k, _), m in measured.items():
            if k >= problem.num_stages:
                continue
            took = m.end_ms - m.start_ms + (overhead if Kind(kind) in COMPUTE_KINDS else 0.0)
            if kind == "BW":
                s = problem.stages[k]
                total = s.backward_input_ms + s.backward_weight_ms
                share = s.backward_input_ms / total if total else 1.0
                samples[k].setdefault("B", []).append(took * share)
                samples[k].setdefault("W", []).append(took * (1 - share))
            else:
                samples[k].setdefault(kind, []).append(took)
        idle_since = {}
        for ops in device_ops.values():
            compute = [o for o in ops if Kind(o.kind) in COMPUTE_KINDS]
            for before, after in zip([None] + compute, compute):
                idle_since[(after.kind, after.stage, after.mb)] = before.end_ms if before else float("-inf")
        for (kind, k, i), m in measured.items():
            producer = None
            if kind == "F" and k > 0:
                producer = ("F", k - 1, i)
            elif kind in ("B", "BW") and k + 1 < problem.num_stages:
                producer = next((c for c in (("B", k + 1, i), ("BW", k + 1, i)) if c in measured), None)
            if producer is None or producer not in measured or k >= problem.num_stages:
                continue
            if problem.stages[producer[1]].device == problem.stages[k].device:
                continue
            arrived = measured[producer].end_ms
            if idle_since.get((kind, k, i), float("inf")) <= arrived:  # the consumer was waiting on it
                links.append(max(0.0, m.start_ms - arrived - overhead))
    costs = [{kind: statistics.median(values) for kind, values in s.items() if values} for s in samples]
    return costs, (statistics.median(links) if links else None), overhead


def _backward_ran_in_w(costs: dict[str, float]) -> bool:
    """Whether the stage's whole backward ran in W: its B measured next to nothing (at most 5% of
    B + W), as torch runs the first stage, whose input needs no gradient."""
    b, w = costs.get("B"), costs.get("W")
    return b is not None and w is not None and w > 0 and b <= 0.05 * (b + w)


def calibrated_problem(problem: Problem, traces: list[Trace]) -> Problem:
    """`problem` with its durations replaced by the measured medians (options kept; memory kept,
    except that stages hold their activations from B to W where the traces came from pipeplan's
    runtime, whose split backward is torch's (memory.held_until_w), or where a stage's B measured
    next to nothing).

    Compute costs include the runtime's measured overhead per op (`measured_costs`), so the
    calibrated problem predicts the runtime as it ran, not only its kernels. Costs the traces did not
    measure keep the problem's values. The result records its origin (and that overhead) in
    `metadata.calibrated_from` (so it has its own key) and is a problem v1 like any other.
    """
    costs, link, overhead = measured_costs(problem, traces)
    doc = problem.model_dump(mode="json")
    for k, stage in enumerate(doc["stages"]):
        for kind, value in costs[k].items():
            stage[_FIELDS[kind]] = max(value, 1e-3) if kind in ("F", "B") else max(value, 0.0)
    if link is not None:
        doc["p2p_ms"] = link
    doc["metadata"] = {**doc.get("metadata", {}), "calibrated_from": {
        "problem_key": problem.key(), "traces": len(traces),
        "revisions": sorted({t.revision for t in traces}), "runtime_overhead_ms": overhead}}
    torch_split = any(t.metadata.get("runtime") == PIPEPLAN_RUNTIME for t in traces)
    held = None if torch_split else [k for k, c in enumerate(costs) if _backward_ran_in_w(c)]
    return held_until_w(Problem.model_validate(doc), held, whole_in_w=held if held is not None else (0,))


def retime(problem: Problem, plan: Plan) -> float:
    """The makespan `plan`'s orders would have under `problem`'s costs (e.g. a calibrated problem)."""
    from .simulator import schedule_from_plan, simulate

    return simulate(problem, schedule_from_plan(plan)).makespan


def synchronous_copies_makespan(problem: Problem, plan: Plan) -> float:
    """The makespan `plan` would have if its copies ran inline on compute (no overlap).

    Each OFFLOAD runs right after its F and before the next compute op; each RELOAD right before
    the compute op that was running when the plan starts it (after the F when that op is its own
    F) — where a runtime without copy lanes issues them. The difference from `plan.makespan_ms` is
    the overlap the plan counts on.
    """
    from .simulator import Gate, schedule_from_plan, simulate

    schedule = schedule_from_plan(plan)
    gates = []
    for dp in plan.devices:
        ops = sorted(dp.ops, key=lambda p: p.start_ms)
        compute = [_op(p.kind, p.stage, p.mb) for p in ops if Kind(p.kind) in COMPUTE_KINDS]
        starts = [p.start_ms for p in ops if Kind(p.kind) in COMPUTE_KINDS]
        position = {op: n for n, op in enumerate(compute)}
        chain: dict[int, list[Op]] = {}  # copies issued after compute op n, in issue order
        for p in ops:
            kind = Kind(p.kind)
            if kind is Kind.OFFLOAD:
                chain.setdefault(position[_op("F", p.stage, p.mb)], []).append(_op(p.kind, p.stage, p.mb))
            elif kind is Kind.RELOAD:
                running = max((n for n, s in enumerate(starts) if s <= p.start_ms + 1e-9), default=0)
                own_f = compute[running] == _op("F", p.stage, p.mb)
                chain.setdefault(running if own_f else running - 1, []).append(_op(p.kind, p.stage, p.mb))
        for n, copies in chain.items():
            previous = compute[n] if n >= 0 else None
            for copy in copies:
                if previous is not None:
                    gates.append(Gate(copy, previous, at_end=True))
                previous = copy
            if n + 1 < len(compute):
                gates.append(Gate(compute[n + 1], previous, at_end=True))
    schedule.gates = [g for g in schedule.gates if g.op.kind is not Kind.RELOAD] + gates
    return simulate(problem, schedule).makespan
