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
             improvements: int | None = None) -> str | None:
    """The sentence people read, e.g. "budget spent after 30 s, gap 4.1% to the proven bound".

    `improvements` is how many better plans this search stored (None: not counted); it decides
    whether a search that gave up early found nothing ("no better plan found") or stalled later.
    None when there is no outcome (a run still going, failed, or finished before outcomes were kept).
    """
    if outcome is None:
        return None
    if outcome == OPTIMAL:
        return "optimal (proven)"
    gap = _pct(gap_pct or 0.0)
    took = _seconds(searched_s or 0.0)
    if outcome == BUDGET:
        nothing = "; no better plan found" if improvements == 0 else ""
        return f"budget spent after {took}, gap {gap} to the proven bound{nothing}"
    if outcome == STALLED:
        if improvements == 0:
            return f"no better plan found in {took} (gap {gap})"
        found = "" if improvements is None else f", {improvements} better plan{'s' if improvements != 1 else ''}"
        return f"search ended early after {took} without proof{found} (gap {gap})"
    if outcome == STOPPED:
        return f"stopped after {took}, gap {gap} to the proven bound"
    return outcome
