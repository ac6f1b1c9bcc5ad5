"""Event scheduler: shadow decisions, partition leases and members, signals.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "pollbridge_decisions",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.String(200), nullable=False),
        sa.Column("instance_id", sa.String(200), nullable=False),
        sa.Column("workflow_type", sa.String(200), nullable=True),
        sa.Column("task_key", sa.String(200), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=True),
        sa.Column("ready_at", TS, nullable=True),
        sa.Column("decided_at", TS, nullable=False),
        sa.Column("trace_id", sa.String(64), nullable=True),
    )
    op.create_index("pollbridge_decisions_task_attempt_key", "pollbridge_decisions", ["task_id", "attempt"],
                    unique=True)
    op.create_index("pollbridge_decisions_type_time_idx", "pollbridge_decisions", ["workflow_type", "decided_at"])
    op.create_table(
        "pollbridge_scheduler_leases",
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("holder", sa.String(200), nullable=True),
        sa.Column("expires_at", TS, nullable=True),
    )
    op.create_table(
        "pollbridge_scheduler_members",
        sa.Column("holder", sa.String(200), primary_key=True),
        sa.Column("heartbeat_at", TS, nullable=False),
    )
    op.create_table(
        "pollbridge_signals",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("payload", sa.Text, nullable=True),
        sa.Column("actor", sa.String(200), nullable=True),
        sa.Column("received_at", TS, nullable=False),
    )
    op.create_index("pollbridge_signals_task_idx", "pollbridge_signals", ["task_id"])


def downgrade() -> None:
    for table in ("pollbridge_signals", "pollbridge_scheduler_members", "pollbridge_scheduler_leases",
                  "pollbridge_decisions"):
        op.drop_table(table)
