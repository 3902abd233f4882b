"""Plans in the formats other tools read: PyTorch's pipeline schedule CSV and Chrome/Perfetto traces.

Pure functions (no torch import): the service serves them over HTTP and the client feeds them to the
runtime, so neither needs torch to produce them.

torch CSV (`torch.distributed.pipelining`, `_PipelineScheduleRuntime._load_csv(path, "compute_only")`):
one row per rank (row r = device r), one action per cell, `{stage}{type}{mb}`. Our compute kinds map
F -> F, B -> I (input gradient), W -> W, BW -> B (full backward). torch has no action for OFFLOAD,
RELOAD or RECOMPUTE, so they travel beside the CSV in `torch_memory_actions` (the (stage, mb) pairs to
offload or recompute); `client.torch_runtime` executes them at the places the plan puts them.

`torch_csv` writes the plan's own compute order (what pipeplan's runtime loads, memory actions beside
it). `torch_schedule` is what a CSV for torch's *stock* runtime (and torchtitan) must be instead:
  - compute order only, re-timed and validated: torch cannot offload or recompute, so the plan's
    memory actions are left out, and a plan whose compute order alone does not fit is refused
    (`ExportRefused`, naming the memory each device would need). Why not always refuse: many
    offload/recompute plans fit without them (the solver may offload where memory is merely
    tight), and for those torch runs the same order with more memory, which the notes say.
  - microbatches renumbered (one permutation on every rank) so the last stage runs its forwards as
    0..M-1: torch keeps each microbatch's loss in the order the last stage ran its forwards and
    reads it back by microbatch number, so any other order fails ("Loss for microbatch 2 is not
    available") or pairs losses with the wrong backward. Microbatches are interchangeable in a
    problem (no per-microbatch cost), so the renumbered plan is the same schedule and still valid.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from typing import Any

from .contract import Plan, Problem
from .memory import TimedOp, memory_curve, order_peak
from .ops import KIND_BY_NAME, Kind, Lane, Op, choices_from_ops, lane_of, op_of
from .simulator import DeviceOrder, Schedule, build_plan, simulate
from .validator import assert_valid

TORCH_ACTION = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}
MEMORY_ACTIONS_FORMAT = "pipeplan.torch-memory/v1"
_LANE_TID = {Lane.COMPUTE: 0, Lane.D2H: 1, Lane.H2D: 2}
_LANE_NAME = {Lane.COMPUTE: "compute", Lane.D2H: "offload (device->host)", Lane.H2D: "reload (host->device)"}


def _sorted_devices(plan: Plan):
    return sorted(plan.devices, key=lambda dp: dp.device)


def _ordered_ops(dp) -> list:
    """A device's ops by start time; ties keep the plan's listed order (the runtime order)."""
    return sorted(dp.ops, key=lambda p: p.start_ms)


def torch_actions(plan: Plan) -> list[list[str]]:
    """Per device (rank), its compute actions in execution order as torch action strings."""
    rows = []
    for dp in _sorted_devices(plan):
        rows.append([f"{p.stage}{TORCH_ACTION[KIND_BY_NAME[p.kind]]}{p.mb}" for p in _ordered_ops(dp)
                     if KIND_BY_NAME[p.kind] in TORCH_ACTION])
    return rows


def torch_csv(problem: Problem, plan: Plan) -> str:
    """The plan as torch's `compute_only` schedule CSV (rows = ranks 0..P-1).

    Rows have different lengths when stages differ in B/W splitting; torch's loader reads each row
    as-is, so no padding is written (an empty cell would be parsed as an idle step).
    """
    if len(plan.devices) != problem.num_devices:
        raise ValueError(f"plan.devices has {len(plan.devices)} entries; the problem has"
                         f" {problem.num_devices} devices")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for row in torch_actions(plan):
        writer.writerow(row)
    return buffer.getvalue()


class ExportRefused(ValueError):
    """The plan cannot be exported to that format; the message says why and what would work."""


MEMORY_KINDS = frozenset({Kind.OFFLOAD.value, Kind.RELOAD.value, Kind.RECOMPUTE.value})


@dataclass(frozen=True)
class TorchSchedule:
    """A plan as torch's stock runtime executes it (see the module docstring).

    `plan` is a validated plan of the same problem; `microbatch_order[i]` is the planned microbatch
    that runs as torch microbatch i; `left_out` counts the memory actions torch cannot run (0: torch
    runs the plan as planned, up to microbatch numbering); `notes` say what differs from the plan.
    """

    plan: Plan
    microbatch_order: list[int]
    left_out: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def as_planned(self) -> bool:
        return self.left_out == 0

    def csv(self, problem: Problem) -> str:
        return torch_csv(problem, self.plan)


def torch_schedule(problem: Problem, plan: Plan) -> TorchSchedule:
    """The plan ready for torch's `_PipelineScheduleRuntime` (and torchtitan): compute order only,
    last stage's forwards as microbatches 0..M-1. Raises ExportRefused when the compute order alone
    exceeds a memory limit."""
    notes: list[str] = []
    runs = plan
    offloads = sum(1 for dp in plan.devices for p in dp.ops if p.kind == Kind.OFFLOAD.value)
    recomputes = sum(1 for dp in plan.devices for p in dp.ops if p.kind == Kind.RECOMPUTE.value)
    if offloads or recomputes:
        counts = ((offloads, "offload"), (recomputes, "recompute"))
        actions = " and ".join(f"{n} {what}(s)" for n, what in counts if n)
        runs = _compute_order_only(problem, plan, actions)
        worst = max(range(problem.num_devices),
                    key=lambda d: runs.peak_memory_mib[d] - plan.peak_memory_mib[d])
        bound = max(plan.lower_bound_ms, plan.solver_bound_ms or 0.0)
        notes.append(
            f"torch's runtime has no offload or recompute action: the plan's {actions} are left out. The"
            f" compute order alone fits every memory limit but needs more memory: device {worst} peaks at"
            f" {runs.peak_memory_mib[worst]:.0f} MiB (planned {plan.peak_memory_mib[worst]:.0f} MiB"
            f"{_limit_text(problem, worst)}); it takes {runs.makespan_ms:.2f} ms per iteration (planned"
            f" {plan.makespan_ms:.2f} ms; lower bound {bound:.2f} ms). pipeplan's runtime runs the plan as"
            " planned.")
    order = last_stage_forward_order(problem, runs)
    if order != list(range(problem.num_microbatches)):
        runs = relabel_microbatches(problem, runs, order)
        shown = ", ".join(map(str, order[:16])) + (", …" if len(order) > 16 else "")
        notes.append(
            "microbatches renumbered so that the last stage runs its forwards as 0..M-1 (torch keeps"
            " each loss in the order the last stage ran its forwards): torch microbatch i is the"
            f" plan's microbatch order[i], order = [{shown}]; the schedule is the same")
    return TorchSchedule(runs, order, offloads + recomputes, notes)


def _limit_text(problem: Problem, device: int) -> str:
    limit = problem.devices[device].memory_limit_mib
    return "" if limit is None else f", limit {limit:.0f} MiB"


def _compute_order_only(problem: Problem, plan: Plan, actions: str) -> Plan:
    """The plan without its memory actions, re-timed; ExportRefused if it no longer fits."""
    orders = [DeviceOrder(compute=[op_of(p) for p in _ordered_ops(dp) if p.kind not in MEMORY_KINDS])
              for dp in _sorted_devices(plan)]
    need = [order_peak(problem, d, order.compute) for d, order in enumerate(orders)]
    over = [f"device {d} would need {need[d]:.0f} MiB (limit {problem.limit_of(d):.0f} MiB)"
            for d in range(problem.num_devices) if need[d] > problem.limit_of(d) + 1e-6]
    if over:
        raise ExportRefused(
            f"torch's runtime has no offload or recompute action, and without the plan's {actions} its"
            " compute order does not fit: " + "; ".join(over)
            + ". Run this plan with pipeplan's runtime (pipeplan.client.torch_runtime.build_schedule),"
            " or plan again with options.offload and options.recompute false for torch's runtime")
    schedule = Schedule(orders)
    stripped = build_plan(problem, schedule, simulate(problem, schedule),
                          f"{plan.method}, compute order only", problem_key=plan.problem_key)
    return assert_valid(problem, stripped.model_copy(update={"revision": plan.revision}))


def last_stage_forward_order(problem: Problem, plan: Plan) -> list[int]:
    """The microbatches in the order the last stage runs their forwards."""
    last = problem.num_stages - 1
    device = next(dp for dp in plan.devices if dp.device == problem.stages[last].device)
    return [p.mb for p in _ordered_ops(device) if p.kind == Kind.F.value and p.stage == last]


def relabel_microbatches(problem: Problem, plan: Plan, order: list[int]) -> Plan:
    """`plan` with microbatch `order[i]` renamed i on every device (validated)."""
    if sorted(order) != list(range(problem.num_microbatches)):
        raise ValueError(f"order: {order} is not a permutation of 0..{problem.num_microbatches - 1}")
    new = {old: i for i, old in enumerate(order)}
    doc = plan.model_dump()
    for device in doc["devices"]:
        for op in device["ops"]:
            op["mb"] = new[op["mb"]]
    return assert_valid(problem, Plan.model_validate(doc))


def stage_layers(problem: Problem) -> list[list[str]]:
    """The layer types each stage holds, from the metadata the cost model writes (`partition`: one
    [first, end) range per stage over `layers`, the whole stack's layer types in order)."""
    partition, layers = problem.metadata.get("partition"), problem.metadata.get("layers")
    if not isinstance(partition, list) or not isinstance(layers, list):
        raise ExportRefused("metadata.partition and metadata.layers: the problem does not say which layers"
                            " each stage holds; a problem made from a model spec (`pipeplan problem`,"
                            " `pipeplan plan`) does")
    if len(partition) != problem.num_stages:
        raise ExportRefused(f"metadata.partition: {len(partition)} ranges for {problem.num_stages} stages")
    end = 0
    for k, rng in enumerate(partition):
        if not (isinstance(rng, list) and len(rng) == 2 and rng[0] == end and isinstance(rng[1], int)
                and rng[1] > rng[0]):
            raise ExportRefused(f"metadata.partition[{k}]: {rng!r} is not a non-empty range [first, end)"
                                f" starting at layer {end}")
        end = rng[1]
    if end != len(layers) or not all(isinstance(t, str) for t in layers):
        raise ExportRefused(f"metadata.layers: {len(layers)} layer types, but the partition covers {end}")
    return [layers[a:b] for a, b in partition]


def placement_of(problem: Problem) -> str | None:
    """The placement: "loop" (stage k on device k mod P), "v" (chunks zigzag: stage k and 2P-1-k share
    a device) or None (any other)."""
    p = problem.num_devices
    devices = [s.device for s in problem.stages]
    if devices == [k % p for k in range(problem.num_stages)]:
        return "loop"
    zigzag = [p - 1 - k % p if (k // p) % 2 else k % p for k in range(problem.num_stages)]
    return "v" if devices == zigzag else None


def torch_memory_actions(plan: Plan) -> dict[str, Any]:
    """The memory actions torch's CSV cannot carry: which (stage, mb) to offload or to recompute."""
    offload, recompute = set(), set()
    for dp in plan.devices:
        for p in dp.ops:
            if p.kind == Kind.OFFLOAD.value:
                offload.add((p.stage, p.mb))
            elif p.kind == Kind.RECOMPUTE.value:
                recompute.add((p.stage, p.mb))
    return {"format": MEMORY_ACTIONS_FORMAT, "problem_key": plan.problem_key, "revision": plan.revision,
            "offload": [list(x) for x in sorted(offload)], "recompute": [list(x) for x in sorted(recompute)]}


def _us(ms: float) -> float:
    return round(ms * 1000.0, 3)


def chrome_trace(problem: Problem, plan: Plan) -> dict[str, Any]:
    """Chrome trace event JSON (chrome://tracing, ui.perfetto.dev) of the plan.

    One process per device, one thread per lane (compute, device->host, host->device), complete events
    with the plan's real durations (trace time unit: microseconds), and a memory counter per device
    stepping exactly as the problem's memory model (docs/formats.md) (planner.memory.memory_curve).
    """
    events: list[dict[str, Any]] = []
    all_ops = [op_of(p) for dp in plan.devices for p in dp.ops]
    choices, errors = choices_from_ops(problem, all_ops)
    if errors:
        raise ValueError("plan does not match the problem: " + "; ".join(errors[:5]))
    for dp in _sorted_devices(plan):
        pid = dp.device
        limit = problem.devices[pid].memory_limit_mib
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"device {pid}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for lane, tid in _LANE_TID.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": _LANE_NAME[lane]}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        timed = []
        for p in _ordered_ops(dp):
            kind = KIND_BY_NAME[p.kind]
            timed.append(TimedOp(Op(kind, p.stage, p.mb), p.start_ms, p.end_ms))
            events.append({
                "ph": "X", "name": f"{kind.value} s{p.stage} mb{p.mb}", "cat": kind.value,
                "pid": pid, "tid": _LANE_TID[lane_of(kind)],
                "ts": _us(p.start_ms), "dur": _us(p.end_ms - p.start_ms),
                "args": {"kind": kind.value, "stage": p.stage, "mb": p.mb,
                         "start_ms": p.start_ms, "end_ms": p.end_ms},
            })
        for time_ms, level in memory_curve(problem, pid, timed, choices):
            args = {"used_mib": level}
            if limit is not None:
                args["limit_mib"] = limit
            events.append({"ph": "C", "name": "memory", "pid": pid, "tid": 0, "ts": _us(time_ms),
                           "args": args})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "problem_key": plan.problem_key, "revision": plan.revision, "method": plan.method,
            "status": plan.status, "makespan_ms": plan.makespan_ms, "lower_bound_ms": plan.lower_bound_ms,
            "bubble_ratio": plan.bubble_ratio, "peak_memory_mib": plan.peak_memory_mib,
        },
    }


