"""Frontiers in SQL (docs/frontier.md): create one with its points, read its curve, and offer a
point's best plan to every larger budget of the same frontier (monotone by construction).

Each point is an ordinary cached problem (its own key, revisions, refine job); this module only
stores the link (tables `frontiers`, `frontier_points`) and what was fixed at request time. A curve
is built once per set of point revisions and job states (`FrontierStore.curve` checks that set with
one light query), not on every read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from cachetools import LRUCache
from pipeplan.planner.bounds import MemoryInfeasibleError
from pipeplan.planner.contract import Limits, Plan, Problem
from pipeplan.planner.frontier import (
    FRONTIER_FORMAT,
    PUBLISHED_PEERS,
    Budgets,
    frontier_document,
    heuristic_points,
    monotone,
    rekey,
    setup_document,
)
from pipeplan.planner.validator import InvalidPlanError
from sqlalchemy import and_, select

from . import inline
from .db import make_engine
from .errors import ApiError
from .models import FrontierPointRow, FrontierRow, JobRow, ProblemRow, RevisionRow, utcnow
from .repository import Repository

log = logging.getLogger("pipeplan.frontier")
# What placing the budgets costs (peers, PipeOffload at three budgets, the unlimited first plan), in
# points: measured about 6-8 points' first plans at P=8-32 (docs/frontier.md)
SETUP_POINTS = 8


def frontier_key(base_key: str, points: int, budgets: str = "uniform") -> str:
    """The same problem asked with the same number of points and budget mode is the same frontier
    (scaled budgets keep the key they had before budgets had modes)."""
    mode = "" if budgets == "scaled" else f":{budgets}"
    return hashlib.sha256(f"{FRONTIER_FORMAT}:{base_key}:{points}{mode}".encode()).hexdigest()


class FrontierStore:
    @classmethod
    def of(cls, repo: Repository) -> FrontierStore:
        """The repository's one store, so its curve cache outlives a request."""
        return repo.attached(cls)

    def __init__(self, repo: Repository, cached_curves: int = 256):
        self.repo = repo
        self._curves: LRUCache = LRUCache(maxsize=cached_curves)  # key -> (revision set, document)
        self._curves_lock = threading.Lock()

    def create(self, key: str, base_key: str, setup: dict[str, Any], point_keys: list[tuple[float, str]]) -> bool:
        """Insert the frontier and its points unless it exists (concurrent creators: one wins)."""
        with self.repo.engine.begin() as conn:
            res = conn.execute(self.repo._insert_ignore(FrontierRow).values(
                key=key, problem_key=base_key, setup=setup, created_at=utcnow()).returning(FrontierRow.key))
            if res.scalar() is None:
                return False
            conn.execute(FrontierPointRow.__table__.insert(), [
                {"frontier_key": key, "idx": i, "factor": f, "point_key": k} for i, (f, k) in enumerate(point_keys)])
        return True

    def exists(self, key: str) -> bool:
        with self.repo.engine.connect() as conn:
            return conn.execute(select(FrontierRow.key).where(FrontierRow.key == key)).first() is not None

    def frontiers_of(self, point_key: str) -> list[str]:
        with self.repo.engine.connect() as conn:
            return list(conn.execute(select(FrontierPointRow.frontier_key)
                                     .where(FrontierPointRow.point_key == point_key)).scalars())

    def point_keys(self, key: str) -> list[tuple[float, str]]:
        with self.repo.engine.connect() as conn:
            rows = conn.execute(select(FrontierPointRow.factor, FrontierPointRow.point_key)
                                .where(FrontierPointRow.frontier_key == key).order_by(FrontierPointRow.factor))
            return [(r[0], r[1]) for r in rows]

    def revision_set(self, key: str) -> tuple | None:
        """What a curve depends on, in one light query: each point's best revision and job state."""
        with self.repo.engine.connect() as conn:
            q = (select(FrontierPointRow.point_key, ProblemRow.best_revision, JobRow.state, JobRow.outcome)
                 .join(ProblemRow, ProblemRow.key == FrontierPointRow.point_key)
                 .outerjoin(JobRow, JobRow.key == ProblemRow.key)
                 .where(FrontierPointRow.frontier_key == key).order_by(FrontierPointRow.idx))
            return tuple(tuple(r) for r in conn.execute(q)) or None

    def curve(self, key: str) -> dict[str, Any] | None:
        """The frontier document with each point's best stored plan now (shared: do not modify)."""
        entry = self._entry(key)
        return None if entry is None else entry[1]

    def curve_json(self, key: str) -> str | None:
        """The same document as JSON, encoded once per revision set."""
        entry = self._entry(key)
        if entry is None:
            return None
        if entry[2] is None:
            entry[2] = json.dumps(entry[1], separators=(",", ":"))
        return entry[2]

    def _entry(self, key: str) -> list | None:
        """[revision set, document, JSON or None], built again only when a point's revision or job
        state changed since the last read."""
        revisions = self.revision_set(key)
        with self._curves_lock:
            hit = self._curves.get(key)
        if hit is not None and hit[0] == revisions:
            return hit
        doc = self._build_curve(key)
        if doc is None:
            return None
        entry = [revisions, doc, None]
        with self._curves_lock:
            self._curves[key] = entry
        return entry

    def _build_curve(self, key: str) -> dict[str, Any] | None:
        """The curve from SQL: one query for all points."""
        with self.repo.engine.connect() as conn:
            setup = conn.execute(select(FrontierRow.setup).where(FrontierRow.key == key)).scalar()
            if setup is None:
                return None
            q = (select(FrontierPointRow.idx, FrontierPointRow.factor, FrontierPointRow.point_key,
                        ProblemRow.best_makespan_ms, ProblemRow.lower_bound_ms, ProblemRow.best_revision,
                        ProblemRow.best_method, RevisionRow.solver_bound_ms, JobRow.state, JobRow.outcome)
                 .join(ProblemRow, ProblemRow.key == FrontierPointRow.point_key)
                 .join(RevisionRow, and_(RevisionRow.problem_key == ProblemRow.key,
                                         RevisionRow.revision == ProblemRow.best_revision))
                 .outerjoin(JobRow, JobRow.key == ProblemRow.key)
                 .where(FrontierPointRow.frontier_key == key).order_by(FrontierPointRow.factor))
            rows = conn.execute(q).all()
        return curve_document(setup, rows)

    # -- monotone by construction ---------------------------------------------------------------------
    def propagate(self, point_key: str, publish: Callable[[str, int], None] | None = None) -> list[tuple[str, int]]:
        """Offer `point_key`'s best plan, re-keyed, to every larger point of its frontiers; each store is
        the repository's validated, atomic replace-if-better. Returns the (key, revision) stored."""
        plan = self.repo.best_plan(point_key)
        stored: list[tuple[str, int]] = []
        if plan is None:
            return stored
        for fkey in self.frontiers_of(point_key):
            points = self.point_keys(fkey)
            mine = next((f for f, k in points if k == point_key), None)
            for f, other in points:
                if mine is None or f <= mine or other == point_key:
                    continue
                revision = self.offer(other, plan)
                if revision is not None:
                    stored.append((other, revision))
                    if publish is not None:
                        publish(other, revision)
        return stored

    def offer(self, key: str, plan: Plan, problem: Problem | None = None) -> int | None:
        """Store `plan` re-keyed for `key` if it fits there and is better; None otherwise."""
        problem = problem or self.repo.get_problem(key)
        if problem is None:
            return None
        best = self.repo.best(key)
        if best is not None and best.makespan_ms <= plan.makespan_ms + 1e-6:
            return None
        moved = rekey(problem, plan, key)
        if moved is None:
            return None
        moved = moved.model_copy(update={"method": f"{plan.method} [from a smaller budget]"
                                         if "smaller budget" not in plan.method else plan.method})
        try:
            return self.repo.store_if_better(key, moved, problem)
        except InvalidPlanError as exc:  # never expected: rekey validated it
            log.error("frontier plan for %s rejected: %s", key[:12], exc)
            return None


