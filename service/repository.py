"""Problems, plan revisions and refine jobs in SQL: reads for the API and dashboard, atomic writes for
everyone. (Traces: service.trace_store; frontiers: service.frontier_store.)

Every write that races (first revision of a new key, "replace if better", job claim, re-queue) is a
single conditional INSERT/UPDATE, so PostgreSQL row locks or SQLite's single writer serialize
concurrent callers and the WHERE clause decides who wins. No read-then-write windows.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.reuse import nearest, signature
from pipeplan.planner.validator import InvalidPlanError, validate_plan
from pydantic import ValidationError
from sqlalchemy import Engine, and_, case, func, insert, or_, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from .models import (
    ACTIVE_STATES,
    CANCELLED,
    DONE,
    FAILED,
    QUEUED,
    SOLVING,
    JobRow,
    ProblemRow,
    RevisionRow,
    as_utc,
    iso,
    utcnow,
)
from .outcomes import OPTIMAL, describe

T = TypeVar("T")

EPS_MS = 1e-6
# The neighbour lookup at a cache miss reads at most NEIGHBOUR_SCAN problems of the same signature
# (the most recently improved: a configuration search stores dozens per structure, not thousands),
# ranks them by planner.reuse.distance in Python, and loads the best plans of the nearest few only.
NEIGHBOUR_SCAN = 64
# A new run starts without the previous run's verdict.
NO_OUTCOME = {"outcome": None, "gap_pct": None, "searched_s": None, "run_improvements": None}


def new_run_id(key: str) -> str:
    return f"{key[:24]}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class BestPlan:
    key: str
    revision: int
    plan_json: str
    status: str
    makespan_ms: float
    updated_at: datetime | None
    lower_bound_ms: float = 0.0
    method: str = ""

    def summary(self) -> dict[str, Any]:
        return {"problem_key": self.key, "revision": self.revision, "makespan_ms": self.makespan_ms,
                "lower_bound_ms": self.lower_bound_ms, "status": self.status, "method": self.method}

    @property
    def etag(self) -> str:
        return f'"{self.key[:16]}-r{self.revision}"'


@dataclass(frozen=True)
class JobInfo:
    key: str
    run_id: str
    state: str
    budget_s: float
    used_s: float
    attempts: int
    runs: int
    cancel_requested: bool
    worker: str | None
    error: str | None
    improvements: int
    queued_at: datetime | None
    started_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    outcome: str | None = None
    gap_pct: float | None = None
    searched_s: float | None = None
    run_improvements: int | None = None
    bound_ms: float | None = None
    owner: str | None = None

    @property
    def outcome_text(self) -> str | None:
        """The run's end in words (service.outcomes.describe); None while running or after a failure."""
        return describe(self.outcome, self.gap_pct, self.searched_s, self.run_improvements)

    @property
    def outcome_words(self) -> str | None:
        """The same without the gap, for a page that shows the gap beside it."""
        return describe(self.outcome, self.gap_pct, self.searched_s, self.run_improvements, gap=False)

    @classmethod
    def of(cls, row: Any) -> JobInfo:
        m = row._mapping
        return cls(**{f: (as_utc(m[f]) if f.endswith("_at") else m[f]) for f in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["outcome_text"] = self.outcome_text
        for f in ("queued_at", "started_at", "heartbeat_at", "finished_at"):
            d[f] = iso(d[f])
        return d


def problem_summary(problem: Problem) -> dict[str, Any]:
    limits = [d.memory_limit_mib for d in problem.devices if d.memory_limit_mib is not None]
    model = problem.metadata.get("model") if isinstance(problem.metadata, dict) else None
    if isinstance(model, dict):
        model = model.get("name")
    return {
        "num_devices": problem.num_devices,
        "num_microbatches": problem.num_microbatches,
        "num_stages": problem.num_stages,
        "memory_limit_mib": min(limits) if limits else None,
        "model": str(model)[:200] if model is not None else None,
    }


class Repository:
    """Problems, plan revisions and refine jobs. Thread-safe; one per process (fork-safe engine)."""

    def __init__(self, engine: Engine | Callable[[], Engine]):
        self._engine = engine if callable(engine) and not isinstance(engine, Engine) else (lambda: engine)
        self._attached: dict[type, Any] = {}
        self._attached_lock = threading.Lock()

    def attached(self, store: type[T]) -> T:
        """The repository's one `store(self)` (a frontier or configuration store), so the caches it
        keeps outlive a request."""
        with self._attached_lock:
            if store not in self._attached:
                self._attached[store] = store(self)
            return self._attached[store]

    @property
    def engine(self) -> Engine:
        return self._engine()

    def _insert_ignore(self, table):
        if self.engine.dialect.name == "postgresql":
            return postgresql.insert(table).on_conflict_do_nothing()
        if self.engine.dialect.name == "sqlite":
            return sqlite.insert(table).on_conflict_do_nothing()
        raise RuntimeError(f"unsupported database {self.engine.dialect.name}")

    # -- health ---------------------------------------------------------------------------------------
    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    # -- reads ----------------------------------------------------------------------------------------
    def get_problem(self, key: str) -> Problem | None:
        with self.engine.connect() as conn:
            doc = conn.execute(select(ProblemRow.problem).where(ProblemRow.key == key)).scalar()
        return None if doc is None else Problem.model_validate(doc)

    def best(self, key: str) -> BestPlan | None:
        q = (
            select(ProblemRow.best_revision, RevisionRow.plan, ProblemRow.best_status,
                   ProblemRow.best_makespan_ms, ProblemRow.updated_at, ProblemRow.lower_bound_ms,
                   ProblemRow.best_method)
            .join(RevisionRow, and_(RevisionRow.problem_key == ProblemRow.key,
                                    RevisionRow.revision == ProblemRow.best_revision))
            .where(ProblemRow.key == key)
        )
        with self.engine.connect() as conn:
            row = conn.execute(q).first()
        if row is None:
            return None
        return BestPlan(key, row[0], row[1], row[2], row[3], as_utc(row[4]), row[5], row[6])

    def best_plan(self, key: str) -> Plan | None:
        best = self.best(key)
        return None if best is None else Plan.model_validate_json(best.plan_json)

    def best_revision(self, key: str) -> int | None:
        with self.engine.connect() as conn:
            return conn.execute(select(ProblemRow.best_revision).where(ProblemRow.key == key)).scalar()

    def neighbours(self, problem: Problem, key: str, nearest_n: int = 3,
                   scan: int = NEIGHBOUR_SCAN) -> list[tuple[Problem, Plan]]:
        """The stored problems with `problem`'s signature (not `key` itself), nearest first
        (planner.reuse.distance), at most `nearest_n`, each with its best plan: what a cache miss
        reuses. Bounded: `scan` small problem documents read, `nearest_n` plans parsed."""
        q = (select(ProblemRow.key, ProblemRow.problem)
             .where(ProblemRow.signature == signature(problem), ProblemRow.key != key)
             .order_by(ProblemRow.updated_at.desc()).limit(scan))
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
        ranked = nearest(problem, ((Problem.model_validate(doc), k) for k, doc in rows))[:nearest_n]
        out = []
        for _, other, k in ranked:
            plan = self.best_plan(k)
            if plan is not None:
                out.append((other, plan))
        return out

    def revisions(self, key: str, after: int = 0) -> list[dict[str, Any]]:
        """Revision history without the plan bodies (makespan and bounds over time; a reused
        revision's neighbour)."""
        q = (
            select(RevisionRow.revision, RevisionRow.makespan_ms, RevisionRow.lower_bound_ms,
                   RevisionRow.solver_bound_ms, RevisionRow.status, RevisionRow.method,
                   RevisionRow.created_at, RevisionRow.neighbour_key, RevisionRow.neighbour_revision)
            .where(RevisionRow.problem_key == key, RevisionRow.revision > after)
            .order_by(RevisionRow.revision)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
        return [
            {"revision": r[0], "makespan_ms": r[1], "lower_bound_ms": r[2], "solver_bound_ms": r[3],
             "status": r[4], "method": r[5], "created_at": iso(r[6]), "neighbour_key": r[7],
             "neighbour_revision": r[8]}
            for r in rows
        ]

    def revision_plans(self, key: str, after: int = 0, limit: int = 100) -> list[tuple[int, str]]:
        q = (
            select(RevisionRow.revision, RevisionRow.plan)
            .where(RevisionRow.problem_key == key, RevisionRow.revision > after)
            .order_by(RevisionRow.revision).limit(limit)
        )
        with self.engine.connect() as conn:
            return [(r[0], r[1]) for r in conn.execute(q).all()]

    def revision_plan(self, key: str, revision: int) -> str | None:
        q = select(RevisionRow.plan).where(RevisionRow.problem_key == key, RevisionRow.revision == revision)
        with self.engine.connect() as conn:
            return conn.execute(q).scalar()

    def job(self, key: str) -> JobInfo | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(*JobRow.__table__.c).where(JobRow.key == key)).first()
        return None if row is None else JobInfo.of(row)

    # The best proven bound of a key: its best plan's, or the tighter one a run proved without finding a
    # shorter plan (jobs.bound_ms). One bound, so the listing's gap is the one gap the key has.
    BOUND = case((JobRow.bound_ms > ProblemRow.lower_bound_ms, JobRow.bound_ms), else_=ProblemRow.lower_bound_ms)

    SORTS = {
        "updated_at": ProblemRow.updated_at,
        "created_at": ProblemRow.created_at,
        "makespan_ms": ProblemRow.best_makespan_ms,
        "num_devices": ProblemRow.num_devices,
        "num_microbatches": ProblemRow.num_microbatches,
        "revision": ProblemRow.best_revision,
        "bubble_ratio": ProblemRow.bubble_ratio,
        "gap": (ProblemRow.best_makespan_ms - BOUND) / ProblemRow.best_makespan_ms,
        "speedup": ProblemRow.first_makespan_ms / ProblemRow.best_makespan_ms,
    }

    def list_plans(self, offset: int = 0, limit: int = 50, sort: str = "updated_at", descending: bool = True,
                   q: str | None = None, job_state: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """One page of the cache with the summary fields the dashboard shows, and the total count."""
        conds = []
        if q:
            like = f"%{q.lower()}%"
            conds.append(or_(ProblemRow.key.like(f"{q.lower()}%"), func.lower(ProblemRow.model).like(like)))
        if job_state:
            conds.append(JobRow.state == job_state)
        order = self.SORTS.get(sort, ProblemRow.updated_at)
        base = select(ProblemRow, JobRow.state, JobRow.outcome, JobRow.gap_pct, JobRow.searched_s,
                      JobRow.run_improvements, self.BOUND).outerjoin(JobRow, JobRow.key == ProblemRow.key)
        if conds:
            base = base.where(*conds)
        page = base.order_by(order.desc() if descending else order.asc(), ProblemRow.key).offset(offset).limit(limit)
        count = select(func.count()).select_from(ProblemRow).outerjoin(JobRow, JobRow.key == ProblemRow.key)
        if conds:
            count = count.where(*conds)
        with Session(self.engine) as session:
            rows = session.execute(page).all()
            total = session.execute(count).scalar() or 0
        items = []
        for p, state, outcome, gap_pct, searched_s, run_improvements, bound in rows:
            bound = min(bound, p.best_makespan_ms)
            items.append({
                "problem_key": p.key,
                "model": p.model,
                "num_devices": p.num_devices,
                "num_microbatches": p.num_microbatches,
                "num_stages": p.num_stages,
                "stages_per_device": p.num_stages // max(1, p.num_devices),
                "memory_limit_mib": p.memory_limit_mib,
                "revision": p.best_revision,
                "makespan_ms": p.best_makespan_ms,
                "lower_bound_ms": bound,
                "gap": (p.best_makespan_ms - bound) / p.best_makespan_ms if p.best_makespan_ms > 0 else 0.0,
                "bubble_ratio": p.bubble_ratio,
                "status": p.best_status,
                "method": p.best_method,
                "first_makespan_ms": p.first_makespan_ms,
                "speedup_over_first": p.first_makespan_ms / p.best_makespan_ms if p.best_makespan_ms else None,
                "job_state": state,
                "job_outcome": outcome,
                "job_outcome_text": describe(outcome, gap_pct, searched_s, run_improvements),
                "job_outcome_words": describe(outcome, gap_pct, searched_s, run_improvements, gap=False),
                "created_at": iso(p.created_at),
                "updated_at": iso(p.updated_at),
            })
        return items, total

    def job_counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(JobRow.state, func.count()).group_by(JobRow.state)).all()
        return {state: n for state, n in rows}

    def improvements_total(self) -> int:
        """Shorter plans stored after the first, over every job (a revision that only adds a proof is none)."""
        with self.engine.connect() as conn:
            return conn.execute(select(func.coalesce(func.sum(JobRow.improvements), 0))).scalar() or 0

    # -- plan writes ----------------------------------------------------------------------------------
    def store_first(self, problem: Problem, plan: Plan, budget_s: float, key: str | None = None,
                    owner: str | None = None,
                    neighbour: tuple[str, int] | None = None) -> tuple[int, bool, JobInfo]:
        """Store revision 1 and its refine job (queued for `owner`), unless the key exists; with the
        problem's signature (the neighbour index) and, for a reused plan, the (key, revision) it grew
        from. Returns (best revision, created, job).

        Concurrent callers with one new problem: exactly one INSERT wins; the others see created=False.
        """
        key = key or problem.key()
        _check_valid(problem, plan, key)
        problem_doc = problem.model_dump(mode="json")
        if read_back(Problem, problem_doc, "the problem").key() != problem.key():  # e.g. a NaN stored as null
            raise UnreadableDocument("the problem would read back as another problem (another key)")
        plan_json = plan.model_copy(update={"revision": 1, "problem_key": key}).model_dump_json()
        now = utcnow()
        run_id = new_run_id(key)
        with self.engine.begin() as conn:
            res = conn.execute(self._insert_ignore(ProblemRow).values(
                key=key, problem=problem_doc, **problem_summary(problem),
                best_revision=1, best_makespan_ms=plan.makespan_ms, best_iteration_ms=plan.iteration_ms,
                lower_bound_ms=plan.lower_bound_ms,
                bubble_ratio=plan.bubble_ratio, best_status=plan.status, best_method=plan.method,
                first_makespan_ms=plan.makespan_ms, signature=signature(problem), created_at=now,
                updated_at=now,
            ).returning(ProblemRow.key))
            created = res.scalar() is not None  # rowcount is not reliable for ON CONFLICT on every driver
            if created:
                conn.execute(insert(RevisionRow).values(
                    problem_key=key, revision=1, makespan_ms=plan.makespan_ms,
                    lower_bound_ms=plan.lower_bound_ms, solver_bound_ms=plan.solver_bound_ms,
                    status=plan.status, method=plan.method, plan=plan_json, created_at=now,
                    neighbour_key=neighbour and neighbour[0], neighbour_revision=neighbour and neighbour[1],
                ))
                # a heuristic plan already at its proven bound needs no search: done, optimal, 0 s
                proven = plan.status == "optimal"
                ended = dict(state=DONE, finished_at=now, outcome=OPTIMAL, gap_pct=0.0, searched_s=0.0,
                             run_improvements=0) if proven else dict(state=QUEUED)
                conn.execute(self._insert_ignore(JobRow).values(
                    key=key, run_id=run_id, budget_s=budget_s, used_s=0.0, attempts=0, runs=1,
                    cancel_requested=False, improvements=0, queued_at=now, owner=owner, **ended,
                ))
            revision = conn.execute(select(ProblemRow.best_revision).where(ProblemRow.key == key)).scalar()
            job = conn.execute(select(*JobRow.__table__.c).where(JobRow.key == key)).first()
        return revision, created, JobInfo.of(job)

    def store_if_better(self, key: str, plan: Plan, problem: Problem | None = None) -> int | None:
        """Store `plan` as the next revision iff it validates and beats the stored best; atomic.

        Better = shorter makespan; or the same makespan and a shorter iteration (the solvers' second
        criterion, when both plans report one); or the same makespan newly proven optimal. Returns the
        new revision, or None when the stored plan is at least as good (another writer may have just
        won). Only a shorter makespan counts as one of the job's improvements.
        """
        problem = problem or self.get_problem(key)
        if problem is None:
            raise KeyError(key)
        _check_valid(problem, plan, key)
        m, it = plan.makespan_ms, plan.iteration_ms
        now = utcnow()
        same = ProblemRow.best_makespan_ms >= m - EPS_MS  # (once a shorter makespan has not won)
        proven = and_(ProblemRow.best_status != "optimal", same)
        with self.engine.begin() as conn:
            def take(better) -> int | None:  # each UPDATE decides atomically; the loser's WHERE no longer holds
                return conn.execute(
                    update(ProblemRow).where(ProblemRow.key == key, better).values(
                        best_revision=ProblemRow.best_revision + 1, best_makespan_ms=m, best_iteration_ms=it,
                        lower_bound_ms=plan.lower_bound_ms, bubble_ratio=plan.bubble_ratio,
                        best_status=plan.status, best_method=plan.method, updated_at=now,
                    ).returning(ProblemRow.best_revision)
                ).scalar()

            revision = take(ProblemRow.best_makespan_ms > m + EPS_MS)
            shorter = revision is not None
            if revision is None and it is not None:
                revision = take(and_(same, ProblemRow.best_iteration_ms > it + EPS_MS))
            if revision is None and plan.status == "optimal":
                revision = take(proven)
            if revision is None:
                return None
            plan_json = plan.model_copy(update={"revision": revision, "problem_key": key}).model_dump_json()
            conn.execute(insert(RevisionRow).values(
                problem_key=key, revision=revision, makespan_ms=m, lower_bound_ms=plan.lower_bound_ms,
                solver_bound_ms=plan.solver_bound_ms, status=plan.status, method=plan.method,
                plan=plan_json, created_at=now,
            ))
            if shorter:
                conn.execute(update(JobRow).where(JobRow.key == key).values(improvements=JobRow.improvements + 1))
        return revision

    # -- job writes -----------------------------------------------------------------------------------
    def request_refine(self, key: str, budget_s: float, owner: str | None = None) -> tuple[JobInfo | None, bool]:
        """Queue a new run of the key's job for `owner` unless one is queued or solving. Returns (job,
        newly queued)."""
        run_id = new_run_id(key)
        with self.engine.begin() as conn:
            res = conn.execute(
                update(JobRow).where(JobRow.key == key, JobRow.state.not_in(ACTIVE_STATES)).values(
                    state=QUEUED, run_id=run_id, budget_s=budget_s, used_s=0.0, attempts=0, owner=owner,
                    cancel_requested=False, runs=JobRow.runs + 1, queued_at=utcnow(), error=None,
                    started_at=None, finished_at=None, heartbeat_at=None, **NO_OUTCOME,
                )
            )
            queued = res.rowcount == 1
            if not queued and conn.execute(select(ProblemRow.key).where(ProblemRow.key == key)).first():
                res = conn.execute(self._insert_ignore(JobRow).values(
                    key=key, run_id=run_id, state=QUEUED, budget_s=budget_s, used_s=0.0, attempts=0, runs=1,
                    cancel_requested=False, improvements=0, queued_at=utcnow(), owner=owner,
                ).returning(JobRow.key))
                queued = res.scalar() is not None
        return self.job(key), queued

    def queued_work(self, owner: str) -> tuple[int, float]:
        """(runs, solve-seconds left) that `owner` has queued or solving: what fair queuing caps."""
        q = select(func.count(), func.coalesce(func.sum(JobRow.budget_s - JobRow.used_s), 0.0)).where(
            JobRow.owner == owner, JobRow.state.in_(ACTIVE_STATES))
        with self.engine.connect() as conn:
            runs, seconds = conn.execute(q).one()
        return int(runs), max(0.0, float(seconds))

    def request_cancel(self, key: str) -> JobInfo | None:
        """A queued run is cancelled at once; a solving one stops at its next heartbeat."""
        now = utcnow()
        with self.engine.begin() as conn:
            conn.execute(update(JobRow).where(JobRow.key == key, JobRow.state == QUEUED).values(
                state=CANCELLED, cancel_requested=True, finished_at=now))
            conn.execute(update(JobRow).where(JobRow.key == key, JobRow.state == SOLVING).values(
                cancel_requested=True))
        return self.job(key)

    def claim(self, key: str, run_id: str, worker: str) -> JobInfo | None:
        """Take a queued run; None when it was cancelled, superseded or already taken."""
        now = utcnow()
        with self.engine.begin() as conn:
            res = conn.execute(update(JobRow).where(
                JobRow.key == key, JobRow.run_id == run_id, JobRow.state == QUEUED,
                JobRow.cancel_requested.is_(False),
            ).values(state=SOLVING, attempts=JobRow.attempts + 1, started_at=now, heartbeat_at=now,
                     worker=worker[:200]))
            if res.rowcount != 1:
                return None
        return self.job(key)

    def heartbeat(self, key: str, run_id: str, used_s: float) -> bool | None:
        """Record progress. Returns cancel_requested, or None when this run no longer owns the job."""
        with self.engine.begin() as conn:
            return conn.execute(update(JobRow).where(
                JobRow.key == key, JobRow.run_id == run_id, JobRow.state == SOLVING,
            ).values(heartbeat_at=utcnow(), used_s=used_s).returning(JobRow.cancel_requested)).scalar()

    def finish(self, key: str, run_id: str, state: str, error: str | None = None, *,
               outcome: str | None = None, gap_pct: float | None = None, searched_s: float | None = None,
               run_improvements: int | None = None, bound_ms: float | None = None) -> bool:
        """End this run (only if it still owns the row), with how it ended in the same UPDATE, so a
        reader never sees "done" without its outcome and gap. `bound_ms`, the bound the run proved,
        is kept when tighter than the job's earlier ones (a bound holds for every later run too)."""
        bound = JobRow.bound_ms if bound_ms is None else case(
            (or_(JobRow.bound_ms.is_(None), JobRow.bound_ms < bound_ms), bound_ms), else_=JobRow.bound_ms)
        with self.engine.begin() as conn:
            res = conn.execute(update(JobRow).where(
                JobRow.key == key, JobRow.run_id == run_id, JobRow.state == SOLVING,
            ).values(state=state, error=error[:4000] if error else None, finished_at=utcnow(),
                     heartbeat_at=utcnow(), outcome=outcome, gap_pct=gap_pct, searched_s=searched_s,
                     run_improvements=run_improvements, bound_ms=bound))
            return res.rowcount == 1

    def release(self, key: str, run_id: str, used_s: float) -> bool:
        """Hand a solving run back (worker shutting down): the reconciler re-runs it with what is left."""
        with self.engine.begin() as conn:
            res = conn.execute(update(JobRow).where(
                JobRow.key == key, JobRow.run_id == run_id, JobRow.state == SOLVING,
            ).values(state=QUEUED, used_s=used_s, queued_at=utcnow() - timedelta(days=1)))
            return res.rowcount == 1

    def unfinished(self, stale_before: datetime, queued_before: datetime) -> list[JobInfo]:
        """Solving runs whose heartbeat stopped, and queued runs old enough to check against the queue."""
        q = select(*JobRow.__table__.c).where(or_(
            and_(JobRow.state == SOLVING, or_(JobRow.heartbeat_at < stale_before, JobRow.heartbeat_at.is_(None))),
            and_(JobRow.state == QUEUED, JobRow.queued_at < queued_before),
        ))
        with self.engine.connect() as conn:
            return [JobInfo.of(r) for r in conn.execute(q).all()]

    def give_up(self, job: JobInfo, error: str) -> bool:
        """Mark an orphaned run failed (it keeps killing its workers); only if nobody else moved it."""
        with self.engine.begin() as conn:
            res = conn.execute(update(JobRow).where(
                JobRow.key == job.key, JobRow.run_id == job.run_id, JobRow.state == job.state,
            ).values(state=FAILED, error=error, finished_at=utcnow()))
        return res.rowcount == 1

    def requeue(self, job: JobInfo) -> str | None:
        """Give an orphaned run a new run id (only if nobody else did); the caller enqueues it."""
        run_id = new_run_id(job.key)
        with self.engine.begin() as conn:
            res = conn.execute(update(JobRow).where(
                JobRow.key == job.key, JobRow.run_id == job.run_id, JobRow.state == job.state,
            ).values(state=QUEUED, run_id=run_id, queued_at=utcnow()))
        return run_id if res.rowcount == 1 else None


class UnreadableDocument(ValueError):
    """A document that would not parse back once stored; nothing was written."""


def read_back(model: type, doc: str | dict, what: str) -> Any:
    """`doc` parsed as `model`, as every later read will parse it. Stores call it before writing, so
    a stored document that cannot be read back (and then answers 500 for good) cannot exist."""
    try:
        return model.model_validate_json(doc) if isinstance(doc, str) else model.model_validate(doc)
    except ValidationError as exc:
        raise UnreadableDocument(f"{what} would not read back: {str(exc).splitlines()[0]}") from None


def _check_valid(problem: Problem, plan: Plan, key: str) -> None:
    violations = validate_plan(problem, plan.model_copy(update={"problem_key": key}), key)
    if violations:
        raise InvalidPlanError(violations)


def stale_cutoffs(stale_after_s: float, queued_grace_s: float = 3.0) -> tuple[datetime, datetime]:
    now = utcnow()
    return now - timedelta(seconds=stale_after_s), now - timedelta(seconds=queued_grace_s)


__all__ = ["BestPlan", "JobInfo", "Repository", "UnreadableDocument", "problem_summary", "read_back", "stale_cutoffs"]

