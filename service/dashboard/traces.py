"""Predicted vs measured on the dashboard: the plan page's "Measured runs" table (every posted trace
of the key, its error and the calibrated plan it yielded), the link back from a calibrated plan to
the plan it was measured on, and the overview's marker for keys that have traces.

Only reads (service.trace_store); formatting is the dashboard's (views).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pipeplan.planner.contract import Problem

from ..trace_store import TraceInfo, TraceStore
from . import views

SHOWN = 20  # newest traces on the plan page; GET /v1/plans/{key}/traces lists more


def _row(t: TraceInfo, now: datetime) -> dict[str, Any]:
    return {"id": t.id, "revision": t.revision, "device_kind": t.device_kind,
            "predicted": views.fmt_ms(t.predicted_ms), "measured": views.fmt_ms(t.measured_ms),
            "error": f"{t.error_pct:+.1f}%", "off": abs(t.error_pct) > 5.0,
            "calibrated_key": t.calibrated_key, "when": views.fmt_age(t.created_at, now)}


def measured_of(repo, key: str, problem: Problem) -> dict[str, Any]:
    """What the plan page shows: the key's traces (newest first) and where a calibrated key came from."""
    origin = problem.metadata.get("calibrated_from") if isinstance(problem.metadata, dict) else None
    origin_key = origin.get("problem_key") if isinstance(origin, dict) else None
    now = datetime.now(UTC)
    return {"traces": [_row(t, now) for t in TraceStore(repo).listing(key, SHOWN)],
            "calibrated_from": origin_key if isinstance(origin_key, str) and len(origin_key) == 64 else None,
            "traces_href": f"/v1/plans/{key}/traces"}


def marks_of(repo, keys: list[str]) -> dict[str, str]:
    """Per key with traces, the overview marker's text: the newest run's error and how many runs."""
    out = {}
    for key, (count, newest) in TraceStore(repo).summaries(keys).items():
        runs = f"{count} measured run{'s' if count != 1 else ''}"
        out[key] = f"measured {newest.error_pct:+.1f}% vs predicted ({runs})"
    return out
