"""The dispatch log: one row per dispatch by either path.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "pollbridge_dispatch_log",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.String(200), nullable=False),
        sa.Column("instance_id", sa.String(200), nullable=False),
        sa.Column("workflow_type", sa.String(200), nullable=True),
        sa.Column("task_key", sa.String(200), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=True),
        sa.Column("path", sa.String(16), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("trace_id", sa.String(64), nullable=True),
    )
    op.create_index("pollbridge_dispatch_log_task_idx", "pollbridge_dispatch_log", ["task_id"])
    op.create_index(
        "pollbridge_dispatch_log_type_time_idx", "pollbridge_dispatch_log", ["workflow_type", "dispatched_at"]
    )
    op.create_index("pollbridge_dispatch_log_time_idx", "pollbridge_dispatch_log", ["dispatched_at"])


def downgrade() -> None:
    op.drop_table("pollbridge_dispatch_log")
