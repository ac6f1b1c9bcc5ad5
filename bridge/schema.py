"""pollbridge's own tables, as SQLAlchemy Core metadata.

This module is the one description of the objects pollbridge owns; every name carries the
``pollbridge_`` prefix so ``uninstall`` can find them and can never touch the scheduler's tables.
The Alembic migrations in ``migrations/versions`` create exactly these objects (a test compares
them), and are what actually installs them: ``metadata.create_all`` is never used for these tables.
"""

from __future__ import annotations

import sqlalchemy as sa

PREFIX = "pollbridge_"
VERSION_TABLE = "pollbridge_alembic_version"

metadata = sa.MetaData()

# SQLite only makes INTEGER PRIMARY KEY an auto-incrementing rowid alias.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

#: One row per dispatch either path made: the evidence for latency, double and early checks.
dispatch_log = sa.Table(
    "pollbridge_dispatch_log",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("task_id", sa.String(200), nullable=False),
    sa.Column("instance_id", sa.String(200), nullable=False),
    sa.Column("workflow_type", sa.String(200), nullable=True),
    sa.Column("task_key", sa.String(200), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=True),
    # 'poller', 'events' or 'fallback'
    sa.Column("path", sa.String(16), nullable=False),
    sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("trace_id", sa.String(64), nullable=True),
    sa.Index("pollbridge_dispatch_log_task_idx", "task_id"),
    sa.Index("pollbridge_dispatch_log_type_time_idx", "workflow_type", "dispatched_at"),
    sa.Index("pollbridge_dispatch_log_time_idx", "dispatched_at"),
)
