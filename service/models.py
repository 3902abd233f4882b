"""SQL tables of the plan cache: problems (with summary columns), plan revisions and refine jobs.

The summary columns on `problems` duplicate the best revision on purpose: the listing, the ETag and
the atomic "replace if better" upsert all read or write one row, never a join.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JSONType = JSON().with_variant(JSONB(), "postgresql")

# Job states: where the run is in its life. A run that ended on its own is DONE; *how* it ended is the
# separate `outcome` (service.outcomes: optimal, budget, stalled, stopped), so the state machine stays
# small for clients and "done" never claims more than that the run is over (docs/service.md).
QUEUED, SOLVING, DONE, FAILED, CANCELLED = "queued", "solving", "done", "failed", "cancelled"
ACTIVE_STATES = (QUEUED, SOLVING)
JOB_STATES = (QUEUED, SOLVING, DONE, FAILED, CANCELLED)


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything we store is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def iso(value: datetime | None) -> str | None:
    value = as_utc(value)
    return value.isoformat() if value else None


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ProblemRow(Base):
    __tablename__ = "problems"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    problem: Mapped[dict] = mapped_column(JSONType)
    num_devices: Mapped[int] = mapped_column(Integer)
    num_microbatches: Mapped[int] = mapped_column(Integer)
    num_stages: Mapped[int] = mapped_column(Integer)
    memory_limit_mib: Mapped[float | None] = mapped_column(Float, nullable=True)
    model: Mapped[str | None] = mapped_column(String(200), nullable=True)
    best_revision: Mapped[int] = mapped_column(Integer)
    best_makespan_ms: Mapped[float] = mapped_column(Float)
    # the best plan's iteration_ms (the solvers' second criterion); NULL for plans without one
    best_iteration_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    lower_bound_ms: Mapped[float] = mapped_column(Float)
    bubble_ratio: Mapped[float] = mapped_column(Float)
    best_status: Mapped[str] = mapped_column(String(16))
    best_method: Mapped[str] = mapped_column(Text)
    first_makespan_ms: Mapped[float] = mapped_column(Float)
    # planner.reuse.signature: the neighbour index (same structure, other numbers; docs/reuse.md).
    # NULL only for a row whose document did not parse when the migration signed the old rows.
    signature: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)


class RevisionRow(Base):
    __tablename__ = "plan_revisions"
    __table_args__ = (UniqueConstraint("problem_key", "revision", name="uq_plan_revisions_key_revision"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    problem_key: Mapped[str] = mapped_column(ForeignKey("problems.key", ondelete="CASCADE"))
    revision: Mapped[int] = mapped_column(Integer)
    makespan_ms: Mapped[float] = mapped_column(Float)
    lower_bound_ms: Mapped[float] = mapped_column(Float)
    solver_bound_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    method: Mapped[str] = mapped_column(Text)
    plan: Mapped[str] = mapped_column(Text)  # the plan v1 JSON exactly as served (bytes, no re-encode)
    # a revision reused from a neighbour's plan: that key and revision (provenance, so no foreign key:
    # the neighbour may be deleted, the record of where the plan came from stays)
    neighbour_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    neighbour_revision: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class JobRow(Base):
    """The refine job of one key (one row per key: the dedup is the primary key)."""

    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_state_heartbeat", "state", "heartbeat_at"),
                      Index("ix_jobs_owner_state", "owner", "state"))

    key: Mapped[str] = mapped_column(ForeignKey("problems.key", ondelete="CASCADE"), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(120))  # the queue's job id of the current run
    state: Mapped[str] = mapped_column(String(16))
    budget_s: Mapped[float] = mapped_column(Float)
    used_s: Mapped[float] = mapped_column(Float, default=0.0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    runs: Mapped[int] = mapped_column(Integer, default=1)  # refine requests served by this row
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    improvements: Mapped[int] = mapped_column(Integer, default=0)  # revisions stored by every run
    # How the last run ended (NULL while one is queued or solving, after a failure, or before 0002):
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)
    gap_pct: Mapped[float | None] = mapped_column(Float, nullable=True)  # best plan's gap to the proven bound
    searched_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # solver seconds, all attempts
    run_improvements: Mapped[int | None] = mapped_column(Integer, nullable=True)  # revisions that run stored
    bound_ms: Mapped[float | None] = mapped_column(Float, nullable=True)  # the lower bound that run proved
    # who asked for the current run (service.admission.identity_of): its queued solve-seconds are capped
    owner: Mapped[str | None] = mapped_column(String(80), nullable=True)
    queued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class FrontierRow(Base):
    """A time-memory frontier (docs/frontier.md): what is fixed when it is requested (budget unit,
    range, peers) as one JSON document; its points are ordinary problems (FrontierPointRow)."""

    __tablename__ = "frontiers"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    problem_key: Mapped[str] = mapped_column(String(64), index=True)  # the base problem's key
    setup: Mapped[dict] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class FrontierPointRow(Base):
    """Point `idx` of a frontier: budget factor `factor`, cached as the plan of `point_key`."""

    __tablename__ = "frontier_points"

    frontier_key: Mapped[str] = mapped_column(ForeignKey("frontiers.key", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    factor: Mapped[float] = mapped_column(Float)
    point_key: Mapped[str] = mapped_column(ForeignKey("problems.key", ondelete="CASCADE"), index=True)


class ConfigurationRow(Base):
    """A configuration search (docs/configure.md): the request and the search's document, as first
    ranked; its candidates are ordinary problems (ConfigurationCandidateRow)."""

    __tablename__ = "configurations"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    document: Mapped[dict] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ConfigurationCandidateRow(Base):
    """Candidate `idx` (the search's order) of a configuration search, cached as the plan of
    `candidate_key`; `refined`: its refine job was queued by the search."""

    __tablename__ = "configuration_candidates"

    configuration_key: Mapped[str] = mapped_column(ForeignKey("configurations.key", ondelete="CASCADE"),
                                                   primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    candidate_key: Mapped[str] = mapped_column(ForeignKey("problems.key", ondelete="CASCADE"), index=True)
    refined: Mapped[bool] = mapped_column(Boolean)


class TraceRow(Base):
    """One measured iteration of a plan (`pipeplan.trace/v1`, docs/trace.md) and what it yielded.

    `calibrated_key` links the trace to the calibrated problem derived from it (its own key; why a
    column and not a link table: migrations/versions/0004_plan_traces.py). The document is kept as
    posted (normalized JSON) so `pipeplan fidelity` can be run on it later.
    """

    __tablename__ = "plan_traces"
    __table_args__ = (UniqueConstraint("problem_key", "digest", name="uq_plan_traces_key_digest"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    problem_key: Mapped[str] = mapped_column(ForeignKey("problems.key", ondelete="CASCADE"))
    revision: Mapped[int] = mapped_column(Integer)  # the plan revision that ran
    digest: Mapped[str] = mapped_column(String(64))  # sha256 of the document: a retried POST stores it once
    iteration: Mapped[int] = mapped_column(Integer)
    device_kind: Mapped[str] = mapped_column(String(16))
    predicted_ms: Mapped[float] = mapped_column(Float)  # that revision's makespan
    measured_ms: Mapped[float] = mapped_column(Float)
    trace: Mapped[str] = mapped_column(Text)
    calibrated_key: Mapped[str | None] = mapped_column(ForeignKey("problems.key", ondelete="SET NULL"), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
