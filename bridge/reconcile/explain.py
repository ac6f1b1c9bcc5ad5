"""``pollbridge explain TASK_ID``: one task's whole story across both paths, and why it was (not yet) triggered.

:func:`explain_task` gathers, for one row of the task table (always through the mapping):

* **the task**: status (stored and logical), attempts, its timestamps;
* **readiness facts**: every dependency with its status and completion time (a dependency on a key
  that does not exist is reported as ``missing``, and blocks, as it does for both paths), the due time
  and whether it passed on the database clock, the awaited signal and when it arrived, with every
  signal recorded in ``pollbridge_signals``; whether the shared readiness SQL finds it ready now and
  since when;
* **the outbox events** of the task (event id, change, old/new status, trace id, created/published
  times, relay partition) and, where the bus can tell, their **delivery** to the scheduler's consumer
  group: ``unpublished``, ``undelivered`` (on the bus, not read yet), ``pending`` (delivered, not
  acknowledged), ``acknowledged``, ``dead_lettered`` or ``unknown`` (with why), as the bus answers
  :meth:`bridge.bus.base.EventBus.delivery_states`. The look-ups are bounded: only the latest
  :data:`DELIVERY_LOOKUPS` events, and each backend bounds its own search (Redis: a scan of the
  stream from just before the event was published);
* **shadow decisions** of the event path (``pollbridge_decisions``) and **every dispatch** (path,
  ready time, dispatch time, latency, trace id and the captured change that trace id came from, which
  may be another task's change of the same instance: the scheduler handles an instance's events as one
  batch), each with the phase the type was in at that moment
  (from the audit trail, :func:`bridge.reconcile.classify.phase_spans`), the current flag and the routes it
  gives this instance. Both are looked up by the row id *and* by the logical task (instance id, task key):
  a foreign scheduler may give a retry a new row id (Airflow does), and its earlier tries stay the same
  task's story. A foreign scheduler's dispatches (``foreign``) are captured transitions recorded with
  path ``poller`` (:mod:`bridge.capture.evidence`) and named "the legacy scheduler";
* **the answer**: a code and one sentence (:class:`Answer`).

Answer codes (stable): ``dispatched``, ``completed``, ``failed_terminal``, ``rejected``,
``failed_retrying``, ``held_for_review``, ``waiting_dependency``, ``not_due``, ``awaiting_signal``,
``not_ready``, ``ready_not_dispatched``, ``unknown_status``. An unknown task id raises
:class:`UnknownTask` (exit 2). The JSON shape is :meth:`Explanation.to_json`, documented in
``docs/observe.md``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from bridge.bus.base import (
    ACKNOWLEDGED,
    DEAD_LETTERED,
    NOT_FOUND,
    PENDING,
    UNDELIVERED,
    EventBus,
    EventDelivery,
    EventRef,
    partition_for,
)
from bridge.core.errors import FlagStoreUnavailable, PollbridgeError, first_line
from bridge.core.phases import Flag
from bridge.core.settings import SchedulerSettings
from bridge.db.clock import as_utc
from bridge.db.engine import db_ago, db_now, read_only
from bridge.db.schema import decisions, dispatch_log, holds, outbox, signals
from bridge.flags.store import FlagStore, describe
from bridge.reconcile.classify import PhaseSpan, phase_spans
from bridge.tasktable.holds import HOLD_SLACK
from bridge.tasktable.readiness import ready_predicate, ready_since
from bridge.tasktable.review import ReviewEntry
from bridge.tasktable.review import entries as review_entries
from bridge.tasktable.tables import TaskTable

#: Outbox events listed per task (the most recent ones).
MAX_EVENTS = 100
#: Events whose delivery is looked up on the bus (the most recent ones); the others say "not looked up".
DELIVERY_LOOKUPS = 10

ANSWER_CODES = ("dispatched", "completed", "failed_terminal", "rejected", "failed_retrying", "held_for_review",
                "held_back", "waiting_dependency", "not_due", "awaiting_signal", "not_ready", "ready_not_dispatched",
                "unknown_status")
DELIVERY_STATES = ("unpublished", "undelivered", "pending", "acknowledged", "dead_lettered", "unknown")

PATH_NAMES = {"poller": "the legacy poller", "events": "the event path", "fallback": "the poller's fallback"}
#: The ``poller`` path of a foreign legacy scheduler: its dispatches captured from the task table.
FOREIGN_LEGACY = "the legacy scheduler"


class UnknownTask(PollbridgeError):
    """No such task in the task table (or an id that cannot be one). Bad input: exit 2."""

    exit_code = 2


# --- the result ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dependency:
    key: str
    task_id: str | None  # None: no task with that key (a missing dependency blocks)
    status: str | None
    logical_status: str | None
    completed_at: datetime | None
    met: bool

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "task_id": self.task_id, "status": self.status,
                "logical_status": self.logical_status, "completed_at": _iso(self.completed_at), "met": self.met}


@dataclass(frozen=True)
class SignalRecord:
    kind: str
    actor: str | None
    received_at: datetime | None
    payload: str | None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "actor": self.actor, "received_at": _iso(self.received_at), "payload": self.payload}


@dataclass(frozen=True)
class Readiness:
    ready_now: bool
    ready_since: datetime | None
    checked_at: datetime
    dependencies: tuple[Dependency, ...]
    due_at: datetime | None
    due: bool | None  # None: no due time
    awaits_signal: str | None
    signal_received_at: datetime | None
    signals: tuple[SignalRecord, ...]

    @property
    def unmet(self) -> list[Dependency]:
        return [d for d in self.dependencies if not d.met]

    def to_json(self) -> dict[str, Any]:
        return {"ready_now": self.ready_now, "ready_since": _iso(self.ready_since), "checked_at": _iso(self.checked_at),
                "dependencies": [d.to_json() for d in self.dependencies], "due_at": _iso(self.due_at), "due": self.due,
                "awaits_signal": self.awaits_signal, "signal_received_at": _iso(self.signal_received_at),
                "signals": [s.to_json() for s in self.signals]}


@dataclass(frozen=True)
class DeliveryState:
    state: str  # one of DELIVERY_STATES
    partition: int | None = None
    entry_id: str | None = None
    deliveries: int | None = None
    consumer: str | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "partition": self.partition, "entry_id": self.entry_id,
                "deliveries": self.deliveries, "consumer": self.consumer, "detail": self.detail}


@dataclass(frozen=True)
class OutboxEvent:
    event_id: str
    change: str
    old_status: str | None
    new_status: str | None
    trace_id: str | None
    created_at: datetime | None
    published_at: datetime | None
    relay_partition: int
    delivery: DeliveryState

    def to_json(self) -> dict[str, Any]:
        return {"event_id": self.event_id, "change": self.change, "old_status": self.old_status,
                "new_status": self.new_status, "trace_id": self.trace_id, "created_at": _iso(self.created_at),
                "published_at": _iso(self.published_at), "relay_partition": self.relay_partition,
                "delivery": self.delivery.to_json()}


@dataclass(frozen=True)
class TraceEvent:
    """The captured change whose trace id a decision or dispatch carries. The scheduler handles a batch of
    events per instance, so this may be a change of another task of the same instance."""

    event_id: str
    task_id: str | None
    task_key: str | None
    change: str
    new_status: str | None

    def to_json(self) -> dict[str, Any]:
        return {"event_id": self.event_id, "task_id": self.task_id, "task_key": self.task_key, "change": self.change,
                "new_status": self.new_status}


def _trace_json(value: TraceEvent | None) -> dict[str, Any] | None:
    return value.to_json() if value is not None else None


@dataclass(frozen=True)
class Decision:
    attempt: int | None
    ready_at: datetime | None
    decided_at: datetime | None
    latency_ms: float | None
    trace_id: str | None
    phase: str
    trace_event: TraceEvent | None = None

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "ready_at": _iso(self.ready_at), "decided_at": _iso(self.decided_at),
                "latency_ms": _ms(self.latency_ms), "trace_id": self.trace_id, "phase": self.phase,
                "trace_event": _trace_json(self.trace_event)}


@dataclass(frozen=True)
class Dispatch:
    attempt: int | None
    path: str
    ready_at: datetime | None
    dispatched_at: datetime | None
    latency_ms: float | None
    trace_id: str | None
    phase: str
    trace_event: TraceEvent | None = None

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "path": self.path, "ready_at": _iso(self.ready_at),
                "dispatched_at": _iso(self.dispatched_at), "latency_ms": _ms(self.latency_ms),
                "trace_id": self.trace_id, "phase": self.phase, "trace_event": _trace_json(self.trace_event)}


@dataclass(frozen=True)
class FlagView:
    """The type's flag now, and the routes it gives this task's instance."""

    phase: str
    percent: float | None
    grace_seconds: float
    event_route: str
    poller_route: str
    source: str  # 'flag' (a stored row), 'default' (no row: polling) or 'unavailable' (store unreadable)
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "percent": self.percent, "grace_seconds": self.grace_seconds,
                "event_route": self.event_route, "poller_route": self.poller_route, "source": self.source,
                "detail": self.detail}


@dataclass(frozen=True)
class HoldView:
    """The task's backpressure hold (``pollbridge_holds``), as the database saw it when explain read it."""

    reason: str  # 'rate' or 'in_flight'
    attempt: int | None
    held_at: datetime | None
    until: datetime | None
    holder: str
    released_at: datetime | None
    legit: bool  # not released and renewed recently enough (bridge.tasktable.holds.HOLD_SLACK)

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "attempt": self.attempt, "held_at": _iso(self.held_at),
                "until": _iso(self.until), "holder": self.holder, "released_at": _iso(self.released_at),
                "legitimate": self.legit}


