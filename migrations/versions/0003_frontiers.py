"""Frontiers: a frontier row (budget unit, range, peers) and its points, each an ordinary problem key.

Why a table and not a derived view: the points are ordinary cached plans under their own keys, and
nothing in a point's problem says which frontier it belongs to (its key must stay the plain problem
key, so a training client can fetch it as usual); the link, the budget factor of each point and the
peers computed at request time have to be stored somewhere. `frontier_points.point_key` is indexed:
a worker finishing a point looks up the frontiers it belongs to, to offer its plan to larger budgets.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "frontiers",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("problem_key", sa.String(64), nullable=False),
        sa.Column("setup", JSONType, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_frontiers")),
    )
    op.create_index(op.f("ix_frontiers_problem_key"), "frontiers", ["problem_key"])
    op.create_table(
        "frontier_points",
        sa.Column("frontier_key", sa.String(64), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("factor", sa.Float(), nullable=False),
        sa.Column("point_key", sa.String(64), nullable=False),
        sa.ForeignKeyConstraint(["frontier_key"], ["frontiers.key"], ondelete="CASCADE",
                                name=op.f("fk_frontier_points_frontier_key_frontiers")),
        sa.ForeignKeyConstraint(["point_key"], ["problems.key"], ondelete="CASCADE",
                                name=op.f("fk_frontier_points_point_key_problems")),
        sa.PrimaryKeyConstraint("frontier_key", "idx", name=op.f("pk_frontier_points")),
    )
    op.create_index(op.f("ix_frontier_points_point_key"), "frontier_points", ["point_key"])


def downgrade() -> None:
    op.drop_index(op.f("ix_frontier_points_point_key"), table_name="frontier_points")
    op.drop_table("frontier_points")
    op.drop_index(op.f("ix_frontiers_problem_key"), table_name="frontiers")
    op.drop_table("frontiers")
