"""The event scheduler's SQL, built from the mapping: one named function per statement, each saying what it is for.

:meth:`EvaluatorQueries.build` builds the statements an :class:`~event_scheduler.evaluate.Evaluator` runs
for every batch once, from the :class:`~bridge.tasktable.tables.TaskTable` and the engine's dialect; the
statements whose text depends on per-call values (the lost-race recheck, a shadow decision) are built by its
methods. The evaluator only runs them: it builds no SQL itself. The
statements that write the task table for timers (a retry's re-pend, a running timeout) are here too
(:func:`repend_statement`, :func:`time_out_statement`), run by the scheduler only on the dispatching route.

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
from bridge.db.engine import db_now, millis_between
from bridge.db.schema import decisions, dispatch_log, holds
from bridge.tasktable.dispatch import ReadyTask, dispatch_values
from bridge.tasktable.queries import in_flight_statement, in_ids, spawn_depth_statement, type_of_row
from bridge.tasktable.readiness import (
    greatest,
    latest_dependency_completion,
    ready_predicate,
    ready_since,
    skip_predicate,
)
from bridge.tasktable.review import parked, review_state
from bridge.tasktable.tables import TaskTable

#: The statuses a task the legacy scheduler took is in afterwards: in a shadow phase its decision is still
#: owed when the event that made it ready is evaluated after the take (a lost race). Skipped is not one of
#: them: a skipped task was never dispatched (a branch not taken), so no decision is owed for it.
TAKEN_STATUSES = ("dispatched", "running", "completed", "failed")

#: How much earlier than its readiness facts a taken task may have left pending and still count as taken
#: *because of* them: the legacy scheduler's dispatch time and a dependency's completion time may come
#: from different hosts' clocks (a foreign scheduler's workers stamp the completion themselves).
TAKEN_CLOCK_SKEW_MS = 1000.0


def instance_in_ids(tt: TaskTable, pg: bool, table: sa.FromClause | None = None) -> sa.ColumnElement[bool]:
    """The task row's instance is one of the ``ids`` parameter (instance ids as text).

    A composite instance key (``["dag_id", "run_id"]``) is compared part by part on PostgreSQL: the ids
    are split back into their parts (``/`` between them, the last part takes the rest) and cast to the
    columns' types, so the index on the parts serves; comparing the joined text would read every row."""
    parts = tt.parts("instance_id", table)
    if not pg or len(parts) == 1:
        return in_ids(tt.col("instance_id", table), pg)
    ids = (sa.func.unnest(sa.bindparam("ids", type_=postgresql.ARRAY(sa.Text))).table_valued("value")
           .render_derived(name="pb_ids"))
    text = ids.c.value
    split: list[sa.ColumnElement[Any]] = [sa.func.split_part(text, "/", i + 1) for i in range(len(parts) - 1)]
    split.append(sa.func.regexp_replace(text, f"^([^/]*/){{{len(parts) - 1}}}", ""))
    typed = [sa.cast(value, column.type) for value, column in zip(split, parts, strict=True)]
    return sa.tuple_(*parts).in_(sa.select(*typed).select_from(ids))


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
                           "signal_received_at", "updated_at", "attempts", "max_attempts", "depth") if tt.has(c)]
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
    names = list(dict.fromkeys([*(name for c in logical for name in tt.mapping.columns.parts(c)),
                                *tt.readiness_columns()]))
    base = (
        sa.select(*(tt.tasks.c[name] for name in names),
                  sa.func.row_number().over(partition_by=tt.col("instance_id"), order_by=tt.col("id"))
                  .label("pb_rn"),
                  sa.func.max(sa.case((is_live, 1), else_=0))
                  .over(partition_by=tt.col("instance_id")).label("pb_any_live"),
                  in_scope.label("pb_in_scope"))
        .where(instance_in_ids(tt, pg))
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
                  base.c.pb_in_scope.label("pb_live"), base.c.pb_any_live.label("pb_any_live"),
                  # A skip to propagate (a mapping with a skipped status only; evaluated for in-scope rows).
                  (sa.case((base.c.pb_in_scope == 0, 0), (skip_predicate(tt, base), 1), else_=0)
                   if tt.statuses.of("skipped") else sa.literal(0)).label("pb_skip"))
        .where(sa.or_(base.c.pb_in_scope == 1, base.c.pb_rn == 1))
        .subquery("pb_eval")
    )
    optional = [tt.col(c, inner).label(c) for c in ("attempts", "max_attempts", "due_at", "updated_at", "depth")
                if tt.has(c)]
    # The review queue's word on a ready task (an index probe, only for the ready rows): 1 parked (no path
    # dispatches it), 2 released by a person (exempt from the guards), NULL neither.
    optional.append(sa.case((inner.c.pb_ready == 1, review_state(tt.col("id", inner))), else_=sa.null())
                    .label("review_state"))
    # The dispatch-count guard's count for the instance of a ready task (an index probe, only for the ready
    # rows): a round trip of its own per new instance otherwise, one in five of a trickle's transactions.
    optional.append(sa.case((inner.c.pb_ready == 1, dispatches_of(tt.key_text("instance_id", inner))),
                            else_=sa.null()).label("dispatches"))
    return (
        sa.select(
            tt.col("id", inner).label("task_id"), tt.col("instance_id", inner).label("instance_id"),
            tt.col("task_key", inner).label("task_key"), tt.col("status", inner).label("status"),
            inner.c.pb_workflow_type.label("workflow_type"), *optional, inner.c.pb_ready.label("ready"),
            inner.c.pb_due_future.label("due_future"), inner.c.pb_live.label("live"),
            inner.c.pb_any_live.label("any_live"), inner.c.pb_skip.label("skip"),
            sa.case((inner.c.pb_ready == 1, ready_since(tt, inner)), else_=sa.null()).label("ready_at"),
        )
        .order_by(tt.col("id", inner))
    )