@dataclass(frozen=True)
class Answer:
    code: str  # one of ANSWER_CODES
    sentence: str

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "sentence": self.sentence}


@dataclass(frozen=True)
class Explanation:
    task_id: str
    instance_id: str
    task_key: str
    workflow_type: str | None
    status: str
    logical_status: str | None
    attempts: int | None
    max_attempts: int | None
    dispatched_at: datetime | None
    completed_at: datetime | None
    updated_at: datetime | None
    readiness: Readiness
    events: tuple[OutboxEvent, ...]
    events_truncated: bool
    decisions: tuple[Decision, ...]
    dispatches: tuple[Dispatch, ...]
    flag: FlagView
    phases: tuple[PhaseSpan, ...]
    answer: Answer
    foreign: bool = False  # the legacy scheduler is foreign: its dispatches are captured, path 'poller'
    #: The task's rows in the review queue, oldest first (open and decided: the audit trail).
    review: tuple[ReviewEntry, ...] = ()
    hold: HoldView | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "task": {"id": self.task_id, "instance_id": self.instance_id, "task_key": self.task_key,
                     "workflow_type": self.workflow_type, "status": self.status,
                     "logical_status": self.logical_status, "attempts": self.attempts,
                     "max_attempts": self.max_attempts, "dispatched_at": _iso(self.dispatched_at),
                     "completed_at": _iso(self.completed_at), "updated_at": _iso(self.updated_at)},
            "readiness": self.readiness.to_json(),
            "events": [e.to_json() for e in self.events],
            "events_truncated": self.events_truncated,
            "decisions": [d.to_json() for d in self.decisions],
            "dispatches": [d.to_json() for d in self.dispatches],
            "flag": self.flag.to_json(),
            "phases": [{"phase": s.phase, "since": _iso(s.since), "until": _iso(s.until)} for s in self.phases],
            "review": [e.as_dict() for e in self.review],
            "hold": self.hold.to_json() if self.hold is not None else None,
            "answer": self.answer.to_json(),
        }


