"""Planning commands: problem, baseline, validate, compare, render (issue 2, item 7).

Every command that takes PROBLEM.json also takes a model spec (the cost model turns it into a
problem). Exit codes: 0 success, 1 invalid plan, 2 bad input or infeasible; stderr says which and why.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from pipeplan.io import (
    EXIT_INVALID,
    bad_input,
    dumps,
    fail,
    in_gib,
    infeasible,
    infeasible_memory,
    load_plan,
    load_problem,
    memory_text,
    transfers_text,
    write_bytes,
    write_json,
    write_text,
)
from pipeplan.planner.contract import Plan, Problem

TORCH_MISSING = "torch is not installed"  # planner.baselines.torch_peers' reason on a base install
ProblemArg = Annotated[Path, typer.Argument(metavar="PROBLEM.json",
                                            help="A problem v1 document or a model spec (detected).")]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Write here instead of stdout.")]


def _check_memory(problem: Problem) -> list[float]:
    """min_memory per device; exit 2 naming every device whose limit is below it."""
    from pipeplan.planner.bounds import MemoryInfeasibleError, check_memory_feasible

    try:
        return check_memory_feasible(problem)
    except MemoryInfeasibleError as exc:
        infeasible_memory(exc.needed_mib, exc.limits, in_gib(problem))


def _does_not_fit_text(problem: Problem, needed: list[float]) -> str:
    gib = in_gib(problem)
    short = [f"device {d} would need {memory_text(n, gib)} (limit {memory_text(problem.limit_of(d), gib)})"
             for d, n in enumerate(needed) if n > problem.limit_of(d) + 1e-6]
    return "; ".join(short) or "its schedule exceeds a memory limit"


def problem_cmd(
    spec: Annotated[Path, typer.Argument(metavar="SPEC.json", help="A model/hardware spec (or a problem).")],
    out: OutOpt = None,
) -> None:
    """Turn a model spec into a problem v1.

    A problem given here comes back normalized (defaults filled in, as its key is computed)."""
    problem = load_problem(spec)
    write_json(problem, out)
    if out is not None:
        typer.echo(f"wrote {out}: {problem.num_devices} devices, {problem.num_stages} stages, "
                   f"{problem.num_microbatches} microbatches, key {problem.key()[:16]}…", err=True)


def baseline_cmd(
    name: Annotated[str, typer.Argument(metavar="NAME", help="gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, "
                                        "zb-v, greedy, pipeoffload, adaoffload; with the torch extra "
                                        "also torch-1f1b, torch-interleaved-1f1b, torch-interleaved-zb, "
                                        "torch-zbv, torch-dualpipev")],
    problem_path: ProblemArg,
    out: OutOpt = None,
) -> None:
    """Run one published schedule and write its validated plan."""
    from pipeplan.planner.baselines import NAMES, DoesNotFit, NotApplicable, run_baseline

    if name not in NAMES:
        bad_input(f"NAME: unknown baseline {name!r}; choose one of {', '.join(NAMES)}")
    problem = load_problem(problem_path)
    _check_memory(problem)
    try:
        plan = run_baseline(problem, name)
    except NotApplicable as exc:
        bad_input(f"{name} is not applicable: {exc.reason}")
    except DoesNotFit as exc:
        detail = _does_not_fit_text(problem, exc.needed_mib) if exc.needed_mib else str(exc)
        infeasible(f"{name} does not fit: {detail}"
                   f" — try greedy, pipeoffload or adaoffload")
    write_json(plan, out)
    if out is not None:
        typer.echo(f"wrote {out}: {name} makespan {plan.makespan_ms:.4g} ms, bubble {plan.bubble_ratio:.1%}",
                   err=True)


def validate_cmd(
    problem_path: ProblemArg,
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN.json")],
) -> None:
    """Check a plan against its problem.

    Exit 0 when valid, 1 when not, with every violation of the contract listed."""
    from pipeplan.planner.validator import validate_plan

    problem = load_problem(problem_path)
    plan = load_plan(plan_path)
    violations = validate_plan(problem, plan)
    if violations:
        for line in violations:
            typer.echo(f"- {line}")
        fail(f"invalid plan: {len(violations)} violation(s) of the contract", EXIT_INVALID)
    typer.echo(f"valid: makespan {plan.makespan_ms:.6g} ms, bubble {plan.bubble_ratio:.2%}, "
               f"peak {max(plan.peak_memory_mib):.6g} MiB, {sum(len(d.ops) for d in plan.devices)} ops")


@dataclass
class Row:
    """One baseline's outcome in `compare`."""

    name: str
    plan: Plan | None = None
    seconds: float = 0.0
    reason: str | None = None  # not applicable
    needed_mib: list[float] = field(default_factory=list)  # does not fit
    message: str | None = None  # does not fit: the baseline's own words

    def to_dict(self, lower_bound: float) -> dict:
        if self.plan is None:
            status = "not_applicable" if self.reason else "does_not_fit"
            return {"name": self.name, "status": status, "reason": self.reason or self.message,
                    "needed_mib": self.needed_mib or None}
        p = self.plan
        return {"name": self.name, "status": "ok", "makespan_ms": p.makespan_ms, "bubble_ratio": p.bubble_ratio,
                "peak_memory_mib": p.peak_memory_mib, "gap": _gap(p.makespan_ms, lower_bound),
                "offloaded_mib": p.offloaded_mib, "recompute_ms": p.recompute_ms,
                "host_memory_mib": p.host_memory_mib, "seconds": round(self.seconds, 4)}


