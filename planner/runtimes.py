"""Which runtimes execute a plan as planned, said once per plan so every export can say it.

- pipeplan's runtime (`pipeplan.client.torch_runtime`): everything, as planned.
- torch's stock `_PipelineScheduleRuntime` (and torchtitan, which runs it): the compute order only;
  as planned when the plan has no offload or recompute (`exports.torch_schedule`).
- torchtitan: as torch, when its placement (loop, or V with two stages per rank) and module split
  can express the problem (`torchtitan_args`).
- Every runtime built on torch's `PipelineStage` (pipeplan's, torch's, torchtitan's) computes the
  first stage's whole backward in its W (that stage's input needs no gradient, so B has nothing to
  do): where a plan splits stage 0's backward, that stage holds its activations until W, more
  memory there than planned when W comes late (measured on an H200: docs/torch.md, "On a GPU").
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
from .memory import order_peak, peak_memory
from .simulator import schedule_from_plan, simulate
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
    first, fits = _first_stage(problem, plan)
    out = [RuntimeSupport("pipeplan", True, fits, "pipeplan.client.torch_runtime runs the compute order and"
                          " every offload, reload and recompute where the plan puts them" + first)]
    schedule: TorchSchedule | None = None
    try:
        schedule = torch_schedule(problem, plan)
        torch_first, torch_fits = _first_stage(problem, schedule.plan)  # what torch runs: no memory actions
        note = (" ".join(schedule.notes) or "loads the exported CSV and runs the plan's order") + torch_first
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
                                  + torch_first))
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


def first_stage_held_peak(problem: Problem, plan: Plan) -> float | None:
    """Stage 0's device's peak memory (MiB) when that stage keeps its whole activation from B to W,
    as torch's PipelineStage runs it; None where the plan does not split stage 0's backward."""
    if not any(p.kind == "W" and p.stage == 0 for d in plan.devices for p in d.ops):
        return None
    doc = problem.model_dump(mode="json")
    doc["stages"][0]["weight_grad_mib"] = doc["stages"][0]["activation_mib"]
    held = Problem.model_validate(doc)
    schedule = schedule_from_plan(plan)
    device = problem.stages[0].device
    order = schedule.devices[device]
    if not (order.d2h or order.h2d):  # the order alone fixes the curve
        return order_peak(held, device, order.compute)
    timing = simulate(held, schedule)
    return peak_memory(held, device, timing.timed([*order.compute, *order.d2h, *order.h2d]), timing.choices)


def _first_stage(problem: Problem, plan: Plan) -> tuple[str, bool]:
    """What torch's PipelineStage does differently on a plan that splits stage 0's backward, and
    whether the plan still fits its memory limit when run so."""
    held = first_stage_held_peak(problem, plan)
    if held is None:
        return "", True
    device = problem.stages[0].device
    planned, limit = plan.peak_memory_mib[device], problem.limit_of(device)
    fits = held <= limit + 1e-6
    if held <= planned + 1e-6:
        effect = ", which this plan's peak already allows"
    else:
        effect = (f": device {device} peaks at {held:.0f} MiB, not the planned {planned:.0f}"
                  + ("" if math.isinf(limit) else f" (limit {limit:.0f} MiB{'' if fits else ', over it'})"))
    return ("; torch's PipelineStage runs stage 0's whole backward at its W, so that stage keeps its"
            " activations from B to W" + effect), fits


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


__all__ = ["RUNTIMES_FORMAT", "RuntimeSupport", "first_stage_held_peak", "runtime_support",
           "runtimes_document", "summary_lines"]
