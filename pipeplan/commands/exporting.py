"""`pipeplan export torch|torchtitan|megatron|runtimes PROBLEM PLAN`: a plan for the stack that trains.

Every export first validates the plan against its problem (exit 1 when invalid), then says on stderr
which runtimes run the plan as planned. A plan a format cannot express exits 2 with the reason
(`error: cannot export: …`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from pipeplan.io import EXIT_BAD_INPUT, EXIT_INVALID, fail, load_plan, load_problem, write_text
from pipeplan.planner.contract import Plan, Problem

ProblemArg = Annotated[Path, typer.Argument(metavar="PROBLEM.json",
                                            help="The plan's problem v1 (or the model spec it came from).")]
PlanArg = Annotated[Path, typer.Argument(metavar="PLAN.json", help="A plan v1 of that problem.")]

export_app = typer.Typer(name="export", no_args_is_help=True, add_completion=False,
                         help="Write a plan for torch, torchtitan or Megatron-LM.")


def _load(problem_path: Path, plan_path: Path) -> tuple[Problem, Plan]:
    from pipeplan.planner.validator import validate_plan

    problem, plan = load_problem(problem_path), load_plan(plan_path)
    violations = validate_plan(problem, plan)
    if violations:
        for line in violations[:20]:
            typer.echo(f"- {line}", err=True)
        fail(f"invalid plan: {plan_path} is not a valid plan of {problem_path}"
             f" ({len(violations)} violation(s))", EXIT_INVALID)
    return problem, plan


def _refused(target: str, reason: object) -> NoReturn:
    fail(f"cannot export to {target}: {reason}", EXIT_BAD_INPUT)


def _say_runtimes(problem: Problem, plan: Plan, *detailed: str) -> None:
    """The plan's figures and the runtime lines; those of `detailed` runtimes without their note: the
    export's own notes, printed next, say the same at length."""
    from pipeplan.planner.runtimes import runtime_support, summary_lines

    typer.echo(f"plan {plan.problem_key[:12]}… revision {plan.revision} ({plan.method}):"
               f" {plan.makespan_ms:.2f} ms per iteration, proven lower bound"
               f" {max(plan.lower_bound_ms, plan.solver_bound_ms or 0.0):.2f} ms", err=True)
    for line in summary_lines(runtime_support(problem, plan)[0], detailed):
        typer.echo(f"  {line}", err=True)


@export_app.command("torch")
def torch_cmd(problem_path: ProblemArg, plan_path: PlanArg,
              out: Annotated[Path | None, typer.Option("--out", "-o", help="CSV file (default: stdout).")]
              = None) -> None:
    """torch.distributed.pipelining's schedule CSV for its stock `_PipelineScheduleRuntime`."""
    from pipeplan.planner.exports import ExportRefused, torch_schedule

    problem, plan = _load(problem_path, plan_path)
    _say_runtimes(problem, plan, "torch")
    try:
        schedule = torch_schedule(problem, plan)
    except ExportRefused as exc:
        _refused("torch", exc)
    for note in schedule.notes:
        typer.echo(f"note: {note}", err=True)
    write_text(schedule.csv(problem), out)
    if out is not None:
        typer.echo(f"wrote {out}: torch loads it with _PipelineScheduleRuntime._load_csv(path)", err=True)


@export_app.command("torchtitan")
def torchtitan_cmd(problem_path: ProblemArg, plan_path: PlanArg,
                   out: Annotated[Path, typer.Option("--out", "-o", help="Directory for schedule.csv,"
                                                     " torchtitan.args and export.json.")],
                   csv_path: Annotated[str | None, typer.Option(
                       "--csv-path", help="The CSV's path as the training job sees it (default: the"
                       " absolute path of OUT/schedule.csv).")] = None,
                   ) -> None:
    """schedule.csv and torchtitan.args: the `--parallelism.*` overrides that must agree with it."""
    from pipeplan.planner.exports import ExportRefused
    from pipeplan.planner.runtimes import runtimes_document
    from pipeplan.planner.torchtitan_args import torchtitan_export

    problem, plan = _load(problem_path, plan_path)
    _say_runtimes(problem, plan, "torch", "torchtitan")
    csv_file = out / "schedule.csv"
    try:
        export = torchtitan_export(problem, plan, csv_path or str(csv_file.resolve()))
    except ExportRefused as exc:
        _refused("torchtitan", exc)
    for note in export.notes:
        typer.echo(f"note: {note}", err=True)
    write_text(export.schedule.csv(problem), csv_file)
    write_text(export.args_text(), out / "torchtitan.args")
    document = {**runtimes_document(problem, plan), "notes": export.notes}
    write_text(json.dumps(document, indent=2) + "\n", out / "export.json")
    args_file = out / "torchtitan.args"
    typer.echo(f"wrote {csv_file}, {args_file} and {out / 'export.json'}; run: torchrun ... -m"
               f" torchtitan.train --module MODULE --config CONFIG $(cat {args_file})", err=True)


@export_app.command("megatron")
def megatron_cmd(problem_path: ProblemArg, plan_path: PlanArg,
                 out: Annotated[Path | None, typer.Option("--out", "-o", help="Arguments file (default:"
                                                          " stdout).")] = None,
                 data_parallel: Annotated[int, typer.Option(
                     "--data-parallel", min=1, help="Data-parallel replicas (for --global-batch-size).")] = 1,
                 ) -> None:
    """Megatron-LM arguments: pipeline size, layout (partition and virtual stages), recompute."""
    from pipeplan.planner.exports import ExportRefused
    from pipeplan.planner.megatron_args import megatron_export

    problem, plan = _load(problem_path, plan_path)
    _say_runtimes(problem, plan, "megatron")
    try:
        export = megatron_export(problem, plan, data_parallel)
    except ExportRefused as exc:
        _refused("megatron", exc)
    for line in export.cannot_express:
        typer.echo(f"cannot express: {line}", err=True)
    for note in export.notes:
        typer.echo(f"note: {note}", err=True)
    write_text("\n".join(export.lines()) + "\n", out)
    if out is not None:
        typer.echo(f"wrote {out}", err=True)


@export_app.command("runtimes")
def runtimes_cmd(problem_path: ProblemArg, plan_path: PlanArg) -> None:
    """Which runtimes run the plan as planned (`pipeplan.runtimes/v1` JSON on stdout)."""
    from pipeplan.planner.runtimes import runtimes_document

    problem, plan = _load(problem_path, plan_path)
    typer.echo(json.dumps(runtimes_document(problem, plan), indent=2))


def register(app: typer.Typer) -> None:
    app.add_typer(export_app, name="export")
