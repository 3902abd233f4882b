"""Which runtimes execute a plan as planned, said once per plan so every export can say it.

- pipeplan's runtime (`pipeplan.client.torch_runtime`): everything, as planned.
- torch's stock `_PipelineScheduleRuntime` (and torchtitan, which runs it): the compute order only;
  as planned when the plan has no offload or recompute (`exports.torch_schedule`).
- torchtitan: as torch, when its placement (loop, or V with two stages per rank) and module split
  can express the problem (`torchtitan_args`).
- Every runtime built on torch's `PipelineStage` (pipeplan's, torch's, torchtitan's) splits the
  backward as torch does: B computes the input gradients with the graph retained for W, so a
  microbatch's saved activations stay until its W (on the first stage B does nothing and W runs
  the whole backward): more memory than planned where W comes late (docs/torch.md, "On a GPU").
- Megatron-LM: never the plan's op order (it runs its own schedule); it takes the partition and,
  as far as it can, the recompute choices (`megatron_args`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .contract import Plan, Problem
from .exports import ExportRefused, TorchSchedule, torch_schedule
from .megatron_args import megatron_export
from .memory import TimedOp, held_until_w, peak_memory
from .ops import Kind, choices_from_ops, op_of
from .torchtitan_args import module_fqns, schedule_class

RUNTIMES_FORMAT = "pipeplan.runtimes/v1"


@dataclass(frozen=True)
class RuntimeSupport:
    runtime: str  # "pipeplan" | "torch" | "torchtitan" | "megatron"
    runs: bool  # the runtime can run (something of) this plan
    as_planned: bool  # ... exactly as planned (microbatch numbering aside)
    note: str


def runtime_support(problem: Problem, plan: Plan) -> tuple[list[RuntimeSupport], TorchSchedule | None]:
    """One line per runtime, and the schedule torch would run (None when torch cannot run it)."""
    held, fits = _split_backward(problem, plan)
    out = [RuntimeSupport("pipeplan", True, fits, "pipeplan.client.torch_runtime runs the compute order and"
                          " every offload, reload and recompute where the plan puts them" + held)]
    schedule: TorchSchedule | None = None
    try:
        schedule = torch_schedule(problem, plan)
        # torch runs no memory actions: where the plan has none, torch's hold is pipeplan's
        torch_held, torch_fits = (held, fits) if not schedule.left_out else \
            _split_backward(problem, schedule.plan)
        note = (" ".join(schedule.notes) or "loads the exported CSV and runs the plan's order") + torch_held
        out.append(RuntimeSupport("torch", True, schedule.as_planned and torch_fits, note))
    except ExportRefused as exc:
        out.append(RuntimeSupport("torch", False, False, str(exc)))
    try:
        module_fqns(problem)
        name = schedule_class(problem)
        if schedule is None:
            raise ExportRefused("torch's runtime, which torchtitan uses, cannot run it (see torch)")
        out.append(RuntimeSupport("torchtitan", True, schedule.as_planned and torch_fits,
                                  f"torch's runtime with the exported CSV, placement from schedule {name}"
                                  + ("" if schedule.as_planned else "; compute order only (see torch)")
                                  + torch_held))
    except ExportRefused as exc:
        out.append(RuntimeSupport("torchtitan", False, False, str(exc)))
    try:
        megatron = megatron_export(problem, plan)
        out.append(RuntimeSupport("megatron", True, False, "takes the partition and placement (and the"
                                  " recompute choices, as far as it can); cannot express: "
                                  + "; ".join(megatron.cannot_express)))
    except ExportRefused as exc:
        out.append(RuntimeSupport("megatron", False, False, str(exc)))
    return out, schedule


def torch_peaks(problem: Problem, plan: Plan) -> list[float] | None:
    """Each device's peak memory (MiB) under torch's split backward, which keeps a microbatch's
    saved activations from its B to its W (memory.held_until_w), at the plan's own op times; None
    where the plan splits no backward (then torch holds what the plan does)."""
    ops = [op_of(p) for d in plan.devices for p in d.ops]
    if not any(op.kind is Kind.W for op in ops):
        return None
    held = held_until_w(problem)
    choices, _ = choices_from_ops(held, ops)
    peaks = [held.devices[d].static_mib for d in range(problem.num_devices)]
    for dp in plan.devices:
        timed = [TimedOp(op_of(p), p.start_ms, p.end_ms) for p in dp.ops]
        peaks[dp.device] = peak_memory(held, dp.device, timed, choices)
    return peaks


def _split_backward(problem: Problem, plan: Plan) -> tuple[str, bool]:
    """What torch's split backward holds beyond the plan, and whether the plan still fits every
    memory limit when run so."""
    peaks = torch_peaks(problem, plan)
    if peaks is None:
        return "", True
    limits = [problem.limit_of(d) for d in range(problem.num_devices)]
    over = [d for d in range(problem.num_devices) if peaks[d] > limits[d] + 1e-6]
    worst = max(over or range(problem.num_devices), key=lambda d: peaks[d] - plan.peak_memory_mib[d])
    held, planned, limit = peaks[worst], plan.peak_memory_mib[worst], limits[worst]
    if held <= planned + 1e-6:
        effect = ", which this plan's peaks already allow"
    else:
        effect = (f": device {worst} peaks at {held:.0f} MiB, not the planned {planned:.0f}"
                  + ("" if math.isinf(limit) else f" (limit {limit:.0f} MiB{', over it' if over else ''})")
                  + (f"; {len(over)} device(s) over their limits" if len(over) > 1 else ""))
    return ("; torch's split backward keeps a microbatch's saved activations from its B to its W (B"
            " retains the graph, and adds the output gradients W needs where the problem gives them; on"
            " the first stage W runs the whole backward)" + effect), not over


def runtimes_document(problem: Problem, plan: Plan) -> dict[str, Any]:
    """`pipeplan.runtimes/v1`: the runtime lines and, when torch can run it, torch's microbatch order."""
    support, schedule = runtime_support(problem, plan)
    return {"format": RUNTIMES_FORMAT, "problem_key": plan.problem_key, "revision": plan.revision,
            "runtimes": [asdict(s) for s in support],
            "torch_microbatch_order": schedule.microbatch_order if schedule is not None else None}


def summary_lines(support: list[RuntimeSupport], brief: tuple[str, ...] = ()) -> list[str]:
    """Human lines: which runtimes run the plan as planned, which only in part, which not at all
    (without the note for the `brief` runtimes, whose caller says it at length)."""
    mark = {True: "as planned", False: "in part"}
    return [f"{s.runtime}: {mark[s.as_planned] if s.runs else 'cannot run it'}"
            + ("" if s.runtime in brief else f" — {s.note}") for s in support]


__all__ = ["RUNTIMES_FORMAT", "RuntimeSupport", "torch_peaks", "runtime_support",
           "runtimes_document", "summary_lines"]
