"""The dispatch transition: the one compare-and-set both paths use (invariant 3).

Dispatch moves a task from *pending* to *dispatched* with one UPDATE whose WHERE clause repeats
the whole readiness condition. Two dispatchers racing for the same task therefore cannot both
win (the second finds the status changed), and a task whose readiness stopped holding between a
scan and its dispatch is not dispatched (invariant 2 is checked at the moment of the write, not
at the moment of the read). The winner records the dispatch in ``pollbridge_dispatch_log`` in
the same transaction, so the log and the task table never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy.engine import Connection

from bridge.db import db_now
from bridge.readiness import ready_predicate
from bridge.schema import dispatch_log
from bridge.tasktable import TaskTable

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


def dispatch(conn: Connection, tt: TaskTable, task: ReadyTask, path: Path, trace_id: str | None = None) -> bool:
    """Try to dispatch ``task`` inside the caller's transaction; ``True`` if this call won."""
    t = tt.tasks
    now = db_now(tt.dialect_name)
    values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.dispatched}
    for logical in ("dispatched_at", "updated_at"):
        if tt.has(logical):
            values[getattr(tt.mapping.columns, logical)] = now
    stmt = (
        t.update()
        .where(tt.col("id") == task.task_id, ready_predicate(tt, t))
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
