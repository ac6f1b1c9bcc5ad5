"""Capture gaps, shared through the database.

``pollbridge_capture_gaps``: one row each time the capture lost changes it cannot replay (the replication
slot of write-ahead-log capture dropped or invalidated: what changed between its loss and its re-creation is
in no log any more, so the state of the unfinished tasks was re-derived from the table). The reconciler and
the promotion gates read it: a window with a gap is incomplete evidence. The guardian reports new ones.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "pollbridge_capture_gaps",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("detected_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.String(32), nullable=False),
        sa.Column("rederived", sa.Integer, nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
    )
    op.create_index("pollbridge_capture_gaps_at_idx", "pollbridge_capture_gaps", ["detected_at"])


def downgrade() -> None:
    op.drop_index("pollbridge_capture_gaps_at_idx", table_name="pollbridge_capture_gaps")
    op.drop_table("pollbridge_capture_gaps")