# --- gathering -------------------------------------------------------------------------------------------

def explain_task(engine: Engine, tt: TaskTable, task_id: str, *, bus: EventBus | None = None,
                 bus_error: str | None = None, group: str = SchedulerSettings().group,
                 store: FlagStore | None = None, foreign: bool = False) -> Explanation:
    """The story of ``task_id`` (see the module docstring). Raises :class:`UnknownTask` for an unknown id.

    ``bus`` is optional: without one (or when it fails) every delivery is ``unknown`` with ``bus_error``
    or the failure as the reason; everything else comes from the database. ``foreign``: the legacy
    scheduler is not pollbridge's poller (``[legacy] kind = "foreign"``)."""
    key = _task_key(tt, task_id)
    reader = read_only(engine)
    with reader.connect() as conn:
        row = _task_row(conn, tt, key)
        if row is None:
            raise UnknownTask(f"no task {task_id!r} in {_table_name(tt)}; check the id "
                              f"(the {tt.mapping.columns.id!r} column of the task table)")
        task_text = str(row.pb_id)
        checked_at = as_utc(row.pb_now) or datetime.now(UTC)
        deps = _dependencies(conn, tt, row)
        sigs = tuple(SignalRecord(r.kind, r.actor, as_utc(r.received_at), r.payload) for r in conn.execute(
            sa.select(signals).where(signals.c.task_id == task_text).order_by(signals.c.id)))
        instance_text, key_text = str(row.pb_instance), str(row.pb_key)
        decision_rows = conn.execute(sa.select(decisions).where(_same_task(decisions, task_text, instance_text,
                                                                           key_text))
                                     .order_by(decisions.c.id)).all()
        dispatch_rows = conn.execute(sa.select(dispatch_log).where(_same_task(dispatch_log, task_text, instance_text,
                                                                              key_text))
                                     .order_by(dispatch_log.c.id)).all()
        review_rows = tuple(review_entries(conn, include_decided=True, task_ids=[task_text]))
        hold_row = conn.execute(sa.select(holds, (holds.c.released_at.is_(None)
                                                  & (holds.c.until > db_ago(tt.dialect_name, HOLD_SLACK)))
                                          .label("pb_legit")).where(holds.c.task_id == task_text)).first()
        event_rows = conn.execute(sa.select(outbox).where(outbox.c.task_id == task_text)
                                  .order_by(outbox.c.id.desc()).limit(MAX_EVENTS + 1)).all()
        traces = sorted({r.trace_id for r in (*decision_rows, *dispatch_rows) if r.trace_id}
                        - {r.trace_id for r in event_rows})
        traced = {r.trace_id: TraceEvent(r.event_id, r.task_id, r.task_key, r.change, r.new_status)
                  for r in event_rows}
        if traces:  # a trace of another task's change of the same instance (the scheduler batches per instance)
            for r in conn.execute(sa.select(outbox).where(outbox.c.instance_id == str(row.pb_instance),
                                                          outbox.c.trace_id.in_(traces))):
                traced.setdefault(r.trace_id, TraceEvent(r.event_id, r.task_id, r.task_key, r.change, r.new_status))
        conn.rollback()

    workflow_type = None if row.pb_type is None else str(row.pb_type)
    instance_id = str(row.pb_instance)
    due_at = as_utc(row.pb_due_at) if tt.has("due_at") else None
    readiness = Readiness(
        ready_now=bool(row.pb_ready), ready_since=as_utc(row.pb_ready_since) if row.pb_ready else None,
        checked_at=checked_at,
        dependencies=deps, due_at=due_at, due=None if due_at is None else due_at <= checked_at,
        awaits_signal=row.pb_awaits if tt.has("awaits_signal") else None,
        signal_received_at=as_utc(row.pb_signal_at) if tt.has("signal_received_at") else None, signals=sigs)

    spans = tuple(s for s in phase_spans(engine, [workflow_type]) if s.workflow_type == workflow_type) \
        if workflow_type is not None else ()
    truncated = len(event_rows) > MAX_EVENTS
    event_rows = list(reversed(event_rows[:MAX_EVENTS]))
    deliveries = _deliveries(engine, bus, bus_error, group, instance_id, event_rows)
    events = tuple(OutboxEvent(r.event_id, r.change, r.old_status, r.new_status, r.trace_id, as_utc(r.created_at),
                               as_utc(r.published_at), int(r.relay_partition), deliveries[r.event_id])
                   for r in event_rows)
    decs = tuple(Decision(r.attempt, as_utc(r.ready_at), as_utc(r.decided_at), _latency(r.ready_at, r.decided_at),
                          r.trace_id, phase_at(spans, as_utc(r.decided_at)), traced.get(r.trace_id))
                 for r in decision_rows)
    disps = tuple(Dispatch(r.attempt, r.path, as_utc(r.ready_at), as_utc(r.dispatched_at),
                           _latency(r.ready_at, r.dispatched_at), r.trace_id, phase_at(spans, as_utc(r.dispatched_at)),
                           traced.get(r.trace_id)) for r in dispatch_rows)
    flag = _flag_view(store if store is not None else FlagStore(engine), workflow_type, instance_id)

    # A NULL status (Airflow's waiting task instance) means what the mapping says NULL means.
    status = "NULL" if row.pb_status is None else str(row.pb_status)
    partial = Explanation(
        task_id=task_text, instance_id=instance_id, task_key=str(row.pb_key), workflow_type=workflow_type,
        status=status, logical_status=tt.statuses.logical(None if row.pb_status is None else status),
        attempts=_int(row.pb_attempts) if tt.has("attempts") else None,
        max_attempts=_int(row.pb_max_attempts) if tt.has("max_attempts") else None,
        dispatched_at=as_utc(row.pb_dispatched_at) if tt.has("dispatched_at") else None,
        completed_at=as_utc(row.pb_completed_at) if tt.has("completed_at") else None,
        updated_at=as_utc(row.pb_updated_at) if tt.has("updated_at") else None,
        readiness=readiness, events=events, events_truncated=truncated, decisions=decs, dispatches=disps,
        flag=flag, phases=spans, answer=Answer("unknown_status", ""), foreign=foreign, review=review_rows,
        hold=None if hold_row is None else HoldView(
            str(hold_row.reason), hold_row.attempt, as_utc(hold_row.held_at), as_utc(hold_row.until),
            str(hold_row.holder), as_utc(hold_row.released_at), bool(hold_row.pb_legit)))
    return _with_answer(partial)


