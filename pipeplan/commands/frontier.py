"""`pipeplan frontier`: the time-memory frontier of a configuration, and its two queries.

    pipeplan frontier PROBLEM|SPEC --points 12 --time-limit 10 --out frontier.json --plot frontier.png
    pipeplan frontier frontier.json --target-ms 2400      # least memory per GPU for 2400 ms
    pipeplan frontier frontier.json --budget-gib 24        # fastest plan within 24 GiB per GPU

Given a problem or spec it computes the frontier (progress on stderr as points are solved); given a
frontier document (`pipeplan.frontier/v1`, docs/frontier.md) it only answers the queries.
Exit codes: 0 success, 2 bad input, infeasible, or a query no point answers.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeplan.io import bad_input, problem_from_doc, read_json, write_bytes, write_json
from pipeplan.settings import get_settings

GIB = 1024.0


def _progress(started: float):
    """Progress lines on stderr; a point beyond the GPU's memory says so."""
    from pipeplan.planner.frontier import within

    hbm_mib: float | None = None

    def report(event: dict[str, Any]) -> None:
        nonlocal hbm_mib
        t = f"[{time.monotonic() - started:7.2f}s]"
        kind = event["event"]
        if kind == "peers":
            names = sorted({p["name"] for p in event["peers"]})
            typer.echo(f"{t} peers: {', '.join(names) or 'none'}", err=True)
        elif kind == "range":
            hbm_mib = event["hbm_mib"]
            span = f"{event['budget_min_mib'] / GIB:.2f} .. {event['budget_max_mib'] / GIB:.2f} GiB per GPU"
            if event["mode"] == "scaled":
                span = (f"factors {event['factor_min']:.4f} .. {event['factor_max']:.4f} of each device's free"
                        f" memory (largest limit {span})")
            typer.echo(f"{t} budgets {span}{_hbm_note(event)}; unlimited-memory plan"
                       f" {event['unlimited_makespan_ms']:.2f} ms", err=True)
        elif kind == "point":
            beyond = " [beyond the GPU's memory]" if hbm_mib is not None and not within(
                event["budget_mib"], hbm_mib) else ""
            typer.echo(f"{t} point {event['index'] + 1}: {event['budget_mib'] / GIB:.2f} GiB/GPU ->"
                       f" {event['makespan_ms']:.2f} ms (bound {event['bound_ms']:.2f}, {event['source']},"
                       f" {event['outcome']}){beyond}", err=True)
    return report


def _hbm_note(doc: dict[str, Any]) -> str:
    """" (GPU memory 79.60 GiB, H100-80GB)" when the frontier knows it."""
    if doc.get("hbm_mib") is None:
        return ""
    return f" (GPU memory {doc['hbm_mib'] / GIB:.2f} GiB, {doc['hbm_of']})"


def _beyond(doc: dict[str, Any], point: dict[str, Any]) -> str:
    return f"; beyond the GPU's {doc['hbm_mib'] / GIB:.2f} GiB ({doc['hbm_of']})" if point.get("beyond_hbm") else ""


def _load(path: Path, offload: bool | None, recompute: bool | None):
    """A frontier document, or the problem (a spec's training options overridden first)."""
    from pipeplan.planner.frontier import FRONTIER_FORMAT

    doc = read_json(path)
    if isinstance(doc, dict) and doc.get("format") == FRONTIER_FORMAT:
        return doc, None
    if not isinstance(doc, dict):
        bad_input(f"{path}: expected a problem, a model spec or a frontier document")
    overrides = {k: v for k, v in (("offload", offload), ("recompute", recompute)) if v is not None}
    if overrides:
        if "training" in doc:
            doc["training"] = {**doc["training"], **overrides}
        else:
            doc["options"] = {**doc.get("options", {}), **overrides}
    from pydantic import ValidationError

    from pipeplan.planner.contract import error_messages

    try:
        problem = problem_from_doc(doc)
        problem.check_limits(get_settings().limits)
    except (ValidationError, ValueError, TypeError, KeyError) as exc:
        bad_input(f"{path}: " + "; ".join(error_messages(exc)))
    return None, problem


