"""The plan page's baselines table (planner.baselines.compare on the key's problem) and the 1F1B
figures beside every plan: computed once per problem in a killable child process, kept in the
process and on disk beside the exports (service.exports_cache), shared by this host's API processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import Request
from pipeplan.planner.contract import Plan, Problem

from .. import exports_cache
from ..errors import ApiError
from ..flight import single_flight
from . import data, views
from .deps import state_attr

# Baseline figures depend only on the problem, i.e. on its content-addressed key: one process-wide
# cache is right. Rendered revisions depend on the database behind the app, so each app has its own.
BASELINES = data.BaselineCache()


def _ratio(baseline_ms: float, this_ms: float) -> str:
    """How this plan compares with a baseline: '1.14× faster', '1.05× slower' or 'as fast'."""
    if abs(baseline_ms - this_ms) <= 5e-4 * this_ms:
        return "as fast"
    return f"{baseline_ms / this_ms:.2f}× faster" if baseline_ms > this_ms else f"{this_ms / baseline_ms:.2f}× slower"


def known(request: Request, key: str, problem: Problem) -> bool:
    """In the process cache, or on disk (then loaded into it): computed once per problem, kept across
    restarts and shared by this host's API processes (service.exports_cache)."""
    if BASELINES.tables.contains(key):
        return True
    root = getattr(state_attr(request, "settings"), "resolved_export_cache_dir", None)
    stored = exports_cache.read_baselines(root, key) if root is not None else None
    if stored is None:
        return False
    BASELINES.put_table(key, problem, [data.BaselineRow(**row) for row in stored], "")
    return True


_BASELINE_BUILDS: dict[str, asyncio.Future] = {}  # key -> the child computing its table (single flight)


def _baseline_slot(request: Request) -> asyncio.Semaphore:
    """One table at a time per app (a big one is a minute of a core); made in the app's own loop."""
    slot = getattr(request.app.state, "baseline_slot", None)
    if slot is None:
        slot = request.app.state.baseline_slot = asyncio.Semaphore(1)
    return slot


async def build(request: Request, key: str, problem: Problem) -> None:
    """Compute the key's baselines table in a killable child process (service.inline), which writes it
    beside the exports; then load it. Without a service (a bare dashboard app) it is computed on
    first read in the thread pool instead. A table that failed or timed out is noted, not retried
    until the process restarts."""
    from .. import inline

    settings = state_attr(request, "settings")
    if settings is None or known(request, key, problem):
        return

    async def compute() -> None:
        async with _baseline_slot(request):
            job = {"key": key, "root": str(settings.resolved_export_cache_dir),
                   "database_url": settings.resolved_database_url}
            try:
                result = await inline.run_in_child(job, settings.baselines_timeout_s, None,
                                                   settings.retry_after_s, entry=data.build_baselines,
                                                   what="the baselines table")
            except ApiError as exc:  # the time box, a crash: said in the table's place
                result = {"rows": 0, "note": f"Baselines could not be computed: {exc.detail}"}
        if not known(request, key, problem):  # no rows written: keep the note instead
            note = result.get("note") or "No baseline applies to this problem."
            BASELINES.put_table(key, problem, [], note)

    await single_flight(_BASELINE_BUILDS, key, compute)


def table_rows(request: Request, key: str, problem: Problem, plan: Plan) -> tuple[list[dict[str, Any]], str]:
    """The table as the page shows it (this plan first, bars relative to the slowest), and its note."""
    computed = not known(request, key, problem)
    rows, note = BASELINES.table_of(key, problem)
    root = getattr(state_attr(request, "settings"), "resolved_export_cache_dir", None)
    if computed and rows and not note and root is not None:
        exports_cache.write_baselines(root, key, [dataclasses.asdict(r) for r in rows])
    entries = [{"name": "this plan", "makespan_ms": plan.makespan_ms,
                "peak_mib": max(plan.peak_memory_mib, default=0.0), "reason": "", "this": True}]
    entries += [{"name": r.name, "makespan_ms": r.makespan_ms, "peak_mib": r.peak_mib, "reason": r.reason,
                 "this": False} for r in rows]
    longest = max((e["makespan_ms"] for e in entries if e["makespan_ms"]), default=1.0)
    out = []
    for e in entries:
        ms = e["makespan_ms"]
        out.append({
            "name": e["name"], "this": e["this"], "reason": views.short_reason(e["reason"]),
            "reason_full": e["reason"],
            "makespan": views.fmt_ms(ms) if ms is not None else None,
            "bar": 100.0 * ms / longest if ms else 0.0,
            "ratio": _ratio(ms, plan.makespan_ms) if ms and not e["this"] else ("—" if e["this"] else ""),
            "peak": views.fmt_mib(e["peak_mib"]) if e["peak_mib"] is not None else "",
        })
    return (out if rows else []), note
