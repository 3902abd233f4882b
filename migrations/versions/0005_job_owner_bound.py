"""Who queued a job and the bound its run proved: fair queuing and one gap per plan.

`owner` is the identity that asked for the queued run (an API key's digest, or the client address
when no keys are configured): the API caps the solve-seconds one identity may have queued or solving
(docs/service.md, fair queuing). `bound_ms` is the lower bound the last run proved (CP-SAT's, or the
memory bound), often tighter than the one stored with the plan when that run found no shorter plan;
listings and the dashboard take the tighter one, so a row shows one gap. Both NULL on older rows
(no owner: counted against nobody; no bound: the plan's own).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("owner", sa.String(80), nullable=True))
        batch.add_column(sa.Column("bound_ms", sa.Float(), nullable=True))
        batch.create_index("ix_jobs_owner_state", ["owner", "state"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_owner_state")
        batch.drop_column("bound_ms")
        batch.drop_column("owner")
