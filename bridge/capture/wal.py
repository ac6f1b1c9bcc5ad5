"""Change capture from PostgreSQL's write-ahead log (``[capture] mode = "wal"``): nothing in the scheduler's
transactions, nothing in its schema.

``init`` creates a publication of the mapped task table (every column: a column list would make PostgreSQL
refuse every UPDATE of the table the moment its owner set ``REPLICA IDENTITY FULL``, "Column list used by the
publication does not cover the replica identity", and capture must never fail the scheduler's writes) and a
logical replication slot on the built-in ``pgoutput`` plugin;
``uninstall`` drops both. No trigger, function or grant is added to the scheduler's schema.

:class:`WalCapture` streams the slot over the replication protocol (psycopg2's
``LogicalReplicationConnection``: psycopg 3 has no replication protocol) and turns each committed insert or
update of the table into the outbox row the capture trigger would have written, with two differences that
follow from the log: ``created_at`` is the **commit** time (a change is never dated before it could be
seen), and the event id is derived from the commit's LSN and the change's place in it, so a change streamed
again after a restart is a duplicate with the same id. A batch of transactions becomes one transaction of
pollbridge's: the rows are inserted already published (``published_at`` set), their events are published to
the bus inside it (on the embedded bus, in it; on Redis before its commit), a foreign scheduler's dispatches
are recorded in it, and only after it committed is the slot told the batch's last commit LSN is flushed. A
crash anywhere in between streams the batch again: at least once. The outbox keeps its role for retention,
bus-loss replay (the relay republishes retained rows), ``explain`` and the reconciler.

**Which changes.** The log carries the new row of an insert or update, and of the old row only the replica
identity's columns (the primary key) unless the table is ``REPLICA IDENTITY FULL``. pollbridge does not
alter the scheduler's table. Without the old row it keeps the watched values (status, due time, signal) it
last saw per task id in memory (:data:`SEEN_CACHE` rows): an update that changed none of them is skipped,
one whose task is not in the cache is captured as a status change with no old status (which the scheduler
and the dispatch evidence treat as they treat any: the event names the instance to look at). A new primary
key is an ``identity`` change. Deletes are not captured (the trigger never captured them either).

**Related tables and the read view.** The publication carries the ``[[mapping.related]]`` tables too. A change
of a related row (an insert, or an update of a ``watch`` column: skipped only when the old values are known, as
for task rows) is written as a status change of every task row the read view shows with matching columns, its
status as read then and no old status, as the related trigger writes it; a captured column that only the read
view has (a status joined from another table) is read through the view by the task's id. Both reads come after
the batch's commits are visible, in the batch's transaction. A table without a replica identity (no primary key)
is refused by ``init`` and ``doctor`` in one line: PostgreSQL would refuse every UPDATE of it once published.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import select
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from bridge.bus.base import EventBus
from bridge.capture.evidence import record_foreign_dispatches
from bridge.capture.gaps import PENDING, WAL_SLOT, close_gap_statement, pending_gap, record_gap_statement
from bridge.capture.pgoutput import (
    UNCHANGED,
    Change,
    DecodeError,
    LogicalMessage,
    Relation,
    Value,
    begin_xid,
    commit_fields,
    decode,
    lsn_text,
    new_row,
    parse_lsn,
    pg_time,
)
from bridge.capture.queries import INVISIBLE_XIDS_SQL, event_payload_sql
from bridge.capture.triggers import (
    CAPTURED,
    WATCHED,
    capture_status,
    capture_target,
    is_quiet,
    loud_first,
    quiet_statuses,
    related_targets,
)
from bridge.core.backoff import Backoff
from bridge.core.errors import MappingMismatch, first_line
from bridge.core.events import encoded_event
from bridge.core.mapping import TaskTableMapping
from bridge.db.driver import DriverStatement
from bridge.db.engine import discard
from bridge.db.schema import capture_gaps, outbox
from bridge.db.schema import capture_state as capture_state_table
from bridge.tasktable.queries import spawn_depths, type_of_row
from bridge.tasktable.tables import TaskTable

log = logging.getLogger(__name__)

PUBLICATION = "pollbridge_publication"
#: Slot names are the cluster's, not the database's: each database's slot is ``pollbridge_<database>_<crc>``.
SLOT_PREFIX = "pollbridge_"


def slot_name(conn: Connection) -> str:
    """This database's slot: ``pollbridge_`` + the database name made a valid slot name + its crc32 (names
    that clean up alike stay apart), at most 63 characters."""
    database = str(conn.exec_driver_sql("SELECT pg_catalog.current_database()").scalar())
    clean = re.sub(r"[^a-z0-9_]", "_", database.lower())[:40]
    return f"{SLOT_PREFIX}{clean}_{zlib.crc32(database.encode()):08x}"
#: Task ids whose watched values are remembered, to skip updates that changed none of them.
SEEN_CACHE = 200_000
#: Most changes in one of pollbridge's transactions.
BATCH_ROWS = 5_000
#: Messages the stream reads in a row before it looks at its stop and its lead again (each look per message took 2 %
#: of the relay's active time at 8 writers, py-spy).
DRAIN = 1_000
#: Seconds between looks at the stop and the lead while the relay has paused publishing.
PAUSED_LOOK = 0.5
#: Seconds between standby status updates while the stream is idle (the server's wal_sender_timeout is 60 s).
FEEDBACK_INTERVAL = 10.0
#: Longest wait for a decoded commit to become visible before the batch is streamed again (see
#: :meth:`WalCapture._await_visible`): below the server's wal_sender_timeout (60 s by default), since the
#: stream sends no feedback meanwhile.
VISIBLE_WAIT = 20.0
#: Longest a batch of quiet changes only (status changes into a dispatched value, which cannot make a task
#: ready: :func:`bridge.capture.triggers.quiet_statuses`) waits for a change that can, to go out in one
#: transaction with it (the relay's ``idle_probe_interval`` by default, as a quiet row waits with triggers).
HOLD_QUIET = 5.0
#: pgoutput's options: protocol 1, the publication, and logical decoding messages (a switch's marker).
STREAM_OPTIONS = {"proto_version": "1", "publication_names": PUBLICATION, "messages": "true"}
_EVENT_NAMESPACE = uuid.UUID("6f1c2a8e-3b51-4d0e-9a57-1f2b9c7d4e10")
_EVENT_NAMESPACE_BYTES = _EVENT_NAMESPACE.bytes
#: What the relay writes of each outbox row (the trace id, the partition and the publication time are made by the
#: insert), and the types the JSON document's values are read as.
_OUTBOX_FIELDS = ("event_id", "task_id", "instance_id", "workflow_type", "task_key", "change", "old_status",
                  "new_status", "attempt", "depth", "created_at")
_FIELD_TYPES: dict[str, Any] = {"attempt": sa.Integer, "depth": sa.Integer, "created_at": sa.DateTime(timezone=True),
                                "pb_i": sa.Integer}


def event_id(seed: str) -> str:
    """``str(uuid.uuid5(_EVENT_NAMESPACE, seed))``, the same text, without building two ``UUID`` objects: one
    per captured change (measured: the ``uuid`` module's version took 4 % of the relay's CPU streaming 5,000
    changes/s)."""
    h = bytearray(hashlib.sha1(_EVENT_NAMESPACE_BYTES + seed.encode()).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x50
    h[8] = (h[8] & 0x3F) | 0x80
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


# --- installing -----------------------------------------------------------------------------------------

def captured_columns(conn: Connection, tt: TaskTable) -> list[str]:
    """The task-table columns the capture reads from the log (the others are read through the read view by id
    when a change is written). Raises :class:`MappingMismatch` (one line) for what this mode cannot capture:
    a table the publication would make PostgreSQL refuse updates of (see :func:`_replica_identity_problem`)."""
    if conn.dialect.name != "postgresql":
        raise MappingMismatch("[capture] mode = 'wal' needs PostgreSQL (SQLite has no write-ahead log to read); "
                              "use mode = 'trigger'")
    target = capture_target(conn, tt)
    related = related_targets(conn, tt)
    for name, schema in [(tt.mapping.table, tt.mapping.schema), *((r.table, r.schema) for r, _ in related)]:
        problem = _replica_identity_problem(conn, name, schema)
        if problem:
            raise MappingMismatch(problem)
    status = tt.mapping.columns.status
    for r, table in related:
        for task_column, related_column in r.columns:
            if related_column not in table.c:
                raise MappingMismatch(f"column {related_column!r} (mapping.related {r.table!r} columns) does not exist "
                                      f"in table {r.table!r}")
            if task_column not in tt.tasks.c:
                raise MappingMismatch(f"column {task_column!r} (mapping.related {r.table!r} columns) is not a column "
                                      f"of the task rows pollbridge reads ({tt.tasks.name!r})")
    if status not in target.c and not any(status in dict(r.columns) for r, _ in related):
        # The view takes the status from a related table: read after the commit, a dispatch followed at once by
        # the start would be read as running, and a foreign scheduler's dispatch would be missed as evidence.
        raise MappingMismatch(f"[capture] mode = 'wal' needs the status column {status!r} from the change itself: "
                              "declare the table the read view takes it from as [[mapping.related]] with columns = {"
                              + status + " = \"<its column>\"}, or use mode = 'trigger'")
    columns: list[str] = []
    for logical in CAPTURED:
        for column in tt.mapping.columns.parts(logical):
            if column in target.c and column not in columns:
                columns.append(column)
    return columns


def _replica_identity_problem(conn: Connection, table: str, schema: str | None) -> str | None:
    """Why ``table`` cannot be published (one line), or None. PostgreSQL refuses every UPDATE of a table that
    publishes updates without a replica identity ("cannot update table ... because it does not have a replica
    identity and publishes updates"): a table without a primary key (or ``REPLICA IDENTITY NOTHING``) in the
    publication would fail the scheduler's writes, which capture must never do."""
    qualified = _sql_name(conn, table, schema)
    # DEFAULT needs a primary key, USING INDEX its index (dropped, PostgreSQL treats it as NOTHING), FULL nothing.
    row = conn.execute(sa.text(
        "SELECT c.relreplident, EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid "
        "AND CASE c.relreplident WHEN 'd' THEN i.indisprimary WHEN 'i' THEN i.indisreplident ELSE false END) "
        "FROM pg_catalog.pg_class c WHERE c.oid = to_regclass(:t)"), {"t": qualified}).first()
    if row is None:
        return None  # missing: capture_target and related_targets say so
    identity, indexed = str(row[0]), bool(row[1])
    if identity == "f" or indexed:
        return None
    return (f"[capture] mode = 'wal' cannot publish table {table!r}: it has no primary key or replica identity, so "
            "PostgreSQL would refuse every UPDATE of it once published; give it a primary key (or ALTER TABLE ... "
            "REPLICA IDENTITY FULL), or use mode = 'trigger'")


def settings_problems(conn: Connection) -> list[str]:
    """What the server must change before WAL capture can run, one line each (empty: nothing)."""
    problems = []
    level = conn.exec_driver_sql("SHOW wal_level").scalar()
    if level != "logical":
        problems.append(f"wal_level is {level!r}: set it to logical (ALTER SYSTEM SET wal_level = logical; then "
                        "restart PostgreSQL)")
    slots = int(conn.exec_driver_sql("SHOW max_replication_slots").scalar() or 0)
    used = int(conn.exec_driver_sql("SELECT count(*) FROM pg_catalog.pg_replication_slots "
                                    f"WHERE slot_name <> '{slot_name(conn)}'").scalar() or 0)
    if used >= slots:
        problems.append(f"max_replication_slots is {slots} and {used} slot(s) are taken: raise it (restart needed)")
    if int(conn.exec_driver_sql("SHOW max_wal_senders").scalar() or 0) < 1:
        problems.append("max_wal_senders is 0: set it to at least 1 (restart needed)")
    role = conn.exec_driver_sql("SELECT rolreplication OR rolsuper FROM pg_catalog.pg_roles "
                                "WHERE rolname = current_user").scalar()
    if not role:
        problems.append("the role pollbridge connects as has no REPLICATION attribute: ALTER ROLE ... REPLICATION")
    keep = conn.exec_driver_sql("SHOW max_slot_wal_keep_size").scalar()
    if str(keep) in ("-1", "-1MB"):
        problems.append("max_slot_wal_keep_size is -1 (unlimited): a slot nobody reads would keep WAL until the disk "
                        "fills; bound it (ALTER SYSTEM SET max_slot_wal_keep_size = '10GB'; SELECT "
                        "pg_reload_conf())")
    return problems


def _sql_name(conn: Connection, table: str, schema: str | None) -> str:
    """A table's SQL name, quoted, schema-qualified when a schema is mapped (else found through the search path)."""
    prep = conn.dialect.identifier_preparer
    return f"{prep.quote_schema(schema)}.{prep.quote(table)}" if schema else prep.quote(table)


def _qualified(conn: Connection, tt: TaskTable) -> str:
    return _sql_name(conn, tt.mapping.table, tt.mapping.schema)


def install_publication(conn: Connection, tt: TaskTable) -> None:
    """(Re)create the publication of the mapped table, inside the caller's transaction. Every column, no column
    list (see the module docstring: with one, the owner's ``REPLICA IDENTITY FULL`` fails the scheduler's
    updates); the capture reads the mapped columns of each row and ignores the rest."""
    captured_columns(conn, tt)  # what this mode cannot capture is refused, in one line
    conn.exec_driver_sql(f"DROP PUBLICATION IF EXISTS {PUBLICATION}")
    # Via the partition root: a partitioned table's changes arrive as the mapped table's, not its partitions'.
    conn.exec_driver_sql(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {', '.join(published_tables(conn, tt))} "
                         "WITH (publish = 'insert, update', publish_via_partition_root = true)")


def published_tables(conn: Connection, tt: TaskTable) -> list[str]:
    """The tables the publication carries, as SQL names: the task table, then each ``[[mapping.related]]``
    table (a change of one is a status change of the task rows that match it)."""
    return [_qualified(conn, tt), *(_sql_name(conn, r.table, r.schema) for r in tt.mapping.related)]


def ensure_slot(engine: Engine) -> bool:
    """Create the replication slot unless it exists (outside any transaction: PostgreSQL refuses to create one
    in a transaction that wrote). True if it was created."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        slot = slot_name(conn)
        if conn.exec_driver_sql(f"SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = '{slot}'").first():
            return False
        conn.exec_driver_sql(f"SELECT pg_catalog.pg_create_logical_replication_slot('{slot}', 'pgoutput')")
        return True


def lock_task_table(conn: Connection, tt: TaskTable) -> None:
    """Hold the task table (and the ``[[mapping.related]]`` tables) against writes until the caller's transaction
    ends (a switch's transaction: no write commits while the capture changes hands, so the mark separates the
    two exactly)."""
    conn.exec_driver_sql(f"LOCK TABLE {', '.join(published_tables(conn, tt))} IN SHARE ROW EXCLUSIVE MODE")


def mark_switch(conn: Connection, mode: str) -> int:
    """Inside the transaction that installs or drops the triggers: a logical decoding message (its LSN
    separates the changes the triggers captured from those the log carries; the WAL capture also sees it in
    the stream, in commit order) and the new ``pollbridge_capture_state``. ``wal``: the log's share starts
    here; ``trigger``: it ends here. Returns the LSN."""
    lsn = int(conn.exec_driver_sql(
        "SELECT pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_logical_emit_message(true, 'pollbridge', "
        f"'capture: {mode}'), '0/0')").scalar_one())
    values: dict[str, Any] = {"mode": mode, "changed_at": sa.func.now()}
    if mode == "wal":
        values.update(wal_start_lsn=lsn, wal_stop_lsn=None)
    else:
        values.update(wal_stop_lsn=lsn)
    table = capture_state_table
    if conn.execute(table.update().where(table.c.id == 1).values(values)).rowcount == 0:
        conn.execute(table.insert().values(id=1, **values))
    return lsn


def bounds(conn: Connection) -> tuple[int, int | None]:
    """``(start, stop)``: the WAL capture's share is the transactions committed after ``start`` and before
    ``stop`` (None: no end)."""
    table = capture_state_table
    row = conn.execute(sa.select(table.c.wal_start_lsn, table.c.wal_stop_lsn).where(table.c.id == 1)).first()
    if row is None:
        return 0, None
    return int(row[0] or 0), None if row[1] is None else int(row[1])


def wait_confirmed(engine: Engine, lsn: int, timeout: float, tables: TaskTable, bus: EventBus | None) -> None:
    """Until the slot is confirmed past ``lsn``: by the running relay if one streams it, else streamed here
    (with ``bus``). :class:`TimeoutError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            slot = slot_name(conn)
            row = conn.exec_driver_sql(
                "SELECT active, pg_catalog.pg_wal_lsn_diff(confirmed_flush_lsn, '0/0') "
                f"FROM pg_catalog.pg_replication_slots WHERE slot_name = '{slot}'").first()
        if row is None or (row[1] is not None and int(row[1]) >= lsn):
            return
        if not row[0] and bus is not None:
            WalCapture(engine, tables, bus).catch_up(max(1.0, deadline - time.monotonic()))
            continue
        if time.monotonic() > deadline:
            why = ("the relay of partition 0 streams the slot: is its publishing paused for a full bus (`pollbridge "
                   "status`), or is it far behind?") if row[0] else "is the relay of partition 0 running?"
            raise TimeoutError(f"the write-ahead-log capture did not confirm {lsn_text(lsn)} within {timeout:g} s: "
                               f"{why}")
        time.sleep(0.1)


