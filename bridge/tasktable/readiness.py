"""Readiness as SQL: the one definition both dispatch paths and every check use.

A task is *ready* when it is pending, its dependencies satisfy its trigger rule (without mapped
rules: every dependency is completed, Airflow's ``all_success``), its due time (if any) has passed
on the database clock and its awaited signal (if any) has arrived. A dependency that does not exist
(an unknown task key) is never done, so it blocks: pollbridge never dispatches early.

Trigger rules (Airflow's names and meaning; a task without dependencies is ready whatever its rule;
an unknown rule is never satisfied): ``all_success``, ``all_done``, ``all_failed``, ``all_skipped``,
``one_success``, ``one_failed``, ``one_done``, ``none_failed``, ``none_failed_min_one_success``,
``none_skipped``, ``always``. ``failed`` counts every stored failure value (Airflow's
``upstream_failed`` too); done = completed, failed or skipped.

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
        if len(tt.statuses.of("completed")) == 1:
            dep_status = _dependency_lookup(tt, t, dep, d, tt.col("status", dep))
            return sa.exists(sa.select(sa.literal(1)).select_from(d).where(dep_status.is_distinct_from(completed)))
        done = _dependency_lookup(tt, t, dep, d, sa.case((tt.status_in("completed", table=dep), 1), else_=0))
        return sa.exists(sa.select(sa.literal(1)).select_from(d).where(sa.func.coalesce(done, 0) == 0))
    if tt.mapping.dependency_mode == "keys":
        deps, dep, where = _key_dependencies(tt, t, "pb_dep")
        return sa.exists(sa.select(sa.literal(1)).select_from(deps).where(
            where, sa.or_(tt.col("id", dep).is_(None), ~tt.status_in("completed", table=dep))))
    assert tt.edges is not None and tt.mapping.edges is not None
    e = tt.edges.alias("pb_edge")
    edge_task = e.c[tt.mapping.edges.task_id]
    edge_dep = e.c[tt.mapping.edges.depends_on_id]
    return sa.exists(
        sa.select(sa.literal(1))
        .select_from(e.outerjoin(dep, tt.col("id", dep) == edge_dep))
        .where(edge_task == tt.col("id", t),
               sa.or_(tt.col("id", dep).is_(None), ~tt.status_in("completed", table=dep)))
    )


def _key_dependencies(tt: TaskTable, t: sa.FromClause, name: str) -> tuple[sa.FromClause, Any, Any]:
    """``keys`` mode: the edges of task row ``t`` outer-joined to the dependency rows they name.

    Returns (from clause, dependency alias, condition on ``t``). A key that names no row yields one
    row whose dependency columns are NULL: a missing dependency is never done."""
    edges = tt.mapping.edges
    assert tt.edges is not None and edges is not None and edges.task_key and edges.depends_on_key
    e = tt.edges.alias(f"{name}_edge")
    dep = tt.tasks.alias(name)
    key_column = tt.mapping.dependency_key_column
    on = sa.and_(tt.key_equal("instance_id", dep, t), dep.c[key_column] == e.c[edges.depends_on_key])
    where = sa.and_(e.c[edges.task_key] == t.c[key_column], *(e.c[m] == t.c[m] for m in edges.match))
    return e.outerjoin(dep, on), dep, where


def _dependency_rows(tt: TaskTable, t: sa.FromClause, name: str) -> tuple[sa.FromClause, Any, Any, Any]:
    """Every dependency of task row ``t`` as rows (NULL dependency columns for a missing one), in any
    mode: (from clause, dependency alias, condition, rule column of the edge or ``None``)."""
    dep = tt.tasks.alias(name)
    if tt.mapping.dependency_mode == "json":
        d = _json_keys(tt, t, name=f"{name}_key")
        on = sa.and_(tt.key_equal("instance_id", dep, t), tt.col("task_key", dep) == d.c.value)
        return d.outerjoin(dep, on), dep, sa.true(), None
    edges = tt.mapping.edges
    assert tt.edges is not None and edges is not None
    if tt.mapping.dependency_mode == "keys":
        joined, dep, where = _key_dependencies(tt, t, name)
        edge = joined.left  # type: ignore[attr-defined]
        return joined, dep, where, edge.c[edges.rule] if edges.rule else None
    e = tt.edges.alias(f"{name}_edge")
    return (e.outerjoin(dep, tt.col("id", dep) == e.c[edges.depends_on_id]), dep,
            e.c[edges.task_id] == tt.col("id", t), e.c[edges.rule] if edges.rule else None)


def rule_satisfied(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[bool]:
    """Whether task row ``t``'s dependencies satisfy its trigger rule (see the module docstring)."""
    return rule_verdict(tt, t) == 1


