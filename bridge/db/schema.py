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
#: Ids, keys and type names: unbounded text on PostgreSQL (migration 0008: a composite key's text can be
#: long, and an overflow inside the capture function would fail the scheduler's own write); SQLite enforces
#: no length, so its columns keep their original declaration.
Key = sa.String(200).with_variant(sa.Text(), "postgresql")
Status = sa.String(64).with_variant(sa.Text(), "postgresql")

dispatch_log = sa.Table(
    "pollbridge_dispatch_log",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("task_id", Key, nullable=False),
    sa.Column("instance_id", Key, nullable=False),
    sa.Column("workflow_type", Key, nullable=True),
    sa.Column("task_key", Key, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=True),
    # 'poller', 'events' or 'fallback'
    sa.Column("path", sa.String(16), nullable=False),
    sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("trace_id", sa.String(64), nullable=True),
    sa.Index("pollbridge_dispatch_log_task_idx", "task_id"),
    sa.Index("pollbridge_dispatch_log_type_time_idx", "workflow_type", "dispatched_at"),
    sa.Index("pollbridge_dispatch_log_time_idx", "dispatched_at"),
    sa.Index("pollbridge_dispatch_log_instance_idx", "instance_id"),
)

#: The capture outbox: one row per relevant change of a task row, written by the capture trigger in
#: the same transaction. Rows are read by ``published_at IS NULL`` (never by a high-water id, since a
#: smaller id can commit after a larger one), marked published after the bus acknowledged them, kept
#: for the retention window (bus-loss recovery republishes them) and then purged.
#: The channel a captured change NOTIFYs on PostgreSQL (the capture trigger while the relay is armed, and
#: pollbridge's own outbox rows: a released task's wake-up); the relay LISTENs on it.
OUTBOX_CHANNEL = "pollbridge_outbox"

outbox = sa.Table(
    "pollbridge_outbox",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("event_id", sa.String(36), nullable=False),
    sa.Column("task_id", Key, nullable=True),
    sa.Column("instance_id", Key, nullable=True),
    sa.Column("workflow_type", Key, nullable=True),
    sa.Column("task_key", Key, nullable=True),
    # 'insert', 'status', 'due' or 'signal' (the first that applies)
    sa.Column("change", sa.String(16), nullable=False),
    sa.Column("old_status", Status, nullable=True),
    sa.Column("new_status", Status, nullable=True),
    sa.Column("trace_id", sa.String(32), nullable=True),
    sa.Column("relay_partition", sa.Integer, nullable=False, server_default="0"),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
    # the mapped attempts column after the change (migration 0006): dispatch evidence of a foreign scheduler
    sa.Column("attempt", sa.Integer, nullable=True),
    # the mapped depth column after the change (migration 0010): the CloudEvent's causation depth
    sa.Column("depth", sa.Integer, nullable=True),
    sa.Index(
        "pollbridge_outbox_unpublished_idx",
        "relay_partition",
        "id",
        postgresql_where=sa.text("published_at IS NULL"),
        sqlite_where=sa.text("published_at IS NULL"),
    ),
    sa.Index("pollbridge_outbox_published_idx", "published_at"),
)

