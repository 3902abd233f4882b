"""The neighbour index: each problem's structure signature, and where a reused revision came from.

`problems.signature` is planner.reuse.signature(problem) (64 hex: devices, each stage's device,
options; docs/reuse.md), indexed: at a cache miss the API reads the stored problems with the new
problem's signature and reuses the nearest ones' best plans. The old rows are signed here, in the
migration, not lazily: a lazy index would miss every problem nobody posts again, which are exactly
the refined plans worth reusing. It reads each row's problem document once, in batches by key
(about 20,000 rows a second); a document that no longer parses keeps NULL and is nobody's
neighbour. Offline (`alembic upgrade --sql`) nothing can be computed: run `pipeplan migrate`.
If the signature's definition changes (planner.reuse.NEIGHBOUR_FORMAT), a new migration re-signs.

`plan_revisions.neighbour_key` / `neighbour_revision` record the neighbour's key and revision a
reused plan grew from (the dashboard links to it). No foreign key: it is provenance, kept when the
neighbour is deleted.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

BATCH = 500


def upgrade() -> None:
    # Plain ALTER TABLE, not batch mode: SQLite's batch copy drops and re-creates `problems`, and with
    # foreign keys on, dropping it cascades to every job, revision and trace (SQLite has had ADD and
    # DROP COLUMN since 3.35).
    op.add_column("problems", sa.Column("signature", sa.String(64), nullable=True))
    op.create_index("ix_problems_signature", "problems", ["signature"])
    op.add_column("plan_revisions", sa.Column("neighbour_key", sa.String(64), nullable=True))
    op.add_column("plan_revisions", sa.Column("neighbour_revision", sa.Integer(), nullable=True))
    if not context.is_offline_mode():
        _sign_existing_rows()


def _sign_existing_rows() -> None:
    from pipeplan.planner.contract import Problem
    from pipeplan.planner.reuse import signature
    from pydantic import ValidationError

    problems = sa.table("problems", sa.column("key", sa.String(64)),
                        sa.column("problem", sa.JSON().with_variant(JSONB(), "postgresql")),
                        sa.column("signature", sa.String(64)))
    conn = op.get_bind()
    after = ""
    while rows := conn.execute(sa.select(problems.c.key, problems.c.problem).where(problems.c.key > after)
                               .order_by(problems.c.key).limit(BATCH)).all():
        signed = []
        for key, doc in rows:
            try:
                signed.append({"k": key, "s": signature(Problem.model_validate(doc))})
            except (ValidationError, ValueError, TypeError):
                continue  # unreadable: stays NULL, nobody's neighbour
        if signed:
            conn.execute(problems.update().where(problems.c.key == sa.bindparam("k"))
                         .values(signature=sa.bindparam("s")), signed)
        after = rows[-1][0]


def downgrade() -> None:
    op.drop_column("plan_revisions", "neighbour_revision")
    op.drop_column("plan_revisions", "neighbour_key")
    op.drop_index("ix_problems_signature", table_name="problems")
    op.drop_column("problems", "signature")
