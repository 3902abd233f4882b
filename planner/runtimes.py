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

from dataclasses import asdict, dataclass
from typing import Any

from .contract import Plan, Problem
from .exports import ExportRefused, TorchSchedule, torch_schedule
from .megatron_args import megatron_export
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
    first = _first_stage_note(plan)
    out = [RuntimeSupport("pipeplan", True, True, "pipeplan.client.torch_runtime runs the compute order and"
                          " every offload, reload and recompute where the plan puts them" + first)]
    schedule: TorchSchedule | None = None
    try:
        schedule = torch_schedule(problem, plan)
        note = (" ".join(schedule.notes) or "loads the exported CSV and runs the plan's order") + first
        out.append(RuntimeSupport("torch", True, schedule.as_planned, note))
    except ExportRefused as exc:
        out.append(RuntimeSupport("torch", False, False, str(exc)))
    try:
        module_fqns(problem)
        name = schedule_class(problem)
        if schedule is None:
            raise ExportRefused("torch's runtime, which torchtitan uses, cannot run it (see torch)")
        out.append(RuntimeSupport("torchtitan", True, schedule.as_planned,
                                  f"torch's runtime with the exported CSV, placement from schedule {name}"
                                  + ("" if schedule.as_planned else "; compute order only (see torch)") + first))
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


def _first_stage_note(plan: Plan) -> str:
    """What torch's PipelineStage does differently on a plan that splits stage 0's backward."""
    if not any(p.kind == "W" and p.stage == 0 for d in plan.devices for p in d.ops):
        return ""
    return ("; torch's PipelineStage runs stage 0's whole backward at its W, so that stage keeps its"
            " activations from B to W (more memory than planned where W comes late)")


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


__all__ = ["RUNTIMES_FORMAT", "RuntimeSupport", "runtime_support", "runtimes_document", "summary_lines"]
