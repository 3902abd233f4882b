"""Plan traces: measured runs of a plan (pipeplan.trace/v1) and the calibrated problem each one yielded.

The link to the calibrated problem is a column on the trace row (`calibrated_key`), not a link
table: every posted trace yields exactly one calibrated problem (from that trace and the key's
recent ones), so the relation is many traces -> one problem, which a nullable foreign key states
completely; the other direction (calibrated problem -> original) is already in the calibrated
problem itself (`metadata.calibrated_from`, part of its key). `problems` is left alone: it is the
hot table every read and upsert touches. (problem_key, digest) is unique, so a client that retries
a POST stores its trace once; it also serves every lookup by problem key.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-08
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "plan_traces",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("problem_key", sa.String(64), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("iteration", sa.Integer(), nullable=False),
        sa.Column("device_kind", sa.String(16), nullable=False),
        sa.Column("predicted_ms", sa.Float(), nullable=False),
        sa.Column("measured_ms", sa.Float(), nullable=False),
        sa.Column("trace", sa.Text(), nullable=False),
        sa.Column("calibrated_key", sa.String(64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["problem_key"], ["problems.key"], ondelete="CASCADE",
                                name=op.f("fk_plan_traces_problem_key_problems")),
        sa.ForeignKeyConstraint(["calibrated_key"], ["problems.key"], ondelete="SET NULL",
                                name=op.f("fk_plan_traces_calibrated_key_problems")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plan_traces")),
        sa.UniqueConstraint("problem_key", "digest", name="uq_plan_traces_key_digest"),
    )


def downgrade() -> None:
    op.drop_table("plan_traces")
