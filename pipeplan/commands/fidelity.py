"""`pipeplan fidelity`: how a measured run (a trace) compares with its plan, and what to plan next.

Exit codes: 0 success, 2 bad input (a file that is not a problem/plan/trace, or a trace of another
plan).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeplan.io import bad_input, load_plan, load_problem, read_json, write_json

ProblemArg = Annotated[Path, typer.Argument(metavar="PROBLEM.json", help="A problem v1 or a model spec.")]
PlanArg = Annotated[Path, typer.Argument(metavar="PLAN.json", help="The plan that ran.")]
TraceArg = Annotated[Path, typer.Argument(metavar="TRACE.json", help="Its pipeplan.trace/v1.")]


def load_trace(path: Path):
    from pydantic import ValidationError

    from pipeplan.planner.trace import Trace

    try:
        return Trace.model_validate(read_json(path))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        bad_input(f"{path}: not a pipeplan.trace/v1: {where}: {first['msg']}")


def fidelity_cmd(
    problem_path: ProblemArg,
    plan_path: PlanArg,
    trace_path: TraceArg,
    as_json: Annotated[bool, typer.Option("--json", help="The report as JSON.")] = False,
    chrome: Annotated[Path | None, typer.Option(help="Write a Chrome trace, planned and measured lanes.")] = None,
    calibrated: Annotated[Path | None, typer.Option(
        help="Write the problem with the measured costs (plan it again for the hardware as it ran).")] = None,
    path_steps: Annotated[int, typer.Option("--path", help="Critical-path steps to print.", min=0)] = 12,
) -> None:
    """Compare a measured run with its plan.

    Predicted against measured makespan, the error per op kind and stage, and the measured critical
    path."""
    from pipeplan.planner.exports import chrome_trace_compared
    from pipeplan.planner.fidelity import calibrated_problem, fidelity
    from pipeplan.planner.trace import check_trace

    problem, plan, trace = load_problem(problem_path), load_plan(plan_path), load_trace(trace_path)
    if errors := check_trace(problem, plan, trace):
        bad_input(f"{trace_path} is not a run of {plan_path}: " + "; ".join(errors))
    report = fidelity(problem, plan, trace)
    if chrome is not None:
        chrome.write_text(json.dumps(chrome_trace_compared(problem, plan, trace)))
        typer.echo(f"wrote {chrome}", err=True)
    if calibrated is not None:
        write_json(calibrated_problem(problem, [trace]), calibrated)
        typer.echo(f"wrote {calibrated}", err=True)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    typer.echo(f"plan {plan.problem_key[:12]}… revision {plan.revision} ({plan.method}), measured on"
               f" {trace.device_kind} ({trace.clock}), iteration {trace.iteration}")
    typer.echo(f"makespan: predicted {report.predicted_ms:.2f} ms, measured {report.measured_ms:.2f} ms"
               f" ({report.error_pct:+.1f}%)")
    typer.echo("\nper op kind       ops   planned ms  measured ms   error")
    for kind, e in report.by_kind.items():
        typer.echo(f"  {kind:12} {e.count:6} {e.planned_ms:12.2f} {e.measured_ms:12.2f} {e.error_pct:+7.1f}%")
    typer.echo("per stage")
    for stage, e in report.by_stage.items():
        typer.echo(f"  stage {stage:<6} {e.count:6} {e.planned_ms:12.2f} {e.measured_ms:12.2f} {e.error_pct:+7.1f}%")
    path = report.critical_path
    overhead = sum(s.gap_ms for s in path)
    typer.echo(f"\nmeasured critical path: {len(path)} ops, {overhead:.2f} ms of it waits no dependency explains")
    shown = sorted(path, key=lambda s: -s.gap_ms)[:path_steps] if len(path) > path_steps else path
    for s in sorted(shown, key=lambda s: s.start_ms):
        drift = s.start_ms - s.planned_start_ms
        typer.echo(f"  {s.op:16} device {s.device}  {s.start_ms:9.2f}-{s.end_ms:9.2f} ms"
                   f" (planned {s.planned_start_ms:.2f}, drift {drift:+.2f})  after {s.waited_for}"
                   + (f", +{s.gap_ms:.2f} ms overhead" if s.gap_ms > 0.005 else ""))


def register(app: typer.Typer) -> None:
    app.command("fidelity")(fidelity_cmd)
