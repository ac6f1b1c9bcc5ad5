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
  goes back to pending (a captured change); one left pending gets a wake-up row in pollbridge's own outbox,
  so the event scheduler looks at it at once. For the poller's fallback and sweep the grace period starts
  again at the release (:func:`released_within`). A released task is exempt from the guards from then on
  (its retries included), so it is not parked again at once; a task it spawns is judged on its own depth. A
  task someone already moved out of ``review`` by hand only has its entry closed.
* **reject**: the row is closed as ``rejected`` and the task moves to the mapping's failed status for good,
  as a rejection signal does: its attempts set to its maximum where both are mapped (no retry brings it back),
  its completion time stamped where mapped.

Each decision is one savepoint: the row is closed only if it was still open and the task row is moved only
if it is still where parking left it, so two people deciding at once cannot both win, and a task someone
moved by hand is reported, not overwritten. A decision that must write the task table is refused while the
type is in ``polling`` or ``dual_write`` (the legacy scheduler owns it then; pollbridge writes nothing to its
table). The closed rows are the audit trail (``review list --all``, ``explain``), kept like the dispatch log.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from bridge.core.errors import ReviewError
from bridge.db.clock import as_utc
from bridge.db.engine import db_ago, db_now
from bridge.db.schema import OUTBOX_CHANNEL, outbox, review
from bridge.tasktable.tables import TaskTable, parse_task_id

Guard = Literal["depth", "dispatches"]
Decision = Literal["released", "rejected"]