def _same_task(table: sa.Table, task_id: str, instance_id: str, task_key: str) -> sa.ColumnElement[bool]:
    """Rows of ``table`` (decisions, dispatch log) about this task: its row id, or its logical task (a retry
    given a new row id stays the same task). Both are indexed (task id; instance id)."""
    c = table.c
    return sa.or_(c.task_id == task_id, sa.and_(c.instance_id == instance_id, c.task_key == task_key))


def phase_at(spans: Sequence[PhaseSpan], at: datetime | None) -> str:
    """The phase in force at ``at`` according to the audit trail's spans (``polling`` without any)."""
    if at is None:
        return spans[-1].phase if spans else "polling"
    for span in spans:
        if (span.since is None or at >= span.since) and (span.until is None or at < span.until):
            return span.phase
    return "polling"


def _task_key(tt: TaskTable, raw: str) -> Any:
    """The id as the id column's Python type; an id that cannot be one (not plain digits for an integer
    id, or past the column's range) is an unknown task."""
    from bridge.tasktable.tables import parse_task_id

    try:
        python_type = tt.col("id").type.python_type
    except NotImplementedError:
        return raw
    try:
        return parse_task_id(tt, raw, ValueError)
    except ValueError:
        raise UnknownTask(f"no task {raw!r} in {_table_name(tt)}: {tt.mapping.columns.id!r} holds "
                          f"{python_type.__name__} values") from None


