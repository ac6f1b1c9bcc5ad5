"""Task ids, instance ids, task keys and statuses as unbounded text.

A composite key's text can be long (Airflow: ``dag_id/run_id``, a dag id of up to 250 characters and a
run id with a timestamp), and so can a stored status value or a UUID-or-longer row id. On PostgreSQL a
``varchar(200)`` overflow inside the capture function would fail the scheduler's own write: capture must
never do that. SQLite does not enforce a length: nothing to change there.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

#: (table, column, the type before this migration)
COLUMNS = (
    ("pollbridge_outbox", "task_id", sa.String(200)),
    ("pollbridge_outbox", "instance_id", sa.String(200)),
    ("pollbridge_outbox", "workflow_type", sa.String(200)),
    ("pollbridge_outbox", "task_key", sa.String(200)),
    ("pollbridge_outbox", "old_status", sa.String(64)),
    ("pollbridge_outbox", "new_status", sa.String(64)),
    ("pollbridge_dispatch_log", "task_id", sa.String(200)),
    ("pollbridge_dispatch_log", "instance_id", sa.String(200)),
    ("pollbridge_dispatch_log", "workflow_type", sa.String(200)),
    ("pollbridge_dispatch_log", "task_key", sa.String(200)),
    ("pollbridge_decisions", "task_id", sa.String(200)),
    ("pollbridge_decisions", "instance_id", sa.String(200)),
    ("pollbridge_decisions", "workflow_type", sa.String(200)),
    ("pollbridge_decisions", "task_key", sa.String(200)),
    ("pollbridge_signals", "task_id", sa.String(200)),
    ("pollbridge_flags", "workflow_type", sa.String(200)),
    ("pollbridge_flag_audit", "workflow_type", sa.String(200)),
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column, _before in COLUMNS:
        op.alter_column(table, column, type_=sa.Text())


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column, before in COLUMNS:
        op.alter_column(table, column, type_=before)
