"""Backpressure holds as SQL: when a ready task held back by the event scheduler is no one's miss.

The event scheduler records each task it holds back by backpressure (a rate limit, or its most in flight)
in ``pollbridge_holds`` (:data:`bridge.db.schema.holds`): one row per task, ``held_at`` when the hold began,
``until`` when its holder looks again (renewed at every look), ``released_at`` once the holder dispatched
it. A hold is *legitimate* while ``until`` is at most :data:`HOLD_SLACK` seconds in the past by the
database clock: its holder is alive and will look again. Then the poller's fallback and safety sweep leave
the task alone, and the reconciler counts it neither missing nor late. Once the holder stops renewing it
(it died), the hold goes stale and the task is fair game again: taken by the fallback or the sweep, it is
the event path's miss, as any other.

Here, not in the event scheduler: the poller's scan and the reconciler ask the same question, and the layers
(``tests/unit/test_layers.py``) let both import :mod:`bridge.tasktable` but neither import the other.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from bridge.db.engine import db_ago
from bridge.db.schema import holds

#: Seconds a hold stays legitimate past its ``until``: a live holder renews ``until`` at every look, and a
#: look may come a little late (a slow batch, a garbage-collection pause), and ``until`` is computed on the
#: holder's clock while it is judged by the database's, so a small skew between the two must not make a live
#: hold look stale. Ten seconds is far beyond a healthy scheduler's delay and short enough that a dead
#: holder's tasks are taken within one grace period or two.
HOLD_SLACK = 10.0


def legit_hold(t_task_id_expr: sa.ColumnElement[Any], dialect_name: str) -> sa.ColumnElement[bool]:
    """SQL: the task whose id is ``t_task_id_expr`` is under a legitimate backpressure hold now.

    An ``EXISTS`` over ``pollbridge_holds`` for that task id, compared as text (the holds table stores task
    ids as text, whatever the task table's id type), not released, whose ``until`` is later than the
    database clock minus :data:`HOLD_SLACK`. A lookup by the holds table's primary key per task."""
    return sa.exists(
        sa.select(sa.literal(1)).select_from(holds).where(
            holds.c.task_id == sa.cast(t_task_id_expr, sa.String),
            holds.c.released_at.is_(None),
            holds.c.until > db_ago(dialect_name, HOLD_SLACK),
        )
    )