def remove_wal(conn: Connection, *, end_stream: bool = False) -> list[str]:
    """Drop the publication and the slot if they exist (PostgreSQL, on an autocommit connection; nothing
    elsewhere). A slot a relay is streaming cannot be dropped: :class:`MappingMismatch` says to stop the relay
    first, unless ``end_stream`` (a switch back to the triggers, its share confirmed): the publication goes
    first, so the relay's capture, its stream ended, finds it gone and stops (it does not recreate the slot)."""
    if conn.dialect.name != "postgresql":
        return []
    dropped = []
    slot = slot_name(conn)

    def state() -> Any:
        return conn.exec_driver_sql("SELECT active FROM pg_catalog.pg_replication_slots "
                                    f"WHERE slot_name = '{slot}'").first()

    active = state()
    # A reader that just disconnected holds the slot a moment longer (its walsender is exiting): a grace
    # period tells that from a relay that is streaming.
    grace = time.monotonic() + 2.0
    while active is not None and active[0] and not end_stream and time.monotonic() < grace:
        time.sleep(0.05)
        active = state()
    if active is not None and active[0] and not end_stream:
        raise MappingMismatch(f"replication slot {slot} is being read (a relay is running): stop the relay first")
    if conn.exec_driver_sql(f"SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = '{PUBLICATION}'").first():
        conn.exec_driver_sql(f"DROP PUBLICATION {PUBLICATION}")
        dropped.append(PUBLICATION)
    if active is not None:
        deadline = time.monotonic() + 30.0
        while True:
            conn.exec_driver_sql("SELECT pg_catalog.pg_terminate_backend(active_pid) FROM "
                                 f"pg_catalog.pg_replication_slots WHERE slot_name = '{slot}' AND active")
            try:
                conn.exec_driver_sql(f"SELECT pg_catalog.pg_drop_replication_slot('{slot}')")
                break
            except sa.exc.DBAPIError:  # still held while the terminated walsender exits
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        dropped.append(slot)
    return dropped