def curve_document(setup: dict[str, Any], rows: list[Any]) -> dict[str, Any]:
    """Rows (idx, factor, key, makespan, lower bound, revision, method, solver bound, job state,
    outcome) sorted by factor, made monotone, as a `pipeplan.frontier/v1` document."""
    budgets = Budgets.from_doc(setup)
    bounds_at = {round(p["factor"], 12): p.get("bound_ms", 0.0) for p in setup.get("points", [])}
    points = []
    for r in rows:
        limits = budgets.limits(r[1])
        bound = max(r[4], r[7] or 0.0, bounds_at.get(round(r[1], 12), 0.0))
        points.append({"factor": r[1], "limits_mib": limits, "budget_mib": max(limits), "makespan_ms": r[3],
                       "bound_ms": bound, "problem_key": r[2], "revision": r[5], "method": r[6],
                       "job_state": r[8], "outcome": r[9]})
    ms, bounds = monotone([p["makespan_ms"] for p in points], [p["bound_ms"] for p in points])
    for p, m, b in zip(points, ms, bounds):
        p["bound_ms"] = b
        p["status"] = "optimal" if p["makespan_ms"] <= b + 1e-6 else "feasible"
        if m < p["makespan_ms"] - 1e-6:  # a smaller point's plan is faster: its worker will offer it here
            p["pending_from_smaller_ms"] = m
    hbm = None if setup.get("hbm_mib") is None else (setup["hbm_mib"], setup.get("hbm_of") or "")
    return frontier_document(setup["problem_key"], budgets, setup["static_mib"], hbm, setup["factor_min"],
                             setup["factor_max"], points, setup["peers"], setup["unlimited_makespan_ms"])