def evaluate_and_dispatch_statement(tt: TaskTable) -> sa.Select[Any]:
    """PostgreSQL: the evaluation (:func:`evaluation_statement`) and, in the same statement, the dispatch of the
    ready tasks whose dispatch needs no decision in Python: one round trip and one transaction where the
    evaluation and the compare-and-set took two of each (issue 20: at 2 to 100 completions/s with triggers, 4
    transactions per completion became 3).

    An instance's ready tasks are *picked* here only all together, and only when each of them could not be
    held back or parked by the evaluator's Python path (:meth:`event_scheduler.evaluate.Evaluator._act`): its
    type is one of ``pb_types`` (the evaluator lists the types on the dispatching route for every instance of
    the batch and without an admission limit, ``max_in_flight`` or ``rate``), it is not parked for review, its
    depth (the mapped ``depth`` column, NULL as 0) is within the type's ``pb_max_depth`` unless a person
    released it, and the instance's dispatches so far (the larger of the dispatch log's count and the
    evaluator's own, ``pb_count_ids``/``pb_counts``) plus its ready tasks stay within ``pb_max_dispatches``.
    Any other instance's ready tasks are left to the Python path, which guards, holds and dispatches them as
    before: this statement never decides what the evaluator would not have decided.

    The picked tasks go through the same compare-and-set as :func:`bridge.tasktable.dispatch.dispatch_many`
    (pending and ready when written, not parked; as in any statement under READ COMMITTED, the row itself is
    read again when written, and the rest of its readiness, its dependencies and the review queue, as of the
    statement's start: here the start of the evaluation, a few milliseconds before the write, where
    ``dispatch_many`` starts after the evaluation) and their winners into the dispatch log (path ``events``,
    the instance's trace id from the JSON document ``pb_traces``), all in this one statement, so it is atomic
    in autocommit. Parameters: the evaluation's (``ids``, ``scope``) and the ``pb_`` ones above, arrays of the
    same length per group. Rows: the evaluation's, plus ``picked`` (1: this statement tried to dispatch the
    task) and ``won`` (1: it did). Not built for a mapping whose depth comes from a ``spawned_by`` chain (the
    Python path reads that with a query of its own)."""
    t = tt.tasks
    ev = evaluation_statement(tt, True).cte("pb_ev")
    array = postgresql.ARRAY
    limits = (sa.func.unnest(sa.bindparam("pb_types", type_=array(sa.Text)),
                             # BIGINT: a limit has no upper bound (a flag may set 1e10).
                             sa.bindparam("pb_max_depth", type_=array(sa.BigInteger)),
                             sa.bindparam("pb_max_dispatches", type_=array(sa.BigInteger)))
              .table_valued(sa.column("workflow_type", sa.Text), sa.column("max_depth", sa.BigInteger),
                            sa.column("max_dispatches", sa.BigInteger))
              .render_derived(name="pb_limits"))
    counts = (sa.func.unnest(sa.bindparam("pb_count_ids", type_=array(sa.Text)),
                             sa.bindparam("pb_counts", type_=array(sa.Integer)))
              .table_valued(sa.column("instance_id", sa.Text), sa.column("n", sa.Integer))
              .render_derived(name="pb_counts"))
    instance_text = sa.cast(ev.c.instance_id, sa.Text)
    # NULL-free: bool_and skips NULLs, so an unknown must count as "not ok", never vanish.
    released = sa.func.coalesce(ev.c.review_state, 0) == 2
    ok: list[sa.ColumnElement[bool]] = [limits.c.workflow_type.is_not(None),
                                        sa.or_(ev.c.review_state.is_(None), released)]
    if tt.has("depth"):
        ok.append(sa.or_(released, sa.func.coalesce(ev.c.depth, 0) <= limits.c.max_depth))
    before = sa.func.greatest(sa.func.coalesce(ev.c.dispatches, 0), sa.func.coalesce(counts.c.n, 0))
    ready = (
        sa.select(ev.c.task_id, instance_text.label("instance_id"), ev.c.task_key, ev.c.workflow_type,
                  (ev.c.attempts + 1 if tt.has("attempts") else sa.null()).label("attempt"), ev.c.ready_at,
                  sa.func.bool_and(sa.func.coalesce(sa.and_(*ok), False)).over(partition_by=ev.c.instance_id)
                  .label("pb_all_ok"),
                  (before + sa.func.count().over(partition_by=ev.c.instance_id)).label("pb_upto"),
                  # An instance's ready tasks may be of several types (a type column on the task row): each
                  # must stay within its own type's limit, so the smallest one counts.
                  sa.func.min(limits.c.max_dispatches).over(partition_by=ev.c.instance_id).label("pb_limit"))
        .select_from(ev.outerjoin(limits, limits.c.workflow_type == sa.cast(ev.c.workflow_type, sa.Text))
                     .outerjoin(counts, counts.c.instance_id == instance_text))
        .where(ev.c.ready == 1)
        .subquery("pb_ready")
    )
    pick = (sa.select(ready.c.task_id, ready.c.instance_id, ready.c.task_key, ready.c.workflow_type,
                      ready.c.attempt, ready.c.ready_at)
            .where(ready.c.pb_all_ok.is_(True), ready.c.pb_upto <= ready.c.pb_limit)
            .cte("pb_pick"))
    now = db_now(tt.dialect_name)
    won = (
        t.update()
        .where(tt.col("id").in_(sa.select(pick.c.task_id)), ready_predicate(tt, t), sa.not_(parked(tt.col("id"))))
        .values(dispatch_values(tt, now))
        .returning(tt.col("id").label("id"))
        .cte("pb_won")
    )
    traces = sa.select(sa.cast(sa.bindparam("pb_traces", type_=sa.Text), postgresql.JSONB)).scalar_subquery()
    logged = (
        dispatch_log.insert()
        .from_select(["task_id", "instance_id", "workflow_type", "task_key", "attempt", "path", "ready_at",
                      "dispatched_at", "trace_id"],
                     sa.select(sa.cast(pick.c.task_id, sa.Text), pick.c.instance_id, pick.c.workflow_type,
                               sa.cast(pick.c.task_key, sa.Text), pick.c.attempt, sa.literal("events", sa.String),
                               pick.c.ready_at, now, traces.op("->>")(pick.c.instance_id))
                     .select_from(pick.join(won, won.c.id == pick.c.task_id)))
        .returning(dispatch_log.c.task_id)
        .cte("pb_logged")
    )
    return (
        sa.select(*ev.c, sa.case((pick.c.task_id.is_not(None), 1), else_=0).label("picked"),
                  sa.case((won.c.id.is_not(None), 1), else_=0).label("won"))
        .select_from(ev.outerjoin(pick, pick.c.task_id == ev.c.task_id).outerjoin(won, won.c.id == ev.c.task_id))
        .add_cte(logged)
        .order_by(ev.c.task_id)
    )


