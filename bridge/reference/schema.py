"""The reference legacy schema: the tables of the polling scheduler pollbridge ships as its example.

These tables stand for *the user's* scheduler, so they carry no ``pollbridge_`` prefix and
``uninstall`` leaves them alone. ``pollbridge init --demo-schema`` creates them (if missing);
the default mapping describes them.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.core.mapping import TaskTableMapping


def demo_metadata(dialect_name: str) -> sa.MetaData:
    now = sa.text("clock_timestamp()") if dialect_name == "postgresql" else sa.text(
        "(strftime('%Y-%m-%d %H:%M:%f','now'))"
    )
    metadata = sa.MetaData()
    sa.Table(
        "workflow_instances",
        metadata,
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("workflow_type", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="running"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
    )
    sa.Table(
        "tasks",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("instance_id", sa.Text, nullable=False),
        sa.Column("task_key", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("depends_on", sa.JSON, nullable=False, server_default=sa.text("'[]'")),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("awaits_signal", sa.Text, nullable=True),
        sa.Column("signal_received_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=False, server_default="3"),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        # Optional trigger rule (Airflow's names; NULL = all_success), read when a mapping sets
        # columns.trigger_rule: a branch's join can run after one side was skipped.
        sa.Column("trigger_rule", sa.Text, nullable=True),
        sa.UniqueConstraint("instance_id", "task_key", name="tasks_instance_task_key_key"),
        sa.Index("tasks_status_idx", "status"),
        sa.CheckConstraint(
            "status IN ('pending','queued','running','completed','failed','review','skipped')",
            name="tasks_status_check",
        ),
    )
    return metadata


def create_demo_schema(conn: Connection) -> list[str]:
    """Create the reference tables that do not exist yet; return the names created."""
    metadata = demo_metadata(conn.dialect.name)
    existing = set(sa.inspect(conn).get_table_names())
    created = [name for name in metadata.tables if name not in existing]
    metadata.create_all(conn, checkfirst=True)
    return created


def is_default_mapping(mapping: TaskTableMapping) -> bool:
    return mapping == TaskTableMapping()