def parked(task_id: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """The task whose id is ``task_id`` has an open row in the review queue.

    An ``IN`` over the open rows rather than a correlated ``EXISTS``: PostgreSQL reads the (few) open rows once
    per statement into a hash and looks each candidate up in it (a hashed SubPlan, microseconds in ``EXPLAIN
    ANALYZE``). ``bench.guards_cost`` measured the dispatch of 50 slower by 0.45 to 0.80 ms with this test, as
    by 0.74 ms with the ``EXISTS``: no clear difference between the two (docs/benchmarks.md)."""
    return sa.cast(task_id, sa.String).in_(sa.select(review.c.task_id).where(review.c.decision.is_(None)))


def released_within(task_id: sa.ColumnElement[Any], dialect_name: str, seconds: float) -> sa.ColumnElement[bool]:
    """A person released the task less than ``seconds`` ago: for the poller's fallback and sweep its grace
    period starts again at the release (it waited for a person, not for the event path)."""
    return sa.exists().where(review.c.task_id == sa.cast(task_id, sa.String), review.c.decision == "released",
                             review.c.decided_at > db_ago(dialect_name, seconds))


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
        return _reason(self.guard, self.measured, self.limit)


def _reason(guard: str, measured: int, limit: int) -> str:
    what, setting = ("causation depth", "max_depth") if guard == "depth" else ("dispatches of its instance",
                                                                               "max_dispatches")
    return f"{what} {measured} > {setting} {limit}"


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
        return _reason(self.guard, self.measured, self.limit)

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
    a compare-and-set on pending: a task that stopped being pending meanwhile is not parked at all. Two
    processes parking the same task at once: the open-row unique index keeps one, the other inserts nothing."""
    done: list[Parking] = []
    review_value = tt.statuses.review
    now = db_now(tt.dialect_name)
    insert_fn = postgresql.insert if tt.dialect_name == "postgresql" else sqlite.insert
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
        inserted = conn.execute(insert_fn(review).values(
            task_id=str(stop.task_id), instance_id=str(stop.instance_id), workflow_type=stop.workflow_type,
            task_key=str(stop.task_key), attempt=stop.attempt, guard=stop.guard, measured=stop.measured,
            limit_value=stop.limit, moved=moved, parked_at=now, parked_by=holder)
            .on_conflict_do_nothing(index_elements=[review.c.task_id], index_where=review.c.decision.is_(None))
            .returning(review.c.id)).first()
        if inserted is not None:  # (rowcount is no answer: PostgreSQL's INSERT ... RETURNING reports -1)
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


#: Phases in which pollbridge may write the task table (the event path dispatches): a decision that has to
#: move a task row is refused in the others, where the legacy scheduler owns the type.
WRITING_PHASES = ("selective", "cutover")


def decide(conn: Connection, tt: TaskTable, task_ids: Sequence[str], decision: Decision, *, actor: str,
           reason: str, phase_of: Callable[[str | None], str] | None = None,
           relay_partitions: int = 1) -> list[Outcome]:
    """Release or reject the parked tasks ``task_ids`` inside the caller's transaction (see the module doc),
    each in a savepoint of its own, so one that cannot be decided leaves the others decided.

    ``phase_of``: the phase of a workflow type (the flag store's view); a decision that has to write the task
    table is refused outside ``selective``/``cutover``. Releasing a task left pending writes nothing to the task
    table: a wake-up row in pollbridge's own outbox (relay partition by ``relay_partitions``, as capture
    computes it) brings its instance to the event scheduler at once."""
    out: list[Outcome] = []
    now = db_now(tt.dialect_name)
    keys = {task_id: _task_id_value(tt, task_id) for task_id in task_ids}  # bad input: nothing changed
    for task_id in task_ids:
        key = keys[task_id]
        text = str(key)  # as the queue stores it ("01" finds task 1)
        row = conn.execute(sa.select(review).where(review.c.task_id == text, review.c.decision.is_(None))).first()
        if row is None:
            out.append(Outcome(text, False, _not_parked(conn, tt, key, text)))
            continue
        status = conn.execute(sa.select(tt.col("status")).where(tt.col("id") == key)).first()
        logical = tt.statuses.logical(status[0]) if status is not None else None
        phase = phase_of(row.workflow_type) if phase_of is not None else "cutover"
        with conn.begin_nested() as savepoint:
            outcome = _decide_one(conn, tt, row, key, text, logical, decision, phase, now, relay_partitions)
            if outcome.done:
                closed = conn.execute(review.update().where(review.c.id == row.id, review.c.decision.is_(None))
                                      .values(decision=decision, decided_at=now, decided_by=actor,
                                              decision_reason=reason)).rowcount
                if closed != 1:  # another person decided between our read and our write: undo our part
                    savepoint.rollback()
                    outcome = Outcome(text, False, "someone else decided it at the same moment; left as they did")
            else:
                savepoint.rollback()
        out.append(outcome)
    return out


def _decide_one(conn: Connection, tt: TaskTable, row: Any, key: Any, text: str, logical: str | None,
                decision: Decision, phase: str, now: Any, relay_partitions: int) -> Outcome:
    """The task-table part of one decision (inside its savepoint); ``done`` False: nothing may be closed."""
    if logical is None:
        return Outcome(text, False, "the task row is gone or has a status the mapping does not know; still parked")
    source: tuple[str, ...] = ()
    if decision == "released":
        if logical == "review" and row.moved:
            source, target = ("review",), "pending"
        elif logical == "pending" and not row.moved:
            _wake(conn, tt, row, relay_partitions)
            return Outcome(text, True, "released: dispatchable again (its instance is looked at at once)")
        else:  # someone moved it meanwhile (back to pending by hand, or on): the entry only needs closing
            return Outcome(text, True, f"released: the task is {logical} already, left as it is; entry closed")
    else:
        if logical not in ("review", "pending"):
            return Outcome(text, False, f"the task is {logical} now, not waiting: not rejected "
                                        f"(`pollbridge review release {text}` closes the entry)")
        source, target = ("review", "pending"), "failed"
    if phase not in WRITING_PHASES:
        return Outcome(text, False, f"its type {row.workflow_type} is in {phase}: the legacy scheduler owns it and "
                                    f"pollbridge writes nothing to the task table in that phase; move the task "
                                    f"yourself, then `pollbridge review release {text}` closes the entry")
    values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write(target)}
    stamped = ("updated_at",) if target == "pending" else ("completed_at", "updated_at")
    if target == "failed" and tt.has("attempts") and tt.has("max_attempts"):
        values[tt.mapping.columns.attempts or ""] = tt.col("max_attempts")  # no retry brings it back
    for logical_column in stamped:
        if tt.has(logical_column):
            values[getattr(tt.mapping.columns, logical_column)] = now
    moved = conn.execute(tt.tasks.update().where(tt.col("id") == key, tt.status_in(*source))
                         .values(values)).rowcount
    if moved != 1:
        return Outcome(text, False, "the task moved at the same moment; still parked, look again")
    what = "back to pending" if decision == "released" else "failed for good (attempts at their maximum)"
    return Outcome(text, True, f"{decision}: {what}")


def _not_parked(conn: Connection, tt: TaskTable, key: Any, text: str) -> str:
    if conn.execute(sa.select(tt.col("id")).where(tt.col("id") == key)).first() is None:
        return f"no such task in {tt.mapping.table} (`pollbridge review list` shows the parked ones)"
    last = conn.execute(sa.select(review.c.decision, review.c.decided_by)
                        .where(review.c.task_id == text).order_by(review.c.id.desc()).limit(1)).first()
    if last is not None:
        return f"not parked (already {last.decision} by {last.decided_by})"
    return "not in the review queue (`pollbridge review list` shows the parked tasks)"


def _wake(conn: Connection, tt: TaskTable, row: Any, relay_partitions: int) -> None:
    """A captured-change row in pollbridge's own outbox for a released task left pending: the relay publishes
    it like any change, so the event scheduler evaluates the instance now instead of at its next re-check."""
    pending = tt.statuses.pending
    partition: Any = 0
    if tt.dialect_name == "postgresql" and relay_partitions > 1:
        partition = sa.func.mod(sa.func.hashtext(sa.literal(str(row.instance_id))).op("&")(2147483647),
                                relay_partitions)
    conn.execute(outbox.insert().values(
        event_id=str(uuid.uuid4()), task_id=str(row.task_id), instance_id=str(row.instance_id),
        workflow_type=row.workflow_type, task_key=str(row.task_key), change="status", old_status=pending,
        new_status=pending, trace_id=uuid.uuid4().hex, relay_partition=partition,
        created_at=db_now(tt.dialect_name), attempt=row.attempt))
    if tt.dialect_name == "postgresql":  # at the commit: a listening relay publishes it now, not at its idle probe
        conn.execute(sa.select(sa.func.pg_notify(OUTBOX_CHANNEL, "")))


def _task_id_value(tt: TaskTable, task_id: str) -> Any:
    return parse_task_id(tt, task_id, ReviewError)