_MEASURED_TID = {Lane.COMPUTE: 10, Lane.D2H: 11, Lane.H2D: 12}
_COMM_TID = 13


def chrome_trace_compared(problem: Problem, plan: Plan, trace: Any) -> dict[str, Any]:
    """The plan's Chrome trace with the measured run beside it (`trace`: a `pipeplan.trace/v1`).

    Each device shows its planned lanes (compute, device->host, host->device) and, below them, the
    measured ones plus a lane of the pipeline's sends and receives; measured events carry their
    planned start and end in `args`, so a slice shows how far it drifted.
    """
    doc = chrome_trace(problem, plan)
    events = doc["traceEvents"]
    planned = {(p.kind, p.stage, p.mb): p for dp in plan.devices for p in dp.ops}
    origin = min((op.start_ms for d in trace.devices for op in d.ops), default=0.0)
    for device in trace.devices:
        pid = device.device
        names = {**{tid: f"measured {_LANE_NAME[lane]}" for lane, tid in _MEASURED_TID.items()},
                 _COMM_TID: "measured sends/receives"}
        for tid, name in names.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        for op in device.ops:
            comm = op.kind not in Kind.__members__
            tid = _COMM_TID if comm else _MEASURED_TID[lane_of(KIND_BY_NAME[op.kind])]
            args: dict[str, Any] = {"kind": op.kind, "stage": op.stage, "mb": op.mb,
                                    "start_ms": op.start_ms - origin, "end_ms": op.end_ms - origin}
            if (p := planned.get((op.kind, op.stage, op.mb))) is not None:
                args.update(planned_start_ms=p.start_ms, planned_end_ms=p.end_ms)
            if op.memory_mib is not None:
                args["memory_mib"] = op.memory_mib
            events.append({"ph": "X", "name": f"{op.kind} s{op.stage} mb{op.mb}", "cat": f"measured {op.kind}",
                           "pid": pid, "tid": tid, "ts": _us(op.start_ms - origin),
                           "dur": _us(op.end_ms - op.start_ms), "args": args})
    doc["otherData"].update(measured_makespan_ms=trace.makespan_ms, trace_device_kind=trace.device_kind,
                            trace_clock=trace.clock)
    return doc
