"""Events: the CloudEvents 1.0 JSON envelope pollbridge puts on the bus.

``id`` is unique and is the idempotency key; ``subject`` is the task id; ``partitionkey`` is the
instance id (one instance's events stay on one partition); ``traceid`` and ``depth`` are
extensions (trace propagation and the causation depth guard). ``data`` carries the instance id,
workflow type, task key, old and new status (``null`` for a NULL status), the per-task version, the kind of
change and, when the task table's attempts column is mapped and not NULL, the ``attempt``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from bridge.core.errors import PollbridgeError

SPECVERSION = "1.0"
SOURCE = "pollbridge"

TASK_STATUS_CHANGED = "task.status_changed"
TASK_SIGNAL_RECEIVED = "task.signal_received"
TIMER_EXPIRED = "timer.expired"
EXTERNAL_CALLBACK = "external.callback"
HUMAN_APPROVED = "human.approved"
HUMAN_REJECTED = "human.rejected"
EVENT_TYPES = (TASK_STATUS_CHANGED, TASK_SIGNAL_RECEIVED, TIMER_EXPIRED, EXTERNAL_CALLBACK, HUMAN_APPROVED,
               HUMAN_REJECTED)
#: The types of a captured change of a task row (``data.change``): a signal has its own type, every other change
#: (insert, status, due time) is a status change. A consumer of task changes accepts both.
TASK_CHANGE_TYPES = (TASK_STATUS_CHANGED, TASK_SIGNAL_RECEIVED)
#: The kinds of captured change (``data.change``, the outbox's ``change``): an inserted row, a status, due-time
#: or signal change, and ``identity``: the row's id changed and nothing else watched did (a scheduler that gives
#: a retried task a new physical row id by an UPDATE). ``identity`` is a ``task.status_changed`` event; a
#: consumer that does not know it evaluates the whole instance.
TASK_CHANGES = ("insert", "status", "due", "signal", "identity")


def change_event_type(change: str) -> str:
    """The CloudEvent type of a captured change: ``task.signal_received`` for ``signal``, else
    ``task.status_changed``."""
    return TASK_SIGNAL_RECEIVED if change == "signal" else TASK_STATUS_CHANGED


_REQUIRED = ("specversion", "id", "source", "type", "subject", "time", "partitionkey")


class EventFormatError(PollbridgeError):
    """A bus entry is not a pollbridge CloudEvent; it goes to a dead letter with this message."""


def new_event_id() -> str:
    return str(uuid.uuid4())


def new_trace_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class CloudEvent:
    id: str
    type: str
    subject: str
    partitionkey: str
    time: datetime
    data: dict[str, Any] = field(default_factory=dict)
    source: str = SOURCE
    traceid: str | None = None
    depth: int = 0

    def to_json(self) -> str:
        envelope: dict[str, Any] = {
            "specversion": SPECVERSION,
            "id": self.id,
            "source": self.source,
            "type": self.type,
            "subject": self.subject,
            "time": _iso(self.time),
            "datacontenttype": "application/json",
            "partitionkey": self.partitionkey,
            "depth": self.depth,
            "data": self.data,
        }
        if self.traceid:
            envelope["traceid"] = self.traceid
        return json.dumps(envelope, separators=(",", ":"), sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str | bytes) -> CloudEvent:
        """Parse and validate; raise :class:`EventFormatError` saying what is wrong."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise EventFormatError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise EventFormatError(f"not a JSON object but {type(raw).__name__}")
        missing = [k for k in _REQUIRED if raw.get(k) in (None, "")]
        if missing:
            raise EventFormatError(f"missing CloudEvents attribute(s): {', '.join(missing)}")
        if raw["specversion"] != SPECVERSION:
            raise EventFormatError(f"unsupported specversion {raw['specversion']!r}; expected {SPECVERSION!r}")
        for key in ("id", "source", "type", "subject", "partitionkey"):
            if not isinstance(raw[key], str):
                raise EventFormatError(f"attribute {key!r} must be a string")
        data = raw.get("data", {})
        if not isinstance(data, dict):
            raise EventFormatError("attribute 'data' must be a JSON object")
        depth = raw.get("depth", 0)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise EventFormatError(f"extension 'depth' must be a non-negative integer, got {depth!r}")
        traceid = raw.get("traceid")
        if traceid is not None and not isinstance(traceid, str):
            raise EventFormatError("extension 'traceid' must be a string")
        try:
            when = datetime.fromisoformat(str(raw["time"]).replace("Z", "+00:00"))
        except ValueError:
            raise EventFormatError(f"attribute 'time' is not an RFC 3339 timestamp: {raw['time']!r}") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return cls(id=raw["id"], type=raw["type"], subject=raw["subject"], partitionkey=raw["partitionkey"],
                   time=when, data=data, source=raw["source"], traceid=traceid, depth=depth)


@dataclass(frozen=True)
class EncodedEvent(CloudEvent):
    """An event whose JSON was already produced (by the database, for the relay's hot path).

    Only ``id``, ``partitionkey`` and :meth:`to_json` are meaningful; a consumer always re-parses the
    payload with :meth:`CloudEvent.from_json`, which validates it like any other."""

    encoded: str = ""

    def to_json(self) -> str:
        return self.encoded


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def encoded_event(event_id: str, partitionkey: str, subject: str, payload: str) -> EncodedEvent:
    return EncodedEvent(id=event_id, type=TASK_STATUS_CHANGED, subject=subject, partitionkey=partitionkey,
                        time=_EPOCH, encoded=payload)


def _iso(value: datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