def skip_predicate(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[bool]:
    """Whether pending task row ``t`` is to be skipped, as Airflow propagates a skip: every dependency is
    done, none failed, and its trigger rule can no longer hold (a join's side after a branch not taken,
    under ``all_success``). Only for a mapping with a ``skipped`` status; a dependency that failed leaves
    the task pending (Airflow's ``upstream_failed`` is the scheduler's own call, not pollbridge's)."""
    if not tt.statuses.of("skipped"):
        return sa.false()
    return sa.and_(tt.status_in("pending", table=t), rule_verdict(tt, t) == 2)


def rule_verdict(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[Any]:
    """1 when task row ``t``'s trigger rule holds, 2 when it cannot hold any more without a failure to
    blame (every dependency done, none failed: :func:`skip_predicate`), else 0.

    One correlated aggregate over the dependency rows: how many there are and how many are in each
    done state; the rule (the task's column, else its edges' rule, else ``all_success``) picks the test."""
    joined, dep, where, edge_rule = _dependency_rows(tt, t, "pb_rule_dep")
    exists = tt.col("id", dep).is_not(None)

    def count(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[Any]:
        return sa.func.coalesce(sa.func.sum(sa.case((sa.and_(exists, condition), 1), else_=0)), 0)

    n = sa.func.count()
    ok = count(tt.status_in("completed", table=dep))
    failed = count(tt.status_in("failed", table=dep))
    skipped = count(tt.status_in("skipped", table=dep)) if tt.statuses.of("skipped") else sa.literal(0)
    done = ok + failed + skipped
    parts: list[sa.ColumnElement[Any]] = []
    if tt.has("trigger_rule"):
        parts.append(tt.col("trigger_rule", t))
    if edge_rule is not None:
        parts.append(sa.func.max(edge_rule))
    parts.append(sa.literal("all_success", sa.String))
    rule = sa.func.coalesce(*parts) if len(parts) > 1 else parts[0]
    tests = {
        "all_success": ok == n,
        "all_done": done == n,
        "all_failed": failed == n,
        "all_skipped": skipped == n,
        "one_success": ok >= 1,
        "one_failed": failed >= 1,
        "one_done": (ok + failed) >= 1,
        "none_failed": sa.and_(done == n, failed == 0),
        "none_failed_min_one_success": sa.and_(done == n, failed == 0, ok >= 1),
        "none_skipped": sa.and_(done == n, skipped == 0),
        "always": sa.true(),
    }
    cannot = sa.case((sa.and_(done == n, failed == 0), 2), else_=0)
    verdict = sa.case((n == 0, 1), *((rule == name, sa.case((test, 1), else_=cannot)) for name, test in tests.items()),
                      else_=0)
    q = sa.select(verdict).select_from(joined).where(where)
    return q.correlate_except(joined).scalar_subquery()


def ready_predicate(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[bool]:
    """The full readiness condition for task row ``t``."""
    now = db_now(tt.dialect_name)
    clauses: list[sa.ColumnElement[bool]] = [tt.status_in("pending", table=t)]
    if tt.has("due_at"):
        due = tt.col("due_at", t)
        clauses.append(sa.or_(due.is_(None), due <= now))
    if tt.has("awaits_signal"):
        clauses.append(
            sa.or_(tt.col("awaits_signal", t).is_(None), tt.col("signal_received_at", t).is_not(None))
        )
    clauses.append(rule_satisfied(tt, t) if tt.has_rules else ~unmet_dependencies(tt, t))
    return sa.and_(*clauses)


def ready_since(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[Any]:
    """When the task's readiness began (``NULL`` if nothing records it)."""
    parts: list[sa.ColumnElement[Any]] = [latest_dependency_completion(tt, t)]
    # committed_at floors the ready time at the commit of the row's own latest change (and, in
    # latest_dependency_completion, of each dependency's): an engine that stamps completed_at before it commits
    # would otherwise make a task look ready for longer than anyone could have seen it.
    for logical in ("due_at", "signal_received_at", "updated_at", "committed_at"):
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
    """The latest completion time of the task's dependencies (each floored at its row's ``committed_at``
    where mapped)."""
    dep = tt.tasks.alias("pb_dep_done")
    completed_at = _completion(tt, dep)
    if completed_at is None:
        return sa.null()
    if tt.mapping.dependency_mode == "json":
        d = _json_keys(tt, t, name="pb_dep_key_done")
        q = sa.select(sa.func.max(_dependency_lookup(tt, t, dep, d, completed_at))).select_from(d)
    elif tt.mapping.dependency_mode == "keys":
        joined, dep_done, where = _key_dependencies(tt, t, "pb_dep_done")
        done_at = _completion(tt, dep_done)
        assert done_at is not None
        q = (sa.select(sa.func.max(done_at)).select_from(joined).where(where)
             .correlate_except(joined))
    else:
        assert tt.edges is not None and tt.mapping.edges is not None
        e = tt.edges.alias("pb_edge_done")
        q = (
            sa.select(sa.func.max(completed_at))
            .select_from(e.join(dep, tt.col("id", dep) == e.c[tt.mapping.edges.depends_on_id]))
            .where(e.c[tt.mapping.edges.task_id] == tt.col("id", t))
        )
    return sa.type_coerce(q.scalar_subquery(), sa.DateTime(timezone=True))


def _completion(tt: TaskTable, dep: sa.FromClause) -> sa.ColumnElement[Any] | None:
    """A dependency row's completion time, floored at its ``committed_at`` where that is mapped."""
    if not tt.has("completed_at"):
        return None
    if not tt.has("committed_at"):
        return tt.col("completed_at", dep)
    return greatest(tt.dialect_name, [tt.col("completed_at", dep), tt.col("committed_at", dep)])


def _dependency_lookup(tt: TaskTable, t: sa.FromClause, dep: sa.FromClause, d: Any,
                       column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """``column`` of the dependency named by key ``d.value`` in the same instance as ``t`` (NULL if none)."""
    return (
        sa.select(column)
        .select_from(dep)
        .where(tt.key_equal("instance_id", dep, t), tt.col("task_key", dep) == d.c.value)
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
