"""Change-data capture: triggers on the existing task table that write the outbox in the same transaction.

Generated from the mapping. One outbox row per *relevant* change: an insert, a status change, a
due-time change or a signal arrival (the ``WHEN`` clause keeps a no-op update, or an update of an
unmapped column, from even calling the trigger body). The row carries the task id, instance id,
workflow type, task key, old and new status, a fresh event id and trace id and the database clock.
The outbox id is the per-task version: changes to one task row are serialised by its row lock, so
a later change of the same task always gets a larger id.

Wake-up modes (PostgreSQL; SQLite has no NOTIFY and always probes):

* ``poll``: the trigger never notifies; the relay probes the outbox's partial index.
* ``notify``: ``pg_notify`` on every captured change (PostgreSQL folds duplicates, so at most one
  notification per transaction). NOTIFY serialises committing transactions on a cluster-wide lock.
* ``adaptive``: notify only while the relay is *armed*, which it is only after the outbox stayed
  empty for a while; under load the trigger reads one flag row and never notifies.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.core.settings import WAKE_MODES, WakeMode
from bridge.db.sqlblocks import render
from bridge.tasktable.tables import TaskTable

NOTIFY_CHANNEL = "pollbridge_outbox"
TRIGGER_NAMES = ("pollbridge_capture_insert", "pollbridge_capture_update")


def _q(conn: Connection, name: str) -> str:
    return conn.dialect.identifier_preparer.quote(name)


def _table_sql(conn: Connection, table: sa.Table) -> str:
    prep = conn.dialect.identifier_preparer
    return prep.format_table(table)


def _placeholders(conn: Connection, tt: TaskTable, wake: WakeMode, relay_partitions: int) -> dict[str, str]:
    cols = tt.mapping.columns
    def q(name: str) -> str:
        return _q(conn, name)

    pg = conn.dialect.name == "postgresql"
    if cols.workflow_type:
        type_expr = f"CAST(NEW.{q(cols.workflow_type)} AS TEXT)"
    else:
        inst = tt.mapping.instances
        assert inst is not None and tt.instances is not None
        type_expr = (f"(SELECT CAST(pb_i.{q(inst.workflow_type)} AS TEXT) FROM {_table_sql(conn, tt.instances)} pb_i "
                     f"WHERE pb_i.{q(inst.id)} = NEW.{q(cols.instance_id)})")
    distinct = "IS DISTINCT FROM" if pg else "IS NOT"
    watched = [("status", cols.status)]
    for kind, column in (("due", cols.due_at), ("signal", cols.signal_received_at), ("signal", cols.awaits_signal)):
        if column:
            watched.append((kind, column))
    changed = " OR ".join(f"OLD.{q(c)} {distinct} NEW.{q(c)}" for _, c in watched)
    change_kind = "CASE " + " ".join(f"WHEN OLD.{q(c)} {distinct} NEW.{q(c)} THEN '{k}'" for k, c in watched) + " END"
    partition_expr = "0"
    if pg and relay_partitions > 1:
        partition_expr = f"mod(hashtext(NEW.{q(cols.instance_id)}::text) & 2147483647, {int(relay_partitions)})"
    notify = ""
    if pg and wake == "notify":
        notify = render("postgresql", "notify_always")
    elif pg and wake == "adaptive":
        notify = render("postgresql", "notify_when_armed", partition_expr=partition_expr)
    return {
        "table": _table_sql(conn, tt.tasks),
        "id": q(cols.id),
        "instance_id": q(cols.instance_id),
        "task_key": q(cols.task_key),
        "status": q(cols.status),
        "type_expr": type_expr,
        "changed": changed if pg else f"({changed})",
        "change_kind": change_kind,
        "partition_expr": partition_expr,
        "notify": notify,
    }


def install_capture(conn: Connection, tt: TaskTable, *, wake: WakeMode = "adaptive", relay_partitions: int = 1) -> None:
    """(Re)create the capture triggers for the mapping, inside the caller's transaction."""
    if wake not in WAKE_MODES:
        raise ValueError(f"unknown wake mode {wake!r}")
    remove_capture(conn)
    values = _placeholders(conn, tt, wake, relay_partitions)
    dialect = conn.dialect.name
    if dialect == "postgresql":
        conn.exec_driver_sql(render(dialect, "capture_function", **values))
    for block in ("insert_trigger", "update_trigger"):
        conn.exec_driver_sql(render(dialect, block, **values))


def installed_triggers(conn: Connection) -> list[tuple[str, str]]:
    """``(trigger, table)`` for every pollbridge trigger in the database."""
    rows = conn.exec_driver_sql(render(conn.dialect.name, "list_triggers")).all()
    return [(str(r[0]), str(r[1])) for r in rows]


def remove_capture(conn: Connection) -> list[str]:
    """Drop every pollbridge trigger (wherever it is) and the capture function. Never touches anything else."""
    dropped = []
    dialect = conn.dialect.name
    for name, table in installed_triggers(conn):
        if dialect == "postgresql":
            conn.exec_driver_sql(render(dialect, "drop_trigger", name=_q(conn, name), table=table))
        else:
            conn.exec_driver_sql(render(dialect, "drop_trigger", name=_q(conn, name)))
        dropped.append(name)
    if dialect == "postgresql":
        conn.exec_driver_sql(render(dialect, "drop_function"))
    return dropped


def capture_status(conn: Connection, tt: TaskTable) -> tuple[bool, str]:
    """Whether both triggers are on the mapped task table (for doctor and preflight)."""
    present = {name for name, table in installed_triggers(conn)
               if table.strip('"').split(".")[-1].strip('"') == tt.tasks.name}
    missing = [n for n in TRIGGER_NAMES if n not in present]
    if missing:
        return False, f"capture trigger(s) missing on {tt.tasks.name!r}: {', '.join(missing)}; run `pollbridge init`"
    return True, f"capture triggers installed on {tt.tasks.name!r}"