def _gap(makespan: float, bound: float) -> float:
    return max(0.0, makespan - bound) / makespan if makespan > 0 else 0.0


def run_all(problem: Problem) -> list[Row]:
    from pipeplan.planner.baselines import NAMES, DoesNotFit, NotApplicable, run_baseline

    rows = []
    for name in NAMES:
        start = time.perf_counter()
        try:
            rows.append(Row(name, plan=run_baseline(problem, name), seconds=time.perf_counter() - start))
        except NotApplicable as exc:
            rows.append(Row(name, reason=exc.reason))
        except DoesNotFit as exc:
            rows.append(Row(name, needed_mib=list(exc.needed_mib or []), message=str(exc)))
    return rows


def _mem_unit(problem: Problem, values: list[float]) -> tuple[str, float]:
    finite = [problem.limit_of(d) for d in range(problem.num_devices) if math.isfinite(problem.limit_of(d))]
    return ("GiB", 1024.0) if max(values + finite, default=0) >= 4096 else ("MiB", 1.0)


def _per_device(values: list[float], scale: float, limits: list[float], width: int = 8) -> str:
    shown = values if len(values) <= width else values[:width // 2] + [math.nan] + values[-width // 2:]
    parts = []
    for v in shown:
        parts.append("…" if math.isnan(v) else f"{v / scale:.1f}")
    return " ".join(parts)


def compare_cmd(
    problem_path: ProblemArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON instead of a table.")] = False,
) -> None:
    """Compare every peer schedule with the lower bound.

    A table of makespan, bubble, gap to the lower bound and peak memory per device against the limit;
    the schedules that do not fit or do not apply say why."""
    from rich.console import Console
    from rich.table import Table

    from pipeplan.planner.bounds import lower_bound

    problem = load_problem(problem_path)
    needed = _check_memory(problem)
    bound = lower_bound(problem)
    rows = run_all(problem)
    ok = sorted((r for r in rows if r.plan), key=lambda r: r.plan.makespan_ms)
    rest = [r for r in rows if not r.plan]
    limits = [problem.limit_of(d) for d in range(problem.num_devices)]
    if as_json:
        write_text(dumps({"problem_key": problem.key(), "lower_bound_ms": bound, "min_memory_mib": needed,
                          "memory_limit_mib": [None if math.isinf(x) else x for x in limits],
                          "baselines": [r.to_dict(bound) for r in ok + rest]}) + "\n", None)
        if not ok:
            fail("no baseline produced a plan for this problem (see the reasons above)")
        return

    peaks = [m for r in ok for m in r.plan.peak_memory_mib] + needed
    unit, scale = _mem_unit(problem, peaks)
    finite = [x for x in limits if math.isfinite(x)]
    limit_text = ("unlimited" if not finite else f"{finite[0] / scale:.1f}" if len(set(finite)) == 1
                  and len(finite) == len(limits) else _per_device(limits, scale, limits))
    console = Console(width=max(100, Console().width or 100))
    # the limit goes in the title: the peak column is the one that folds when a terminal is narrow
    table = Table(title=f"{problem.num_devices} devices × {problem.chunks} stage(s), "
                        f"{problem.num_microbatches} microbatches — lower bound {bound:.4g} ms — "
                        f"memory limit {limit_text} {'' if limit_text == 'unlimited' else unit}",
                  title_justify="left")
    table.add_column("baseline", style="bold", no_wrap=True)
    table.add_column("makespan ms", justify="right")
    table.add_column("bubble", justify="right")
    table.add_column("gap to LB", justify="right")
    table.add_column(f"peak per device ({unit})", overflow="fold")
    for r in ok:
        p = r.plan
        over = any(m > lim + 1e-6 for m, lim in zip(p.peak_memory_mib, limits))
        table.add_row(r.name, f"{p.makespan_ms:.4g}", f"{p.bubble_ratio:.1%}", f"{_gap(p.makespan_ms, bound):.1%}",
                      ("[red]" if over else "") + _per_device(p.peak_memory_mib, scale, limits))
    no_torch = [r.name for r in rest if r.reason == TORCH_MISSING]
    for r in rest:
        if r.reason == TORCH_MISSING:
            continue  # one line below the table, not a row per torch peer
        if r.reason:
            table.add_row(f"[dim]{r.name}", "—", "—", "—", f"[dim]not applicable: {r.reason}")
        else:
            detail = f"needs {_per_device(r.needed_mib, scale, limits)}" if r.needed_mib else r.message
            table.add_row(f"[dim]{r.name}", "—", "—", "—", f"[yellow]does not fit: {detail}")
    console.print(table)
    if no_torch:
        console.print(f"torch's own schedules ({', '.join(no_torch)}) need the torch extra:"
                      " pip install 'pipeplan[torch]'", markup=False)
    console.print(f"lower bound {bound:.6g} ms; min memory per device ({unit}): "
                  f"{_per_device(needed, scale, limits, width=16)}")
    copies = [_transfers(r.name, r.plan) for r in ok if r.plan.offloaded_mib or r.plan.recompute_ms]
    if copies:  # a line, not columns: the table is already as wide as a terminal
        console.print("transfers per iteration: " + "; ".join(copies))
    if not ok:
        fail("no baseline produced a plan for this problem (see the reasons above)")


def _transfers(name: str, plan: Plan) -> str:
    return f"{name} {transfers_text(plan)}"


def render_cmd(
    problem_path: ProblemArg,
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN.json")],
    out: Annotated[Path, typer.Option("--out", "-o", help="FILE.svg or FILE.png")],
    title: Annotated[str | None, typer.Option(help="Chart title (default: method and metrics).")] = None,
    width: Annotated[float, typer.Option(help="Width in inches.", min=3.0, max=60.0)] = 13.0,
    dpi: Annotated[int, typer.Option(help="Resolution of a PNG.", min=50, max=600)] = 150,
    memory: Annotated[bool, typer.Option("--memory/--no-memory", help="Memory curves beneath.")] = True,
    copy_lanes: Annotated[str, typer.Option(help="auto (only when the plan copies), always or never.")] = "auto",
) -> None:
    """Draw a plan as a Gantt chart with memory beneath.

    One row group per device (compute and copy lanes), its memory over time beneath; SVG or PNG."""
    from pipeplan.planner.render import RenderOptions, render
    from pipeplan.planner.validator import validate_plan

    fmt = Path(out).suffix.lower().lstrip(".")
    if fmt not in ("svg", "png"):
        bad_input(f"--out: {out} must end in .svg or .png")
    if copy_lanes not in ("auto", "always", "never"):
        bad_input(f"--copy-lanes: expected auto, always or never, got {copy_lanes!r}")
    problem = load_problem(problem_path)
    plan = load_plan(plan_path)
    if len(plan.devices) and max(dp.device for dp in plan.devices) >= problem.num_devices:
        bad_input(f"{plan_path}: the plan has devices the problem lacks (problem has {problem.num_devices})")
    violations = validate_plan(problem, plan)
    options = RenderOptions(width_in=width, dpi=dpi, title=title, memory=memory, copy_lanes=copy_lanes)
    write_bytes(render(problem, plan, fmt, options), out)
    typer.echo(f"wrote {out}", err=True)
    if violations:
        for line in violations:
            typer.echo(f"- {line}")
        fail(f"invalid plan: rendered anyway, but it has {len(violations)} violation(s) of the contract",
             EXIT_INVALID)


def register(app: typer.Typer) -> None:
    app.command("problem")(problem_cmd)
    app.command("baseline")(baseline_cmd)
    app.command("validate")(validate_cmd)
    app.command("compare")(compare_cmd)
    app.command("render")(render_cmd)


__all__ = ["Row", "register", "run_all"]