def answer_queries(doc: dict[str, Any], target_ms: float | None, budget_gib: float | None) -> int:
    """Print the answers on stdout; 2 when a query has no answer (the message says the nearest)."""
    from pipeplan.planner.frontier import view_of

    view = view_of(doc)
    code = 0
    if target_ms is not None:
        hit = view.least_memory(target_ms)
        if hit is None:
            best = min(view.points, key=lambda p: p.makespan_ms)
            typer.echo(f"error: no point reaches {target_ms:g} ms; the fastest is {best.makespan_ms:.2f} ms"
                       f" at {best.budget_mib / GIB:.2f} GiB per GPU", err=True)
            code = 2
        else:
            p = hit.doc
            limits = "" if view.budgets.mode == "uniform" else \
                f" (limits {', '.join(f'{x / GIB:.2f}' for x in p['limits_mib'])} GiB)"
            typer.echo(f"least memory for <= {target_ms:g} ms: {p['budget_mib'] / GIB:.2f} GiB per GPU{limits} ->"
                       f" {p['makespan_ms']:.2f} ms{_beyond(doc, p)}, plan key {p['problem_key']}")
    if budget_gib is not None:
        hit = view.fastest(budget_gib * GIB)
        if hit is None:
            least = min(view.points, key=lambda p: p.budget_mib)
            typer.echo(f"error: {budget_gib:g} GiB per GPU is below the least any schedule needs"
                       f" ({least.budget_mib / GIB:.2f} GiB per GPU)", err=True)
            code = 2
        else:
            p = hit.doc
            typer.echo(f"fastest within {budget_gib:g} GiB per GPU: {p['makespan_ms']:.2f} ms at"
                       f" {p['budget_mib'] / GIB:.2f} GiB (bound {p['bound_ms']:.2f} ms){_beyond(doc, p)},"
                       f" plan key {p['problem_key']}")
    return code


def frontier_cmd(
    source: Annotated[Path, typer.Argument(
        metavar="PROBLEM|SPEC|FRONTIER.json",
        help="A problem v1, a model spec, or a frontier document (queries only).")],
    points: Annotated[int, typer.Option(
        "--points", "-n", min=2, max=64,
        help="Points on the curve (at least; every peer's memory also gets one).")] = 12,
    time_limit: Annotated[float, typer.Option(
        "--time-limit", "-t", min=0.0,
        help="Seconds of search per point (plus one unlimited solve).")] = 10.0,
    budgets: Annotated[str, typer.Option(
        "--budgets",
        help="uniform: one memory cap per GPU, the same on every device; scaled: each device's free"
             " memory scaled by one factor (clusters of mixed GPUs).")] = "uniform",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the frontier JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Draw the frontier (PNG or SVG by suffix).")] = None,
    plans_dir: Annotated[Path | None, typer.Option(
        "--plans-dir", help="Also write each point's plan and problem.")] = None,
    target_ms: Annotated[float | None, typer.Option(
        "--target-ms", min=0.0, help="Query: least memory per GPU for this time.")] = None,
    budget_gib: Annotated[float | None, typer.Option(
        "--budget-gib", min=0.0, help="Query: fastest plan within this memory per GPU.")] = None,
    offload: Annotated[bool | None, typer.Option(
        "--offload/--no-offload", help="Allow offload (overrides the input).")] = None,
    recompute: Annotated[bool | None, typer.Option(
        "--recompute/--no-recompute", help="Allow recompute (overrides the input).")] = None,
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="CP-SAT workers per solve.")] = None,
    title: Annotated[str | None, typer.Option("--title", help="Title of the plot.")] = None,
) -> None:
    """Chart iteration time against memory per GPU.

    The curve runs from the least memory any schedule needs to where the unlimited-memory optimum
    fits, with every peer schedule at its own peak memory; --target-ms and --budget-gib query it."""
    from pipeplan.planner.frontier import BUDGET_MODES, compute_frontier

    if budgets not in BUDGET_MODES:
        bad_input(f"--budgets: expected {' or '.join(BUDGET_MODES)}, got {budgets!r}")
    doc, problem = _load(source, offload, recompute)
    if problem is not None:
        started = time.monotonic()
        stop = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set())  # Ctrl-C: finish with what is solved
        try:
            result = compute_frontier(problem, points, time_limit, on_progress=_progress(started), stop=stop,
                                      workers=workers or get_settings().solver_workers, budgets=budgets)
        finally:
            signal.signal(signal.SIGINT, previous)
        doc = result.to_document()
        worst = min((d["margin_pct"] for d in doc["dominance"] if d["margin_pct"] is not None), default=0.0)
        beaten = sum(1 for d in doc["dominance"] if d["dominated"])
        unit = "per GPU" if budgets == "uniform" else "at their budget factor"
        typer.echo(f"done in {result.elapsed_s:.1f}s: {len(result.points)} points,"
                   f" {beaten}/{len(doc['dominance'])} peer points dominated {unit} (smallest margin {worst:.2f}%)",
                   err=True)
        if plans_dir is not None:
            for i, p in enumerate(result.points):
                write_json(p.plan, plans_dir / f"point{i:02d}.plan.json")
                write_json(p.problem, plans_dir / f"point{i:02d}.problem.json")
        if out is not None or (plot is None and target_ms is None and budget_gib is None):
            write_json(doc, out)
    elif out is not None:
        write_json(doc, out)
    if plot is not None:
        from pipeplan.planner.frontier_render import render_frontier

        fmt = plot.suffix.lstrip(".") or "png"
        if fmt not in ("png", "svg"):
            bad_input(f"--plot: {plot}: expected a .png or .svg file")
        write_bytes(render_frontier(doc, fmt, title), plot)
    code = answer_queries(doc, target_ms, budget_gib)
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("frontier")(frontier_cmd)


__all__ = ["answer_queries", "register"]
