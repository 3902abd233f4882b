"""The cached best plan's iteration: `problems.best_iteration_ms`.

Why: the solvers rank plans by makespan first and iteration second (docs/decisions.md), so a refine
that finds the same makespan with a shorter iteration (a stage's gradient reduction hidden behind
later compute) has improved the plan; the cache compares it with the stored best's iteration, which
it keeps here beside `best_makespan_ms`. The old rows are filled from their best revision's plan
document (`iteration_ms`); a plan stored before plans carried it, or a document that no longer
parses, keeps NULL, and such a row takes a new revision for a shorter makespan or a proof, as before.
Offline (`alembic upgrade --sql`) nothing can be read: run `pipeplan migrate`.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27
"""
from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import context, op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BATCH = 500


def upgrade() -> None:
    # Plain ALTER TABLE, not batch mode (0006 says why: SQLite's batch copy would cascade).
    op.add_column("problems", sa.Column("best_iteration_ms", sa.Float(), nullable=True))
    if not context.is_offline_mode():
        _fill_existing_rows()


def _fill_existing_rows() -> None:
    problems = sa.table("problems", sa.column("key", sa.String(64)), sa.column("best_revision", sa.Integer()),
                        sa.column("best_iteration_ms", sa.Float()))
    revisions = sa.table("plan_revisions", sa.column("problem_key", sa.String(64)),
                         sa.column("revision", sa.Integer()), sa.column("plan", sa.Text()))
    conn = op.get_bind()
    after = ""
    while rows := conn.execute(
            sa.select(problems.c.key, revisions.c.plan)
            .select_from(problems.join(revisions, sa.and_(revisions.c.problem_key == problems.c.key,
                                                          revisions.c.revision == problems.c.best_revision)))
            .where(problems.c.key > after).order_by(problems.c.key).limit(BATCH)).all():
        filled = []
        for key, doc in rows:
            try:
                iteration = json.loads(doc).get("iteration_ms")
            except (ValueError, TypeError, AttributeError):
                continue  # unreadable: stays NULL
            if isinstance(iteration, (int, float)):
                filled.append({"k": key, "i": float(iteration)})
        if filled:
            conn.execute(problems.update().where(problems.c.key == sa.bindparam("k"))
                         .values(best_iteration_ms=sa.bindparam("i")), filled)
        after = rows[-1][0]


def downgrade() -> None:
    op.drop_column("problems", "best_iteration_ms")
