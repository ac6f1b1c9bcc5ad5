"""The flags as SQL filters for the poller's scans (see the phase table in :mod:`bridge.core.phases`).

* ``cutover`` types are left out of the regular scan (only the safety sweep looks at them);
* in ``selective``, a task of a canary instance (inside the percentage) is held back until it has been
  ready longer than the type's grace period; found after that, it is a ``fallback`` dispatch;
* the event path owns the retries of the types it is authoritative for, so the poller's re-pending of
  failed tasks leaves those out too.

The percentage test is the frozen hash in SQL (``pollbridge_bucket``), so held-back tasks never fill a
scan's batch and starve the others.

A task the event scheduler holds back by backpressure (a *legitimate* hold of ``pollbridge_holds``, renewed by
a live scheduler: :func:`bridge.tasktable.holds.legit_hold`) is not a miss: neither the fallback nor the sweep
takes it while the hold lasts; once its holder stops renewing it (the scheduler died), they do. A task a person
released from the review queue gets its grace period again from the release.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from bridge.core.phases import Flag, percent_threshold
from bridge.db.engine import db_ago
from bridge.tasktable.holds import legit_hold
from bridge.tasktable.queries import type_of_row
from bridge.tasktable.readiness import ready_since
from bridge.tasktable.review import released_within
from bridge.tasktable.tables import TaskTable


def in_percentage(tt: TaskTable, t: sa.FromClause, flag: Flag) -> sa.ColumnElement[bool]:
    if flag.percent is None:
        return sa.true()
    bucket = sa.func.pollbridge_bucket(sa.literal(flag.workflow_type, sa.String),
                                       sa.cast(tt.col("instance_id", t), sa.String))
    return sa.cast(bucket, sa.Integer) < percent_threshold(flag.percent)


def canary(tt: TaskTable, t: sa.FromClause, type_expr: sa.ColumnElement[Any], flag: Flag) -> sa.ColumnElement[bool]:
    """Row ``t`` belongs to the event path's share of a ``selective`` type. Never NULL: a task without a
    type (its instance row is missing) is nobody's canary, so ``NOT canary(...)`` keeps it in the scan."""
    return sa.and_(type_expr.is_not(None), type_expr == flag.workflow_type, in_percentage(tt, t, flag))


def scan_filter(tt: TaskTable, t: sa.FromClause, type_expr: sa.ColumnElement[Any],
                flags: Mapping[str, Flag]) -> sa.ColumnElement[bool] | None:
    """What the regular scan may dispatch (``None``: everything, no flag restricts it)."""
    clauses: list[sa.ColumnElement[bool]] = []
    cutover = sorted(name for name, f in flags.items() if f.phase == "cutover")
    if cutover:
        clauses.append(sa.or_(type_expr.is_(None), type_expr.not_in(cutover)))
    for flag in sorted((f for f in flags.values() if f.phase == "selective"), key=lambda f: f.workflow_type):
        since = ready_since(tt, t)
        within_grace = sa.and_(since.is_not(None), since > db_ago(tt.dialect_name, flag.grace_seconds))
        waits = sa.or_(within_grace, legit_hold(tt.col("id", t), tt.dialect_name),
                       released_within(tt.col("id", t), tt.dialect_name, flag.grace_seconds))
        clauses.append(sa.not_(sa.and_(canary(tt, t, type_expr, flag), waits)))
    return sa.and_(*clauses) if clauses else None


def sweep_filter(tt: TaskTable, t: sa.FromClause, type_expr: sa.ColumnElement[Any],
                 flags: Mapping[str, Flag]) -> sa.ColumnElement[bool] | None:
    """What the safety sweep dispatches: tasks of ``cutover`` types ready longer than their grace period."""
    clauses: list[sa.ColumnElement[bool]] = []
    for flag in sorted((f for f in flags.values() if f.phase == "cutover"), key=lambda f: f.workflow_type):
        since = ready_since(tt, t)
        clauses.append(sa.and_(type_expr == flag.workflow_type,
                               sa.or_(since.is_(None), since <= db_ago(tt.dialect_name, flag.grace_seconds)),
                               sa.not_(legit_hold(tt.col("id", t), tt.dialect_name)),
                               sa.not_(released_within(tt.col("id", t), tt.dialect_name, flag.grace_seconds))))
    return sa.or_(*clauses) if clauses else None


def owned_by_events(tt: TaskTable, t: sa.FromClause, flags: Mapping[str, Flag]) -> sa.ColumnElement[bool] | None:
    """Rows the event path is authoritative for (``cutover``, or a ``selective`` canary instance)."""
    type_expr = type_of_row(tt, t)
    clauses: list[sa.ColumnElement[bool]] = []
    cutover = sorted(name for name, f in flags.items() if f.phase == "cutover")
    if cutover:
        # Never NULL: NOT (NULL IN (...)) would leave a typeless failed task re-pended by nobody.
        clauses.append(sa.and_(type_expr.is_not(None), type_expr.in_(cutover)))
    for flag in (f for f in flags.values() if f.phase == "selective"):
        clauses.append(canary(tt, t, type_expr, flag))
    return sa.or_(*clauses) if clauses else None
