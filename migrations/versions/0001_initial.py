"""Initial schema: problems, plan revisions, jobs.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "problems",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("problem", JSONType, nullable=False),
        sa.Column("num_devices", sa.Integer(), nullable=False),
        sa.Column("num_microbatches", sa.Integer(), nullable=False),
        sa.Column("num_stages", sa.Integer(), nullable=False),
        sa.Column("memory_limit_mib", sa.Float(), nullable=True),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("best_revision", sa.Integer(), nullable=False),
        sa.Column("best_makespan_ms", sa.Float(), nullable=False),
        sa.Column("lower_bound_ms", sa.Float(), nullable=False),
        sa.Column("bubble_ratio", sa.Float(), nullable=False),
        sa.Column("best_status", sa.String(16), nullable=False),
        sa.Column("best_method", sa.Text(), nullable=False),
        sa.Column("first_makespan_ms", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_problems")),
    )
    op.create_index(op.f("ix_problems_updated_at"), "problems", ["updated_at"])
    op.create_table(
        "plan_revisions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("problem_key", sa.String(64), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("makespan_ms", sa.Float(), nullable=False),
        sa.Column("lower_bound_ms", sa.Float(), nullable=False),
        sa.Column("solver_bound_ms", sa.Float(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("method", sa.Text(), nullable=False),
        sa.Column("plan", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["problem_key"], ["problems.key"], ondelete="CASCADE",
                                name=op.f("fk_plan_revisions_problem_key_problems")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plan_revisions")),
        sa.UniqueConstraint("problem_key", "revision", name="uq_plan_revisions_key_revision"),
    )
    op.create_table(
        "jobs",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("run_id", sa.String(120), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("budget_s", sa.Float(), nullable=False),
        sa.Column("used_s", sa.Float(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("improvements", sa.Integer(), nullable=False),
        sa.Column("queued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["key"], ["problems.key"], ondelete="CASCADE",
                                name=op.f("fk_jobs_key_problems")),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_jobs")),
    )
    op.create_index("ix_jobs_state_heartbeat", "jobs", ["state", "heartbeat_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_state_heartbeat", table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("plan_revisions")
    op.drop_index(op.f("ix_problems_updated_at"), table_name="problems")
    op.drop_table("problems")
