"""Dispatch evidence of a scheduler pollbridge did not write (``[legacy] kind = "foreign"``).

pollbridge's own reference poller records each dispatch in ``pollbridge_dispatch_log`` (path ``poller``).
A foreign scheduler (Airflow, ...) records nothing there, yet the reconciler, ``status``, ``explain``, the
metrics and the guardian all read the log. Its dispatches are the captured transitions of the task table
into a dispatched status: an outbox row whose new status is one of the mapping's ``dispatched`` values and
whose old status is not (NULL, and an insert, count as not dispatched). :func:`record_foreign_dispatches`
writes one log row per such transition, path ``poller``:

* ``dispatched_at`` is the outbox row's ``created_at``: the database clock inside the scheduler's own
  transaction, so the dispatch time is the scheduler's, not the relay's;
* ``attempt`` is the outbox row's ``attempt`` (the mapped attempts column after the change), plus one when
  the attempts column moves at claim (``[mapping.dispatch] attempt_moves = "claim"``: a row just dispatched
  still holds the previous attempt's count), as is, when the dispatch itself moves it (``"dispatch"``:
  Airflow's ``try_number``). It is then the same number the event path records with its shadow decision
  (the pending row's attempts + 1), so both can be matched;
* ``ready_at`` is NULL. The relay does not see readiness facts, and reading them here (the dependencies of
  the row, in the relay's publishing transaction, after the row has moved on) would put pollbridge's guess
  in the foreign scheduler's name and slow every publish. The reconciler takes a matched attempt's ready
  time from the shadow decision, and re-derives early dispatches from the task table either way;
* ``trace_id`` is the captured change's trace id, so ``explain`` shows the change a dispatch came from.

It is called by the relay in the transaction that marks the outbox rows published: both commit or neither
does, so a batch the relay retries after a failed publish is recorded once. It is also idempotent, which
a republish needs (after a bus loss the relay marks retained rows unpublished again): a dispatch is
recorded only if the log holds none for the same logical task and attempt (instance id, task key,
attempt; never the row id, which a foreign scheduler may change between tries), on any path, and only the
first of several in one batch. So each attempt has at most one legacy dispatch, as it has at most one
shadow decision; a change pollbridge's own dispatch made (its ``events`` or ``fallback`` row is already
in the log, written with the task-table update that was captured) is not taken for the legacy
scheduler's. The look-up uses the log's index on the instance id.

An anti-join rather than a unique index: the reference poller writes path ``poller`` too, and a unique
index would turn a double dispatch of one attempt (a safety violation the reconciler must report as
``duplicate``) into a failed dispatch transaction. Two relays never record one instance at once: an
instance's changes go to one relay partition, which one relay holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.core.mapping import StatusValues, TaskTableMapping
from bridge.db.schema import dispatch_log, outbox
from bridge.tasktable.tables import TaskTable

#: The dispatch-log path of the legacy scheduler's dispatches, whoever the legacy scheduler is.
LEGACY_PATH = "poller"


def _mapping(tt: TaskTable | TaskTableMapping) -> TaskTableMapping:
    return tt.mapping if isinstance(tt, TaskTable) else tt


def is_dispatch_transition(statuses: StatusValues, change: str | None, old_status: str | None,
                           new_status: str | None) -> bool:
    """Whether a captured change moved a task into a dispatched status (an insert directly in one counts;
    a NULL old status counts as not dispatched)."""
    dispatched = statuses.of("dispatched")
    if new_status not in dispatched:
        return False
    return change == "insert" or old_status is None or old_status not in dispatched


def dispatch_transition_sql(statuses: StatusValues, table: sa.FromClause | None = None) -> sa.ColumnElement[bool]:
    """SQL over ``pollbridge_outbox`` (or ``table``, an alias of it): the row is a transition into a
    dispatched status (:func:`is_dispatch_transition`)."""
    o = (outbox if table is None else table).c
    values = [v for v in statuses.of("dispatched") if v is not None]
    into: list[sa.ColumnElement[bool]] = [o.new_status.in_(values)] if values else []
    if None in statuses.of("dispatched"):
        into.append(o.new_status.is_(None))
    if not into:
        return sa.false()
    old_not = [o.change == "insert", o.old_status.is_(None)]
    if values:
        old_not.append(o.old_status.not_in(values))
    return sa.and_(sa.or_(*into), sa.or_(*old_not))


def dispatch_attempt_sql(mapping: TaskTableMapping, table: sa.FromClause | None = None) -> sa.ColumnElement[Any]:
    """The attempt of the dispatch an outbox row (of ``table``, an alias of the outbox) captured (see the
    module docstring)."""
    column: sa.ColumnElement[Any] = (outbox if table is None else table).c.attempt
    return column + 1 if mapping.attempt_moves == "claim" else column


def record_foreign_dispatches(conn: Connection, tt: TaskTable | TaskTableMapping,
                              outbox_rows_or_ids: Iterable[Any]) -> int:
    """Record in ``pollbridge_dispatch_log`` the dispatches of a foreign legacy scheduler among the given
    outbox rows (rows with at least ``id``; or their ids), inside the caller's transaction. Returns how
    many were recorded. See the module docstring for what is recorded and why it is idempotent.

    Given rows (the relay's claimed rows: ``change``, ``old_status``, ``new_status``), the ones that are
    no dispatch transition are dropped here, so a batch without one costs no statement at all."""
    mapping = _mapping(tt)
    statuses = mapping.statuses
    ids: list[int] = []
    for item in outbox_rows_or_ids:
        if isinstance(item, int):
            ids.append(item)
            continue
        if all(hasattr(item, name) for name in ("change", "old_status", "new_status")) and \
                not is_dispatch_transition(statuses, item.change, item.old_status, item.new_status):
            continue
        ids.append(int(item.id))
    if not ids:
        return 0
    o = outbox.c
    dl = dispatch_log.c
    attempt = dispatch_attempt_sql(mapping)
    # The first captured dispatch of each attempt in the batch (a NULL attempt, when the attempts column
    # is not mapped, is one attempt: the decisions carry NULL then too). An alias: a subquery over the
    # outbox itself would be correlated to the outer statement's outbox.
    b = outbox.alias("pb_batch")
    first = (sa.select(sa.func.min(b.c.id))
             .where(b.c.id.in_(ids), dispatch_transition_sql(statuses, b), b.c.task_id.is_not(None),
                    b.c.instance_id.is_not(None), b.c.task_key.is_not(None))
             .group_by(b.c.instance_id, b.c.task_key, sa.func.coalesce(dispatch_attempt_sql(mapping, b), -1)))
    logged = (sa.select(sa.literal(1)).select_from(dispatch_log)
              .where(dl.instance_id == o.instance_id, dl.task_key == o.task_key,
                     sa.func.coalesce(dl.attempt, -1) == sa.func.coalesce(attempt, -1)))
    select = (sa.select(o.task_id, o.instance_id, o.workflow_type, o.task_key, attempt,
                        sa.literal(LEGACY_PATH, sa.String), sa.null(), o.created_at, o.trace_id)
              .where(o.id.in_(first), ~sa.exists(logged))
              .order_by(o.id))
    insert = dispatch_log.insert().from_select(
        ["task_id", "instance_id", "workflow_type", "task_key", "attempt", "path", "ready_at", "dispatched_at",
         "trace_id"], select)
    # Counted from RETURNING: a driver may report no row count for an INSERT ... SELECT (psycopg: -1).
    return len(conn.execute(insert.returning(dispatch_log.c.id)).all())