def _table_name(tt: TaskTable) -> str:
    return f"{tt.mapping.schema}.{tt.mapping.table}" if tt.mapping.schema else tt.mapping.table


def _task_row(conn: Connection, tt: TaskTable, key: Any) -> Any:
    t = tt.tasks
    src, type_expr = tt.workflow_type_source(t)

    def opt(logical: str, label: str) -> sa.ColumnElement[Any]:
        return tt.col(logical, t).label(label) if tt.has(logical) else sa.null().label(label)

    q = (sa.select(
        tt.col("id", t).label("pb_id"), tt.col("instance_id", t).label("pb_instance"),
        tt.col("task_key", t).label("pb_key"), tt.col("status", t).label("pb_status"),
        type_expr.label("pb_type"),
        opt("depends_on", "pb_depends_on"), opt("due_at", "pb_due_at"), opt("awaits_signal", "pb_awaits"),
        opt("signal_received_at", "pb_signal_at"), opt("attempts", "pb_attempts"),
        opt("max_attempts", "pb_max_attempts"), opt("dispatched_at", "pb_dispatched_at"),
        opt("completed_at", "pb_completed_at"), opt("updated_at", "pb_updated_at"),
        sa.case((ready_predicate(tt, t), 1), else_=0).label("pb_ready"),
        ready_since(tt, t).label("pb_ready_since"),
        db_now(tt.dialect_name).label("pb_now"),  # SQLite: text, parsed by _utc
    ).select_from(src).where(tt.col("id", t) == key))
    return conn.execute(q).first()


def _dependencies(conn: Connection, tt: TaskTable, row: Any) -> tuple[Dependency, ...]:
    dep = tt.tasks.alias("pb_explain_dep")
    completed_col = tt.col("completed_at", dep).label("completed_at") if tt.has("completed_at") \
        else sa.null().label("completed_at")

    def found(key: str, r: Any) -> Dependency:
        status = None if r.status is None else str(r.status)
        logical = tt.statuses.logical(status)  # a NULL status is whatever the mapping says NULL means
        return Dependency(key, str(r.id), status, logical, as_utc(r.completed_at), logical == "completed")

    out: list[Dependency] = []
    if tt.mapping.dependency_mode == "json":
        keys = _json_keys(row.pb_depends_on)
        if not keys:
            return ()
        rows = {str(r.task_key): r for r in conn.execute(
            sa.select(tt.col("id", dep).label("id"), tt.col("task_key", dep).label("task_key"),
                      tt.col("status", dep).label("status"), completed_col)
            .where(tt.col("instance_id", dep) == row.pb_instance, tt.col("task_key", dep).in_(keys)))}
        for k in keys:
            r = rows.get(k)
            out.append(Dependency(k, None, None, None, None, False) if r is None else found(k, r))
        return tuple(out)
    edges = tt.mapping.edges
    assert tt.edges is not None and edges is not None
    e = tt.edges
    if tt.mapping.dependency_mode == "keys":
        # A workflow definition's edges (task key -> depends-on key) for this row's match columns, each
        # resolved to the rows of the same instance with that key (several for a mapped task, none: missing).
        assert edges.task_key is not None and edges.depends_on_key is not None
        me = tt.tasks.alias("pb_explain_self")
        key_column = tt.mapping.dependency_key_column
        edge_key = e.c[edges.depends_on_key]
        q = (sa.select(edge_key.label("dep_key"), tt.col("id", dep).label("id"),
                       tt.col("task_key", dep).label("task_key"), tt.col("status", dep).label("status"), completed_col)
             .select_from(me.join(e, sa.and_(e.c[edges.task_key] == me.c[key_column],
                                              *(e.c[m] == me.c[m] for m in edges.match)))
                          .outerjoin(dep, sa.and_(tt.key_equal("instance_id", dep, me),
                                                  dep.c[key_column] == edge_key)))
             .where(tt.col("id", me) == row.pb_id).order_by(edge_key, tt.col("task_key", dep)))
        for edge in conn.execute(q):
            out.append(Dependency(str(edge.dep_key), None, None, None, None, False) if edge.id is None
                       else found(str(edge.task_key), edge))
        return tuple(out)
    edge_dep = e.c[edges.depends_on_id]
    q = (sa.select(edge_dep.label("dep_id"), tt.col("id", dep).label("id"), tt.col("task_key", dep).label("task_key"),
                   tt.col("status", dep).label("status"), completed_col)
         .select_from(e.outerjoin(dep, tt.col("id", dep) == edge_dep))
         .where(e.c[edges.task_id] == row.pb_id).order_by(edge_dep))
    for edge in conn.execute(q):
        out.append(Dependency(f"#{edge.dep_id}", None, None, None, None, False) if edge.id is None
                   else found(str(edge.task_key), edge))
    return tuple(out)


