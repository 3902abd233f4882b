"""`pipeplan plan SPEC.json`: choose partition, placement and schedule together (planner.adaptive)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan(
        spec: Annotated[Path, typer.Argument(metavar="SPEC.json", help="model/hardware/training spec")],
        time_limit: Annotated[float, typer.Option("--time-limit", help="seconds for search + optimizer")] = 10.0,
        out: Annotated[Path | None, typer.Option("--out", help="plan v1 JSON (default: stdout)")] = None,
        problem_out: Annotated[Path | None, typer.Option(
            "--problem-out", help="the chosen problem v1 (partition in metadata); default with --out:"
            " beside the plan, as NAME.problem.json")] = None,
        solve_top: Annotated[int, typer.Option("--solve-top", min=0, help="optimize the best N candidates")] = 2,
    ) -> None:
        """Choose partition, placement and schedule for a spec.

        Searches partition x placement x schedule, optimizes the best candidates, prints their table
        on stderr and writes the plan v1 (and the problem v1 it belongs to)."""
        from pydantic import ValidationError

        from pipeplan.io import fail, infeasible_memory, read_json, write_json
        from pipeplan.planner.adaptive import plan_adaptive
        from pipeplan.planner.bounds import MemoryInfeasibleError
        from pipeplan.planner.contract import error_messages
        from pipeplan.planner.spec import Spec, is_problem_document
        from pipeplan.settings import get_settings

        if time_limit <= 0:
            fail("--time-limit: must be > 0")
        doc = read_json(spec)
        if is_problem_document(doc):
            fail(f"{spec}: is a problem v1; `pipeplan plan` needs a model spec (use `pipeplan solve`"
                 " for a fixed problem)")
        try:
            parsed = Spec.model_validate(doc)
        except (ValidationError, ValueError) as exc:
            fail(f"{spec}: " + "; ".join(error_messages(exc)))
        try:
            result = plan_adaptive(parsed, time_limit_s=time_limit, solve_top=solve_top,
                                   workers=get_settings().solver_workers)
        except MemoryInfeasibleError as exc:
            infeasible_memory(exc.needed_mib, exc.limits, gib=True)  # a spec's budget is in GiB
        typer.echo(result.table(), err=True)
        for run in result.solver_runs:
            typer.echo(f"optimizer on {run['candidate']} ({run['schedule']}): {run['heuristic_ms']:.2f}"
                       f" -> {run['solver_ms']:.2f} ms [{run['status']}, {run['seconds']} s]", err=True)
        best = result.best
        plan = result.plan
        job = (f", iteration {plan.iteration_ms:.2f} ms, {plan.tokens_per_s_per_gpu:,.0f} tokens/s/GPU,"
               f" MFU {plan.mfu:.1%}" if plan.tokens_per_s_per_gpu is not None else "")
        typer.echo(f"chosen: {best.label}, pipeline {plan.makespan_ms:.2f} ms{job}, peak"
                   f" {max(plan.peak_memory_mib):.0f} MiB per GPU, partition {best.partition}"
                   f" ({result.elapsed_s:.1f} s)", err=True)
        # The plan is keyed by the *chosen* problem (its partition), not by the spec: without that
        # problem nobody can validate, render or export it, so it goes beside the plan by default.
        if problem_out is None and out is not None:
            problem_out = out.with_name(f"{out.stem}.problem.json")
        if problem_out is not None:
            write_json(result.problem, problem_out)
            typer.echo(f"wrote {problem_out}: the problem v1 this plan belongs to", err=True)
        else:
            typer.echo("note: the plan's problem v1 is not saved; pass --out or --problem-out to"
                       " validate, render or export the plan later", err=True)
        write_json(result.plan, out)
