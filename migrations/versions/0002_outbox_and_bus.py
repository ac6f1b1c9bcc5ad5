"""The capture outbox, its dead letters, relay state, and the embedded bus tables.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "pollbridge_outbox",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(36), nullable=False),
        sa.Column("task_id", sa.String(200), nullable=True),
        sa.Column("instance_id", sa.String(200), nullable=True),
        sa.Column("workflow_type", sa.String(200), nullable=True),
        sa.Column("task_key", sa.String(200), nullable=True),
        sa.Column("change", sa.String(16), nullable=False),
        sa.Column("old_status", sa.String(64), nullable=True),
        sa.Column("new_status", sa.String(64), nullable=True),
        sa.Column("trace_id", sa.String(32), nullable=True),
        sa.Column("relay_partition", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("published_at", TS, nullable=True),
    )
    op.create_index(
        "pollbridge_outbox_unpublished_idx", "pollbridge_outbox", ["relay_partition", "id"],
        postgresql_where=sa.text("published_at IS NULL"), sqlite_where=sa.text("published_at IS NULL"),
    )
    op.create_index("pollbridge_outbox_published_idx", "pollbridge_outbox", ["published_at"])
    op.create_table(
        "pollbridge_outbox_dead",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("outbox_id", sa.BigInteger, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "pollbridge_relay_state",
        sa.Column("relay_partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("armed", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("holder", sa.String(200), nullable=True),
        sa.Column("heartbeat_at", TS, nullable=True),
        sa.Column("bus_epoch", sa.String(64), nullable=True),
    )
    op.create_table(
        "pollbridge_bus_log",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("event_id", sa.String(36), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("pollbridge_bus_log_partition_idx", "pollbridge_bus_log", ["partition", "id"])
    op.create_table(
        "pollbridge_bus_groups",
        sa.Column("group_name", sa.String(200), primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("last_delivered_id", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_table(
        "pollbridge_bus_pending",
        sa.Column("group_name", sa.String(200), primary_key=True),
        sa.Column("entry_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("consumer", sa.String(200), nullable=False),
        sa.Column("delivered_at", TS, nullable=False),
        sa.Column("deliveries", sa.Integer, nullable=False, server_default="1"),
    )
    op.create_index("pollbridge_bus_pending_idle_idx", "pollbridge_bus_pending",
                    ["group_name", "partition", "delivered_at"])
    op.create_table(
        "pollbridge_bus_dead",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("group_name", sa.String(200), nullable=False),
        sa.Column("entry_id", sa.String(64), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )


def downgrade() -> None:
    for table in ("pollbridge_bus_dead", "pollbridge_bus_pending", "pollbridge_bus_groups", "pollbridge_bus_log",
                  "pollbridge_relay_state", "pollbridge_outbox_dead", "pollbridge_outbox"):
        op.drop_table(table)
