"""Measured runs of plans in SQL (table `plan_traces`, docs/trace.md): store, list, read back.

A trace is stored once per (key, document digest), so a retried POST stores nothing new; the
document is parsed back before it is written (repository.read_back), as every stored document is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pipeplan.planner.trace import Trace
from sqlalchemy import func, select

from .models import TraceRow, as_utc, iso, utcnow
from .repository import Repository, read_back


@dataclass(frozen=True)
class TraceInfo:
    """A stored trace's summary (the document itself: `TraceStore.document`)."""

    id: int
    problem_key: str
    revision: int
    iteration: int
    device_kind: str
    predicted_ms: float
    measured_ms: float
    calibrated_key: str | None
    created_at: datetime | None

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.measured_ms - self.predicted_ms) / self.predicted_ms if self.predicted_ms else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["error_pct"] = self.error_pct
        d["created_at"] = iso(self.created_at)
        return d


_TRACE_COLUMNS = (TraceRow.id, TraceRow.problem_key, TraceRow.revision, TraceRow.iteration, TraceRow.device_kind,
                  TraceRow.predicted_ms, TraceRow.measured_ms, TraceRow.calibrated_key, TraceRow.created_at)


def _trace_info(row: Any) -> TraceInfo:
    return TraceInfo(*row[:8], as_utc(row[8]))


class TraceStore:
    """Measured runs of plans (table `plan_traces`, docs/trace.md): store, list, read back."""

    def __init__(self, repo: Repository):
        self.repo = repo

    def add(self, key: str, revision: int, digest: str, trace_json: str, *, iteration: int, device_kind: str,
            predicted_ms: float, measured_ms: float, calibrated_key: str | None) -> tuple[TraceInfo, bool]:
        """Store a trace unless this key already has one with `digest`. Returns (row, created)."""
        read_back(Trace, trace_json, "the trace")
        with self.repo.engine.begin() as conn:
            res = conn.execute(self.repo._insert_ignore(TraceRow).values(
                problem_key=key, revision=revision, digest=digest, trace=trace_json, iteration=iteration,
                device_kind=device_kind, predicted_ms=predicted_ms, measured_ms=measured_ms,
                calibrated_key=calibrated_key, created_at=utcnow()).returning(TraceRow.id))
            created = res.scalar() is not None
            info = self._by_digest(conn, key, digest)
        return info, created

    def by_digest(self, key: str, digest: str) -> TraceInfo | None:
        with self.repo.engine.connect() as conn:
            return self._by_digest(conn, key, digest)

    @staticmethod
    def _by_digest(conn: Any, key: str, digest: str) -> TraceInfo | None:
        row = conn.execute(select(*_TRACE_COLUMNS).where(TraceRow.problem_key == key,
                                                          TraceRow.digest == digest)).first()
        return None if row is None else _trace_info(row)

    def listing(self, key: str, limit: int = 100) -> list[TraceInfo]:
        """The key's traces, newest first."""
        q = select(*_TRACE_COLUMNS).where(TraceRow.problem_key == key).order_by(TraceRow.id.desc()).limit(limit)
        with self.repo.engine.connect() as conn:
            return [_trace_info(r) for r in conn.execute(q).all()]

    def documents(self, key: str, limit: int) -> list[str]:
        """The newest `limit` trace documents of the key (JSON), newest first."""
        q = select(TraceRow.trace).where(TraceRow.problem_key == key).order_by(TraceRow.id.desc()).limit(limit)
        with self.repo.engine.connect() as conn:
            return list(conn.execute(q).scalars())

    def document(self, key: str, trace_id: int) -> str | None:
        q = select(TraceRow.trace).where(TraceRow.problem_key == key, TraceRow.id == trace_id)
        with self.repo.engine.connect() as conn:
            return conn.execute(q).scalar()

    def summaries(self, keys: list[str]) -> dict[str, tuple[int, TraceInfo]]:
        """Per key with traces: (how many, the newest) - one query for a dashboard page."""
        if not keys:
            return {}
        newest = (select(TraceRow.problem_key, func.max(TraceRow.id).label("last"), func.count().label("n"))
                  .where(TraceRow.problem_key.in_(keys)).group_by(TraceRow.problem_key).subquery())
        q = select(newest.c.n, *_TRACE_COLUMNS).join(newest, TraceRow.id == newest.c.last)
        with self.repo.engine.connect() as conn:
            return {r[2]: (r[0], _trace_info(r[1:])) for r in conn.execute(q).all()}