def dispatches_of(instance_id: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """The dispatches logged for the instance whose id (as text) is ``instance_id``: a scalar subquery."""
    return (sa.select(sa.func.count()).select_from(dispatch_log)
            .where(dispatch_log.c.instance_id == instance_id).scalar_subquery())


def dispatch_count_statement(pg: bool) -> sa.Select[Any]:
    """The dispatch-count guard: rows ``(instance_id, count)`` of the dispatches logged per instance, for the
    instances in the ``ids`` parameter (read once per instance, then counted in memory)."""
    return (sa.select(dispatch_log.c.instance_id, sa.func.count())
            .where(in_ids(dispatch_log.c.instance_id, pg))
            .group_by(dispatch_log.c.instance_id))


def hold_statement(dialect_name: str) -> sa.Insert:
    """Record backpressure holds (executemany rows ``task_id, instance_id, workflow_type, task_key, attempt,
    reason, holder`` and ``pb_wait``: seconds until the holder looks again; on SQLite the text of a date
    modifier, ``"+1.000 seconds"``): a new hold starts at the database's now, a renewed one keeps its start;
    ``until`` is the database's now plus the wait, by the same clock the poller and the reconciler compare it
    with (a host clock behind the database's would make every hold look stale at once). A hold of an earlier
    attempt, or one already released, starts again. ``RETURNING`` makes the driver send a batch of rows as one
    multi-row statement (SQLAlchemy's "insertmanyvalues"), not a statement per row."""
    insert_fn = postgresql.insert if dialect_name == "postgresql" else sqlite.insert
    if dialect_name == "postgresql":
        until: sa.ColumnElement[Any] = sa.func.clock_timestamp() + sa.func.make_interval(
            0, 0, 0, 0, 0, 0, sa.bindparam("pb_wait", type_=sa.Float))
    else:
        until = sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", sa.bindparam("pb_wait", type_=sa.String))
    stmt = insert_fn(holds).values(held_at=db_now(dialect_name), until=until)
    fresh = sa.or_(holds.c.released_at.is_not(None),
                   holds.c.attempt.is_distinct_from(stmt.excluded.attempt))
    return stmt.on_conflict_do_update(index_elements=[holds.c.task_id], set_={
        "held_at": sa.case((fresh, stmt.excluded.held_at), else_=holds.c.held_at),
        "instance_id": stmt.excluded.instance_id, "workflow_type": stmt.excluded.workflow_type,
        "task_key": stmt.excluded.task_key, "attempt": stmt.excluded.attempt, "reason": stmt.excluded.reason,
        "until": stmt.excluded.until, "holder": stmt.excluded.holder, "released_at": sa.null()}
    ).returning(holds.c.task_id)


def release_holds_statement(dialect_name: str, pg: bool) -> sa.Update:
    """The holds of the tasks in the ``ids`` parameter (task ids as text) end: their holder dispatched them."""
    return (holds.update().where(in_ids(holds.c.task_id, pg), holds.c.released_at.is_(None))
            .values(released_at=db_now(dialect_name)))


def still_pending_statement(tt: TaskTable, task_ids: Sequence[Any]) -> sa.Select[Any]:
    """After a lost race: the ids among ``task_ids`` still pending (their instances get a recheck timer)."""
    return sa.select(tt.col("id")).where(tt.col("id").in_(list(task_ids)), tt.status_in("pending"))


def decision_statement(dialect_name: str, task: ReadyTask, trace_id: str | None) -> sa.Insert:
    """A shadow decision for ``task``, once per (task, attempt): a conflict on the unique key inserts
    nothing (rowcount 0). Without an attempt (a mapping without an attempts column) the unique key cannot
    see a conflict (NULLs are distinct), so the insert then carries its own NOT EXISTS: a task left pending
    by the legacy scheduler is evaluated again and again, and must still be decided once."""
    values: dict[str, Any] = {
        "task_id": str(task.task_id), "instance_id": task.instance_id, "workflow_type": task.workflow_type,
        "task_key": task.task_key, "attempt": task.attempt, "ready_at": task.ready_at,
        "decided_at": db_now(dialect_name), "trace_id": trace_id,
    }
    insert_fn = postgresql.insert if dialect_name == "postgresql" else sqlite.insert
    if task.attempt is not None:
        return insert_fn(decisions).values(values).on_conflict_do_nothing()
    names = list(values)
    literals = [v if isinstance(v, sa.ColumnElement) else sa.literal(v, decisions.c[k].type)
                for k, v in values.items()]
    already = sa.exists().where(decisions.c.task_id == str(task.task_id), decisions.c.attempt.is_(None))
    return insert_fn(decisions).from_select(names, sa.select(*literals).where(~already))


def decisions_statement(tasks: Sequence[tuple[ReadyTask, str | None]]) -> sa.Insert:
    """PostgreSQL: the shadow decisions of ``(task, trace id)`` pairs that all have an attempt, in one statement
    (atomic on its own, so it runs on the evaluation's autocommit connection: no transaction, no pool checkout
    of its own), once per (task, attempt) as :func:`decision_statement`. Returns ``task_id`` and ``attempt``
    of the decisions it recorded (a conflict, one recorded before, returns nothing)."""
    rows = [{"task_id": str(task.task_id), "instance_id": task.instance_id, "workflow_type": task.workflow_type,
             "task_key": task.task_key, "attempt": task.attempt, "ready_at": task.ready_at,
             "decided_at": db_now("postgresql"), "trace_id": trace_id} for task, trace_id in tasks]
    return (postgresql.insert(decisions).values(rows).on_conflict_do_nothing()
            .returning(decisions.c.task_id, decisions.c.attempt))


def taken_attempt(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[Any]:
    """The attempt a taken task row ``t`` (see :data:`TAKEN_STATUSES`) is in, as the dispatch that took it
    would have logged it (pending attempts + 1).

    ``attempt_moves = "claim"`` (the reference: a worker's claim increments the counter): a task still
    dispatched is at attempts + 1, one that a worker claimed (running, completed, failed) at attempts.
    ``"dispatch"`` (Airflow's try_number): the dispatch itself incremented it, so attempts. NULL without
    an attempts column."""
    if not tt.has("attempts"):
        return sa.null()
    attempts = tt.col("attempts", t)
    if tt.mapping.attempt_moves == "dispatch":
        return attempts
    return sa.case((tt.status_in("dispatched", table=t), attempts + 1), else_=attempts)


def _json_dependency_keys(tt: TaskTable, t: sa.FromClause) -> Any:
    column = tt.col("depends_on", t)
    fn = (sa.func.json_array_elements_text(sa.cast(column, sa.JSON)) if tt.dialect_name == "postgresql"
          else sa.func.json_each(column))
    return fn.table_valued("value").alias("pb_taken_key")


def depends_on_any(tt: TaskTable, t: sa.FromClause, pairs: sa.BindParameter[Any]) -> sa.ColumnElement[bool]:
    """Task row ``t`` depends on one of the tasks named in ``pairs`` (an expanding parameter of
    ``(instance id, task key)`` tuples, as text), in any dependency mode."""
    if tt.mapping.dependency_mode == "json":
        d = _json_dependency_keys(tt, t)
        return sa.exists(sa.select(sa.literal(1)).select_from(d).where(
            sa.tuple_(tt.key_text("instance_id", t), sa.cast(d.c.value, sa.String)).in_(pairs)))
    edges = tt.mapping.edges
    assert tt.edges is not None and edges is not None
    e = tt.edges.alias("pb_taken_edge")
    dep = tt.tasks.alias("pb_taken_dep")
    named = sa.tuple_(tt.key_text("instance_id", dep), tt.key_text("task_key", dep)).in_(pairs)
    if tt.mapping.dependency_mode == "keys":
        assert edges.task_key and edges.depends_on_key
        key_column = tt.mapping.dependency_key_column
        return sa.exists(
            sa.select(sa.literal(1))
            .select_from(e.join(dep, sa.and_(tt.key_equal("instance_id", dep, t),
                                             dep.c[key_column] == e.c[edges.depends_on_key])))
            .where(e.c[edges.task_key] == t.c[key_column], *(e.c[m] == t.c[m] for m in edges.match), named))
    return sa.exists(
        sa.select(sa.literal(1))
        .select_from(e.join(dep, tt.col("id", dep) == e.c[edges.depends_on_id]))
        .where(e.c[edges.task_id] == tt.col("id", t), named))


def taken_statement(tt: TaskTable, pg: bool) -> sa.Select[Any]:
    """Shadow phases: the lost races. Tasks the legacy scheduler took (a status of :data:`TAKEN_STATUSES`)
    before the event path evaluated the event that made them ready, and whose shadow decision is still owed.

    The event path decides on the facts the events carry, not on the row's status at evaluation time: a
    task counts when an event of this batch concerns it (parameter ``fresh``: ``(instance id, task key)``
    of tasks whose own event said they were pending: inserted, re-pended, due time or signal changed;
    parameter ``done``: tasks that reached a done status, whose dependents' readiness may have become
    true), its readiness holds as if it were still pending (the one readiness definition, applied to the
    row with its status read as pending: dependencies by its rule, due time, signal; never early), it left
    pending no earlier than those facts became true (its dispatch time, else its ``updated_at``; an old
    dispatch by an earlier readiness is not this event's), and no decision was recorded for its attempt
    (:func:`taken_attempt`). Parameter ``ids``: the instances (as for the evaluation). On PostgreSQL the
    facts come as one parameter ``facts`` instead, the scope document of :func:`scope_hit` with ``fresh``
    as its ``k`` and ``done`` as its ``d`` keys (the same test: the task itself, or a task depending on one).

    Rows: ``task_id``, ``instance_id``, ``task_key``, ``workflow_type``, ``attempt``, ``ready_at`` (the
    latest of the facts; NULL when none is recorded: a root task's readiness time is its insert, which a
    taken row no longer shows)."""
    t = tt.tasks
    concerned: sa.ColumnElement[bool]
    if pg:
        # The facts as one scope document (parameter ``facts``: per instance id ``{"k": fresh task keys, "d":
        # done task keys}``), parsed once, so the SQL text is constant and the driver prepares it. With
        # expanding lists of pairs the text changed with every batch's size: measured beside Airflow, this
        # round trip took 6-9 ms, most of it SQLAlchemy's rendering and the server planning it afresh, against
        # 0.5 ms prepared.
        document = sa.select(sa.cast(sa.bindparam("facts", type_=sa.Text), postgresql.JSONB)).scalar_subquery()
        concerned = scope_hit(tt, document)
    else:
        fresh: sa.BindParameter[Any] = sa.bindparam("fresh", expanding=True)
        done: sa.BindParameter[Any] = sa.bindparam("done", expanding=True)
        concerned = sa.or_(sa.tuple_(tt.key_text("instance_id"), tt.key_text("task_key")).in_(fresh),
                           depends_on_any(tt, t, done))
    status_column = tt.mapping.columns.status
    pending = tt.statuses.of("pending")[0]
    as_pending = (sa.null() if pending is None else sa.literal(pending)).label(status_column)
    left_column = "dispatched_at" if tt.has("dispatched_at") else "updated_at" if tt.has("updated_at") else None
    # The row with its status read as pending, so ready_predicate (the one readiness definition) judges
    # the rest of its readiness; the attempt is computed from its real status.
    taken = (
        sa.select(*(as_pending if c.name == status_column else c for c in t.c),
                  taken_attempt(tt, t).label("pb_attempt"))
        .where(instance_in_ids(tt, pg), tt.status_in(*TAKEN_STATUSES), concerned)
        .subquery("pb_taken")
    )
    facts_parts: list[sa.ColumnElement[Any]] = [latest_dependency_completion(tt, taken)]
    for logical in ("due_at", "signal_received_at"):
        if tt.has(logical):
            facts_parts.append(tt.col(logical, taken))
    facts = greatest(tt.dialect_name, facts_parts)
    attempt = taken.c.pb_attempt
    conditions: list[sa.ColumnElement[bool]] = [ready_predicate(tt, taken)]
    if left_column is not None:
        left = tt.col(left_column, taken)
        conditions.append(left.is_not(None))
        conditions.append(sa.or_(facts.is_(None),
                                 millis_between(tt.dialect_name, facts, left) >= -TAKEN_CLOCK_SKEW_MS))
    decided = sa.exists().where(
        decisions.c.task_id == sa.cast(tt.col("id", taken), sa.String),
        sa.or_(decisions.c.attempt == attempt, sa.and_(attempt.is_(None), decisions.c.attempt.is_(None))))
    conditions.append(~decided)
    return (
        sa.select(tt.col("id", taken).label("task_id"), tt.key_text("instance_id", taken).label("instance_id"),
                  tt.key_text("task_key", taken).label("task_key"),
                  type_of_row(tt, taken).label("workflow_type"), attempt.label("attempt"),
                  facts.label("ready_at"))
        .where(*conditions)
        .order_by(tt.col("id", taken))
    )


def repend_statement(tt: TaskTable, task_id: Any, attempts: Any) -> sa.Update:
    """A retry: the failed task back to pending, a compare-and-set on (failed, the attempt the timer was
    armed for, attempts left), with ``updated_at`` stamped by the database where mapped. Run only on the
    dispatching route, and only when pollbridge owns retries."""
    values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write("pending")}
    if tt.has("updated_at"):
        values[tt.mapping.columns.updated_at or ""] = db_now(tt.dialect_name)
    return tt.tasks.update().where(tt.col("id") == task_id, tt.status_in("failed"), tt.col("attempts") == attempts,
                                   tt.col("attempts") < tt.col("max_attempts")).values(values)


def retry_owed_statement(tt: TaskTable, task_id: Any) -> sa.Select[Any]:
    """``(attempts, updated_at)`` of ``task_id`` (``updated_at`` NULL where not mapped) if it is failed with
    attempts left: no row if it is not (re-pended, or out of attempts)."""
    return sa.select(tt.col("attempts"), tt.col("updated_at") if tt.has("updated_at") else sa.null()).where(
        tt.col("id") == task_id, tt.status_in("failed"), tt.col("attempts") < tt.col("max_attempts"))


def time_out_statement(tt: TaskTable, task_id: Any, cutoff: Any) -> sa.Update:
    """A running timeout: the task running since before ``cutoff`` (by ``updated_at``, where mapped) to
    failed, with its completion and update times stamped. Run only on the dispatching route, and only
    when pollbridge owns retries and timeouts."""
    now = db_now(tt.dialect_name)
    values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write("failed")}
    for logical in ("completed_at", "updated_at"):
        if tt.has(logical):
            values[getattr(tt.mapping.columns, logical)] = now
    conditions = [tt.col("id") == task_id, tt.status_in("running")]
    if tt.has("updated_at"):
        conditions.append(tt.col("updated_at") <= cutoff)
    return tt.tasks.update().where(*conditions).values(values)