@dataclass(frozen=True)
class SlotState:
    exists: bool
    active: bool = False
    wal_status: str | None = None  # reserved, extended, unreserved, lost
    retained_bytes: int | None = None  # WAL the slot keeps (current LSN - restart LSN)
    lag_bytes: int | None = None  # not yet confirmed (current LSN - confirmed flush LSN)


def slot_state(conn: Connection) -> SlotState:
    row = conn.exec_driver_sql(
        "SELECT active, wal_status, pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), restart_lsn), "
        "pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), confirmed_flush_lsn) "
        f"FROM pg_catalog.pg_replication_slots WHERE slot_name = '{slot_name(conn)}'").first()
    if row is None:
        return SlotState(False)
    return SlotState(True, bool(row[0]), row[1], None if row[2] is None else int(row[2]),
                     None if row[3] is None else int(row[3]))


def wal_status(conn: Connection, tt: TaskTable) -> tuple[bool, str]:
    """Whether WAL capture is installed and current for the mapping (for doctor and the dual_write gate)."""
    try:
        columns = captured_columns(conn, tt)
    except MappingMismatch as exc:
        return False, str(exc)
    problems = settings_problems(conn)
    if problems:
        return False, problems[0]
    published = conn.exec_driver_sql(
        "SELECT pr.prattrs IS NOT NULL FROM pg_catalog.pg_publication_rel pr "
        "JOIN pg_catalog.pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = %(p)s "
        "AND pr.prrelid = to_regclass(%(t)s)",
        {"p": PUBLICATION, "t": _qualified(conn, tt)}).first()
    if published is None:
        return False, f"publication {PUBLICATION} of {tt.mapping.table!r} missing; run `pollbridge init`"
    for related, name in zip(tt.mapping.related, published_tables(conn, tt)[1:], strict=True):
        if conn.exec_driver_sql(
                "SELECT 1 FROM pg_catalog.pg_publication_rel pr JOIN pg_catalog.pg_publication p ON p.oid = pr.prpubid "
                "WHERE p.pubname = %(p)s AND pr.prrelid = to_regclass(%(t)s)", {"p": PUBLICATION, "t": name}).first() \
                is None:
            return False, (f"publication {PUBLICATION} does not carry the related table {related.table!r} "
                           "(mapping.related); run `pollbridge init`")
    if published[0]:
        return False, (f"publication {PUBLICATION} has a column list ({len(columns)} columns; an older pollbridge's): "
                       f"REPLICA IDENTITY FULL on {tt.mapping.table!r} would then fail every update of it; run "
                       "`pollbridge init` to regenerate it")
    state = slot_state(conn)
    slot = slot_name(conn)
    if not state.exists:
        return False, f"replication slot {slot} missing; run `pollbridge init`"
    if state.wal_status == "lost":
        return False, (f"replication slot {slot} was invalidated (the WAL it needed was removed): run `pollbridge "
                       "init` to recreate it; the scheduler's catch-up re-derives what changed meanwhile")
    return True, (f"write-ahead-log capture of {tt.mapping.table!r}: publication {PUBLICATION}, slot {slot} "
                  f"({'streaming' if state.active else 'not being read'}, {state.retained_bytes or 0} bytes of WAL "
                  "retained)")


def publication_exists(conn: Connection) -> bool:
    return conn.dialect.name == "postgresql" and conn.exec_driver_sql(
        f"SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = '{PUBLICATION}'").first() is not None


def capture_state(conn: Connection, tt: TaskTable, mode: str | None = None, *, wake: str | None = None,
                  relay_partitions: int | None = None) -> tuple[bool, str]:
    """Whether capture in ``mode`` (``None``: the mode installed, found from the database) is installed and
    current: :func:`wal_status` or :func:`bridge.capture.triggers.capture_status`."""
    installed = "wal" if publication_exists(conn) else "trigger"
    if mode is not None and mode != installed and installed == "wal":
        return False, ("capture is installed as the write-ahead log, but [capture] mode is 'trigger': set mode = "
                       "\"wal\" (or `pollbridge capture switch --to trigger`)")
    mode = mode or installed
    if mode == "wal":
        return wal_status(conn, tt)
    return capture_status(conn, tt, wake=wake, relay_partitions=relay_partitions)  # type: ignore[arg-type]


# --- streaming ------------------------------------------------------------------------------------------

@dataclass
class _Pending:
    rows: list[dict[str, Any]] = field(default_factory=list)
    end_lsn: int = 0  # the last commit's end LSN: what may be confirmed once the rows are durable
    #: The transaction ids (32-bit, as decoded) of the commits the rows came from: published once visible.
    xids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Plan:
    """Where the task table's captured columns are in the tuples of one of its Relation messages (None: not
    there, read as NULL), so that each change is read by position instead of through a dict of every column."""

    id: int | None
    #: The watched columns' positions, their kinds (WATCHED), and where the id and the status are among them.
    watched: tuple[int | None, ...]
    kinds: tuple[str, ...]
    id_at: int
    status_at: int | None
    status: int | None
    instance: tuple[int | None, ...]
    task_key: tuple[int | None, ...]
    typed: bool  # the mapping names a workflow type column
    workflow_type: int | None
    attempt: int | None
    depth: int | None

    @classmethod
    def of(cls, relation: Relation, cols: Any, watched: Sequence[tuple[str, str]]) -> _Plan:
        at = {c.name: i for i, c in enumerate(relation.columns)}
        names = [column for _, column in watched]
        return cls(id=at.get(cols.id), watched=tuple(at.get(c) for c in names), kinds=tuple(k for k, _ in watched),
                   id_at=names.index(cols.id), status_at=names.index(cols.status) if cols.status in names else None,
                   status=at.get(cols.status), instance=tuple(at.get(c) for c in cols.parts("instance_id")),
                   task_key=tuple(at.get(c) for c in cols.parts("task_key")), typed=bool(cols.workflow_type),
                   workflow_type=at.get(cols.workflow_type) if cols.workflow_type else None,
                   attempt=at.get(cols.attempts) if cols.attempts else None,
                   depth=at.get(cols.depth) if cols.depth else None)

    @staticmethod
    def value(values: tuple[Value, ...], at: int | None) -> Value:
        return values[at] if at is not None and at < len(values) else None

    def watched_values(self, values: tuple[Value, ...]) -> tuple[Value, ...]:
        return tuple(values[p] if p is not None and p < len(values) else None for p in self.watched)

    def joined(self, values: tuple[Value, ...], parts: tuple[int | None, ...]) -> str:
        """A key made of ``parts`` as the trigger writes it: the columns' text joined by ``/``."""
        return "/".join(_text(self.value(values, p)) for p in parts)


