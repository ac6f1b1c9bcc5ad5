"""External callbacks and human approvals: recording a signal through the mapping.

``callback`` and ``approval`` set the task's signal-received time, which makes it ready (if the rest
of its readiness holds); ``rejection`` fails the task for good (attempts set to the maximum, so no
retry). A task whose awaited signal is named after a kind takes only that kind (:func:`answers`): one
that awaits ``approval`` takes an approval or a rejection (the way to refuse it), one that awaits
``callback`` only a callback; a wrong kind is refused and records nothing. A task that awaits a signal of
the platform's own naming (``manager``, ``payment``, ...) takes any kind.

The change is captured like any other, so the event path reacts within milliseconds and the poller at
its next scan. Every signal is also recorded in ``pollbridge_signals`` (kind, payload,
actor), in the same transaction. A signal that cannot apply changes nothing and says why.
"""

from __future__ import annotations

import getpass
import json
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.db.engine import db_now
from bridge.db.schema import signals
from bridge.tasktable.tables import TaskTable, parse_task_id
from event_scheduler.exceptions import SignalError

SignalKind = Literal["callback", "approval", "rejection"]
KINDS: tuple[SignalKind, ...] = ("callback", "approval", "rejection")
MAX_PAYLOAD = 64 * 1024
#: The kinds that answer a task whose awaited signal is named after a kind; any other awaited name takes any kind.
ANSWERED_BY: dict[str, tuple[SignalKind, ...]] = {"callback": ("callback",), "approval": ("approval", "rejection")}


@dataclass(frozen=True)
class SignalResult:
    task_id: str
    kind: str
    new_status: str


def _task_id(tt: TaskTable, raw: str) -> Any:
    return parse_task_id(tt, raw, SignalError)


def answers(kind: str, awaited: str) -> bool:
    """Whether a signal of ``kind`` answers a task that awaits ``awaited`` (see the module docstring)."""
    return kind in ANSWERED_BY.get(awaited, KINDS)


def record_signal(engine: Engine, tt: TaskTable, task_id: str, kind: str, *, payload: str | None = None,
                  actor: str | None = None) -> SignalResult:
    """Record a signal for ``task_id``; raise :class:`SignalError` (changing nothing) if it cannot apply."""
    if kind not in KINDS:
        raise SignalError(f"unknown signal kind {kind!r}; expected one of {', '.join(KINDS)}")
    if not tt.has("awaits_signal"):
        raise SignalError("the mapping has no awaited-signal columns (mapping.columns.awaits_signal, "
                          "signal_received_at): signals cannot be recorded")
    if payload is not None:
        if len(payload) > MAX_PAYLOAD:
            raise SignalError(f"payload is {len(payload)} bytes; the limit is {MAX_PAYLOAD}")
        try:
            json.loads(payload)
        except ValueError as exc:
            raise SignalError(f"payload is not valid JSON: {exc}") from None
    key = _task_id(tt, task_id)
    st = tt.statuses
    cols = tt.mapping.columns
    with engine.begin() as conn:
        row = conn.execute(sa.select(tt.col("status"), tt.col("awaits_signal"), tt.col("signal_received_at"))
                           .where(tt.col("id") == key)).first()
        if row is None:
            raise SignalError(f"no task {task_id!r} in {tt.mapping.table}")
        status, awaits, received = row
        if awaits is None:
            raise SignalError(f"task {task_id} awaits no signal")
        if received is not None:
            raise SignalError(f"task {task_id} already received its signal {awaits!r}")
        if not answers(kind, str(awaits)):
            expected = " or ".join(repr(k) for k in ANSWERED_BY[str(awaits)])
            raise SignalError(f"task {task_id} awaits {awaits!r}: a {kind!r} signal does not answer it "
                              f"(send {expected})")
        if st.logical(status) != "pending":
            raise SignalError(f"task {task_id} is {status!r}, not pending: a signal cannot change it")
        now = db_now(tt.dialect_name)
        values: dict[str, Any] = {cols.signal_received_at or "": now}
        new_status = status
        if kind == "rejection":
            new_status = st.write("failed")
            values[cols.status] = new_status
            if cols.completed_at:
                values[cols.completed_at] = now
            if cols.attempts and cols.max_attempts:
                values[cols.attempts] = tt.col("max_attempts")
        if cols.updated_at:
            values[cols.updated_at] = now
        changed = conn.execute(tt.tasks.update().where(
            tt.col("id") == key, tt.status_in("pending"), tt.col("signal_received_at").is_(None))
            .values(values)).rowcount
        if changed != 1:
            raise SignalError(f"task {task_id} changed while the signal was being recorded; try again")
        conn.execute(signals.insert().values(task_id=str(key), kind=kind, payload=payload,
                                             actor=actor or _os_user(), received_at=now))
    return SignalResult(str(key), kind, new_status)


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"
