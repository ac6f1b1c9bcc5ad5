"""Change-data capture: triggers on the existing task table that write the outbox in the same transaction.

Generated from the mapping. One outbox row per *relevant* change: an insert, a status change, a due-time
change, a signal arrival, or a new physical row id (``identity``: a scheduler that gives a retried task a
new primary key by an UPDATE). The row carries the task id, instance id and task key (a composite key as
its text form, the parts joined with ``/``: :meth:`bridge.tasktable.tables.TaskTable.key_text`), the
workflow type, old and new status (NULL included), the attempt (the mapped ``attempts`` column of the new
row), a fresh event id and trace id and the database clock. The outbox id is the per-task version:
changes to one task row are serialised by its row lock, so a later change of the same task always gets a
larger id.

**Nothing the scheduler does may trip over capture.**

* The update trigger has no ``WHEN`` clause and no column list: PostgreSQL refuses ``ALTER TABLE …
  ALTER COLUMN … TYPE`` on a column either names ("cannot alter type of a column used in a trigger
  definition"), and schedulers' own migrations retype their columns. The trigger body compares the
  watched columns (as text on PostgreSQL, so any column type compares without an operator looked up on a
  search path) and returns without writing when none changed.
* On PostgreSQL the function is ``SECURITY DEFINER``, owned by the role that ran ``pollbridge init``: a
  scheduler whose role has rights on its own table only still writes it. Its ``search_path`` is pinned
  (``pg_catalog``, the schema of pollbridge's tables, ``pg_temp`` last) and every relation it names is
  schema-qualified, so the writer's session cannot redirect what it touches. ``EXECUTE`` is revoked from
  ``PUBLIC``: a trigger function is invoked by its trigger, and PostgreSQL checks no ``EXECUTE`` right
  when a trigger fires.
* A view cannot carry row triggers: a view as ``mapping.table`` is refused (by ``init`` before anything is
  created, and by ``doctor``) naming its base table; reads may go through the view (``mapping.read_table``)
  while capture sits on the base table.
* :func:`capture_status` says whether the installed capture is the one the current mapping and settings
  generate (a fingerprint of the generated SQL in the function's comment on PostgreSQL, the stored trigger
  text on SQLite), so ``doctor`` reports an outdated capture with the command that fixes it.

Wake-up modes (PostgreSQL; SQLite has no NOTIFY and always probes):

* ``poll``: the trigger never notifies; the relay probes the outbox's partial index.
* ``notify``: ``pg_notify`` on every captured change (PostgreSQL folds duplicates, so at most one
  notification per transaction). NOTIFY serialises committing transactions on a cluster-wide lock.
* ``adaptive``: notify only while the relay is *armed*, which it is only after the outbox stayed
  empty for a while; under load the trigger reads one flag row and never notifies.

In both, a status change into a dispatched value notifies no one (:func:`quiet_statuses`): it cannot make a
task ready, and its row is published with the relay's next claim. The first notifying change of a transaction
sends its event in the notification (``send_event``: :func:`bridge.capture.queries.event_notice_sql`), which the
relay publishes before its claim; the others notify empty (a related table's change always does).
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import NoSuchTableError

from bridge.capture.queries import EVENT_WINDOW, NOTICE_LIMIT, event_notice_sql
from bridge.core.errors import MappingMismatch
from bridge.core.mapping import RelatedTable, StatusValues
from bridge.core.settings import WAKE_MODES, WakeMode
from bridge.db.schema import OUTBOX_CHANNEL
from bridge.db.sqlblocks import render, sql_literal
from bridge.tasktable.tables import TaskTable


class _OfInstance(Protocol):
    @property
    def instance_id(self) -> Any: ...


R = TypeVar("R", bound=_OfInstance)

NOTIFY_CHANNEL = OUTBOX_CHANNEL
#: The payload of the notification that capture triggers were installed or removed (the relays read which).
CAPTURE_CHANGED = "capture"
TRIGGER_NAMES = ("pollbridge_capture_insert", "pollbridge_capture_update")
FUNCTION_NAME = "pollbridge_capture"
#: The columns the update trigger compares, in the order their change kinds take precedence.
WATCHED = (("status", "status"), ("due", "due_at"), ("signal", "signal_received_at"), ("signal", "awaits_signal"),
           ("identity", "id"))
#: What the function's comment starts with; the rest is ``sha256:<hex> wake:<mode> relay_partitions:<n>``.
COMMENT_PREFIX = "pollbridge capture"
_COMMENT = re.compile(r"^pollbridge capture sha256:([0-9a-f]{64}) wake:([a-z]+) relay_partitions:([0-9]+)$")
#: Mapped columns capture reads on the task table (the triggers, and the WAL capture's publication).
CAPTURED = ("id", "instance_id", "task_key", "status", "due_at", "awaits_signal", "signal_received_at",
             "attempts", "workflow_type", "depth")


def _q(conn: Connection, name: str) -> str:
    return conn.dialect.identifier_preparer.quote(name)


def _table_sql(conn: Connection, table: sa.Table) -> str:
    prep = conn.dialect.identifier_preparer
    return prep.format_table(table)


# --- where things are -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Relation:
    kind: str  # "table", "view", "materialized view", "other"
    name: str  # as the mapping names it (schema.table with mapping.schema)


def _pg_relation(conn: Connection, name: str) -> tuple[int, str, str, str] | None:
    """``(oid, relkind, schema, relname)`` of a (quoted, maybe qualified) relation name, or None."""
    row = conn.execute(sa.text(
        "SELECT c.oid, c.relkind, n.nspname, c.relname FROM pg_catalog.pg_class c "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = pg_catalog.to_regclass(:name)"),
        {"name": name}).first()
    return None if row is None else (int(row[0]), str(row[1]), str(row[2]), str(row[3]))


def _pg_qualified(conn: Connection, table: sa.Table) -> str:
    """``table`` qualified with the schema it really lives in (found through the connection's search path, as
    the trigger's DDL finds it): the function runs with a pinned search path that need not contain it."""
    found = _pg_relation(conn, _table_sql(conn, table))
    if found is None:
        return _table_sql(conn, table)
    prep = conn.dialect.identifier_preparer
    return f"{prep.quote_schema(found[2])}.{prep.quote(found[3])}"


def pollbridge_schema(conn: Connection) -> str:
    """The schema holding pollbridge's tables: where ``pollbridge_outbox`` is found (the migrations create it in
    the current schema of the connection that ran ``init``), else the current schema."""
    schema = conn.execute(sa.text(
        "SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = pg_catalog.to_regclass('pollbridge_outbox')")).scalar()
    if schema is None:
        schema = conn.execute(sa.text("SELECT pg_catalog.current_schema()")).scalar()
    return str(schema)


_PG_KINDS = {"r": "table", "p": "table", "f": "table", "v": "view", "m": "materialized view"}


def _relation(conn: Connection, table: str, schema: str | None) -> _Relation | None:
    """What ``table`` is (a table, a view, ...), or None when it does not exist."""
    prep = conn.dialect.identifier_preparer
    if conn.dialect.name == "postgresql":
        name = f"{prep.quote_schema(schema)}.{prep.quote(table)}" if schema else prep.quote(table)
        found = _pg_relation(conn, name)
        if found is None:
            return None
        return _Relation(_PG_KINDS.get(found[1], "other"), f"{schema}.{table}" if schema else table)
    master = f"{prep.quote_schema(schema)}.sqlite_master" if schema else "sqlite_master"
    kind = conn.execute(sa.text(f"SELECT type FROM {master} WHERE type IN ('table', 'view') AND name = :name"),
                        {"name": table}).scalar()
    if kind is None:
        return None
    return _Relation(str(kind), f"{schema}.{table}" if schema else table)


def _pg_view_bases(conn: Connection, name: str) -> list[str]:
    """The base tables a PostgreSQL view (or materialized view) reads, following views over views, as regclass
    text (schema-qualified when the schema is not on the search path)."""
    seen: set[int] = set()
    bases: list[str] = []
    pending = [name]
    while pending and len(seen) < 20:
        current = _pg_relation(conn, pending.pop())
        if current is None or current[0] in seen:
            continue
        seen.add(current[0])
        rows = conn.execute(sa.text(
            "SELECT DISTINCT d.refobjid::pg_catalog.regclass::text, c.relkind FROM pg_catalog.pg_rewrite r "
            "JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass "
            "AND d.objid = r.oid AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass "
            "AND d.refobjid <> r.ev_class "
            "JOIN pg_catalog.pg_class c ON c.oid = d.refobjid WHERE r.ev_class = :oid ORDER BY 1"),
            {"oid": current[0]}).all()
        for text, relkind in rows:
            if _PG_KINDS.get(str(relkind)) == "table":
                if text not in bases:
                    bases.append(str(text))
            elif str(relkind) == "v":
                pending.append(str(text))
    return bases


def _sqlite_view_bases(conn: Connection, table: str, schema: str | None) -> list[str]:
    """The tables a SQLite view reads: SQLite reports every column a statement reads to an authorizer, views
    expanded, so preparing ``SELECT * FROM view`` names them without parsing any SQL."""
    raw: Any = conn.connection.driver_connection
    prep = conn.dialect.identifier_preparer
    read: list[str] = []

    def authorizer(action: int, arg1: str | None, _arg2: str | None, _db: str | None, _src: str | None) -> int:
        if action == sqlite3.SQLITE_READ and arg1 and arg1 not in read:
            read.append(arg1)
        return sqlite3.SQLITE_OK

    name = f"{prep.quote_schema(schema)}.{prep.quote(table)}" if schema else prep.quote(table)
    raw.set_authorizer(authorizer)
    try:
        raw.execute(f"SELECT * FROM {name} LIMIT 0").fetchall()
    finally:
        raw.set_authorizer(None)
    return [t for t in read if (r := _relation(conn, t, schema)) is not None and r.kind == "table"]


def _has_task_columns(conn: Connection, tt: TaskTable, name: str) -> bool:
    """Whether the table ``name`` (as a view's dependencies name it) has the mapped id, keys and status."""
    schema, _, table = name.rpartition(".")
    try:
        columns = {c["name"] for c in sa.inspect(conn).get_columns(table.strip('"'), schema=schema.strip('"') or None)}
    except NoSuchTableError:
        return False
    cols = tt.mapping.columns
    return all(c in columns for logical in ("id", "instance_id", "task_key", "status") for c in cols.parts(logical))


def capture_target(conn: Connection, tt: TaskTable) -> sa.Table:
    """The table capture sits on: ``mapping.table`` (not ``mapping.read_table``, which reads may go through).

    Raises :class:`MappingMismatch` (one line saying what to set) when it is a view, which cannot carry row
    triggers, or when it lacks a column capture reads."""
    m = tt.mapping
    relation = _relation(conn, m.table, m.schema)
    if relation is not None and relation.kind != "table":
        if conn.dialect.name == "postgresql":
            prep = conn.dialect.identifier_preparer
            quoted = f"{prep.quote_schema(m.schema)}.{prep.quote(m.table)}" if m.schema else prep.quote(m.table)
            bases = _pg_view_bases(conn, quoted) if "view" in relation.kind else []
        else:
            bases = _sqlite_view_bases(conn, m.table, m.schema)
        if len(bases) > 1:  # a join: the task rows come from the table that has the mapped task columns
            having = [b for b in bases if _has_task_columns(conn, tt, b)]
            bases = having if len(having) == 1 else bases
        if len(bases) == 1:
            base = f"the base table {bases[0]!r}"
        elif bases:
            base = f"the base table whose rows are the tasks (it reads {', '.join(map(repr, bases))})"
        else:
            base = "the base table"
        raise MappingMismatch(
            f"mapping.table {relation.name!r} is a {relation.kind}: capture needs the base table; set mapping.table "
            f"to {base} and mapping.read_table to the {relation.kind} {m.table!r}")
    if m.read_table is None or m.read_table == m.table:
        return tt.tasks
    try:
        base_table = sa.Table(m.table, sa.MetaData(), schema=m.schema, autoload_with=conn)
    except NoSuchTableError:
        raise MappingMismatch(f"table {relation.name if relation else m.table!r} named by mapping.table does not "
                              "exist in the database; capture needs it (reads go through mapping.read_table "
                              f"{m.read_table!r})") from None
    # The id must be on the base table (the row a change happened to); any other captured column the base
    # lacks (a status joined from another table, a key computed by the view) is read through the view by id.
    if m.columns.id not in base_table.c:
        raise MappingMismatch(
            f"column {m.columns.id!r} (mapping.columns.id) does not exist in table {m.table!r}, which capture "
            f"sits on (reads go through {m.read_table!r}); existing columns: {', '.join(base_table.c.keys())}")
    return base_table


def related_targets(conn: Connection, tt: TaskTable) -> list[tuple[RelatedTable, sa.Table]]:
    """The ``[[mapping.related]]`` tables with their reflected columns, each checked: a table (not a view),
    its ``match`` and ``watch`` columns present, the ``match`` task columns present in the read table.
    Raises :class:`MappingMismatch` (one line) otherwise."""
    out: list[tuple[RelatedTable, sa.Table]] = []
    for related in tt.mapping.related:
        relation = _relation(conn, related.table, related.schema)
        name = f"{related.schema}.{related.table}" if related.schema else related.table
        if relation is None:
            raise MappingMismatch(f"table {name!r} named by mapping.related does not exist in the database")
        if relation.kind != "table":
            raise MappingMismatch(f"mapping.related table {name!r} is a {relation.kind}: capture needs a base table")
        table = sa.Table(related.table, sa.MetaData(), schema=related.schema, autoload_with=conn)
        for task_column, related_column in related.match:
            if task_column not in tt.tasks.c:
                raise MappingMismatch(f"column {task_column!r} (mapping.related {name!r} match) does not exist in "
                                      f"{tt.tasks.name!r}; existing columns: {', '.join(tt.tasks.c.keys())}")
            if related_column not in table.c:
                raise MappingMismatch(f"column {related_column!r} (mapping.related {name!r} match) does not exist in "
                                      f"{name!r}; existing columns: {', '.join(table.c.keys())}")
        for column in related.watch:
            if column not in table.c:
                raise MappingMismatch(f"column {column!r} (mapping.related {name!r} watch) does not exist in "
                                      f"{name!r}; existing columns: {', '.join(table.c.keys())}")
        out.append((related, table))
    return out


def related_names(index: int) -> tuple[str, tuple[str, str]]:
    """The capture function and the (insert, update) trigger names of the ``index``-th related table (from 1)."""
    base = f"{FUNCTION_NAME}_r{index}"
    return base, (f"{base}_insert", f"{base}_update")


# --- the generated SQL ----------------------------------------------------------------------------------

Columns = dict[str, str]  # a mapped column -> the SQL reading it for the captured row


def _key_text(tt: TaskTable, logical: str, read: Columns) -> str:
    """The text form of a (maybe composite) key of the captured row: what :meth:`TaskTable.key_text` computes."""
    return " || '/' || ".join(f"CAST({read[c]} AS TEXT)" for c in tt.mapping.columns.parts(logical))


def _row_columns(conn: Connection, tt: TaskTable, target: sa.Table, view: str | None) -> Columns:
    """How the main capture reads each captured column: ``NEW.column`` where the captured table has it, else
    through the read view by the row's id (a status joined from another table, a key the view computes)."""
    cols = tt.mapping.columns
    out: Columns = {}
    for logical in CAPTURED:
        for column in cols.parts(logical):
            if column in target.c:
                out[column] = f"NEW.{_q(conn, column)}"
            else:
                assert view is not None  # capture_target: only the id must be on the base table
                out[column] = (f"(SELECT pb_v.{_q(conn, column)} FROM {view} pb_v "
                               f"WHERE pb_v.{_q(conn, cols.id)} = NEW.{_q(conn, cols.id)})")
    return out


def _values(conn: Connection, tt: TaskTable, read: Columns, types: sa.Table) -> dict[str, str]:
    """The SQL of each outbox value of the captured task row (``read``: how each column is read)."""
    cols = tt.mapping.columns
    pg = conn.dialect.name == "postgresql"
    instance_key = _key_text(tt, "instance_id", read)
    if cols.workflow_type:
        type_expr = f"CAST({read[cols.workflow_type]} AS TEXT)"
    else:
        inst = tt.mapping.instances
        assert inst is not None and tt.instances is not None
        instances = _pg_qualified(conn, tt.instances) if pg else _table_sql(conn, tt.instances)
        if cols.composite("instance_id"):  # the instances' id holds the key's text form
            match = f"CAST(pb_i.{_q(conn, inst.id)} AS TEXT) = {instance_key}"
        else:
            match = f"pb_i.{_q(conn, inst.id)} = {read[cols.parts('instance_id')[0]]}"
        type_expr = f"(SELECT CAST(pb_i.{_q(conn, inst.workflow_type)} AS TEXT) FROM {instances} pb_i WHERE {match})"
    attempt = "NULL"
    if cols.attempts:
        attempt = f"CAST({read[cols.attempts]} AS INTEGER)"
        stored = (types.c[cols.attempts] if cols.attempts in types.c else tt.tasks.c[cols.attempts]).type
        if pg and (not isinstance(stored, sa.Integer) or isinstance(stored, sa.BigInteger)):
            # A cast that could fail (a bigint past the integer range, a text column) would fail the scheduler's
            # write: such a value is captured as no attempt instead.
            text = f"CAST({read[cols.attempts]} AS TEXT)"
            attempt = f"CASE WHEN {text} ~ '^[0-9]{{1,9}}$' THEN CAST({text} AS INTEGER) END"
    return {
        "depth": _small_int(conn, tt, read, types, cols.depth),
        "id_text": f"CAST({read[cols.id]} AS TEXT)",
        "instance_key": instance_key,
        "task_key": _key_text(tt, "task_key", read),
        "new_status": f"CAST({read[cols.status]} AS TEXT)",
        "type_expr": type_expr,
        "attempt": attempt,
        "partition_key": instance_key,
    }


def _small_int(conn: Connection, tt: TaskTable, read: Columns, types: sa.Table, column: str | None) -> str:
    """A mapped integer column as an outbox value, or NULL. On PostgreSQL a value the cast could fail on (a
    bigint past the integer range, a text column) is captured as NULL: a failed cast would fail the
    scheduler's own write."""
    if not column:
        return "NULL"
    stored = (types.c[column] if column in types.c else tt.tasks.c[column]).type
    if conn.dialect.name == "postgresql" and (not isinstance(stored, sa.Integer) or isinstance(stored, sa.BigInteger)):
        text = f"CAST({read[column]} AS TEXT)"
        return f"CASE WHEN {text} ~ '^[0-9]{{1,9}}$' THEN CAST({text} AS INTEGER) END"
    return f"CAST({read[column]} AS INTEGER)"


def _change_kind(conn: Connection, watched: list[tuple[str, str]]) -> str:
    """The kind of an update: the first watched column (kind, column) that changed, else NULL."""
    if conn.dialect.name == "postgresql":
        # As text: any column type compares, with no operator looked up on the (pinned) search path.
        changed = [f"CAST(OLD.{_q(conn, c)} AS TEXT) IS DISTINCT FROM CAST(NEW.{_q(conn, c)} AS TEXT)"
                   for _, c in watched]
    else:
        changed = [f"OLD.{_q(conn, c)} IS NOT NEW.{_q(conn, c)}" for _, c in watched]
    return "CASE " + " ".join(f"WHEN {test} THEN '{kind}'" for test, (kind, _) in zip(
        changed, watched, strict=True)) + " END"


def _read_view(conn: Connection, tt: TaskTable) -> str | None:
    """The read relation's SQL name when reads go through a view (else None)."""
    if tt.mapping.read_table is None or tt.mapping.read_table == tt.mapping.table:
        return None
    return _pg_qualified(conn, tt.tasks) if conn.dialect.name == "postgresql" else _table_sql(conn, tt.tasks)


def quiet_statuses(st: StatusValues) -> tuple[str, ...]:
    """The stored status values a captured status change into which wakes no relay: ``dispatched``. Such a
    change cannot make any task ready (the event scheduler acknowledges it unread: ``EventScheduler._may_matter``),
    so its outbox row rides on the relay's next claim, made for the next change that can, or on its idle probe
    (``relay.idle_probe_interval``). ``bench.cost``, trigger, 2 completions/s: the scheduler's own dispatch was a
    claim and a notification read, 2 of the 6 transactions per completion. ``running`` is not quiet: a type with
    a running timeout arms its timer from that event, and one of 2 s would fire up to the idle probe late."""
    return tuple(v for v in st.of("dispatched") if v is not None)


def is_quiet(change: object, new_status: object, quiet: frozenset[str]) -> bool:
    """Whether a captured change (its outbox row's ``change`` and ``new_status``) is a quiet one: a status change
    into one of ``quiet`` (:func:`quiet_statuses`), as the trigger's ``notify_unless_quiet`` tests it."""
    return change == "status" and new_status in quiet


def loud_first(rows: Sequence[R], loud: Collection[object]) -> list[R]:
    """A batch's rows (each with an ``instance_id``) in publishing order: those of the instances in ``loud`` (with
    a change that can make a task ready) first, then the instances whose changes are all quiet, each instance's
    rows in their order (the bus keeps one instance's events in publish order; between instances there is no
    order to keep).

    Why: at a trickle a quiet row (a dispatch) waits for the next loud one and goes out in its batch, first by id.
    The bus wakes a blocked reader at the first write of its partitions, so the scheduler read the quiet event
    alone, skipped it and came back for the loud one: a round trip to the bus inside every light-load dispatch
    (``bench.cost``, trigger, 2 completions/s: 1.07 ms of p50 6.65 ms from the completion's commit to the
    dispatch, traced per stage)."""
    if not loud:
        return list(rows)
    first = [r for r in rows if r.instance_id in loud]
    if len(first) == len(rows):
        return first
    return first + [r for r in rows if r.instance_id not in loud]


def _pg_values(conn: Connection, values: dict[str, str], wake: WakeMode, relay_partitions: int, *,
               many: bool, quiet: tuple[str, ...] = ()) -> dict[str, str]:
    """The PostgreSQL-only placeholders: function home, pinned search path, outbox, partition, wake-up.

    ``quiet``: the stored status values whose status change notifies no relay (:func:`quiet_statuses`)."""
    schema = pollbridge_schema(conn)
    home = conn.dialect.identifier_preparer.quote_schema(schema)
    partition_expr = "0"
    if relay_partitions > 1:
        partition_expr = f"mod(hashtext({values['partition_key']}) & 2147483647, {int(relay_partitions)})"
    notify = ""
    # A related change writes its rows in one statement, with no record of them to send: it notifies empty.
    send = render("postgresql", "send_empty") if many else render(
        "postgresql", "send_event", notice=event_notice_sql("pb_o_"), limit=str(NOTICE_LIMIT),
        outbox=f"{home}.pollbridge_outbox", before=str(EVENT_WINDOW))
    if wake == "notify":
        notify = render("postgresql", "notify_always", send=send)
    elif wake == "adaptive":
        # A related change may concern tasks of several relay partitions: wake if any relay is armed.
        notify = render("postgresql", "notify_when_any_armed" if many else "notify_when_armed",
                        relay_state=f"{home}.pollbridge_relay_state", send=send)
    if notify and quiet:
        notify = render("postgresql", "notify_unless_quiet", notify=notify,
                        quiet=", ".join(sql_literal(v) for v in quiet))
    return {
        "home": home,
        # pg_catalog first and pg_temp last: nothing of the writer's session can stand in for what it names.
        "search_path": f"pg_catalog, {home}, pg_temp",
        "outbox": f"{home}.pollbridge_outbox",
        "partition_expr": partition_expr,
        "notify": notify,
    }


def _placeholders(conn: Connection, tt: TaskTable, target: sa.Table, wake: WakeMode,
                  relay_partitions: int) -> dict[str, str]:
    cols = tt.mapping.columns
    pg = conn.dialect.name == "postgresql"
    read = _row_columns(conn, tt, target, _read_view(conn, tt))
    values = _values(conn, tt, read, target)
    # Only the captured table's own columns can be compared (a joined status changes with its related table).
    watched = [(kind, column) for kind, logical in WATCHED
               if (column := getattr(cols, logical)) and column in target.c]
    status_column = cols.status if cols.status in target.c else None
    values.update({
        "table": _pg_qualified(conn, target) if pg else _table_sql(conn, target),
        "change_kind": _change_kind(conn, watched) if watched else "NULL",
        "old_status": f"CAST(OLD.{_q(conn, status_column)} AS TEXT)" if status_column else "NULL",
    })
    if not pg:
        return values
    extra = _pg_values(conn, values, wake, relay_partitions, many=False, quiet=quiet_statuses(tt.statuses))
    return {**values, **extra, "function": f"{extra['home']}.{FUNCTION_NAME}"}


def _related_placeholders(conn: Connection, tt: TaskTable, index: int, related: RelatedTable, table: sa.Table,
                          wake: WakeMode, relay_partitions: int) -> dict[str, str]:
    """The placeholders of the ``index``-th related table's capture: every task row of the read relation
    (alias ``pb_r``) matching the changed row."""
    pg = conn.dialect.name == "postgresql"
    read = {c: f"pb_r.{_q(conn, c)}" for c in tt.tasks.c.keys()}  # noqa: SIM118 (a ColumnCollection iterates columns)
    values = _values(conn, tt, read, tt.tasks)
    relation = _pg_qualified(conn, table) if pg else _table_sql(conn, table)
    reads = _pg_qualified(conn, tt.tasks) if pg else _table_sql(conn, tt.tasks)
    function, (insert_name, update_name) = related_names(index)
    values.update({
        "related": relation,
        "read": reads,
        "match": " AND ".join(f"pb_r.{_q(conn, t)} = NEW.{_q(conn, r)}" for t, r in related.match),
        "change_kind": _change_kind(conn, [("status", c) for c in related.watch]),
        "insert_trigger": insert_name,
        "update_trigger": update_name,
    })
    if not pg:
        return values
    extra = _pg_values(conn, values, wake, relay_partitions, many=True)
    return {**values, **extra, "function": f"{extra['home']}.{function}"}


def _statements(conn: Connection, tt: TaskTable, target: sa.Table, wake: WakeMode,
                relay_partitions: int) -> tuple[list[str], dict[str, str]]:
    """The generated capture SQL (function and triggers, in order; then each related table's) and the main
    capture's placeholders."""
    values = _placeholders(conn, tt, target, wake, relay_partitions)
    dialect = conn.dialect.name
    pg = dialect == "postgresql"
    blocks = ("capture_function", "insert_trigger", "update_trigger") if pg else ("insert_trigger", "update_trigger")
    statements = [render(dialect, block, **values) for block in blocks]
    for index, (related, table) in enumerate(related_targets(conn, tt), start=1):
        rv = _related_placeholders(conn, tt, index, related, table, wake, relay_partitions)
        blocks = ("related_function", "related_insert_trigger", "related_update_trigger") if pg \
            else ("related_insert_trigger", "related_update_trigger")
        statements += [render(dialect, block, **rv) for block in blocks]
    return statements, values


def _functions(conn: Connection, tt: TaskTable, values: dict[str, str]) -> list[str]:
    """Every capture function the statements create (PostgreSQL): the main one, then each related table's."""
    home = values["function"].rsplit(".", 1)[0]
    return [values["function"], *(f"{home}.{related_names(i)[0]}" for i in range(1, len(tt.mapping.related) + 1))]


def fingerprint(statements: list[str]) -> str:
    """The sha256 of the generated capture SQL: what the function's comment records."""
    return hashlib.sha256("\n;\n".join(statements).encode()).hexdigest()


def install_capture(conn: Connection, tt: TaskTable, *, wake: WakeMode = "adaptive", relay_partitions: int = 1) -> None:
    """(Re)create the capture triggers for the mapping (and its related tables), inside the caller's
    transaction."""
    if wake not in WAKE_MODES:
        raise ValueError(f"unknown wake mode {wake!r}")
    target = capture_target(conn, tt)
    related_targets(conn, tt)  # every related table checked before anything is dropped
    remove_capture(conn)
    statements, values = _statements(conn, tt, target, wake, relay_partitions)
    for statement in statements:
        conn.exec_driver_sql(statement)
    if conn.dialect.name == "postgresql":
        comment = f"{COMMENT_PREFIX} sha256:{fingerprint(statements)} wake:{wake} relay_partitions:{relay_partitions}"
        for function in _functions(conn, tt, values):
            conn.exec_driver_sql(render("postgresql", "revoke_function", function=function))
        conn.exec_driver_sql(render("postgresql", "comment_function", function=values["function"],
                                    comment=sql_literal(comment)))
        conn.exec_driver_sql(render("postgresql", "notify_capture_changed"))


def installed_triggers(conn: Connection) -> list[tuple[str, str]]:
    """``(trigger, table)`` for every capture trigger in the database (``pollbridge_capture_...``; a trigger
    of the user's own ``install_sql`` is the user's)."""
    rows = conn.exec_driver_sql(render(conn.dialect.name, "list_triggers")).all()
    return [(str(r[0]), str(r[1])) for r in rows]


def remove_capture(conn: Connection) -> list[str]:
    """Drop every capture trigger (wherever it is) and the capture functions. Never touches anything else."""
    dropped = []
    dialect = conn.dialect.name
    for name, table in installed_triggers(conn):
        if dialect == "postgresql":
            conn.exec_driver_sql(render(dialect, "drop_trigger", name=_q(conn, name), table=table))
        else:
            conn.exec_driver_sql(render(dialect, "drop_trigger", name=_q(conn, name)))
        dropped.append(name)
    if dialect == "postgresql":
        # Wherever an install put it (an older one: the current schema of its connection).
        for function in conn.exec_driver_sql(render(dialect, "list_functions")).scalars().all():
            conn.exec_driver_sql(render(dialect, "drop_function", function=str(function)))
        if dropped:  # an install that follows in the transaction notifies again: one notification at the commit
            conn.exec_driver_sql(render(dialect, "notify_capture_changed"))
    return dropped


def _present(conn: Connection, table: sa.Table) -> dict[str, Any]:
    """pollbridge's triggers on ``table``, by name (PostgreSQL rows: name, enabled, function, comment;
    SQLite rows: name, sql)."""
    if conn.dialect.name == "postgresql":
        rows = conn.execute(sa.text(render("postgresql", "capture_triggers_on")),
                            {"table": _pg_qualified(conn, table)}).all()
    else:
        master = f"{_q(conn, table.schema)}.sqlite_master" if table.schema else "sqlite_master"
        rows = conn.execute(sa.text(f"SELECT name, sql FROM {master} WHERE type = 'trigger' AND tbl_name = :table"),
                            {"table": table.name}).all()
    return {str(r.name): r for r in rows}


def capture_status(conn: Connection, tt: TaskTable, *, wake: WakeMode | None = None,
                   relay_partitions: int | None = None) -> tuple[bool, str]:
    """Whether the capture on the mapped task table (and on each related table) is installed, enabled and
    current (for doctor, preflight and the dual_write gate): one line, saying what to run when it is not.

    *Current* means the installed SQL is what the mapping and the ``[capture]`` settings generate now; a
    ``wake`` or ``relay_partitions`` not given is taken from what the installed function records."""
    try:
        target = capture_target(conn, tt)
        related = related_targets(conn, tt)
    except MappingMismatch as exc:
        return False, str(exc)
    pg = conn.dialect.name == "postgresql"
    prefix = target.schema + "." if target.schema and not pg else ""
    name = prefix + tt.mapping.table
    where: list[tuple[str, tuple[str, ...], dict[str, Any]]] = [(name, TRIGGER_NAMES, _present(conn, target))]
    for index, (r, table) in enumerate(related, start=1):
        where.append((f"{r.schema}.{r.table}" if r.schema else r.table, related_names(index)[1], _present(conn, table)))
    everything: list[Any] = []
    for on, names, present in where:
        missing = [n for n in names if n not in present]
        if missing:
            return False, f"capture trigger(s) missing on {on!r}: {', '.join(missing)}; run `pollbridge init`"
        if pg:
            # 'D': disabled; 'R': fires only while session_replication_role = replica, so not for the scheduler.
            disabled = [n for n in names if present[n].enabled in ("D", "R")]
            if disabled:
                return False, (f"capture trigger(s) disabled on {on!r}: {', '.join(disabled)} (changes are not "
                               "captured); run `pollbridge init` to re-create them enabled")
            if any(present[n].function != present[names[0]].function for n in names):
                return False, _outdated(on)
        everything += [present[n] for n in names]
    on_tables = f"{name!r}" + "".join(f", {w[0]!r}" for w in where[1:])
    if pg:
        main = where[0][2][TRIGGER_NAMES[0]]
        recorded = _COMMENT.match(str(main.comment or ""))
        mode = wake or (recorded.group(2) if recorded else "")
        if recorded is None or mode not in WAKE_MODES:
            return False, _outdated(name)
        statements, _ = _statements(conn, tt, target, mode, relay_partitions or int(recorded.group(3)))
        if fingerprint(statements) != recorded.group(1):
            return False, _outdated(name)
        return True, f"capture triggers installed on {on_tables} and current (wake-up: {mode})"
    statements, _ = _statements(conn, tt, target, "poll", 1)
    triggers = [s for s in statements if s.lstrip().upper().startswith("CREATE TRIGGER")]
    if [str(r.sql).strip() for r in everything] != [s.strip() for s in triggers]:
        return False, _outdated(name)
    return True, f"capture triggers installed on {on_tables} and current"


def _outdated(name: str) -> str:
    return (f"capture on {name!r} is outdated: it is not what the current mapping and [capture] settings generate "
            "(installed by an older pollbridge, or the mapping changed since); run `pollbridge init` to regenerate it")
