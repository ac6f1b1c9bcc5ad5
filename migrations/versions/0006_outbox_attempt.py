"""The outbox carries the task's attempt and the database's commit-side clock for dispatch evidence.

A scheduler pollbridge did not write records no dispatch log: its dispatches are read from captured
transitions into a dispatched status, and a dispatch is identified by (instance, task key, attempt),
since such a scheduler may give a retry a new physical row id. ``attempt`` is the mapped attempts
column of the row after the change (NULL when not mapped).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("pollbridge_outbox", sa.Column("attempt", sa.Integer, nullable=True))


def downgrade() -> None:
    op.drop_column("pollbridge_outbox", "attempt")  # SQLite >= 3.35 drops a column in place
