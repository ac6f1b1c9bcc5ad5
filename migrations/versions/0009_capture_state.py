"""Which capture is on, and where the write-ahead log's share of the changes begins and ends.

Switching capture between the triggers and the write-ahead log (``pollbridge init`` with the other
``[capture] mode``, or ``pollbridge capture switch``) must neither lose nor double a change. The switching
transaction installs or drops the triggers and writes a logical decoding message whose LSN it records here:
the WAL capture streams the transactions that commit after ``wal_start_lsn`` (before it the triggers captured
them) and before ``wal_stop_lsn`` (after it the triggers do). One row (``id`` 1).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pollbridge_capture_state",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("wal_start_lsn", sa.BigInteger, nullable=True),
        sa.Column("wal_stop_lsn", sa.BigInteger, nullable=True),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("pollbridge_capture_state")
