"""The event scheduler's SQL, built from the mapping: one named function per statement, each saying what it is for.

:meth:`EvaluatorQueries.build` builds the statements an :class:`~event_scheduler.evaluate.Evaluator` runs
for every batch once, from the :class:`~bridge.tasktable.tables.TaskTable` and the engine's dialect; the
statements whose text depends on per-call values (the lost-race recheck, the depth guard's move to review,
a shadow decision) are built by its methods. The evaluator only runs them: it builds no SQL itself.

Parameters: statements that take instance ids take them as ``ids``: an array (``= ANY``) on PostgreSQL, so
the SQL text is one whatever the number of ids (compiled once, prepared by the driver), an expanding ``IN``
elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect

from bridge.db.driver import DriverStatement
from bridge.db.engine import db_now
from bridge.db.schema import decisions, dispatch_log
from bridge.tasktable.dispatch import ReadyTask
from bridge.tasktable.queries import type_of_row
from bridge.tasktable.readiness import ready_predicate, ready_since
from bridge.tasktable.tables import TaskTable


def in_ids(column: sa.ColumnElement[Any], pg: bool) -> sa.ColumnElement[bool]:
    """``column`` is one of the ``ids`` parameter: ``= ANY(array)`` on PostgreSQL (one SQL text whatever
    the number of ids), an expanding ``IN`` elsewhere."""
    if pg:
        return column == sa.any_(sa.bindparam("ids", type_=postgresql.ARRAY(column.type)))
    return column.in_(sa.bindparam("ids", expanding=True))


def scope_hit(tt: TaskTable, scope: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """Whether the task row is in the evaluation's scope, given the scope document (JSONB, per instance
    id: ``{"w": 1}`` for the whole instance, else ``{"k": [task keys], "d": [task keys]}``: those tasks,
    and the tasks depending on one of the ``d`` keys). Binary searches in the document, per row."""
    entry = scope.op("->")(sa.cast(tt.col("instance_id"), sa.Text))
    key = sa.cast(tt.col("task_key"), sa.Text)
    if tt.mapping.dependency_mode == "json":
        deps = sa.func.array(sa.select(sa.func.json_array_elements_text(sa.cast(tt.col("depends_on"), sa.JSON)))
                             .correlate(tt.tasks).scalar_subquery())
    elif tt.mapping.dependency_mode == "keys":
        # A dependency's task key as the scope document holds it: the dependency rows' key text.
        edges = tt.mapping.edges
        assert tt.edges is not None and edges is not None and edges.task_key and edges.depends_on_key
        e = tt.edges.alias("pb_scope_edge")
        dep = tt.tasks.alias("pb_scope_dep")
        key_column = tt.mapping.dependency_key_column
        deps = sa.func.array(
            sa.select(sa.cast(tt.col("task_key", dep), sa.Text))
            .select_from(e.join(dep, sa.and_(tt.key_equal("instance_id", dep, tt.tasks),
                                             dep.c[key_column] == e.c[edges.depends_on_key])))
            .where(e.c[edges.task_key] == tt.tasks.c[key_column], *(e.c[m] == tt.tasks.c[m] for m in edges.match))
            .correlate_except(e, dep).scalar_subquery())
    else:
        assert tt.edges is not None and tt.mapping.edges is not None
        e = tt.edges.alias("pb_scope_edge")
        dep = tt.tasks.alias("pb_scope_dep")
        deps = sa.func.array(
            sa.select(sa.cast(tt.col("task_key", dep), sa.Text))
            .select_from(e.join(dep, tt.col("id", dep) == e.c[tt.mapping.edges.depends_on_id]))
            .where(e.c[tt.mapping.edges.task_id] == tt.col("id"))
            .correlate_except(e, dep).scalar_subquery())
    return sa.or_(
        entry.op("->>")(sa.literal("w", sa.Text)) == "1",
        entry.op("->")(sa.literal("k", sa.Text)).op("?", return_type=sa.Boolean)(key),
        entry.op("->")(sa.literal("d", sa.Text)).op("?|", return_type=sa.Boolean)(deps),
    )


def evaluation_statement(tt: TaskTable, pg: bool) -> sa.Select[Any]:
    """The evaluation: the live tasks of a batch of instances with their readiness, in one round trip.

    Parameters ``ids`` (the instance ids) and, on PostgreSQL, ``scope`` (the scope document of
    :func:`scope_hit`, as JSON text). One row per live task in scope (``live`` = 1) with ``ready``,
    ``ready_at`` (only for the ready ones), ``due_future`` (not due yet by the database clock) and what
    the timers need (``attempts``, ``max_attempts``, ``due_at``, ``updated_at`` where mapped); an instance
    without a live task in scope keeps one marker row (``live`` = 0; ``any_live`` says whether it has live
    tasks at all), so "finished, not unknown" comes with the same query: an instance without any row is
    unknown. On SQLite every live task is in scope. Ordered by task id."""
    # pb_base: every task of the instances, found through the instance index alone. OFFSET 0 keeps the
    # status condition out of this scan: with stale statistics PostgreSQL otherwise ANDs in a bitmap of
    # the status index, which reads every pending task of the table (O(pending) per evaluation).
    # An instance without a live task keeps one row (pb_rn = 1) as a marker: "finished, not unknown"
    # comes with the same query (an instance without any row is unknown).
    logical = [c for c in ("id", "instance_id", "task_key", "status", "depends_on", "due_at", "awaits_signal",
                           "signal_received_at", "updated_at", "attempts", "max_attempts") if tt.has(c)]
    if tt.instances is None and tt.has("workflow_type"):
        logical.append("workflow_type")
    # pb_in_scope: the live tasks this evaluation is about (see Scope); on SQLite every live task.
    is_live = tt.status_in("pending", "failed", "running")
    in_scope: sa.ColumnElement[Any] = sa.case((is_live, 1), else_=0)
    if pg:
        # The document parsed once (an uncorrelated scalar subquery is an InitPlan), never carried
        # per row: joined in, it travelled through the window sort (1,000 instances: a 500 MB sort).
        document = sa.select(sa.cast(sa.bindparam("scope", type_=sa.Text), postgresql.JSONB)).scalar_subquery()
        in_scope = sa.case((is_live, sa.case((scope_hit(tt, document), 1), else_=0)), else_=0)
    # Composite keys travel as their part columns (each selected once) and become text at the end.
    names = list(dict.fromkeys(name for c in logical for name in tt.mapping.columns.parts(c)))
    base = (
        sa.select(*(tt.tasks.c[name] for name in names),
                  sa.func.row_number().over(partition_by=tt.col("instance_id"), order_by=tt.col("id"))
                  .label("pb_rn"),
                  sa.func.max(sa.case((is_live, 1), else_=0))
                  .over(partition_by=tt.col("instance_id")).label("pb_any_live"),
                  in_scope.label("pb_in_scope"))
        .where(in_ids(tt.col("instance_id"), pg))
        .offset(0)
        .subquery("pb_base")
    )
    workflow_type = type_of_row(tt, base)
    # pb_eval: the live tasks with their readiness (and the instance marker rows); outer query: the
    # ready time, computed only for the rows found ready (a CASE branch is evaluated only when taken).
    # One statement, one round trip.
    inner = (
        sa.select(*(base.c[name] for name in names),
                  workflow_type.label("pb_workflow_type"),
                  # CASE evaluates in order: readiness only for the rows in scope.
                  sa.case((base.c.pb_in_scope == 0, 0), (ready_predicate(tt, base), 1), else_=0)
                  .label("pb_ready"),
                  # "Not due yet" by the database clock, the one readiness uses: the scheduler host's
                  # clock may disagree, and deciding with it could leave a task with neither a
                  # dispatch nor a timer.
                  (sa.case((tt.col("due_at", base) > db_now(tt.dialect_name), 1), else_=0) if tt.has("due_at")
                   else sa.literal(0)).label("pb_due_future"),
                  base.c.pb_in_scope.label("pb_live"), base.c.pb_any_live.label("pb_any_live"))
        .where(sa.or_(base.c.pb_in_scope == 1, base.c.pb_rn == 1))
        .subquery("pb_eval")
    )
    optional = [tt.col(c, inner).label(c) for c in ("attempts", "max_attempts", "due_at", "updated_at")
                if tt.has(c)]
    return (
        sa.select(
            tt.col("id", inner).label("task_id"), tt.col("instance_id", inner).label("instance_id"),
            tt.col("task_key", inner).label("task_key"), tt.col("status", inner).label("status"),
            inner.c.pb_workflow_type.label("workflow_type"), *optional, inner.c.pb_ready.label("ready"),
            inner.c.pb_due_future.label("due_future"), inner.c.pb_live.label("live"),
            inner.c.pb_any_live.label("any_live"),
            sa.case((inner.c.pb_ready == 1, ready_since(tt, inner)), else_=sa.null()).label("ready_at"),
        )
        .order_by(tt.col("id", inner))
    )


def in_flight_statement(tt: TaskTable) -> sa.Select[Any]:
    """Backpressure (``max_in_flight``): rows ``(workflow_type, count)`` of the dispatched and running
    tasks per workflow type. Read only when a type has a limit, once per dispatch round."""
    all_src, any_type = tt.workflow_type_source(tt.tasks)
    return (sa.select(any_type.label("workflow_type"), sa.func.count()).select_from(all_src)
            .where(tt.status_in("dispatched", "running")).group_by(any_type))


def depth_statement(pg: bool) -> sa.Select[Any]:
    """The depth guard: rows ``(instance_id, count)`` of the dispatches logged per instance, for the
    instances in the ``ids`` parameter (read once per instance, then counted in memory)."""
    return (sa.select(dispatch_log.c.instance_id, sa.func.count())
            .where(in_ids(dispatch_log.c.instance_id, pg))
            .group_by(dispatch_log.c.instance_id))


def still_pending_statement(tt: TaskTable, task_ids: Sequence[Any]) -> sa.Select[Any]:
    """After a lost race: the ids among ``task_ids`` still pending (their instances get a recheck timer)."""
    return sa.select(tt.col("id")).where(tt.col("id").in_(list(task_ids)), tt.status_in("pending"))


def review_statement(tt: TaskTable, task_id: Any) -> sa.Update:
    """The depth guard stops a task: pending → the mapping's review status (a compare-and-set on pending),
    with ``updated_at`` stamped by the database where mapped. Only for a mapping with a review status."""
    values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write("review")}
    if tt.has("updated_at"):
        values[tt.mapping.columns.updated_at or ""] = db_now(tt.dialect_name)
    return tt.tasks.update().where(tt.col("id") == task_id, tt.status_in("pending")).values(values)


def decision_statement(dialect_name: str, task: ReadyTask, trace_id: str | None) -> sa.Insert:
    """A shadow decision for ``task``, once per (task, attempt): a conflict on the unique key inserts
    nothing (rowcount 0)."""
    values: dict[str, Any] = {
        "task_id": str(task.task_id), "instance_id": task.instance_id, "workflow_type": task.workflow_type,
        "task_key": task.task_key, "attempt": task.attempt, "ready_at": task.ready_at,
        "decided_at": db_now(dialect_name), "trace_id": trace_id,
    }
    insert_fn = postgresql.insert if dialect_name == "postgresql" else sqlite.insert
    return insert_fn(decisions).values(values).on_conflict_do_nothing()


@dataclass(frozen=True)
class EvaluatorQueries:
    """The statements of one evaluator, built once from the mapping and the engine's dialect."""

    tables: TaskTable
    dialect_name: str
    #: :func:`evaluation_statement`.
    evaluation: sa.Select[Any]
    #: The evaluation straight through the driver on PostgreSQL (run hundreds of times a second; see
    #: :mod:`bridge.db.driver`).
    evaluation_run: DriverStatement
    #: :func:`in_flight_statement`.
    in_flight: sa.Select[Any]
    #: :func:`depth_statement`.
    depth: sa.Select[Any]

    @classmethod
    def build(cls, tt: TaskTable, dialect: Dialect) -> EvaluatorQueries:
        pg = dialect.name == "postgresql"
        evaluation = evaluation_statement(tt, pg)
        return cls(tables=tt, dialect_name=dialect.name, evaluation=evaluation,
                   evaluation_run=DriverStatement(evaluation, dialect), in_flight=in_flight_statement(tt),
                   depth=depth_statement(pg))

    @property
    def pg(self) -> bool:
        return self.dialect_name == "postgresql"

    def still_pending(self, task_ids: Sequence[Any]) -> sa.Select[Any]:
        """:func:`still_pending_statement`."""
        return still_pending_statement(self.tables, task_ids)

    def to_review(self, task_id: Any) -> sa.Update:
        """:func:`review_statement`."""
        return review_statement(self.tables, task_id)

    def decision(self, task: ReadyTask, trace_id: str | None) -> sa.Insert:
        """:func:`decision_statement`."""
        return decision_statement(self.dialect_name, task, trace_id)