# -- a new frontier's first plans (in the API's killable child: service.inline.run_in_child) ------------
def check_size(problem: Problem, points: int, max_ops: int) -> None:
    """422 naming `points` when (points + SETUP_POINTS) x the problem's ops exceeds `max_ops`."""
    ops = inline.ops_of(problem)
    work = (points + SETUP_POINTS) * ops
    if work <= max_ops:
        return
    fits = max_ops // ops - SETUP_POINTS
    advice = f"at most {fits} points fit this problem" if fits >= 2 else "this problem is too large for a frontier here"
    raise ApiError(422, "too_large", f"points: {points} points on a problem of {ops:,} ops is (points + {SETUP_POINTS})"
                   f" x ops = {work:,}, above this server's limit of {max_ops:,} (PIPEPLAN_FRONTIER_MAX_OPS);"
                   f" {advice}")


def first_points(job: dict[str, Any]) -> dict[str, Any]:
    """Convert (spec) or parse (problem), check the size, place the points and store each one's
    first plan and the frontier. Runs in the child (service.inline.run_in_child); returns {"key",
    "created", "new": keys whose refine job the API enqueues} or {"error": {...}}."""
    try:
        limits = Limits(**job["limits"])
        if "spec" in job:
            problem = inline.problem_from_spec(job["spec"], limits)
        else:
            problem = Problem.model_validate_json(job["problem"])
        check_size(problem, job["points"], job["max_ops"])
        key = frontier_key(problem.key(), job["points"], job["budgets"])
        engine = make_engine(job["database_url"], 1)
        try:
            repo = Repository(engine)
            store = FrontierStore(repo)
            if store.exists(key):
                return {"key": key, "created": False, "new": []}

            def first(sub: Problem, sub_key: str):
                return inline.first_plan(sub, sub_key, job["greedy_s"], job["greedy_max_s"])

            # the published schedules as implemented here; torch's generators (the CLI's peers too)
            # would cost every request a 300-MB, seconds-long import of torch in its fresh process
            s, points = heuristic_points(problem, job["points"], job["budgets"], first, PUBLISHED_PEERS)
            new = []
            for p in points:
                _, created, _ = repo.store_first(p.problem, p.plan, job["budget_s"], key=p.key)
                if created:
                    new.append(p.key)
                else:
                    store.offer(p.key, p.plan, p.problem)  # a cached point still gets its neighbours' plans
            setup = {**setup_document(problem, s), "points": [{"factor": p.factor, "bound_ms": p.bound_ms}
                                                               for p in points]}
            created = store.create(key, problem.key(), setup, [(p.factor, p.key) for p in points])
        finally:
            engine.dispose()
        return {"key": key, "created": created, "new": new}
    except (ApiError, MemoryInfeasibleError) as exc:
        err = inline.infeasible(exc) if isinstance(exc, MemoryInfeasibleError) else exc
        return {"error": {"status": err.status_code, "code": err.code, "message": err.detail, "extra": err.extra}}
