"""How a refine run (or a `pipeplan solve`) ended, in one vocabulary for the API, SSE, CLI and dashboard.

A finished job used to say "converged" whatever happened, including when the budget simply ran out
with nothing found. The solver now reports why it stopped (`planner.solver.SolveResult.outcome`) and
every surface prints the same words from `describe`, with the gap to the proven bound, so "done"
never hides a spent budget. Pure Python (no FastAPI or SQLAlchemy): the base-install CLI imports it.
"""

from __future__ import annotations

OPTIMAL, BUDGET, STALLED, STOPPED = "optimal", "budget", "stalled", "stopped"
OUTCOMES = (OPTIMAL, BUDGET, STALLED, STOPPED)


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def _pct(gap_pct: float) -> str:
    return "<0.1%" if 0 < gap_pct < 0.05 else f"{gap_pct:.1f}%"


def describe(outcome: str | None, gap_pct: float | None, searched_s: float | None,
             improvements: int | None = None, gap: bool = True) -> str | None:
    """The sentence people read, e.g. "budget spent after 30 s, gap 4.1% to the proven bound".

    `improvements` is how many better plans this search stored (None: not counted); it decides
    whether a search that gave up early found nothing ("no better plan found") or stalled later.
    `gap=False` leaves the gap out, for a place that shows it beside (the dashboard's Gap column).
    None when there is no outcome (a run still going, failed, or finished before outcomes were kept).
    """
    if outcome is None:
        return None
    if outcome == OPTIMAL:
        return "optimal (proven)"
    pct = _pct(gap_pct or 0.0)
    took = _seconds(searched_s or 0.0)
    if outcome == BUDGET:
        nothing = "; no better plan found" if improvements == 0 else ""
        return f"budget spent after {took}{f', gap {pct} to the proven bound' if gap else ''}{nothing}"
    if outcome == STALLED:
        tail = f" (gap {pct})" if gap else ""
        if improvements == 0:
            return f"no better plan found in {took}{tail}"
        found = "" if improvements is None else f", {improvements} better plan{'s' if improvements != 1 else ''}"
        return f"search ended early after {took} without proof{found}{tail}"
    if outcome == STOPPED:
        return f"stopped after {took}{f', gap {pct} to the proven bound' if gap else ''}"
    return outcome
