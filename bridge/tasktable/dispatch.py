"""The dispatch transition: the one compare-and-set both paths use (invariant 3).

Dispatch moves a task from *pending* to *dispatched* with one UPDATE whose WHERE clause repeats
the whole readiness condition. Two dispatchers racing for the same task therefore cannot both
win (the second finds the status changed), and a task whose readiness stopped holding between a
scan and its dispatch is not dispatched (invariant 2 is checked at the moment of the write, not
at the moment of the read). The winner records the dispatch in ``pollbridge_dispatch_log`` in
the same transaction, so the log and the task table never disagree. A task parked in the review queue
(:func:`bridge.tasktable.review.parked`) is never dispatched, by any path, until a person releases it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Dialect

from bridge.db.driver import DriverStatement
from bridge.db.engine import db_now
from bridge.db.schema import dispatch_log
from bridge.tasktable.readiness import ready_predicate, skip_predicate
from bridge.tasktable.review import parked
from bridge.tasktable.tables import TaskTable

Path = Literal["poller", "events", "fallback"]


@dataclass(frozen=True)
class ReadyTask:
    """A task a scan found ready, with what the dispatch log needs."""

    task_id: Any
    instance_id: str
    task_key: str
    workflow_type: str | None
    attempt: int | None
    ready_at: datetime | None


def dispatch_values(tt: TaskTable, now: Any) -> dict[str, Any]:
    """What a dispatch writes: the dispatched status, the dispatch and update times where mapped, and the
    mapping's extra columns (``[mapping.dispatch] set``: the database clock, or the column plus one)."""
    values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write("dispatched")}
    for logical in ("dispatched_at", "updated_at"):
        if tt.has(logical):
            values[getattr(tt.mapping.columns, logical)] = now
    for column, how in tt.mapping.dispatch_set:
        values[column] = now if how == "now" else tt.tasks.c[column] + 1
    return values


def written_columns(tt: TaskTable) -> tuple[str, ...]:
    """Every task-table column pollbridge may write on the dispatching route: the status, the dispatch,
    update and completion times where mapped (a dispatch, a skip, a retry, a timeout), the attempts where it
    re-pends, and the mapping's ``[mapping.dispatch] set`` columns."""
    cols = tt.mapping.columns
    names = [cols.status, *(getattr(cols, logical) for logical in ("dispatched_at", "updated_at", "completed_at")
                            if tt.has(logical))]
    names += [column for column, _how in tt.mapping.dispatch_set]
    return tuple(dict.fromkeys(names))


def write_blocker(conn: Connection, tt: TaskTable) -> str | None:
    """Why pollbridge's writes cannot reach the task table through the read relation (one line), or None.

    Without ``mapping.read_table`` the writes go to ``mapping.table`` itself. Through a view they reach the
    base tables only if the view is updatable for every written column: on PostgreSQL an automatically
    updatable view (``pg_column_is_updatable``, which does not look at triggers) or one with an
    enabled ``INSTEAD OF UPDATE`` trigger; on SQLite never, since SQLite does not report the rows an
    ``INSTEAD OF`` trigger wrote and the compare-and-set needs them."""
    m = tt.mapping
    if m.read_table is None or m.read_table == m.table:
        return None
    columns = written_columns(tt)
    if conn.dialect.name != "postgresql":
        return (f"pollbridge writes through mapping.read_table {m.read_table!r}, a view, and SQLite does not report "
                "the rows a view's INSTEAD OF trigger wrote: keep this mapping in polling or dual_write")
    prep = conn.dialect.identifier_preparer
    relation = f"{prep.quote_schema(m.schema)}.{prep.quote(m.read_table)}" if m.schema else prep.quote(m.read_table)
    blocked = list(conn.execute(sa.text(
        "SELECT a.attname FROM pg_catalog.pg_attribute a WHERE a.attrelid = pg_catalog.to_regclass(:relation) "
        "AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY(:columns) "
        "AND NOT pg_catalog.pg_column_is_updatable(a.attrelid, a.attnum, false) "
        # An enabled INSTEAD OF UPDATE row trigger (tgtype bits: 64 instead, 16 update) takes every column.
        "AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = a.attrelid "
        "AND (t.tgtype & 64) <> 0 AND (t.tgtype & 16) <> 0 AND t.tgenabled <> 'D') ORDER BY a.attnum"),
        {"relation": relation, "columns": list(columns)}).scalars())
    if blocked:
        return (f"pollbridge cannot write column(s) {', '.join(map(repr, blocked))} through mapping.read_table "
                f"{m.read_table!r} (a view that is not updatable there): give it an INSTEAD OF UPDATE trigger in "
                "your install_sql, or keep this mapping in polling or dual_write")
    return None


