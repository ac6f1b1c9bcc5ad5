"""What ``GET /tasks/{id}`` and ``POST /signals/{task_id}`` do with the database (blocking: run off the event loop).

* :func:`task_status` reads one task row through the mapping: the current status, for clients that
  cannot take a stream.
* :func:`accept_signal` records a signal through :func:`event_scheduler.signals.record_signal`, the
  same internal path as ``pollbridge signal`` (same checks, same messages, the same captured change),
  then finds the id of the event that change produced: the outbox row the capture trigger wrote for
  the task in the signal's transaction. Rows are looked up above the outbox's highest id read just
  before the signal (a primary-key range, however large the outbox), so the look-up stays cheap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.db.engine import read_only
from bridge.db.schema import outbox
from bridge.tasktable.tables import TaskTable
from event_scheduler.exceptions import SignalError
from event_scheduler.signals import KINDS, record_signal

#: Largest request body the webhook reads (the signal payload itself is limited to 64 KiB by record_signal).
MAX_BODY = 256 * 1024


class RequestError(Exception):
    """A request the service refuses; ``status`` is the HTTP status, ``code`` a stable short name."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class SignalRequest:
    kind: str
    payload: str | None
    actor: str | None
    task_id: str  # the body names the task (it must be the path's): a signature cannot be moved to another task


def parse_signal_body(body: bytes) -> SignalRequest:
    """``{"task_id": "7", "kind": "callback"|"approval"|"rejection", "payload": <any JSON>?, "actor": "name"?}``.

    The signature covers the body, not the path; the body names the task so that a signed request cannot be
    sent to another task (and two senders' identical signals to different tasks in one second differ)."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestError(400, "bad_request", f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RequestError(400, "bad_request", "the body must be a JSON object with 'kind'")
    unknown = sorted(set(doc) - {"kind", "payload", "actor", "task_id"})
    if unknown:
        raise RequestError(400, "bad_request", f"unknown key(s) in the body: {', '.join(unknown)}; "
                                               "expected kind, payload, actor, task_id")
    kind = doc.get("kind")
    if kind not in KINDS:
        raise RequestError(400, "bad_request", f"unknown signal kind {kind!r}; expected one of {', '.join(KINDS)}")
    actor = doc.get("actor")
    if actor is not None and (not isinstance(actor, str) or not actor or len(actor) > 200):
        raise RequestError(400, "bad_request", "'actor' must be a non-empty string of at most 200 characters")
    task_id = doc.get("task_id")
    if task_id is None:
        raise RequestError(400, "bad_request", "the body must name the task ('task_id', the same as the path's), "
                                               "so that its signature cannot be used for another task")
    if isinstance(task_id, bool) or not isinstance(task_id, str | int):
        raise RequestError(400, "bad_request", "'task_id' must be a string or an integer")
    payload = None if "payload" not in doc or doc["payload"] is None else json.dumps(doc["payload"])
    return SignalRequest(str(kind), payload, actor, str(task_id))


def _signal_status(exc: SignalError) -> tuple[int, str]:
    """The HTTP status of a refused signal; the message stays the CLI's, word for word."""
    text = str(exc)
    if text.startswith("no task") or " is not a valid " in text:
        return 404, "unknown_task"
    if text.startswith(("unknown signal kind", "payload")):
        return 400, "bad_request"
    return 409, "conflict"  # awaits no signal, already received, not pending, changed meanwhile, no signal columns


@dataclass(frozen=True)
class AcceptedSignal:
    task_id: str
    kind: str
    new_status: str
    event_id: str | None  # None: the change produced no outbox row (capture not installed on this table)

    def to_json(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "kind": self.kind, "status": self.new_status, "event_id": self.event_id}


def accept_signal(engine: Engine, tt: TaskTable, task_id: str, request: SignalRequest,
                  default_actor: str = "webhook") -> AcceptedSignal:
    """Record the signal (raising :class:`RequestError` with the CLI's message when it cannot apply)."""
    if request.task_id != task_id:
        raise RequestError(400, "bad_request", f"the body names task {request.task_id!r} but the path task "
                                               f"{task_id!r}")
    reader = read_only(engine)
    with reader.connect() as conn:
        before = int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(outbox.c.id), 0))).scalar_one())
        conn.rollback()
    try:
        result = record_signal(engine, tt, task_id, request.kind, payload=request.payload,
                               actor=request.actor or default_actor)
    except SignalError as exc:
        status, code = _signal_status(exc)
        raise RequestError(status, code, str(exc)) from None
    with reader.connect() as conn:
        event_id = conn.execute(
            sa.select(outbox.c.event_id)
            .where(outbox.c.id > before, outbox.c.task_id == result.task_id,
                   outbox.c.change.in_(("signal", "status")), outbox.c.new_status == result.new_status)
            .order_by(outbox.c.id).limit(1)).scalar()
        conn.rollback()
    return AcceptedSignal(result.task_id, result.kind, result.new_status, None if event_id is None else str(event_id))


def task_status(engine: Engine, tt: TaskTable, task_id: str) -> dict[str, Any]:
    """The task's row as JSON (mapped columns only); :class:`RequestError` 404 for an unknown id."""
    key = _task_key(tt, task_id)
    t = tt.tasks
    src, type_expr = tt.workflow_type_source(t)
    optional = [c for c in ("attempts", "max_attempts", "due_at", "awaits_signal", "signal_received_at",
                            "dispatched_at", "completed_at", "updated_at") if tt.has(c)]
    query = (sa.select(tt.col("id", t).label("id"), tt.col("instance_id", t).label("instance_id"),
                       tt.col("task_key", t).label("task_key"), tt.col("status", t).label("status"),
                       type_expr.label("workflow_type"), *(tt.col(c, t).label(c) for c in optional))
             .select_from(src).where(tt.col("id", t) == key))
    with read_only(engine).connect() as conn:
        row = conn.execute(query).first()
        conn.rollback()
    if row is None:
        raise RequestError(404, "unknown_task", f"no task {task_id!r} in {tt.mapping.table}")
    doc: dict[str, Any] = {
        "task_id": str(row.id), "instance_id": str(row.instance_id), "task_key": str(row.task_key),
        "workflow_type": None if row.workflow_type is None else str(row.workflow_type),
        "status": str(row.status), "logical_status": tt.statuses.logical(str(row.status)),
    }
    for column in optional:
        doc[column] = _json_value(getattr(row, column))
    return doc


def _task_key(tt: TaskTable, raw: str) -> Any:
    try:
        python_type = tt.col("id").type.python_type
    except NotImplementedError:
        return raw
    if python_type is str:
        return raw
    try:
        return python_type(raw)
    except (TypeError, ValueError):
        raise RequestError(404, "unknown_task", f"no task {raw!r} in {tt.mapping.table} (not a valid "
                                                f"{python_type.__name__})") from None


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        moment = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
