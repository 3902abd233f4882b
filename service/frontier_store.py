"""Frontiers in SQL (docs/frontier.md): create one with its points, read its curve, and offer a
point's best plan to every larger budget of the same frontier (monotone by construction).

Each point is an ordinary cached problem (its own key, revisions, refine job); this module only
stores the link (tables `frontiers`, `frontier_points`) and what was fixed at request time.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable

from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.frontier import FRONTIER_FORMAT, frontier_document, monotone, rekey
from pipeplan.planner.validator import InvalidPlanError
from sqlalchemy import and_, select

from .models import FrontierPointRow, FrontierRow, JobRow, ProblemRow, RevisionRow, utcnow
from .repository import Repository

log = logging.getLogger("pipeplan.frontier")


def frontier_key(base_key: str, points: int) -> str:
    """The same problem asked with the same number of points is the same frontier."""
    return hashlib.sha256(f"{FRONTIER_FORMAT}:{base_key}:{points}".encode()).hexdigest()


class FrontierStore:
    def __init__(self, repo: Repository):
        self.repo = repo

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

    def curve(self, key: str) -> dict[str, Any] | None:
        """The frontier document with each point's best stored plan now (one query for all points)."""
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
    free, static = setup["free_mib"], setup["static_mib"]
    bounds_at = {round(p["factor"], 12): p.get("bound_ms", 0.0) for p in setup.get("points", [])}
    points = []
    for r in rows:
        limits = [s + r[1] * fr for s, fr in zip(static, free)]
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
    return frontier_document(setup["problem_key"], free, static, setup["factor_min"], setup["factor_max"],
                             points, setup["peers"], setup["unlimited_makespan_ms"])