def dispatch_many(conn: Connection, tt: TaskTable, tasks: Sequence[ReadyTask], path: Path,
                  trace_ids: Mapping[str, str | None] | None = None) -> list[ReadyTask]:
    """Dispatch a batch inside the caller's transaction; return the tasks this call won.

    Two statements whatever the batch size: one compare-and-set UPDATE over all the ids (each row is
    still updated only if it is pending and ready at the moment it is written: a row another
    dispatcher changed first is re-checked against its new version and skipped), then one INSERT of
    the dispatch-log rows of the winners."""
    if not tasks:
        return []
    by_id = {task.task_id: task for task in tasks}
    traces = trace_ids or {}
    if tt.dialect_name == "postgresql":
        # One statement, one round trip: the UPDATE and the dispatch-log INSERT in a data-modifying
        # CTE, atomic as a statement even in autocommit mode. The batch travels as arrays, so the SQL
        # text is the same whatever the batch: compiled once, prepared by the driver.
        won_ids = set(_pg_dispatch_statement(tt, path, conn.dialect).scalars(conn, {
            "pb_ids": list(by_id),
            "pb_task_ids": [str(task.task_id) for task in tasks],
            "pb_instance_ids": [str(task.instance_id) for task in tasks],
            "pb_types": [task.workflow_type for task in tasks],
            "pb_keys": [task.task_key for task in tasks],
            "pb_attempts": [task.attempt for task in tasks],
            "pb_ready_ats": [task.ready_at for task in tasks],
            "pb_trace_ids": [traces.get(task.instance_id) for task in tasks],
        }))
        return [task for task in tasks if str(task.task_id) in won_ids]
    won = [by_id[task_id] for task_id in conn.execute(_dispatch_statement(tt), {"pb_ids": list(by_id)}).scalars()]
    if won:
        conn.execute(dispatch_log.insert().values(dispatched_at=db_now(tt.dialect_name)), [
            {"task_id": str(task.task_id), "instance_id": str(task.instance_id), "workflow_type": task.workflow_type,
             "task_key": task.task_key, "attempt": task.attempt, "path": path, "ready_at": task.ready_at,
             "trace_id": traces.get(task.instance_id)}
            for task in won
        ])
    return won


_T = TypeVar("_T")
_PG_STATEMENTS: dict[Any, tuple[TaskTable, DriverStatement]] = {}
_STATEMENTS: dict[Any, tuple[TaskTable, sa.Update]] = {}


def _cached(cache: dict[Any, tuple[TaskTable, _T]], key: Any, tt: TaskTable, build: Callable[[], _T]) -> _T:
    """``build()`` once per task table (and ``key``): the entry of a table that is gone is rebuilt, never reused
    (``id`` values are recycled), and the cache stays small when tables are reflected again and again (tests)."""
    hit = cache.get(key)
    if hit is not None and hit[0] is tt:
        return hit[1]
    value = build()
    if len(cache) >= 64:
        cache.clear()
    cache[key] = (tt, value)
    return value


def _dispatch_statement(tt: TaskTable) -> sa.Update:
    """The compare-and-set UPDATE of a batch (``:pb_ids``, expanding) on other dialects than PostgreSQL, built
    once per task table: building it per batch (the readiness predicate, its cache key) took longer than
    running it (measured on SQLite: milliseconds between the write transaction's BEGIN and the UPDATE, with the
    database's one write lock held)."""

    def build() -> sa.Update:
        t = tt.tasks
        return (
            t.update()
            .where(tt.col("id").in_(sa.bindparam("pb_ids", expanding=True)), ready_predicate(tt, t),
                   sa.not_(parked(tt.col("id"))))
            .values(dispatch_values(tt, db_now(tt.dialect_name)))
            .returning(tt.col("id"))
        )

    return _cached(_STATEMENTS, id(tt), tt, build)