def _json_keys(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    if not isinstance(value, list):
        return []
    return [str(v) for v in value]


def _flag_view(store: FlagStore, workflow_type: str | None, instance_id: str) -> FlagView:
    try:
        stored = store.all()
    except FlagStoreUnavailable as exc:
        flag = Flag(workflow_type or "", grace_seconds=store.default_grace)
        return FlagView("polling", None, flag.grace_seconds, flag.event_route(instance_id),
                        flag.poller_route(instance_id), "unavailable",
                        f"{exc}; pollers treat every type as polling until it can be read")
    found = stored.get(workflow_type or "")
    flag = found or Flag(workflow_type or "", grace_seconds=store.default_grace)
    return FlagView(flag.phase, flag.percent, flag.grace_seconds, flag.event_route(instance_id),
                    flag.poller_route(instance_id), "flag" if found is not None else "default",
                    describe(flag) if found is not None else "no flag: polling")


# --- delivery ---------------------------------------------------------------------------------------------

def _deliveries(engine: Engine, bus: EventBus | None, bus_error: str | None, group: str, instance_id: str,
                rows: Sequence[Any]) -> dict[str, DeliveryState]:
    out: dict[str, DeliveryState] = {}
    published = [r for r in rows if r.published_at is not None]
    lookup = {r.event_id for r in published[-DELIVERY_LOOKUPS:]}
    for r in rows:
        if r.published_at is None:
            out[r.event_id] = DeliveryState("unpublished", detail="in the outbox, not yet published by the relay")
        elif r.event_id not in lookup:
            out[r.event_id] = DeliveryState("unknown", detail=f"not looked up (only the latest {DELIVERY_LOOKUPS} "
                                                              "published events are)")
    wanted = [r for r in published if r.event_id in lookup]
    if not wanted:
        return out
    if bus is None:
        reason = bus_error or "no bus given"
        out.update({r.event_id: DeliveryState("unknown", detail=reason) for r in wanted})
        return out
    partition = partition_for(instance_id, bus.partitions)
    try:
        found = bus.delivery_states(group, [EventRef(r.event_id, instance_id, as_utc(r.published_at))
                                            for r in wanted])
    except NotImplementedError:
        out.update({r.event_id: DeliveryState("unknown", partition, detail=f"{type(bus).__name__} cannot tell")
                    for r in wanted})
    except Exception as exc:  # an unreachable bus only makes delivery unknown
        out.update({r.event_id: DeliveryState("unknown", partition, detail=f"bus unreachable: {first_line(exc)}")
                    for r in wanted})
    else:
        out.update({r.event_id: _state(found[r.event_id], group) for r in wanted})
    return out


def _state(d: EventDelivery, group: str) -> DeliveryState:
    """What the bus answered, in explain's words."""
    if d.state == NOT_FOUND:
        return DeliveryState("unknown", d.partition, detail=d.detail)
    if d.state == DEAD_LETTERED:
        return DeliveryState("dead_lettered", d.partition, d.entry_id,
                             detail=f"dead-lettered by group {group} (see `pollbridge dlq list`)")
    if d.state == PENDING:
        return DeliveryState("pending", d.partition, d.entry_id, d.deliveries, d.consumer,
                             f"delivered to {d.consumer} of group {group}, not acknowledged")
    if d.state == ACKNOWLEDGED:
        return DeliveryState("acknowledged", d.partition, d.entry_id,
                             detail=f"delivered to group {group} and acknowledged")
    if d.state == UNDELIVERED:
        return DeliveryState("undelivered", d.partition, d.entry_id,
                             detail=f"on the bus, not yet read by group {group}")
    return DeliveryState("unknown", d.partition, d.entry_id, detail=f"the bus answered {d.state!r}")


# --- the answer -------------------------------------------------------------------------------------------

def _with_answer(x: Explanation) -> Explanation:
    return replace(x, answer=answer_for(x))


def answer_for(x: Explanation) -> Answer:
    """The one-sentence answer to "why was this task (not yet) triggered?"."""
    name = f"Task {x.task_id} ({x.task_key} of instance {x.instance_id}"
    name += f", type {x.workflow_type})" if x.workflow_type else ")"
    logical = x.logical_status
    last = x.dispatches[-1] if x.dispatches else None
    parked = next((e for e in x.review if e.decision is None), None)
    if parked is not None:
        return Answer("held_for_review", f"{name} is parked for review since {_fmt(parked.parked_at)} "
                                         f"(by {parked.parked_by}): {parked.reason}. No path dispatches it until a "
                                         f"person decides: `pollbridge review release {x.task_id}` lets it run, "
                                         f"`pollbridge review reject {x.task_id} --reason TEXT` fails it.")
    if logical == "completed":
        how = f"; {_dispatch_clause(x, last)}" if last is not None else "; pollbridge recorded no dispatch of it"
        return Answer("completed", f"{name} completed at {_fmt(x.completed_at)}{how}.")
    if logical in ("dispatched", "running"):
        if last is None:
            if x.foreign:
                return Answer("dispatched", f"{name} is {x.status} since {_fmt(x.dispatched_at)}, dispatched by "
                                            "the legacy scheduler; its dispatch is not recorded yet (the relay "
                                            "records it when it publishes the captured change).")
            return Answer("dispatched", f"{name} is {x.status} since {_fmt(x.dispatched_at)}, dispatched by a "
                                        "dispatcher pollbridge did not record (no row in pollbridge_dispatch_log).")
        state = "running" if logical == "running" else f"waiting for a worker (status {x.status})"
        return Answer("dispatched", f"{name} was {_dispatch_clause(x, last)}; it is now {state}.")
    if logical == "failed":
        return _failed(x, name)
    if logical == "review":
        return Answer("held_for_review", f"{name} is in the review status ({x.status}) but not in pollbridge's review "
                                         "queue (set by hand or by the platform): no path dispatches it until "
                                         "something moves it back to pending.")
    if logical == "pending":
        return _pending(x, name)
    return Answer("unknown_status", f"{name} has status {x.status!r}, which the mapping does not know; "
                                    "neither path dispatches it.")


def _path_name(path: str, phase: str, foreign: bool = False) -> str:
    if path == "fallback":
        return "the safety sweep (an event-path miss)" if phase == "cutover" \
            else "the poller's fallback (an event-path miss)"
    if path == "poller" and foreign:
        return FOREIGN_LEGACY
    return PATH_NAMES.get(path, f"path {path}")


def _dispatch_clause(x: Explanation, d: Dispatch) -> str:
    text = f"dispatched by {_path_name(d.path, d.phase, x.foreign)} at {_fmt(d.dispatched_at)}"
    if d.latency_ms is None and x.foreign and d.path == "poller":
        text += " (captured from the task table, which records no ready time)"
    elif d.latency_ms is None:
        text += " (its ready time was not recorded)"
    elif d.latency_ms < 0:
        text += f", {_fmt_ms(-d.latency_ms)} BEFORE it became ready (an early dispatch: a safety violation)"
    else:
        text += f", {_fmt_ms(d.latency_ms)} after it became ready"
    text += f", while the type was in phase {d.phase}"
    if len(x.dispatches) > 1:
        text += f" (dispatch {len(x.dispatches)} of the task)"
    return text


def _failed(x: Explanation, name: str) -> Answer:
    rejected = next((e for e in reversed(x.review) if e.decision == "rejected"), None)
    if rejected is not None:
        return Answer("rejected", f"{name} was parked for review ({rejected.reason}) and rejected by "
                                  f"{rejected.decided_by} at {_fmt(rejected.decided_at)}: {rejected.decision_reason}; "
                                  "it failed for good and no path will dispatch it.")
    rejection = next((s for s in reversed(x.readiness.signals) if s.kind == "rejection"), None)
    if rejection is not None:
        who = f" by {rejection.actor}" if rejection.actor else ""
        return Answer("rejected", f"{name} was rejected{who} at {_fmt(rejection.received_at)} and failed for good; "
                                  "no path will dispatch it.")
    if x.attempts is None or x.max_attempts is None:
        return Answer("failed_terminal", f"{name} failed at {_fmt(x.completed_at)}; the mapping has no attempts "
                                         "columns, so pollbridge does not retry it.")
    if x.attempts >= x.max_attempts:
        return Answer("failed_terminal", f"{name} failed terminally at {_fmt(x.completed_at)} after {x.attempts} of "
                                         f"{x.max_attempts} attempts; no path will dispatch it again.")
    owner = ("the event path re-pends it after its backoff" if x.flag.poller_route in ("fallback", "sweep")
             else "the legacy poller re-pends it at its next scan")
    return Answer("failed_retrying", f"{name} failed on attempt {x.attempts} of {x.max_attempts} and waits for its "
                                     f"retry: {owner} (type in phase {_phase_text(x.flag)}).")


def _pending(x: Explanation, name: str) -> Answer:
    r = x.readiness
    if not r.ready_now:
        blockers: list[tuple[str, str]] = []
        unmet = r.unmet
        if unmet:
            parts = [f"{d.key} (missing: no such task in the instance)" if d.task_id is None
                     else f"{d.key} (status {d.status})" for d in unmet]
            word = "dependency" if len(unmet) == 1 else "dependencies"
            blockers.append(("waiting_dependency", f"waiting for {word} {', '.join(parts)}"))
        if r.due is False and r.due_at is not None:
            seconds = (r.due_at - r.checked_at).total_seconds()
            blockers.append(("not_due", f"due at {_fmt(r.due_at)} (in {_fmt_seconds(seconds)})"))
        if r.awaits_signal is not None and r.signal_received_at is None:
            blockers.append(("awaiting_signal", f"awaiting signal {r.awaits_signal!r}"))
        if not blockers:
            return Answer("not_ready", f"{name} is pending and not ready yet by the database's clock "
                                       f"({_fmt(r.checked_at)}); look again in a moment.")
        return Answer(blockers[0][0], f"{name} is not triggered yet: {'; '.join(b for _, b in blockers)}.")
    since = r.ready_since
    waited = (r.checked_at - since).total_seconds() if since is not None else None
    ready = f"{name} is ready since {_fmt(since)}" + (f" ({_fmt_seconds(waited)} ago)" if waited is not None else "")
    flag = x.flag
    phase = _phase_text(flag)
    past_grace = waited is not None and waited > flag.grace_seconds
    attempt = (x.attempts or 0) + 1 if x.attempts is not None else None
    decided = next((d for d in reversed(x.decisions) if attempt is None or d.attempt == attempt), None)
    hold = x.hold
    if hold is not None and hold.legit and flag.event_route == "dispatch":
        limit = "in-flight cap (max_in_flight)" if hold.reason == "in_flight" else "rate limit (rate, burst)"
        return Answer("held_back", f"{ready} and held back by backpressure: its type's {limit} is reached. "
                                   f"{hold.holder} holds it since {_fmt(hold.held_at)} and looks again by "
                                   f"{_fmt(hold.until)}; while the hold lasts neither the poller's fallback nor the "
                                   "safety sweep takes it, and it is not an event-path miss.")
    if flag.source == "unavailable":
        why = ("the flag store cannot be read, so the legacy poller treats every type as polling and dispatches it "
               "at its next scan")
    elif flag.poller_route == "sweep":
        why = (f"the type is in phase {phase}, so the event path should have dispatched it"
               + _event_hint(x)
               + ("; it has been ready longer than the grace period "
                  f"({flag.grace_seconds:g} s), so the next safety sweep dispatches it (an event-path miss)"
                  if past_grace else
                  f"; the safety sweep will catch it after the grace period ({flag.grace_seconds:g} s)"))
    elif flag.poller_route == "fallback":
        why = (f"the type is in phase {phase} and its instance is in the event path's share, so the event path "
               "should have dispatched it" + _event_hint(x)
               + ("; it has been ready longer than the grace period "
                  f"({flag.grace_seconds:g} s), so the poller's next scan dispatches it as a fallback (an event-path "
                  "miss)" if past_grace else
                  f"; the poller's fallback dispatches it once it has been ready for the grace period "
                  f"({flag.grace_seconds:g} s)"))
    else:
        share = (" and its instance is outside the event path's share" if flag.phase == "selective" else "")
        why = f"the type is in phase {phase}{share}, so the legacy poller should dispatch it at its next scan"
        if flag.phase == "dual_write":
            why += (f" (the event path recorded its shadow decision at {_fmt(decided.decided_at)})"
                    if decided is not None else " (the event path has recorded no shadow decision for it yet)")
    return Answer("ready_not_dispatched", f"{ready} but not dispatched: {why}.")


def _event_hint(x: Explanation) -> str:
    """Where the task's latest event is on its way to the scheduler (when that explains the miss)."""
    if not x.events:
        return " (no outbox event of the task is retained)"
    last = x.events[-1]
    state = last.delivery.state
    if state == "unpublished":
        return " (its latest event is still unpublished in the outbox: is the relay running?)"
    if state == "undelivered":
        return " (its latest event is on the bus but not yet read by the scheduler: is it running, or lagging?)"
    if state == "pending":
        return " (its latest event was delivered but not acknowledged: the scheduler may be failing on it)"
    if state == "dead_lettered":
        return " (its latest event was dead-lettered: see `pollbridge dlq list`)"
    return ""


def _phase_text(flag: FlagView) -> str:
    if flag.phase == "selective" and flag.percent is not None:
        return f"selective {flag.percent:g}%"
    return flag.phase


# --- small helpers ----------------------------------------------------------------------------------------


def _latency(ready_at: Any, at: Any) -> float | None:
    start, end = as_utc(ready_at), as_utc(at)
    if start is None or end is None:
        return None
    return (end - start) / timedelta(milliseconds=1)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _fmt(value: datetime | None) -> str:
    if value is None:
        return "an unrecorded time"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _fmt_ms(ms: float) -> str:
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:,.0f} ms"


def _fmt_seconds(seconds: float) -> str:
    if abs(seconds) < 120:
        return f"{seconds:.1f} s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"

