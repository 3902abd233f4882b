"""Plans in the formats other tools read: PyTorch's pipeline schedule CSV and Chrome/Perfetto traces.

Pure functions (no torch import): the service serves them over HTTP and the client feeds them to the
runtime, so neither needs torch to produce them.

torch CSV (`torch.distributed.pipelining`, `_PipelineScheduleRuntime._load_csv(path, "compute_only")`):
one row per rank (row r = device r), one action per cell, `{stage}{type}{mb}`. Our compute kinds map
F -> F, B -> I (input gradient), W -> W, BW -> B (full backward). torch has no action for OFFLOAD,
RELOAD or RECOMPUTE, so they travel beside the CSV in `torch_memory_actions` (the (stage, mb) pairs to
offload or recompute); `client.torch_runtime` executes them at the places the plan puts them.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from .contract import Plan, Problem
from .memory import TimedOp, memory_curve
from .ops import KIND_BY_NAME, Kind, Lane, Op, choices_from_ops, lane_of, op_of

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
    stepping exactly as CONTRACT.md's memory model (planner.memory.memory_curve).
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