def running_since_statement(tt: TaskTable, task_id: Any) -> sa.Select[Any]:
    """``updated_at`` of ``task_id`` (NULL where not mapped) if it is running: no row if it is not."""
    return sa.select(tt.col("updated_at") if tt.has("updated_at") else sa.null()).where(
        tt.col("id") == task_id, tt.status_in("running"))


def instance_of_statement(tt: TaskTable, task_id: Any) -> sa.Select[Any]:
    """The instance id (as text) of ``task_id``: a timer armed without it still asks the router."""
    return sa.select(tt.key_text("instance_id")).where(tt.col("id") == task_id)


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
    #: :func:`evaluate_and_dispatch_statement` through the driver (PostgreSQL, and not for a depth from a
    #: ``spawned_by`` chain; else None).
    evaluate_and_dispatch_run: DriverStatement | None
    #: :func:`in_flight_statement`.
    in_flight: sa.Select[Any]
    #: :func:`dispatch_count_statement`.
    dispatch_count: sa.Select[Any]
    #: :func:`spawn_depth_statement` (a mapping with ``columns.spawned_by`` only).
    spawn_depth: sa.Select[Any] | None
    #: :func:`hold_statement`.
    hold: sa.Insert
    #: :func:`release_holds_statement`.
    release_holds: sa.Update
    #: :func:`taken_statement` (shadow phases only).
    taken: sa.Select[Any]
    #: The same through the driver on PostgreSQL (constant SQL text, prepared).
    taken_run: DriverStatement

    @classmethod
    def build(cls, tt: TaskTable, dialect: Dialect) -> EvaluatorQueries:
        pg = dialect.name == "postgresql"
        evaluation = evaluation_statement(tt, pg)
        taken = taken_statement(tt, pg)
        return cls(tables=tt, dialect_name=dialect.name, evaluation=evaluation,
                   evaluation_run=DriverStatement(evaluation, dialect),
                   evaluate_and_dispatch_run=DriverStatement(evaluate_and_dispatch_statement(tt), dialect)
                   if pg and (tt.has("depth") or not tt.has("spawned_by")) else None,
                   in_flight=in_flight_statement(tt),
                   dispatch_count=dispatch_count_statement(pg),
                   spawn_depth=spawn_depth_statement(tt, pg) if tt.has("spawned_by") else None,
                   hold=hold_statement(dialect.name), release_holds=release_holds_statement(dialect.name, pg),
                   taken=taken, taken_run=DriverStatement(taken, dialect))

    @property
    def pg(self) -> bool:
        return self.dialect_name == "postgresql"

    def still_pending(self, task_ids: Sequence[Any]) -> sa.Select[Any]:
        """:func:`still_pending_statement`."""
        return still_pending_statement(self.tables, task_ids)

    def decision(self, task: ReadyTask, trace_id: str | None) -> sa.Insert:
        """:func:`decision_statement`."""
        return decision_statement(self.dialect_name, task, trace_id)

    def decisions(self, tasks: Sequence[tuple[ReadyTask, str | None]]) -> sa.Insert:
        """:func:`decisions_statement` (PostgreSQL)."""
        return decisions_statement(tasks)
