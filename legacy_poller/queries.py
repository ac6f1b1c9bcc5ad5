"""The poller's SQL, built from the mapping and the flags: one named function per statement.

:class:`~legacy_poller.poller.LegacyPoller` keeps the scans it built per flag set and only runs them; the
flags' SQL filters they use are in :mod:`legacy_poller.routing`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from bridge.core.phases import Flag
from bridge.db.engine import db_ago, db_now
from bridge.tasktable.readiness import ready_predicate, ready_since
from bridge.tasktable.review import parked
from bridge.tasktable.tables import TaskTable
from legacy_poller.routing import owned_by_events, scan_filter, sweep_filter


def scan_statement(tt: TaskTable, mode: str, flags: Mapping[str, Flag], batch_size: int) -> sa.Select[Any] | None:
    """One poll (``mode`` ``"scan"``) or safety sweep (``"sweep"``): up to ``batch_size`` ready tasks the
    flags let it dispatch (oldest id first: ``task_id``, ``instance_id``, ``task_key``, ``workflow_type``,
    ``attempt``, ``ready_at``), each row carrying ``examined``, the count of pending rows the poll looks
    at (the types it still scans; for a sweep, the ``cutover`` types). An empty poll returns one row with
    the count and NULL task columns. ``None``: a sweep without a ``cutover`` type has nothing to do."""
    t = tt.tasks
    src, workflow_type = tt.workflow_type_source(t)
    routed = (sweep_filter if mode == "sweep" else scan_filter)(tt, t, workflow_type, flags)
    if mode == "sweep" and routed is None:
        return None  # no cutover type: nothing to sweep
    # The attempt a dispatch starts: attempts + 1 when a claim increments the counter (the reference);
    # the incremented value itself is written by the dispatch when the dispatch moves it (Airflow).
    attempt = (tt.col("attempts") + 1) if tt.has("attempts") else sa.null()
    # A task parked in the review queue waits for a person, whatever the phase (the dispatch's compare-and-set
    # would refuse it anyway; left in the scan it would fill the batch on every poll).
    where = sa.and_(ready_predicate(tt, t), sa.not_(parked(tt.col("id"))))
    if routed is not None:
        where = sa.and_(where, routed)
    ready = (
        sa.select(
            tt.col("id").label("task_id"),
            tt.col("instance_id").label("instance_id"),
            tt.col("task_key").label("task_key"),
            workflow_type.label("workflow_type"),
            attempt.label("attempt"),
            ready_since(tt, t).label("ready_at"),
        )
        .select_from(src)
        .where(where)
        .order_by(tt.col("id"))
        .limit(batch_size)
        .subquery("pb_ready")
    )
    # What a poll examines: the pending rows of the types it still scans (so the work cutover saves
    # shows in pollbridge_poller_rows_examined_total instead of being claimed).
    cutover = sorted(name for name, f in flags.items() if f.phase == "cutover")
    counted = tt.status_in("pending")
    count_src: sa.FromClause = t
    if cutover:
        count_src = src
        if mode == "sweep":
            counted = sa.and_(counted, workflow_type.in_(cutover))
        else:
            counted = sa.and_(counted, sa.or_(workflow_type.is_(None), workflow_type.not_in(cutover)))
    pending = (
        sa.select(sa.func.count().label("examined"))
        .select_from(count_src)
        .where(counted)
        .subquery("pb_pending")
    )
    return sa.select(pending.c.examined, *ready.c).select_from(pending.outerjoin(ready, sa.true()))


def repend_failed_statement(tt: TaskTable, flags: Mapping[str, Flag]) -> sa.Update:
    """The legacy scheduler's retry: every failed task with attempts left back to pending (``updated_at``
    stamped by the database where mapped), except those the event path owns by the flags (it retries them
    with its backoff). Needs the ``attempts`` and ``max_attempts`` columns."""
    values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write("pending")}
    if tt.has("updated_at"):
        values[tt.mapping.columns.updated_at or ""] = db_now(tt.dialect_name)
    where = [tt.status_in("failed"), tt.col("attempts") < tt.col("max_attempts")]
    owned = owned_by_events(tt, tt.tasks, flags)
    if owned is not None:  # the event scheduler retries those, with its backoff
        where.append(sa.not_(owned))
    return tt.tasks.update().where(*where).values(values)


def time_out_running_statement(tt: TaskTable, flags: Mapping[str, Flag], timeout: float) -> sa.Update:
    """The legacy scheduler's running timeout: every task running (by ``updated_at``) for longer than
    ``timeout`` seconds to failed, its completion and update times stamped by the database, except those
    the event path owns by the flags (its own timers time those out). Needs the ``updated_at`` column."""
    now = db_now(tt.dialect_name)
    values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write("failed")}
    for logical in ("completed_at", "updated_at"):
        if tt.has(logical):
            values[getattr(tt.mapping.columns, logical)] = now
    where = [tt.status_in("running"), tt.col("updated_at") <= db_ago(tt.dialect_name, timeout)]
    owned = owned_by_events(tt, tt.tasks, flags)
    if owned is not None:
        where.append(sa.not_(owned))
    return tt.tasks.update().where(*where).values(values)
