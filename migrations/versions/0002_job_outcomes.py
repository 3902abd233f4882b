"""Honest job ends: state "converged" becomes "done" plus how the run ended (outcome, gap, seconds).

"converged" was written whatever happened, so an old row says nothing about the search. Upgrading
maps it to "done" and records outcome "optimal" (gap 0) only where the stored best plan is proven
optimal; the others keep a NULL outcome ("not recorded") rather than a guessed one. Downgrading
maps "done" back to "converged" and drops the columns.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

COLUMNS = {"outcome": sa.String(16), "gap_pct": sa.Float(), "searched_s": sa.Float(),
           "run_improvements": sa.Integer()}


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name, type_ in COLUMNS.items():
            batch.add_column(sa.Column(name, type_, nullable=True))
    op.execute("UPDATE jobs SET state = 'done' WHERE state = 'converged'")
    op.execute(
        "UPDATE jobs SET outcome = 'optimal', gap_pct = 0.0 WHERE state = 'done' AND key IN"
        " (SELECT key FROM problems WHERE best_status = 'optimal')"
    )


def downgrade() -> None:
    op.execute("UPDATE jobs SET state = 'converged' WHERE state = 'done'")
    with op.batch_alter_table("jobs") as batch:
        for name in reversed(list(COLUMNS)):
            batch.drop_column(name)
