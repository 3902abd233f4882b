"""Execution traces (`pipeplan.trace/v1`, docs/trace.md): what one iteration of a plan really did.

A trace is the measured twin of a plan: every op the plan schedules, with the start and end the
runtime measured on its device, plus the pipeline's sends and receives and the memory high-water
marks. Pure (no torch, no I/O): the client writes traces, the service stores them, and
`planner.fidelity` compares them with the plan and derives a calibrated problem from them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .contract import Plan, Problem, check_metadata

TRACE_FORMAT = "pipeplan.trace/v1"
PLAN_KINDS = ("F", "B", "W", "BW", "OFFLOAD", "RELOAD", "RECOMPUTE")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
# What pipeplan's runtime writes in a trace's `metadata.runtime`: its split backward is torch's
# (planner.fidelity.calibrated_problem reads it)
PIPEPLAN_RUNTIME = "pipeplan.client.torch_runtime"

# Times are clock readings in ms: a monotonic clock counts from boot (3e10 ms after a year up), CUDA
# events from the first one. Nothing larger is a reading, and differences of larger values lose every
# digit or overflow to infinity (start -1.7e308, end 1.7e308), so such a trace is refused, not stored.
MAX_CLOCK_MS = 1e13
MAX_MEMORY_MIB = 1e9  # as planner.contract.Limits.max_memory_mib
ClockMs = Field(ge=-MAX_CLOCK_MS, le=MAX_CLOCK_MS, allow_inf_nan=False)


class TraceOp(BaseModel):
    """One measured op: a plan op (compute or copy) or a pipeline send/receive.

    `memory_mib` is the device-memory high-water mark while the op ran (None if not measured); for a
    receive, `start_ms` is when it was posted and `end_ms` when its wait returned.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["F", "B", "W", "BW", "OFFLOAD", "RELOAD", "RECOMPUTE",
                  "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
    stage: int = Field(ge=0)
    mb: int = Field(ge=0)
    start_ms: float = ClockMs
    end_ms: float = ClockMs
    memory_mib: float | None = Field(None, ge=0, le=MAX_MEMORY_MIB, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> TraceOp:
        if self.end_ms < self.start_ms:
            raise ValueError(f"{self.kind}(stage {self.stage}, mb {self.mb}): end_ms {self.end_ms}"
                             f" is before start_ms {self.start_ms}")
        return self


class DeviceTrace(BaseModel):
    """One rank's measurements. `memory_source` says what `memory_mib` counts (docs/trace.md)."""

    model_config = ConfigDict(extra="forbid")

    device: int = Field(ge=0)
    ops: list[TraceOp]
    peak_memory_mib: float | None = Field(None, ge=0, le=MAX_MEMORY_MIB, allow_inf_nan=False)
    memory_source: Literal["cuda_allocator", "saved_tensors", "none"] = "none"


class Trace(BaseModel):
    """One measured iteration of plan (`problem_key`, `revision`) on every device."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["pipeplan.trace/v1"] = TRACE_FORMAT
    problem_key: str = Field(min_length=1, max_length=128)
    revision: int = Field(ge=1)
    iteration: int = Field(default=0, ge=0)
    clock: Literal["monotonic", "cuda_events"]
    device_kind: Literal["cpu", "cuda", "emulated"]
    makespan_ms: float = Field(ge=0, le=2 * MAX_CLOCK_MS, allow_inf_nan=False)
    devices: list[DeviceTrace] = Field(min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_metadata(value)
        return value

    @model_validator(mode="after")
    def _devices_distinct(self) -> Trace:
        seen = [d.device for d in self.devices]
        if len(set(seen)) != len(seen):
            raise ValueError(f"devices lists a device twice: {sorted(seen)}")
        return self

    def plan_ops(self) -> dict[tuple[str, int, int], TraceOp]:
        """The measured plan ops by (kind, stage, mb) (sends and receives left out)."""
        return {(op.kind, op.stage, op.mb): op for d in self.devices for op in d.ops if op.kind in PLAN_KINDS}


def measured_makespan(devices: list[DeviceTrace]) -> float:
    """Latest end minus earliest start over the plan ops (the makespan of docs/formats.md, measured)."""
    ops = [op for d in devices for op in d.ops if op.kind in PLAN_KINDS]
    if not ops:
        return 0.0
    return max(op.end_ms for op in ops) - min(op.start_ms for op in ops)


def check_trace(problem: Problem, plan: Plan, trace: Trace) -> list[str]:
    """Why `trace` is not a measurement of `plan` (empty when it is): keys, devices, op sets."""
    errors: list[str] = []
    if trace.problem_key != plan.problem_key:
        errors.append(f"problem_key: the trace is of {trace.problem_key[:12]}…, the plan of"
                      f" {plan.problem_key[:12]}…")
    if trace.revision != plan.revision:
        errors.append(f"revision: the trace ran revision {trace.revision}, the plan is revision {plan.revision}")
    planned = {(p.kind, p.stage, p.mb): dp.device for dp in plan.devices for p in dp.ops}
    measured: dict[tuple[str, int, int], int] = {}
    for d in trace.devices:
        if d.device >= problem.num_devices:
            errors.append(f"devices: device {d.device} does not exist (the problem has {problem.num_devices})")
        for op in d.ops:
            if op.kind not in PLAN_KINDS:
                continue
            key = (op.kind, op.stage, op.mb)
            if key in measured:
                errors.append(f"devices[{d.device}].ops: {op.kind}(stage {op.stage}, mb {op.mb}) appears twice")
            measured[key] = d.device
    missing = [k for k in planned if k not in measured]
    extra = [k for k in measured if k not in planned]
    moved = [k for k, dev in measured.items() if k in planned and planned[k] != dev]
    for name, keys in (("missing", missing), ("not in the plan", extra), ("on another device", moved)):
        if keys:
            shown = ", ".join(f"{k}(stage {s}, mb {i})" for k, s, i in sorted(keys)[:5])
            errors.append(f"ops {name}: {len(keys)} ({shown}{'…' if len(keys) > 5 else ''})")
    return errors