class WalCapture:
    """Streams the slot and writes the captured changes to the outbox, published (see the module docstring).

    ``run(stop)`` reconnects after failures (backoff); :meth:`handle` and :meth:`flush` are the steps,
    separately testable."""

    def __init__(self, engine: Engine, tables: TaskTable, bus: EventBus, *, relay_partitions: int = 1,
                 foreign: TaskTableMapping | None = None, batch_rows: int = BATCH_ROWS,
                 hold_quiet: float = HOLD_QUIET, leading: threading.Event | None = None,
                 publishing: threading.Event | None = None,
                 on_flush: Callable[[int], None] | None = None) -> None:
        self.engine = engine
        #: Cleared while the relay has paused publishing (the bus near its memory limit): the stream reads,
        #: writes and publishes nothing meanwhile; the slot keeps the changes (None: never paused).
        self.publishing = publishing
        #: Set while the relay this capture runs for holds partition 0 (None: always): the stream ends when it
        #: is cleared, so one process does the partition's whole work (see :func:`stream_when_installed`).
        self.leading = leading
        #: Told how many rows each committed batch wrote (the relay schedules its purge of them by it).
        self.on_flush = on_flush
        #: How long the stream keeps a batch of quiet changes only (:meth:`_holds`); 0: never.
        self.hold_quiet = hold_quiet
        self._quiet = frozenset(quiet_statuses(tables.statuses))
        self._holding_since: float | None = None
        self._switching = False
        self.tables = tables
        self.bus = bus
        self.relay_partitions = relay_partitions
        self.foreign = foreign
        self.batch_rows = batch_rows
        self.relations: dict[int, Relation] = {}
        #: Of the relations that are the task table: where its captured columns are (see _Plan).
        self._plans: dict[int, _Plan] = {}
        self.pending = _Pending()
        self._txn: list[dict[str, Any]] | None = None
        self._xid = 0
        self._changes = 0
        #: Batches that had to wait for a decoded commit to become visible (:meth:`_await_visible`).
        self.invisible_waits = 0
        self._seen: OrderedDict[str, tuple[Value, ...]] = OrderedDict()
        #: The same for the rows of the ``[[mapping.related]]`` tables: (related index, replica identity key).
        self._seen_related: OrderedDict[tuple[int, tuple[Value, ...]],
                                        tuple[tuple[Value, ...], tuple[Value, ...]]] = OrderedDict()
        self.confirmed_lsn = 0
        #: The server the last stream ran on: (system identifier, timeline), from IDENTIFY_SYSTEM.
        self._server: tuple[str, int] | None = None
        self.captured = 0
        self._conn: Connection | None = None
        #: The WAL capture's share of the changes (see :func:`bounds`), read at each connection and after a
        #: switch's message in the stream.
        self.start_lsn: int = 0
        self.stop_lsn: int | None = None
        self._reload_bounds = False
        #: Times the slot was found gone and recreated, and the tasks re-derived then (:meth:`recover_slot`).
        self.gaps = 0
        self.rederived = 0
        with engine.connect() as conn:
            self.slot = slot_name(conn)
            base = set(capture_target(conn, tables).c.keys())
            #: The captured tables' OIDs (what a Relation message names): the task table -1, related tables from 0.
            self._oids = self._resolve(conn)
        self._unknown_relations: set[int] = set()
        #: Task-row changes whose row the read view did not show when they were written (not captured).
        self.unseen = 0
        cols = tables.mapping.columns
        # Only the captured table's own columns can be compared (a joined status changes with its related table).
        self._watched = [(kind, column) for kind, logical in WATCHED
                         if (column := getattr(cols, logical)) and column in base]
        #: Whether some captured column is only in the read view: each change's values are then read through it.
        self._fill = any(column not in base for logical in CAPTURED for column in cols.parts(logical))
        # Of a task change's values, those the view supplies (their columns are not all on the captured table);
        # the others come from the change itself, as it was.
        def off_base(logical: str) -> bool:
            return any(column not in base for column in cols.parts(logical))
        self._from_view = {field for field, off in (
            ("instance_id", off_base("instance_id")), ("task_key", off_base("task_key")),
            ("workflow_type", off_base("workflow_type") or (not cols.workflow_type and off_base("instance_id"))),
            ("new_status", off_base("status")), ("attempt", off_base("attempts")), ("depth", off_base("depth")),
        ) if off}
        self._view_statements: dict[tuple[str, ...], sa.Select[Any]] = {}
        # Both run once per batch: compiled once, run straight through the driver (bridge.db.driver).
        self._insert = DriverStatement(self._insert_statement(), engine.dialect)
        self._types_from_instances, facts = self._build_facts_statement()
        self._facts_run = DriverStatement(facts, engine.dialect)

    # --- decoding --------------------------------------------------------------------------------------
    def handle(self, payload: bytes) -> None:
        """One message of the stream."""
        # A captured transaction's begin, changes of task rows and commit are read in place (pgoutput's begin_xid,
        # new_row, commit_fields), not through decode's message objects: 3 messages for each single-row
        # transaction the scheduler commits. Measured on recorded messages of the reference table: 23-33 against
        # 43-61 microseconds per change (docs/capture.md, "The stream read in place").
        tag = payload[:1]
        if tag == b"B":
            self._txn = []
            self._xid = begin_xid(payload)
            self._changes = 0
            return
        if tag == b"C":
            self._commit(*commit_fields(payload))
            return
        if tag == b"U" or tag == b"I":
            fast = new_row(payload)
            plan = self._plans.get(fast[0]) if fast is not None else None
            if fast is not None and plan is not None:
                self._open()
                self._add(self._task_row(plan, fast[1], fast[2], None, False))
                return
        message = decode(payload)
        if isinstance(message, Relation):
            self.relations[message.relid] = message
            # Made at the relation's first captured change (_row), where an unknown relation is resolved, as before.
            self._plans.pop(message.relid, None)
        elif isinstance(message, Change):
            self._open()
            self._add(self._row(message))
        elif isinstance(message, LogicalMessage) and message.prefix == "pollbridge":
            self._reload_bounds = True  # a switch: its state committed with the message
            self._switching = True  # and `capture switch` waits for its confirmation: nothing is held

    def _open(self) -> None:
        if self._txn is None:
            raise DecodeError("a change outside a transaction")

    def _add(self, row: dict[str, Any] | None) -> None:
        """A change of the open transaction, numbered among all its changes, skipped ones included: a change
        streamed again gets the same event id whatever this process remembered the first time."""
        assert self._txn is not None
        if row is not None:
            row["pb_n"] = self._changes
            self._txn.append(row)
        self._changes += 1

    def _commit(self, commit_lsn: int, end_lsn: int, micros: int) -> None:
        if self._reload_bounds:
            self._load_bounds()
        # Outside the log's share (before a switch to it, or after a switch away): the triggers have them.
        inside = commit_lsn >= self.start_lsn and (self.stop_lsn is None or commit_lsn < self.stop_lsn)
        rows = (self._txn or []) if inside else []
        if rows:
            created = pg_time(micros).isoformat()  # as the outbox's JSON document carries it
            for row in rows:
                row["created_at"] = created
                seed = f"{commit_lsn}:{row.pop('pb_n')}"
                if "pb_related" in row:  # its task rows' event ids are derived from it when it is written
                    row["pb_seed"] = seed
                else:
                    row["event_id"] = event_id(seed)
            self.pending.rows += rows
            self.pending.xids.append(self._xid)
        self.pending.end_lsn = end_lsn
        self._txn = None

    def _load_bounds(self) -> None:
        with self.engine.connect() as conn:
            self.start_lsn, self.stop_lsn = bounds(conn)
        self._reload_bounds = False

    def _resolve(self, conn: Connection) -> dict[int, int]:
        """The OIDs of the task table (-1) and of each ``[[mapping.related]]`` table (its index), resolved as the
        publication named them (a table without a schema through the search path)."""
        out: dict[int, int] = {}
        for index, name in enumerate(published_tables(conn, self.tables)):
            oid = conn.execute(sa.text("SELECT CAST(to_regclass(:t) AS oid)"), {"t": name}).scalar()
            if oid is not None:
                out[int(oid)] = index - 1
        return out

    def _target(self, relation: Relation) -> int | None:
        """-1 for the task table, the index of a ``[[mapping.related]]`` table, or None: a relation the
        publication carries that is none of them (resolved again once, then logged once: never silent)."""
        target = self._oids.get(relation.relid)
        if target is None and relation.relid not in self._unknown_relations:
            with self.engine.connect() as conn:
                self._oids = self._resolve(conn)
            target = self._oids.get(relation.relid)
            if target is None:
                self._unknown_relations.add(relation.relid)
                log.warning("the publication carries %s.%s, which is none of the mapped tables: its changes are not "
                            "captured (run `pollbridge init` after changing the mapping)", relation.namespace,
                            relation.name)
        return target

    def _row(self, change: Change) -> dict[str, Any] | None:
        relation = self.relations.get(change.relid)
        if relation is None or change.kind == "delete" or change.new is None:
            return None
        target = self._target(relation)
        if target is None:
            return None
        if target >= 0:
            return self._related_row(relation, target, change)
        plan = self._plans.get(change.relid)
        if plan is None:
            plan = self._plans[change.relid] = _Plan.of(relation, self.tables.mapping.columns, self._watched)
        return self._task_row(plan, change.kind, change.new, change.old, change.old_full)

    def _task_row(self, plan: _Plan, kind: str, new: tuple[Value, ...], old: tuple[Value, ...] | None,
                  old_full: bool) -> dict[str, Any] | None:
        """The outbox row of an insert or update of a task row (None: skipped), by the positions of ``plan``."""
        task_id = plan.value(new, plan.id)
        if not isinstance(task_id, str):
            return None
        # The id before the change: the old key tuple's when the update changed the primary key.
        old_id = task_id
        if old is not None and isinstance(earlier := plan.value(old, plan.id), str):
            old_id = earlier
        watched_now = plan.watched_values(new)
        remembered = self._seen.pop(old_id, None) if old_id != task_id else self._seen.get(task_id)
        change, old_status = "insert", None
        if kind == "update":
            before: list[Value] | None = None
            if old is not None and old_full:  # REPLICA IDENTITY FULL: the whole old row
                before = list(plan.watched_values(old))
            elif remembered is not None:
                before = list(remembered)
            if before is not None:
                before[plan.id_at] = old_id
                # The first watched column that changed names the kind, as in the trigger; an unchanged
                # TOASTed value travels as "unchanged": it did not change.
                changed = next((k for k, a, b in zip(plan.kinds, before, watched_now, strict=True)
                                if b is not UNCHANGED and a != b), None)
                if changed is None:
                    self._remember(task_id, watched_now)
                    return None
                change = changed
                old_status = before[plan.status_at] if plan.status_at is not None else None
            else:
                change = "identity" if old_id != task_id else "status"  # not remembered: the status may have moved
        self._remember(task_id, watched_now)
        status = plan.value(new, plan.status)
        return {
            "task_id": task_id,
            "instance_id": plan.joined(new, plan.instance),
            "task_key": plan.joined(new, plan.task_key),
            "workflow_type": _text(plan.value(new, plan.workflow_type)) if plan.typed else None,
            "change": change,
            "old_status": None if old_status is UNCHANGED else old_status,
            "new_status": None if status is UNCHANGED else status,
            "attempt": _small_int(plan.value(new, plan.attempt)),
            "depth": _small_int(plan.value(new, plan.depth)),
        }

    def _related_row(self, relation: Relation, index: int, change: Change) -> dict[str, Any] | None:
        """A change of a ``[[mapping.related]]`` row: a marker that becomes, when written, a status change of every
        task row (read through the read view) whose match columns equal the row's, as the related trigger writes
        (:data:`pb_related`, :data:`pb_match`: the related columns' values, as text, in match order). An update
        that changed no ``watch`` column is skipped when the old values are known (the ones last seen for the
        row's replica identity key, or the whole old row under ``REPLICA IDENTITY FULL``)."""
        related = self.tables.mapping.related[index]
        names = [c.name for c in relation.columns]
        new = dict(zip(names, change.new or (), strict=False))
        old = dict(zip(names, change.old, strict=False)) if change.old is not None and change.old_full else None
        key = (index, tuple(new.get(c.name) for c in relation.columns if c.key))
        watched_now = tuple(new.get(c) for c in related.watch)
        remembered = self._seen_related.get(key)
        # An unchanged TOASTed match value travels as "unchanged": it is what it was (the old row's, or the one
        # remembered for the row).
        match = tuple(new.get(column) for _, column in related.match)
        if any(v is UNCHANGED for v in match):
            earlier = tuple(old.get(column) for _, column in related.match) if old is not None \
                else remembered[1] if remembered is not None else None
            if earlier is not None:
                match = tuple(e if v is UNCHANGED else v for v, e in zip(match, earlier, strict=True))
        if change.kind == "update":
            before = tuple(old.get(c) for c in related.watch) if old is not None \
                else remembered[0] if remembered is not None else None
            if before is not None and not any(b is not UNCHANGED and a != b
                                              for a, b in zip(before, watched_now, strict=True)):
                self._remember_related(key, (watched_now, match))
                return None
        self._remember_related(key, (watched_now, match))
        if any(v is None for v in match):
            return None  # a NULL matches no task row
        if any(v is UNCHANGED for v in match):
            log.warning("a change of %s (mapping.related) left a match column unchanged and out of line, and its value "
                        "is not known here (no REPLICA IDENTITY FULL, not seen since the relay started): the tasks "
                        "it concerns are evaluated at their next change or catch-up", related.table)
            return None
        # The values the view takes from this row, as they were at this change (mapping.related.columns).
        values = {task_column: new.get(related_column) for task_column, related_column in related.columns
                  if new.get(related_column) is not UNCHANGED}
        return {"pb_related": index, "pb_match": tuple(_text(v) for v in match), "pb_values": values}

    def _remember(self, task_id: str, values: tuple[Value, ...]) -> None:
        self._seen[task_id] = values
        self._seen.move_to_end(task_id)
        if len(self._seen) > SEEN_CACHE:
            self._seen.popitem(last=False)

    def _remember_related(self, key: tuple[int, tuple[Value, ...]],
                          values: tuple[tuple[Value, ...], tuple[Value, ...]]) -> None:
        self._seen_related[key] = values
        self._seen_related.move_to_end(key)
        if len(self._seen_related) > SEEN_CACHE:
            self._seen_related.popitem(last=False)

    # --- writing ---------------------------------------------------------------------------------------
    def _insert_statement(self) -> Any:
        """The batch's outbox rows, inserted already published, from one JSON document (``:pb_rows``, see
        :meth:`_rows_document`), in the batch's order; returning what the events are built from."""
        o = outbox.c
        rows = sa.func.json_to_recordset(sa.cast(sa.bindparam("pb_rows", type_=sa.Text), postgresql.JSON)) \
            .table_valued(*(sa.column(n, _FIELD_TYPES.get(n, sa.Text)) for n in (*_OUTBOX_FIELDS, "pb_i"))) \
            .render_derived(name="pb_rows", with_types=True)
        partition: Any = sa.literal(0)
        if self.relay_partitions > 1:
            partition = sa.func.mod(sa.func.hashtext(rows.c.instance_id).op("&")(2147483647),
                                    self.relay_partitions)
        # The trace id as the capture trigger makes it, by the database (a uuid4 per row in Python took 6 % of the
        # relay's CPU streaming 5,000 changes/s).
        trace = sa.func.replace(sa.cast(sa.func.gen_random_uuid(), sa.Text), "-", "")
        # In the batch's order: the outbox id is the event's version.
        select = sa.select(*(rows.c[n] for n in _OUTBOX_FIELDS), trace, partition, sa.func.clock_timestamp()) \
            .order_by(rows.c.pb_i)
        # The event's fields first (published by position); what a foreign scheduler's dispatches are recorded from
        # only with one (each returned column is read and converted per row: a timestamp parsed, for one).
        evidence = (o.id, o.change, o.old_status, o.new_status) if self.foreign is not None else ()
        return (outbox.insert().from_select([*_OUTBOX_FIELDS, "trace_id", "relay_partition", "published_at"],
                                            select)
                .returning(o.event_id, o.instance_id, o.task_id, event_payload_sql("postgresql"), *evidence))

    @staticmethod
    def _rows_document(rows: Sequence[dict[str, Any]]) -> str:
        """The rows as the one JSON document the insert reads (``json_to_recordset``, which ignores the keys it does
        not name): dumped by the ``json`` module's C encoder, where twelve array parameters were dumped element by
        element by the driver's Python code (measured: 10 % of the relay's CPU streaming 5,000 changes/s), and
        the rows as they are, their place added (``pb_i``), not copied. Text as it is, not ``\\u`` escapes: a
        ``SQL_ASCII`` database refuses escapes above U+007F in JSON."""
        for i, r in enumerate(rows):
            r["pb_i"] = i
        return json.dumps(rows, ensure_ascii=False, separators=(",", ":"), default=_json_time)

    def flush(self, *, closing: sa.Update | None = None) -> int:
        """Write, publish and record the pending changes in one transaction; return how many. The caller
        confirms :attr:`pending`'s LSN to the server afterwards (:attr:`confirmed_lsn` moves here). ``closing``: a
        slot recovery's statement that closes its gap, run in the same transaction as its re-derived rows."""
        rows, end_lsn = self.pending.rows, self.pending.end_lsn
        if rows:
            # A kept connection: a pool checkout per batch would add the pool's pre-ping, a transaction of its own
            # (measured: 1.7 database transactions per change at 200 changes/s with it).
            if self._conn is None:
                # READ COMMITTED whatever the server's default: the visibility check needs a new snapshot per
                # statement (under REPEATABLE READ it would look at the first one until its deadline).
                self._conn = self.engine.connect().execution_options(isolation_level="READ COMMITTED")
            conn = self._conn
            try:
                with conn.begin():
                    self._await_visible(conn, [r for r in rows if "pb_related" not in r], self.pending.xids)
                    if self._fill or self.tables.mapping.related:
                        rows = self._through_view(conn, rows)
                    if self.tables.has("spawned_by"):  # the causation depth the events carry, from the chain
                        depths = spawn_depths(conn, self.tables, [r["task_id"] for r in rows])
                        for r in rows:
                            r["depth"] = depths.get(r["task_id"], r.get("depth"))
                    # In chunks: one transaction can change millions of rows (and a lost slot re-derives every
                    # unfinished task), and one parameter holds at most 1 GB.
                    written = [r for at in range(0, len(rows), self.batch_rows) for r in self._insert.all(
                        conn, {"pb_rows": self._rows_document(rows[at:at + self.batch_rows])})]
                    if self.foreign is not None:
                        record_foreign_dispatches(conn, self.foreign, written)
                    quiet = self._quiet
                    loud = {r["instance_id"] for r in rows if not is_quiet(r.get("change"), r.get("new_status"), quiet)}
                    self.bus.publish_in(conn, [encoded_event(*r[:4]) for r in loud_first(written, loud)])
                    if closing is not None:
                        conn.execute(closing)
            except BaseException:
                self.close()
                raise
        self.pending = _Pending(end_lsn=end_lsn)
        self.confirmed_lsn = max(self.confirmed_lsn, end_lsn)
        self.captured += len(rows)
        if rows and self.on_flush is not None:
            self.on_flush(len(rows))
        return len(rows)

    def _through_view(self, conn: Connection, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The batch's rows as written, in order (its commits visible already): a task change with values only
        the read view has gets them from it (dropped if the view does not show its row, as the trigger's read
        through the view finds nothing); a related change becomes a status change of each task row that
        matches it, its status as read now, no old status (as the related trigger writes it)."""
        cols = self.tables.mapping.columns
        # With values only the read view has (a status joined from another table), every task change is read
        # through it.
        fill = [r for r in rows if "pb_related" not in r] if self._fill else []
        filled = {v.pb_k0: v for v in self._view_rows(conn, (cols.id,), [(r["task_id"],) for r in fill])} \
            if fill else {}
        matched: dict[tuple[int, tuple[str, ...]], list[Any]] = {}
        for index, related in enumerate(self.tables.mapping.related):
            keys = sorted({r["pb_match"] for r in rows if r.get("pb_related") == index})
            if keys:
                columns = tuple(task_column for task_column, _ in related.match)
                for v in self._view_rows(conn, columns, keys):
                    matched.setdefault((index, tuple(getattr(v, f"pb_k{i}") for i in range(len(columns)))),
                                       []).append(v)
        out: list[dict[str, Any]] = []
        for r in rows:
            if "pb_related" in r:
                at_change = r["pb_values"]
                for v in matched.get((r["pb_related"], r["pb_match"]), []):
                    values = _view_values(v)
                    if cols.status in at_change:
                        values["new_status"] = at_change[cols.status]
                    if cols.attempts and cols.attempts in at_change:
                        values["attempt"] = _small_int(at_change[cols.attempts])
                    if cols.depth and cols.depth in at_change:
                        values["depth"] = _small_int(at_change[cols.depth])
                    out.append({**values, "event_id": event_id(f"{r['pb_seed']}:{v.task_id}"),
                                "change": "status", "old_status": None,
                                "created_at": r["created_at"]})
            elif self._fill:
                v = filled.get(r["task_id"])
                if v is None:
                    self.unseen += 1
                    log.info("a change of task %s is not captured: the read view does not show its row (deleted "
                             "since, or outside the view's join)", r["task_id"])
                    continue
                values = _view_values(v)
                out.append({**r, **{k: values[k] for k in self._from_view}})
            else:
                out.append(r)
        return out

    def _view_rows(self, conn: Connection, columns: tuple[str, ...], keys: Sequence[tuple[str, ...]]) -> list[Any]:
        """The task rows of the read view whose ``columns`` equal one of ``keys`` (text, cast to each column's
        type), with the values an outbox row carries and the key they matched (``pb_k0``…)."""
        statement = self._view_statements.get(columns)
        if statement is None:
            tt = self.tables
            t = tt.tasks
            arrays = [sa.bindparam(f"pb_k{i}", type_=postgresql.ARRAY(sa.Text)) for i in range(len(columns))]
            keyed = sa.func.unnest(*arrays).table_valued(
                *(sa.column(f"pb_k{i}", sa.Text) for i in range(len(columns)))).render_derived(name="pb_m")
            on = sa.and_(*(t.c[c] == sa.cast(keyed.c[f"pb_k{i}"], t.c[c].type) for i, c in enumerate(columns)))

            def text(logical: str) -> Any:
                return sa.cast(tt.col(logical, t), sa.Text) if tt.has(logical) else sa.null()
            statement = (sa.select(sa.cast(tt.col("id", t), sa.Text).label("task_id"),
                                   tt.key_text("instance_id", t).label("instance_id"),
                                   tt.key_text("task_key", t).label("task_key"),
                                   sa.cast(type_of_row(tt, t), sa.Text).label("workflow_type"),
                                   text("status").label("status"), text("attempts").label("attempt"),
                                   text("depth").label("depth"),
                                   *(keyed.c[f"pb_k{i}"] for i in range(len(columns))))
                         .select_from(t.join(keyed, on)).order_by(tt.col("id", t)))
            self._view_statements[columns] = statement
        return list(conn.execute(statement, {f"pb_k{i}": [k[i] for k in keys] for i in range(len(columns))}))

    def _await_visible(self, conn: Connection, rows: Sequence[dict[str, Any]], xids: Sequence[int]) -> None:
        """Until every transaction of the batch is visible to this connection's statements (and so to every
        snapshot taken after them, the scheduler's evaluation of the events included); the rows' workflow types
        are read by the same statement, from the same snapshot (:meth:`_facts`).

        The server flushes a commit record and wakes the walsenders before the committing session leaves the
        process array: a commit can be decoded while it is still invisible to other sessions. A scheduler woken by
        its event would read the task as it was and acknowledge the event, and the change would never be acted
        on (measured: 4 of 399 completions at 20/s, with the machine's CPU busy). Usually one statement that
        finds nothing to wait for; the wait is microseconds unless the session is descheduled, or held by
        synchronous replication, which holds the commit's visibility until a standby confirms it."""
        # The gap is usually well under a millisecond: the relay reads the log as soon as it is flushed.
        backoff = Backoff(first=0.0002, cap=0.005)
        deadline = time.monotonic() + VISIBLE_WAIT
        waited = False
        while self._facts(conn, rows, sorted(set(xids))):
            if time.monotonic() > deadline:
                # Streamed again from the last confirmation by the run loop: nothing is lost.
                raise TimeoutError(f"a decoded commit stayed invisible for {VISIBLE_WAIT:g} s (synchronous "
                                   "replication waiting for a standby?)")
            waited = True
            time.sleep(backoff.next())
        if waited:
            self.invisible_waits += 1

    def _build_facts_statement(self) -> tuple[bool, sa.Select[Any]]:
        """:meth:`_facts`'s statement: the count of ``:xids`` this snapshot does not see yet and, where the mapping
        takes the workflow type from the instances table (True, first), beside it the batch's instances
        (``:pb_ids``), at least one row."""
        m = self.tables.mapping
        inst = self.tables.instances
        invisible = sa.text(INVISIBLE_XIDS_SQL).columns(sa.column("count", sa.Integer)).subquery("pb_invisible")
        if m.columns.workflow_type or m.instances is None or inst is None:
            return False, sa.select(invisible.c.count.label("invisible"))
        inst_id = sa.cast(inst.c[m.instances.id], sa.Text)
        # An array parameter, not an expanding IN: the statement's text stays the same for every batch, so it is
        # compiled once and run straight through the driver (an expanding IN was rendered per call: 4 % of the
        # relay's CPU at 8 writers, py-spy).
        ids = sa.func.any(sa.cast(sa.bindparam("pb_ids"), postgresql.ARRAY(sa.Text)))
        return True, (sa.select(invisible.c.count.label("invisible"), inst_id.label("instance_id"),
                                sa.cast(inst.c[m.instances.workflow_type], sa.Text).label("workflow_type"))
                      .select_from(invisible.outerjoin(inst, inst_id == ids)))

    def _facts(self, conn: Connection, rows: Sequence[dict[str, Any]], xids: list[int]) -> int:
        """One statement: how many of ``xids`` this snapshot does not see yet and, where the mapping takes the
        workflow type from the instances table, the rows' types (set only when every transaction is visible:
        an instance inserted with its tasks is found then). Returns the invisible count."""
        if not self._types_from_instances:
            return int(self._facts_run.all(conn, {"xids": xids})[0][0]) if xids else 0
        ids = sorted({r["instance_id"] for r in rows})
        found = self._facts_run.all(conn, {"xids": xids, "pb_ids": ids})
        if found and found[0][0]:
            return int(found[0][0])
        types = {str(r[1]): r[2] for r in found if r[1] is not None}
        for r in rows:
            r["workflow_type"] = types.get(r["instance_id"])
        return 0

    def close(self) -> None:
        """Let the kept connection go (the next flush takes a fresh one)."""
        discard(self._conn)
        self._conn = None

    # --- the loop --------------------------------------------------------------------------------------
    def _switched_away(self) -> bool:
        """Whether capture was switched back to the triggers (or removed): then a missing slot is no loss."""
        try:
            with self.engine.connect() as conn:
                return not publication_exists(conn)
        except Exception:
            return False

    def run(self, stop: threading.Event) -> None:
        """Stream until ``stop`` or until capture is switched away from the log; reconnect with backoff after a
        failure (the slot resends what was not confirmed)."""
        try:
            self._run(stop)
        finally:
            self.close()
            # A capture that ended (the relay lost its partition, a switch) is kept by its caller for its counts
            # only: its cache of watched values (up to SEEN_CACHE tasks) goes.
            self._seen.clear()
            self._seen_related.clear()

    def _leads(self) -> bool:
        return self.leading is None or self.leading.is_set()

    def _paused(self) -> bool:
        return self.publishing is not None and not self.publishing.is_set()

    def _run(self, stop: threading.Event) -> None:
        backoff = Backoff(first=0.5, cap=10.0)
        while not stop.is_set() and self._leads():
            try:
                self._resume_recovery()
                self._stream(stop)
                backoff.reset()
            except Exception as exc:  # a lost connection, a server restart, a busy slot: try again
                self._forget_unconfirmed()
                if self._switched_away():
                    log.info("write-ahead-log capture switched away: streaming stopped")
                    return
                if _slot_gone(exc):
                    try:
                        self.recover_slot()
                    except Exception as again:  # the database is away too: the next round tries again
                        exc = again
                    else:
                        # The new slot keeps every change from its creation, so a pause loses nothing; a growing
                        # one keeps a slot that is gone again at once (an invalidated one its old walsender still
                        # held) from recording a gap and re-deriving every task in a loop.
                        stop.wait(backoff.next())
                        continue
                delay = backoff.next()
                log.warning("write-ahead-log capture stopped (%s); reconnecting in %.1f s", first_line(exc), delay)
                stop.wait(delay)

    def _forget_unconfirmed(self) -> None:
        """After a failure: drop what was decoded and not confirmed; the slot sends it again. The watched values
        remembered while decoding it go too: they describe changes that are not captured yet, and a change sent
        again would otherwise look unchanged against them and be skipped (found by the restart fault test: a
        write decoded just before a restart was never published). The next update of each task is then captured
        without its old status, as after a restart of the relay."""
        self.pending = _Pending(end_lsn=self.confirmed_lsn)
        self._txn = None
        self._holding_since, self._switching = None, False
        self._seen.clear()
        self._seen_related.clear()

    def recover_slot(self) -> int:
        """The slot was dropped or invalidated (the WAL it needed was removed): what changed in between is not
        in any log any more. Record the gap first (pending: :data:`bridge.capture.gaps.PENDING`), recreate the
        slot (changes from now on are streamed), then re-derive the state of every unfinished task from the
        table, as after a bus loss: each becomes a status change with no old status, published, so the scheduler
        evaluates its instance again; the same transaction writes the gap's count. A failure or a crash after
        the slot is made leaves the gap pending, and the capture's next start finishes it
        (:meth:`_resume_recovery`) instead of streaming on as if nothing were missing. The gap is counted
        (:attr:`gaps`) and logged. Returns how many tasks were re-derived."""
        with self.engine.begin() as conn:  # a recovery cut short earlier: its gap, not a second one
            gap_id = pending_gap(conn, WAL_SLOT)
            if gap_id is None:
                gap_id = int(conn.execute(record_gap_statement(
                    "postgresql", WAL_SLOT, PENDING,
                    f"{self._slot_gone_text()} and is being recreated; the state of the unfinished tasks is being "
                    "re-derived").returning(capture_gaps.c.id)).scalar_one())
        self._recreate_slot()
        return self._rederive(gap_id)

    def _recreate_slot(self) -> None:
        """The slot as a recovery needs it: an invalidated one dropped, a missing one created, a valid one kept."""
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            state = slot_state(conn)
            if state.exists and not state.active and state.wal_status == "lost":  # invalidated: drop to make it again
                conn.exec_driver_sql(f"SELECT pg_catalog.pg_drop_replication_slot('{self.slot}')")
        ensure_slot(self.engine)

    def _resume_recovery(self) -> None:
        """Before each stream: a slot recovery that a failure or a crash cut short (its gap recorded pending, its
        re-derivation not written) is finished first; one look at the gaps table per stream started."""
        with self.engine.connect() as conn:
            gap_id = pending_gap(conn, WAL_SLOT)
        if gap_id is not None:
            log.warning("a recovery of replication slot %s was cut short: finishing it", self.slot)
            self._recreate_slot()
            self._rederive(gap_id)

    def _rederive(self, gap_id: int) -> int:
        """Publish the current state of every unfinished task (the slot made again) and close gap ``gap_id`` with
        their count, in one transaction."""
        self.confirmed_lsn = 0
        self._seen.clear()
        tt = self.tables
        cols = tt.mapping.columns
        # The keys' text forms as the evaluation reads them (TaskTable.key_text), not rebuilt here.
        q = sa.select(sa.cast(tt.col("id"), sa.Text).label("task_id"), tt.col("status").label("status"),
                      tt.key_text("instance_id").label("instance_id"), tt.key_text("task_key").label("task_key"),
                      (sa.cast(tt.col("workflow_type"), sa.Text) if cols.workflow_type else sa.null())
                      .label("workflow_type"),
                      (tt.col("attempts") if cols.attempts else sa.null()).label("attempt"),
                      (tt.col("depth") if cols.depth else sa.null()).label("depth")) \
            .where(sa.not_(tt.status_in("completed", "failed", *(["skipped"] if tt.statuses.of("skipped") else []))))
        with self.engine.connect() as conn:
            now = conn.exec_driver_sql("SELECT clock_timestamp()").scalar_one()
            rows = [{"event_id": str(uuid.uuid4()), "task_id": r.task_id, "instance_id": r.instance_id,
                     "task_key": r.task_key, "workflow_type": r.workflow_type, "change": "status",
                     "old_status": None, "new_status": None if r.status is None else str(r.status),
                     "attempt": r.attempt if isinstance(r.attempt, int) else None,
                     "depth": r.depth if isinstance(r.depth, int) else None,
                     "created_at": now} for r in conn.execute(q)]
        close = close_gap_statement(gap_id, len(rows), f"{self._slot_gone_text()} and was recreated; the state of "
                                                        f"{len(rows)} unfinished task(s) was re-derived")
        if rows:
            self.pending = _Pending(rows=rows, end_lsn=0)
            self.flush(closing=close)
        else:
            with self.engine.begin() as conn:
                conn.execute(close)
        self.gaps += 1
        self.rederived += len(rows)
        log.warning("%s: recreated; changes between its loss and now were not streamed, so the state of %d "
                    "unfinished task(s) was re-derived from the table and published", self._slot_gone_text(),
                    len(rows))
        return len(rows)

    def _slot_gone_text(self) -> str:
        """How a gap's record and the log line name what happened."""
        return (f"replication slot {self.slot} was gone (dropped, or invalidated when the WAL it needed was "
                "removed)")

    def _stream(self, stop: threading.Event) -> None:
        import psycopg2
        import psycopg2.extras

        dsn = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
        try:
            cur = conn.cursor()
            self._load_bounds()
            start = self._start_position(cur)
            cur.start_replication(slot_name=self.slot, decode=False, options=STREAM_OPTIONS, start_lsn=start)
            log.info("streaming slot %s from %s", self.slot,
                     lsn_text(start) if start else "its confirmed position")
            last_feedback = time.monotonic()
            while not stop.is_set() and self._leads():
                if self._paused():
                    # Paused with the relay: what is pending stays unconfirmed. Nothing is read meanwhile, so the
                    # status updates that keep the server's wal_sender_timeout off are forced out (psycopg2 sends
                    # an unforced one only from inside read_message).
                    if time.monotonic() - last_feedback >= FEEDBACK_INTERVAL:
                        cur.send_feedback(flush_lsn=self.confirmed_lsn, force=True)
                        last_feedback = time.monotonic()
                    assert self.publishing is not None  # _paused()
                    self.publishing.wait(PAUSED_LOOK)
                    continue
                # What the connection holds, up to DRAIN messages or one full batch before the stop, the lead and a
                # pause are looked at again (a flush can wait for a commit's visibility).
                drained = False
                for _ in range(DRAIN):
                    message = cur.read_message()
                    if message is None:
                        drained = True
                        break
                    self.handle(message.payload)
                    if len(self.pending.rows) >= self.batch_rows:
                        self._flush_and_confirm(cur)
                        last_feedback = time.monotonic()
                        break
                if not drained:
                    continue
                # Nothing waiting: what is pending goes out now (a batch is what arrived together), unless it is
                # quiet changes only, which wait for a change that can make a task ready (or their hold's end).
                held = self._holds(time.monotonic())
                if held is None and (self.pending.rows or self.pending.end_lsn > self.confirmed_lsn):
                    self._flush_and_confirm(cur)
                    last_feedback = time.monotonic()
                elif time.monotonic() - last_feedback >= FEEDBACK_INTERVAL:
                    cur.send_feedback(flush_lsn=self.confirmed_lsn, reply=False)
                    last_feedback = time.monotonic()
                select.select([cur], [], [], 0.5 if held is None else max(0.0, min(0.5, held)))
            if self.pending.rows and not self._paused():  # a held batch goes out with the stop, not the next stream
                self._flush_and_confirm(cur)
        finally:
            conn.close()

    def _start_position(self, cur: Any) -> int:
        """Where the next stream starts (on a replication cursor, before ``start_replication``): the position this
        process confirmed, so a stream restarted in the process does not repeat a batch whose confirmation the
        server had not taken yet (the server skips the transactions committed before it). 0, the slot's own
        position, on a first stream, and wherever the server may not be the one this process confirmed on: another
        system or timeline (a failover to a standby, a restore) or a log not yet past that position, where a
        start ahead of the server's history would skip its commits without an error."""
        cur.execute("IDENTIFY_SYSTEM")
        system_id, timeline, position = cur.fetchone()[:3]
        server = (str(system_id), int(timeline))
        known, self._server = self._server, server
        if not self.confirmed_lsn:
            return 0
        if known != server or parse_lsn(str(position)) < self.confirmed_lsn:
            log.warning("the server is not the one this relay confirmed %s on (system %s, timeline %s, log at %s): "
                        "streaming from the slot's own position", lsn_text(self.confirmed_lsn), server[0],
                        server[1], position)
            return 0
        return self.confirmed_lsn

    def catch_up(self, timeout: float = 30.0) -> int:
        """Stream until everything committed before this call is captured and confirmed, then disconnect;
        return how many changes were written. For tests and tools: the running capture is :meth:`run`."""
        import psycopg2
        import psycopg2.errors
        import psycopg2.extras

        with self.engine.connect() as sa_conn:
            target = int(sa_conn.exec_driver_sql(
                "SELECT pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), '0/0')").scalar_one())
        dsn = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        before = self.captured
        deadline = time.monotonic() + timeout
        while True:
            conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
            cur = conn.cursor()
            self._load_bounds()
            try:
                cur.start_replication(slot_name=self.slot, decode=False, options=STREAM_OPTIONS,
                                      start_lsn=self._start_position(cur))
                break
            except psycopg2.errors.ObjectInUse:
                # The previous reader's walsender is still letting the slot go (it exits a moment after its
                # client closed): measured under load in CI. Retried until the deadline.
                conn.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        try:
            while True:
                message = cur.read_message()
                if message is not None:
                    self.handle(message.payload)
                    continue
                if self._txn is None and max(self.pending.end_lsn, int(cur.wal_end or 0)) >= target:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"write-ahead-log capture did not reach {lsn_text(target)} in {timeout:g} s")
                cur.send_feedback(flush_lsn=self.confirmed_lsn, reply=True)
                select.select([cur], [], [], 0.2)
            self._flush_and_confirm(cur)
            self._await_confirmation(cur, deadline)
        except BaseException:
            self._forget_unconfirmed()
            raise
        finally:
            conn.close()
        return self.captured - before

    def _await_confirmation(self, cur: Any, deadline: float) -> None:
        """Until the server has taken the confirmation (a connection closed right after sending it may lose
        it, and the next stream would then start before it)."""
        while self.confirmed_lsn and time.monotonic() < deadline:
            with self.engine.connect() as conn:
                confirmed = conn.exec_driver_sql(
                    "SELECT pg_catalog.pg_wal_lsn_diff(confirmed_flush_lsn, '0/0') "
                    f"FROM pg_catalog.pg_replication_slots WHERE slot_name = '{self.slot}'").scalar()
            if confirmed is not None and int(confirmed) >= self.confirmed_lsn:
                return
            cur.send_feedback(flush_lsn=self.confirmed_lsn, reply=True, force=True)
            select.select([cur], [], [], 0.05)
            while cur.read_message() is not None:
                pass

    def _holds(self, now: float) -> float | None:
        """Seconds the pending batch may still be held (None: it goes out now). Held: a batch of status changes
        into a quiet value only (dispatches), for up to :attr:`hold_quiet` from its first, so that it
        goes out in one transaction with the next change that can make a task ready. At a trickle each such
        batch was a transaction of its own, and one more decoded by the walsender (``bench.cost``, wal, 2
        completions/s). Unconfirmed meanwhile: a crash streams it again, as any batch."""
        rows = self.pending.rows
        if not rows or self.hold_quiet <= 0 or self._switching or not all(
                "pb_related" not in r and is_quiet(r.get("change"), r.get("new_status"), self._quiet)
                for r in rows):
            self._holding_since = None
            return None
        if self._holding_since is None:
            self._holding_since = now
        left = self._holding_since + self.hold_quiet - now
        return left if left > 0 else None

    def _flush_and_confirm(self, cur: Any) -> None:
        self._holding_since, self._switching = None, False
        self.flush()
        if self.confirmed_lsn:
            cur.send_feedback(flush_lsn=self.confirmed_lsn)


def stream_when_installed(engine: Engine, make: Callable[[], WalCapture], stop: threading.Event,
                          check_every: float = 5.0, ran: list[WalCapture] | None = None,
                          leading: threading.Event | None = None) -> list[WalCapture]:
    """The relay's loop for the write-ahead log: stream while the WAL capture is installed (its publication
    exists: ``init`` or ``capture switch`` put it there), look again every ``check_every`` seconds while it is
    not (the relay runs it only where the log's capture is configured or installed). ``make`` builds the
    capture (reading the mapping) only once it is needed. ``ran`` (returned) collects the captures it ran, as
    they start (for their counts).

    ``leading``: the relay of partition 0 holds its partition. Only then does this process stream (a standby
    relay's process asks nothing, not even whether the capture is installed), and the stream ends when the
    relay loses the partition: the process that publishes partition 0's outbox rows is the one that writes
    the log's, so it purges them too, and a review release that wakes it is heard where the stream runs.
    A new capture (a fresh position: the slot's) starts when the partition comes back."""
    ran = [] if ran is None else ran
    while not stop.is_set():
        if leading is not None and not leading.is_set():
            leading.wait(0.5)  # a short slice: a stop request is honoured promptly
            continue
        try:
            with engine.connect() as conn:
                installed = publication_exists(conn)
            if installed:
                ran.append(make())
                ran[-1].run(stop)
                continue
        except Exception as exc:  # the database is away, or the mapping does not match: look again later
            log.warning("write-ahead-log capture: not streaming (%s)", first_line(exc))
        stop.wait(check_every)
    return ran


def _slot_gone(exc: BaseException) -> bool:
    """Whether streaming failed because the slot does not exist or was invalidated (not a passing outage)."""
    text = str(exc)
    return ("replication slot" in text and "does not exist" in text) or "has been invalidated" in text \
        or "can no longer get changes from replication slot" in text


def _small_int(text: Any) -> int | None:
    """An attempt or depth decoded as text: an int when it is a plain non-negative one that fits, else None."""
    # isascii: str.isdigit also accepts "²", which int() refuses.
    return int(text) if isinstance(text, str) and text.isascii() and text.isdigit() and len(text) < 10 else None


def _view_values(v: Any) -> dict[str, Any]:
    """The outbox values of a task row read through the view (:meth:`WalCapture._view_rows`)."""
    return {"task_id": v.task_id, "instance_id": v.instance_id, "task_key": v.task_key,
            "workflow_type": v.workflow_type, "new_status": v.status, "attempt": _small_int(v.attempt),
            "depth": _small_int(v.depth)}


def _json_time(value: Any) -> str:
    """A datetime in the outbox's JSON document (a re-derived row's time; a streamed change's comes as text)."""
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _text(value: Value) -> str:
    return "" if value is None or value is UNCHANGED else str(value)