def _pg_dispatch_statement(tt: TaskTable, path: Path, dialect: Dialect) -> DriverStatement:
    """The PostgreSQL batch dispatch for ``tt`` and ``path``, built once: the compare-and-set UPDATE over
    ``id = ANY(:pb_ids)`` and the dispatch-log INSERT of its winners, the batch's facts unnested from arrays."""
    return _cached(_PG_STATEMENTS, (id(tt), path), tt, lambda: _build_pg_dispatch(tt, path, dialect))


def _build_pg_dispatch(tt: TaskTable, path: Path, dialect: Dialect) -> DriverStatement:
    t = tt.tasks
    now = db_now(tt.dialect_name)
    values = dispatch_values(tt, now)
    ids = sa.bindparam("pb_ids", type_=postgresql.ARRAY(tt.col("id").type))
    won = (
        t.update()
        .where(tt.col("id") == sa.any_(ids), ready_predicate(tt, t), sa.not_(parked(tt.col("id"))))
        .values(values)
        .returning(tt.col("id").label("id"))
        .cte("pb_won")
    )

    def array(name: str, of: Any) -> Any:
        return sa.bindparam(name, type_=postgresql.ARRAY(of))

    facts = (
        sa.func.unnest(ids, array("pb_task_ids", sa.String), array("pb_instance_ids", sa.String),
                       array("pb_types", sa.String), array("pb_keys", sa.String), array("pb_attempts", sa.Integer),
                       array("pb_ready_ats", sa.DateTime(timezone=True)), array("pb_trace_ids", sa.String))
        .table_valued(sa.column("id"), sa.column("task_id", sa.String), sa.column("instance_id", sa.String),
                      sa.column("workflow_type", sa.String), sa.column("task_key", sa.String),
                      sa.column("attempt", sa.Integer), sa.column("ready_at", sa.DateTime(timezone=True)),
                      sa.column("trace_id", sa.String))
        .render_derived(name="pb_facts")
    )
    select_won = (
        sa.select(facts.c.task_id, facts.c.instance_id, facts.c.workflow_type, facts.c.task_key, facts.c.attempt,
                  sa.literal(path, sa.String), facts.c.ready_at, now, facts.c.trace_id)
        .select_from(won.join(facts, won.c.id == facts.c.id))
    )
    stmt = (
        dispatch_log.insert()
        .from_select(["task_id", "instance_id", "workflow_type", "task_key", "attempt", "path", "ready_at",
                      "dispatched_at", "trace_id"], select_won)
        .returning(dispatch_log.c.task_id)
    )
    # Run for every batch either path dispatches: straight through the driver (see bridge.db.driver).
    return DriverStatement(stmt, dialect)


def skip_many(conn: Connection, tt: TaskTable, task_ids: Sequence[Any]) -> list[Any]:
    """Propagate skips (:func:`~bridge.tasktable.readiness.skip_predicate`) inside the caller's transaction:
    one compare-and-set UPDATE that moves each still-pending row whose rule can no longer hold to the
    mapping's skipped status (its completion and update times stamped where mapped); returns the ids moved.
    Its captured change wakes the task's dependents, so a skip travels down a branch not taken."""
    if not task_ids:
        return []
    now = db_now(tt.dialect_name)
    values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write("skipped")}
    for logical in ("completed_at", "updated_at"):
        if tt.has(logical):
            values[getattr(tt.mapping.columns, logical)] = now
    stmt = (tt.tasks.update().where(tt.col("id").in_(list(task_ids)), skip_predicate(tt, tt.tasks))
            .values(values).returning(tt.col("id")))
    return list(conn.execute(stmt).scalars())


def dispatch(conn: Connection, tt: TaskTable, task: ReadyTask, path: Path, trace_id: str | None = None) -> bool:
    """Try to dispatch ``task`` inside the caller's transaction; ``True`` if this call won."""
    t = tt.tasks
    now = db_now(tt.dialect_name)
    values = dispatch_values(tt, now)
    stmt = (
        t.update()
        .where(tt.col("id") == task.task_id, ready_predicate(tt, t), sa.not_(parked(tt.col("id"))))
        .values(values)
    )
    if conn.execute(stmt).rowcount != 1:
        return False
    conn.execute(
        dispatch_log.insert().values(
            task_id=str(task.task_id),
            instance_id=str(task.instance_id),
            workflow_type=task.workflow_type,
            task_key=task.task_key,
            attempt=task.attempt,
            path=path,
            ready_at=task.ready_at,
            dispatched_at=now,
            trace_id=trace_id,
        )
    )
    return True
