"""Configuration searches: a configurations row (the request and the search's document) and its
candidates, each an ordinary problem key.

Why a table: each scored candidate is an ordinary cached plan under its own problem key (a training
client fetches it as usual), and nothing in its problem says which search it came from; the link, the
rank the search gave it, and whether its refine job was queued are stored here.
`configuration_candidates.candidate_key` is indexed: a revision of a candidate finds its searches.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-08
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "configurations",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("document", JSONType, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_configurations")),
    )
    op.create_table(
        "configuration_candidates",
        sa.Column("configuration_key", sa.String(64), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("candidate_key", sa.String(64), nullable=False),
        sa.Column("refined", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["configuration_key"], ["configurations.key"], ondelete="CASCADE",
                                name=op.f("fk_configuration_candidates_configuration_key_configurations")),
        sa.ForeignKeyConstraint(["candidate_key"], ["problems.key"], ondelete="CASCADE",
                                name=op.f("fk_configuration_candidates_candidate_key_problems")),
        sa.PrimaryKeyConstraint("configuration_key", "idx", name=op.f("pk_configuration_candidates")),
    )
    op.create_index(op.f("ix_configuration_candidates_candidate_key"), "configuration_candidates",
                    ["candidate_key"])


def downgrade() -> None:
    op.drop_index(op.f("ix_configuration_candidates_candidate_key"), table_name="configuration_candidates")
    op.drop_table("configuration_candidates")
    op.drop_table("configurations")