#: Outbox rows the relay could not turn into an event (inserted by hand, unknown status, ...).
outbox_dead = sa.Table(
    "pollbridge_outbox_dead",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("outbox_id", sa.BigInteger, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

#: One row per relay partition: who holds it, whether the capture trigger should NOTIFY (adaptive
#: wake-up arms it only after the outbox stayed empty), and the bus epoch the relay last saw.
relay_state = sa.Table(
    "pollbridge_relay_state",
    metadata,
    sa.Column("relay_partition", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("armed", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("holder", sa.String(200), nullable=True),
    sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
    # The bus's epochs, one per bus partition, as JSON (migration 0011; was one token in 64 characters).
    sa.Column("bus_epoch", sa.Text, nullable=True),
)

#: Which capture is on and the write-ahead log's share of the changes (migration 0009; one row, id 1).
capture_state = sa.Table(
    "pollbridge_capture_state",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("mode", sa.String(16), nullable=False),
    sa.Column("wal_start_lsn", sa.BigInteger, nullable=True),
    sa.Column("wal_stop_lsn", sa.BigInteger, nullable=True),
    sa.Column("changed_at", sa.DateTime(timezone=True), nullable=True),
)

#: Changes the capture lost and could not replay (migration 0012): the write-ahead log's slot dropped or
#: invalidated, the unfinished tasks re-derived from the table. The reconciler and the gates read it.
capture_gaps = sa.Table(
    "pollbridge_capture_gaps",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("detected_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("source", sa.String(32), nullable=False),  # 'wal_slot'
    sa.Column("rederived", sa.Integer, nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
    sa.Index("pollbridge_capture_gaps_at_idx", "detected_at"),
)

#: The embedded bus: an append-only log per partition, consumer-group offsets and pending entries
#: (delivered, not acknowledged), with the same semantics as Redis Streams consumer groups.
bus_log = sa.Table(
    "pollbridge_bus_log",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("partition", sa.Integer, nullable=False),
    sa.Column("event_id", sa.String(36), nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("pollbridge_bus_log_partition_idx", "partition", "id"),
)

bus_groups = sa.Table(
    "pollbridge_bus_groups",
    metadata,
    sa.Column("group_name", sa.String(200), primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("last_delivered_id", sa.BigInteger, nullable=False, server_default="0"),
)

bus_pending = sa.Table(
    "pollbridge_bus_pending",
    metadata,
    sa.Column("group_name", sa.String(200), primary_key=True),
    sa.Column("entry_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("partition", sa.Integer, nullable=False),
    sa.Column("consumer", sa.String(200), nullable=False),
    sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("deliveries", sa.Integer, nullable=False, server_default="1"),
    sa.Index("pollbridge_bus_pending_idle_idx", "group_name", "partition", "delivered_at"),
)

#: Dead letters of the embedded bus (the Redis bus keeps them in a stream).
bus_dead = sa.Table(
    "pollbridge_bus_dead",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("group_name", sa.String(200), nullable=False),
    sa.Column("entry_id", sa.String(64), nullable=False),
    sa.Column("partition", sa.Integer, nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

#: Decisions the event path made in shadow mode (``dual_write``): what it would have dispatched, when.
decisions = sa.Table(
    "pollbridge_decisions",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("task_id", Key, nullable=False),
    sa.Column("instance_id", Key, nullable=False),
    sa.Column("workflow_type", Key, nullable=True),
    sa.Column("task_key", Key, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=True),
    sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("decided_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("trace_id", sa.String(64), nullable=True),
    sa.Index("pollbridge_decisions_task_attempt_key", "task_id", "attempt", unique=True),
    sa.Index("pollbridge_decisions_type_time_idx", "workflow_type", "decided_at"),
    # by logical task (migration 0007): a foreign scheduler may give a retry a new row id
    sa.Index("pollbridge_decisions_instance_idx", "instance_id"),
)

#: Which scheduler process consumes which bus partition (one at a time, so one instance's events are
#: handled in order), with a lease that another process takes over when it expires.
scheduler_leases = sa.Table(
    "pollbridge_scheduler_leases",
    metadata,
    sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("holder", sa.String(200), nullable=True),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
)

#: Live scheduler processes (heartbeat), so each can compute its fair share of the partitions.
scheduler_members = sa.Table(
    "pollbridge_scheduler_members",
    metadata,
    sa.Column("holder", sa.String(200), primary_key=True),
    sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
)

#: Every external callback, approval or rejection recorded through ``pollbridge signal`` (audit and explain).
signals = sa.Table(
    "pollbridge_signals",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("task_id", Key, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("payload", sa.Text, nullable=True),
    sa.Column("actor", sa.String(200), nullable=True),
    sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("pollbridge_signals_task_idx", "task_id"),
)

#: The phase of each workflow type (a type without a row is ``polling``). ``percent`` limits ``selective``
#: to a stable-hash share of the instances (NULL: all); ``grace_seconds`` is how long the poller lets a
#: task of a canary instance wait before it dispatches it as a fallback; ``thresholds`` (JSON) overrides
#: gate and guardian settings for the type.
flags = sa.Table(
    "pollbridge_flags",
    metadata,
    sa.Column("workflow_type", Key, primary_key=True),
    sa.Column("phase", sa.String(16), nullable=False),
    sa.Column("percent", sa.Float, nullable=True),
    sa.Column("grace_seconds", sa.Float, nullable=False, server_default="5"),
    sa.Column("thresholds", sa.Text, nullable=True),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_by", sa.String(200), nullable=False),
)

#: Every flag change: who, why, from what to what, whether a gate was overridden and what it said.
#: ``action`` is ``set``, ``rollback`` or ``guardian``; a ``rollback`` row is also the record that a
#: rollback was rehearsed for the type.
flag_audit = sa.Table(
    "pollbridge_flag_audit",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("workflow_type", Key, nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("old_phase", sa.String(16), nullable=False),
    sa.Column("new_phase", sa.String(16), nullable=False),
    sa.Column("old_percent", sa.Float, nullable=True),
    sa.Column("new_percent", sa.Float, nullable=True),
    sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("gate", sa.Text, nullable=True),
    sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("pollbridge_flag_audit_type_time_idx", "workflow_type", "changed_at"),
)

#: Ready tasks the event scheduler holds back by backpressure (``rate``, ``max_in_flight``; migration 0010):
#: one row per task, written when a hold starts and renewed each time the scheduler looks again. A hold is
#: *legitimate* while ``until`` (when its holder looks again) is less than ``HOLD_SLACK`` seconds past
#: (:mod:`bridge.tasktable.holds`): then the poller's fallback and safety sweep leave the task alone, the
#: reconciler does not count it a miss and the guardian does not count it a failure. ``released_at`` is set
#: when the holder dispatched the task; the row stays (the reconciler's evidence), like the dispatch log's.
holds = sa.Table(
    "pollbridge_holds",
    metadata,
    sa.Column("task_id", Key, primary_key=True),
    sa.Column("instance_id", Key, nullable=False),
    sa.Column("workflow_type", Key, nullable=True),
    sa.Column("task_key", Key, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=True),
    # 'rate' or 'in_flight'
    sa.Column("reason", sa.String(16), nullable=False),
    sa.Column("held_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("until", sa.DateTime(timezone=True), nullable=False),
    sa.Column("holder", sa.String(200), nullable=False),
    sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
    sa.Index("pollbridge_holds_type_idx", "workflow_type", "held_at"),
)

#: The review queue (migration 0010): tasks the depth guard (or the dispatch-count guard) stopped before
#: dispatch, for a person to release or reject (``pollbridge review``). One open row (``decision`` NULL) per
#: task at most; a decided row stays as the audit record (who, when, why), and a ``released`` one exempts
#: the task from the guards from then on. ``moved`` says the task row itself was moved to the mapping's
#: ``review`` status (without one it stays pending and every dispatcher leaves it alone while it is parked).
review = sa.Table(
    "pollbridge_review",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("task_id", Key, nullable=False),
    sa.Column("instance_id", Key, nullable=False),
    sa.Column("workflow_type", Key, nullable=True),
    sa.Column("task_key", Key, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=True),
    # 'depth' or 'dispatches'
    sa.Column("guard", sa.String(16), nullable=False),
    sa.Column("measured", sa.Integer, nullable=False),
    sa.Column("limit_value", sa.Integer, nullable=False),
    sa.Column("moved", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("parked_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("parked_by", sa.String(200), nullable=False),
    # NULL while parked; 'released' or 'rejected'
    sa.Column("decision", sa.String(16), nullable=True),
    sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("decided_by", sa.String(200), nullable=True),
    sa.Column("decision_reason", sa.Text, nullable=True),
    sa.Index("pollbridge_review_task_idx", "task_id"),
    sa.Index("pollbridge_review_open_key", "task_id", unique=True,
             postgresql_where=sa.text("decision IS NULL"), sqlite_where=sa.text("decision IS NULL")),
)
