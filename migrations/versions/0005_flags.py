"""Flags: the phase of each workflow type, its audit trail, and the poller's routing function.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from bridge.db.sqlblocks import load_blocks, render

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "pollbridge_flags",
        sa.Column("workflow_type", sa.String(200), primary_key=True),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("percent", sa.Float, nullable=True),
        sa.Column("grace_seconds", sa.Float, nullable=False, server_default="5"),
        sa.Column("thresholds", sa.Text, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("updated_by", sa.String(200), nullable=False),
    )
    op.create_table(
        "pollbridge_flag_audit",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("workflow_type", sa.String(200), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("old_phase", sa.String(16), nullable=False),
        sa.Column("new_phase", sa.String(16), nullable=False),
        sa.Column("old_percent", sa.Float, nullable=True),
        sa.Column("new_percent", sa.Float, nullable=True),
        sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("gate", sa.Text, nullable=True),
        sa.Column("changed_at", TS, nullable=False),
    )
    op.create_index("pollbridge_flag_audit_type_time_idx", "pollbridge_flag_audit", ["workflow_type", "changed_at"])
    dialect = op.get_bind().dialect.name
    for name in ("bucket_function", "should_handle_function"):
        if name in load_blocks(dialect):  # PostgreSQL only: SQLite registers pollbridge_bucket per connection
            op.execute(render(dialect, name))


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    for name in ("drop_should_handle_function", "drop_bucket_function"):
        if name in load_blocks(dialect):
            op.execute(render(dialect, name))
    op.drop_index("pollbridge_flag_audit_type_time_idx", table_name="pollbridge_flag_audit")
    op.drop_table("pollbridge_flag_audit")
    op.drop_table("pollbridge_flags")
