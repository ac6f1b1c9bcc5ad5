"""Readiness as SQL: the one definition both dispatch paths and every check use.

A task is *ready* when it is pending, every dependency is completed, its due time (if any) has
passed on the database clock and its awaited signal (if any) has arrived. A dependency that does
not exist (an unknown task key) is never completed, so it blocks: pollbridge never dispatches early.

``ready_since`` is when the last of those facts became true: the latest of the dependencies'
completion times, the due time, the signal time and (when mapped) the row's own ``updated_at``,
which stands for "when the task was created or re-pended". Latency is measured from it.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from bridge.db.engine import db_now
from bridge.tasktable.tables import TaskTable


def unmet_dependencies(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[bool]:
    """EXISTS a dependency of task row ``t`` that is not completed (or does not exist)."""
    completed = tt.statuses.completed
    dep = tt.tasks.alias("pb_dep")
    if tt.mapping.dependency_mode == "json":
        d = _json_keys(tt, t)
        # A scalar lookup by (instance, key): the only index it can use is the (instance_id, task_key)
        # one, so the plan cannot degrade into a scan of every completed task when statistics are stale.
        dep_status = _dependency_lookup(tt, t, dep, d, tt.col("status", dep))
        return sa.exists(sa.select(sa.literal(1)).select_from(d).where(dep_status.is_distinct_from(completed)))
    assert tt.edges is not None and tt.mapping.edges is not None
    e = tt.edges.alias("pb_edge")
    edge_task = e.c[tt.mapping.edges.task_id]
    edge_dep = e.c[tt.mapping.edges.depends_on_id]
    return sa.exists(
        sa.select(sa.literal(1))
        .select_from(e.outerjoin(dep, tt.col("id", dep) == edge_dep))
        .where(edge_task == tt.col("id", t), tt.col("status", dep).is_distinct_from(completed))
    )


def ready_predicate(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[bool]:
    """The full readiness condition for task row ``t``."""
    now = db_now(tt.dialect_name)
    clauses: list[sa.ColumnElement[bool]] = [tt.col("status", t) == tt.statuses.pending]
    if tt.has("due_at"):
        due = tt.col("due_at", t)
        clauses.append(sa.or_(due.is_(None), due <= now))
    if tt.has("awaits_signal"):
        clauses.append(
            sa.or_(tt.col("awaits_signal", t).is_(None), tt.col("signal_received_at", t).is_not(None))
        )
    clauses.append(~unmet_dependencies(tt, t))
    return sa.and_(*clauses)


def ready_since(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[Any]:
    """When the task's readiness began (``NULL`` if nothing records it)."""
    parts: list[sa.ColumnElement[Any]] = [latest_dependency_completion(tt, t)]
    for logical in ("due_at", "signal_received_at", "updated_at"):
        if tt.has(logical):
            parts.append(tt.col(logical, t))
    return greatest(tt.dialect_name, parts)


def greatest(dialect_name: str, parts: list[sa.ColumnElement[Any]]) -> sa.ColumnElement[Any]:
    """NULL-ignoring maximum of timestamps (PostgreSQL's GREATEST semantics on both dialects)."""
    if len(parts) == 1:
        return parts[0]
    if dialect_name == "postgresql":
        return sa.func.greatest(*parts)
    # SQLite's scalar max() returns NULL if any argument is NULL; '' sorts before any timestamp.
    return sa.type_coerce(
        sa.func.nullif(sa.func.max(*[sa.func.coalesce(p, "") for p in parts]), ""), sa.DateTime()
    )


def latest_dependency_completion(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[Any]:
    dep = tt.tasks.alias("pb_dep_done")
    completed_at = tt.col("completed_at", dep) if tt.has("completed_at") else None
    if completed_at is None:
        return sa.null()
    if tt.mapping.dependency_mode == "json":
        d = _json_keys(tt, t, name="pb_dep_key_done")
        q = sa.select(sa.func.max(_dependency_lookup(tt, t, dep, d, completed_at))).select_from(d)
    else:
        assert tt.edges is not None and tt.mapping.edges is not None
        e = tt.edges.alias("pb_edge_done")
        q = (
            sa.select(sa.func.max(completed_at))
            .select_from(e.join(dep, tt.col("id", dep) == e.c[tt.mapping.edges.depends_on_id]))
            .where(e.c[tt.mapping.edges.task_id] == tt.col("id", t))
        )
    return sa.type_coerce(q.scalar_subquery(), sa.DateTime(timezone=True))


def _dependency_lookup(tt: TaskTable, t: sa.FromClause, dep: sa.FromClause, d: Any,
                       column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """``column`` of the dependency named by key ``d.value`` in the same instance as ``t`` (NULL if none)."""
    return (
        sa.select(column)
        .select_from(dep)
        .where(tt.col("instance_id", dep) == tt.col("instance_id", t), tt.col("task_key", dep) == d.c.value)
        .correlate_except(dep)
        .scalar_subquery()
    )


def _json_keys(tt: TaskTable, t: sa.FromClause, name: str = "pb_dep_key") -> Any:
    column = tt.col("depends_on", t)
    if tt.dialect_name == "postgresql":
        fn = sa.func.json_array_elements_text(sa.cast(column, sa.JSON))
    else:
        fn = sa.func.json_each(column)
    return fn.table_valued("value").alias(name)
