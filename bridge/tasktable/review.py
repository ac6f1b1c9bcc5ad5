"""The review queue: tasks the depth guard stopped before dispatch, and what a person decided about them.

The event scheduler's guards (:mod:`event_scheduler.evaluate`) *park* a ready task instead of dispatching it
when its causation depth is past ``max_depth``, or its instance's dispatch count past ``max_dispatches``.
Parking writes one open row of ``pollbridge_review`` (the queue, shared through the database) and, where the
mapping has a ``review`` status, moves the task row to it (a compare-and-set on pending). Without a review
status the task stays pending; either way it is parked for every dispatcher: the shared compare-and-set
(:mod:`bridge.tasktable.dispatch`) and the poller's scans (:mod:`legacy_poller.queries`) leave a task with an
open row alone (:func:`parked`), whatever phase its type is in and whatever another scheduler's settings say.

A person decides with ``pollbridge review``:

* **release**: the row is closed as ``released`` (actor, time, reason); a task that was moved to ``review``
  goes back to pending. A released task is exempt from the guards from then on (its retries included), so
  it is not parked again at once; a task it spawns is judged on its own depth.
* **reject**: the row is closed as ``rejected`` and the task moves to the mapping's failed status for good,
  as a rejection signal does: its attempts set to its maximum where both are mapped (no retry brings it back),
  its completion time stamped where mapped.

Each decision is one transaction: the row is closed only if it was still open and the task row is moved
only if it is still where parking left it, so two people deciding at once cannot both win, and a task
someone moved by hand is reported, not overwritten. The closed rows are the audit trail (``review list
--all``, ``explain``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.core.errors import ReviewError
from bridge.db.clock import as_utc
from bridge.db.engine import db_now
from bridge.db.schema import review
from bridge.tasktable.tables import TaskTable, parse_task_id

Guard = Literal["depth", "dispatches"]
Decision = Literal["released", "rejected"]


def parked(task_id: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """The task whose id is ``task_id`` has an open row in the review queue (an index probe)."""
    return sa.exists().where(review.c.task_id == sa.cast(task_id, sa.String), review.c.decision.is_(None))


def review_state(task_id: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """The queue's word on the task whose id is ``task_id`` (an index probe): 1 parked, 2 released by a person
    (exempt from the guards), NULL neither."""
    return (sa.select(sa.func.min(sa.case((review.c.decision.is_(None), 1), (review.c.decision == "released", 2))))
            .where(review.c.task_id == sa.cast(task_id, sa.String)).scalar_subquery())


@dataclass(frozen=True)
class Parking:
    """One task a guard stops: what it measured against which limit."""

    task_id: Any
    instance_id: str
    workflow_type: str | None
    task_key: str
    attempt: int | None
    guard: Guard
    measured: int
    limit: int

    @property
    def reason(self) -> str:
        what = "causation depth" if self.guard == "depth" else "dispatches of its instance"
        setting = "max_depth" if self.guard == "depth" else "max_dispatches"
        return f"{what} {self.measured} > {setting} {self.limit}"


@dataclass(frozen=True)
class ReviewEntry:
    id: int
    task_id: str
    instance_id: str
    workflow_type: str | None
    task_key: str
    attempt: int | None
    guard: str
    measured: int
    limit: int
    moved: bool
    parked_at: datetime
    parked_by: str
    decision: str | None
    decided_at: datetime | None
    decided_by: str | None
    decision_reason: str | None

    @property
    def reason(self) -> str:
        return Parking(self.task_id, self.instance_id, self.workflow_type, self.task_key, self.attempt,
                       "depth" if self.guard == "depth" else "dispatches", self.measured, self.limit).reason

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "task_id": self.task_id, "instance_id": self.instance_id,
                "workflow_type": self.workflow_type, "task_key": self.task_key, "attempt": self.attempt,
                "guard": self.guard, "measured": self.measured, "limit": self.limit, "reason": self.reason,
                "moved_to_review_status": self.moved, "parked_at": self.parked_at.isoformat(),
                "parked_by": self.parked_by, "decision": self.decision,
                "decided_at": self.decided_at.isoformat() if self.decided_at else None,
                "decided_by": self.decided_by, "decision_reason": self.decision_reason}


def _entry(r: Any) -> ReviewEntry:
    return ReviewEntry(int(r.id), str(r.task_id), str(r.instance_id), r.workflow_type, str(r.task_key), r.attempt,
                       str(r.guard), int(r.measured), int(r.limit_value), bool(r.moved),
                       as_utc(r.parked_at) or r.parked_at, str(r.parked_by), r.decision,
                       as_utc(r.decided_at), r.decided_by, r.decision_reason)


def park(conn: Connection, tt: TaskTable, stops: Sequence[Parking], holder: str) -> list[Parking]:
    """Park ``stops`` inside the caller's transaction; return those parked by this call (a task already
    parked, by this or another process, is left as it is). With a review status the task row moves to it,
    a compare-and-set on pending: a task that stopped being pending meanwhile is not parked at all."""
    done: list[Parking] = []
    review_value = tt.statuses.review
    now = db_now(tt.dialect_name)
    for stop in stops:
        if conn.execute(sa.select(review.c.id).where(review.c.task_id == str(stop.task_id),
                                                     review.c.decision.is_(None))).first() is not None:
            continue
        moved = False
        if review_value:
            values: dict[str, Any] = {tt.mapping.columns.status: review_value}
            if tt.has("updated_at"):
                values[tt.mapping.columns.updated_at or ""] = now
            key = parse_task_id(tt, str(stop.task_id), ReviewError)
            moved = conn.execute(tt.tasks.update().where(tt.col("id") == key, tt.status_in("pending"))
                                 .values(values)).rowcount == 1
            if not moved:
                continue
        conn.execute(review.insert().values(
            task_id=str(stop.task_id), instance_id=str(stop.instance_id), workflow_type=stop.workflow_type,
            task_key=str(stop.task_key), attempt=stop.attempt, guard=stop.guard, measured=stop.measured,
            limit_value=stop.limit, moved=moved, parked_at=now, parked_by=holder))
        done.append(stop)
    return done


def entries(conn: Connection, *, include_decided: bool = False, task_ids: Sequence[str] | None = None,
            workflow_type: str | None = None, limit: int = 1000) -> list[ReviewEntry]:
    """The queue (open rows, oldest first), or with ``include_decided`` the whole audit trail."""
    stmt = sa.select(review).order_by(review.c.parked_at, review.c.id).limit(limit)
    if not include_decided:
        stmt = stmt.where(review.c.decision.is_(None))
    if task_ids is not None:
        stmt = stmt.where(review.c.task_id.in_(list(task_ids)))
    if workflow_type is not None:
        stmt = stmt.where(review.c.workflow_type == workflow_type)
    return [_entry(r) for r in conn.execute(stmt)]


def summary(conn: Connection) -> dict[str | None, tuple[int, datetime | None]]:
    """Per workflow type: the number of parked tasks and when the oldest was parked."""
    rows = conn.execute(sa.select(review.c.workflow_type, sa.func.count(), sa.func.min(review.c.parked_at))
                        .where(review.c.decision.is_(None)).group_by(review.c.workflow_type))
    return {r[0]: (int(r[1]), as_utc(r[2])) for r in rows}


@dataclass(frozen=True)
class Outcome:
    task_id: str
    done: bool
    detail: str


def decide(conn: Connection, tt: TaskTable, task_ids: Sequence[str], decision: Decision, *, actor: str,
           reason: str) -> list[Outcome]:
    """Release or reject the parked tasks ``task_ids`` inside the caller's transaction (see the module doc)."""
    out: list[Outcome] = []
    now = db_now(tt.dialect_name)
    keys = {task_id: _task_id_value(tt, task_id) for task_id in task_ids}  # bad input: nothing changed
    for task_id in task_ids:
        row = conn.execute(sa.select(review).where(review.c.task_id == task_id, review.c.decision.is_(None))
                           ).first()
        if row is None:
            last = conn.execute(sa.select(review.c.decision, review.c.decided_by)
                                .where(review.c.task_id == task_id).order_by(review.c.id.desc()).limit(1)).first()
            detail = (f"not parked (already {last.decision} by {last.decided_by})" if last is not None
                      else "not in the review queue")
            out.append(Outcome(task_id, False, detail))
            continue
        key = keys[task_id]
        values: dict[str, Any] = {}
        if decision == "released":
            source = "review" if row.moved else None
            target = "pending"
        else:
            source = "review" if row.moved else "pending"
            target = "failed"
        if source is not None:
            values[tt.mapping.columns.status] = tt.statuses.write(target)
            stamped = ("updated_at",) if target == "pending" else ("completed_at", "updated_at")
            if target == "failed" and tt.has("attempts") and tt.has("max_attempts"):
                values[tt.mapping.columns.attempts or ""] = tt.col("max_attempts")
            for logical in stamped:
                if tt.has(logical):
                    values[getattr(tt.mapping.columns, logical)] = now
            moved = conn.execute(tt.tasks.update().where(tt.col("id") == key, tt.status_in(source))
                                 .values(values)).rowcount
            if moved != 1:
                out.append(Outcome(task_id, False, f"the task is no longer {source!r} (moved by someone else?): "
                                                   "left as it is, still parked"))
                continue
        closed = conn.execute(review.update().where(review.c.id == row.id, review.c.decision.is_(None)).values(
            decision=decision, decided_at=now, decided_by=actor, decision_reason=reason)).rowcount
        if closed != 1:  # another person decided between our read and our write: undo our part
            raise ReviewError(f"task {task_id}: someone else decided it at the same moment; nothing changed")
        what = "back to pending" if decision == "released" and row.moved else (
            "moved to failed" if decision == "rejected" else "dispatchable again")
        out.append(Outcome(task_id, True, f"{decision}: {what}"))
    return out


def _task_id_value(tt: TaskTable, task_id: str) -> Any:
    return parse_task_id(tt, task_id, ReviewError)


def released_ids(conn: Connection, task_ids: Sequence[str]) -> set[str]:
    """Which of ``task_ids`` a person released (exempt from the guards)."""
    if not task_ids:
        return set()
    return {str(v) for v in conn.execute(sa.select(review.c.task_id).where(
        review.c.task_id.in_(list(task_ids)), review.c.decision == "released")).scalars()}
