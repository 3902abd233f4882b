"""`pipeplan solve`: optimize a problem under a time limit, reporting each improvement on stderr and,
last, how the search ended ("optimal (proven)", "budget spent after 30 s, gap 4.1% …").

Exit codes: 0 a valid plan was written, 2 bad input or an infeasible memory budget (stderr gives the
least memory each device needs).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from pipeplan.io import fail, in_gib, infeasible_memory, load_problem, transfers_text, write_json


def _progress(started: float, lower: float):
    def report(plan) -> None:
        bound = max(lower, plan.solver_bound_ms or 0.0)
        typer.echo(f"[{time.monotonic() - started:7.2f}s] best {plan.makespan_ms:.4f} ms  bound {bound:.4f} ms"
                   f"  gap {100 * plan.gap:.2f}%  ({plan.method})", err=True)
    return report


def solve_cmd(
    problem_path: Annotated[Path, typer.Argument(metavar="PROBLEM.json",
                                                 help="A problem v1 document or a model spec (detected).")],
    time_limit: Annotated[float, typer.Option("--time-limit", "-t", min=0.0, help="Seconds to search.")] = 30.0,
    engine: Annotated[str, typer.Option("--engine", help="auto, cpsat, lns or milp.")] = "auto",
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="CP-SAT workers (default: settings).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Random seed of the search.")] = 0,
    deterministic: Annotated[bool, typer.Option("--deterministic", help="Reproducible search (1 worker).")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the plan here instead of stdout.")] = None,
) -> None:
    """Search for the fastest plan that fits the memory.

    Heuristics first, then CP-SAT / LNS until the time limit; progress on stderr, the best valid plan
    v1 on stdout or --out."""
    from pipeplan.planner.bounds import MemoryInfeasibleError, lower_bound
    from pipeplan.planner.solver import ENGINES, solve
    from pipeplan.service.outcomes import describe
    from pipeplan.settings import get_settings

    if engine not in ENGINES:
        fail(f"--engine: {engine!r} is not one of {', '.join(ENGINES)}")
    problem = load_problem(problem_path)
    started = time.monotonic()
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())  # Ctrl-C: stop, keep the best plan
    try:
        result = solve(problem, time_limit, on_improvement=_progress(started, lower_bound(problem)),
                       stop=stop, engine=engine, workers=workers or get_settings().solver_workers, seed=seed,
                       deterministic=deterministic)
    except MemoryInfeasibleError as exc:
        infeasible_memory(exc.needed_mib, exc.limits, in_gib(problem))
    finally:
        signal.signal(signal.SIGINT, previous)
    plan = result.plan
    bound = max(result.lower_bound_ms, result.solver_bound_ms or 0.0)
    # the service's words (service.outcomes): a spent budget never reads as a proof. The solver's
    # improvement count includes the seeds, so "no better plan found" is left to the service's jobs.
    verdict = describe(result.outcome, 100 * plan.gap, result.elapsed_s)
    copies = f"; per iteration it {transfers_text(plan)}" if plan.offloaded_mib or plan.recompute_ms else ""
    # the whole iteration, where something follows the pipeline or the problem is a whole job
    tail = (f"; iteration {plan.iteration_ms:.4f} ms, bound {plan.iteration_bound_ms:.4f} ms"
            if plan.iteration_ms is not None and plan.iteration_bound_ms is not None
            and (plan.iteration_ms > plan.makespan_ms + 1e-9 or plan.tokens_per_s_per_gpu) else "")
    if tail and plan.tokens_per_s_per_gpu:
        tail += f", {plan.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
    typer.echo(f"done in {result.elapsed_s:.2f}s: {verdict}; makespan {plan.makespan_ms:.4f} ms, bound"
               f" {bound:.4f} ms{tail}, first plan after {result.time_to_first_s:.2f}s,"
               f" engine {result.engine}, seeded by {result.seed_method}{copies}", err=True)
    write_json(plan, out)


def register(app: typer.Typer) -> None:
    app.command("solve")(solve_cmd)


__all__ = ["register"]
