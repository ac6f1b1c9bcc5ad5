"""Server-Sent Events of task status changes, fed from the bus (never from polling the database).

**One bus reader per process.** A :class:`Hub` thread tails every partition of the bus with
:meth:`EventBus.tail` (read-only, no consumer group: it can never take an entry from the scheduler's
group, and it adds one reader whatever the number of clients). It routes each ``task.status_changed``
event to the clients subscribed to its instance (``partitionkey``) or its workflow type
(``data.workflow_type``) by dictionary look-up, so idle clients cost the reader nothing.

**Bounded buffers, never blocking the reader.** Each client has a buffer of ``sse_buffer`` events. The
reader only appends to it (under a per-client lock held for an append) and wakes the client's coroutine
with ``call_soon_threadsafe``; it never waits for a client. A client whose buffer is full (it reads
slower than events come, or vanished without closing) is dropped: its buffer is emptied, and it gets a
last ``event: dropped`` frame with the reason before its stream ends. It can reconnect with its last
event id and resume, since the bus still holds the entries.

**Ids and resuming (``Last-Event-ID``).** Each event frame's ``id`` is a *bus cursor*: comma-separated
``partition:entry_id`` pairs, the bus entry id (embedded: the log id, Redis: the stream id) of the last
entry the stream passed on each partition it covers. An instance stream covers its instance's partition
(``id: 3:1718000000000-0``); a type stream covers every partition (``id: 0:…,1:…,…``). A stream's first
frame carries the cursor it starts from, so a client that disconnects before any event resumes from
where it connected. A reconnecting client sends the last id it saw (``Last-Event-ID`` header, or the
``last_event_id`` query parameter for clients that cannot set headers): the stream replays what the bus
holds after that cursor (with :meth:`EventBus.tail`, up to the point the hub had reached when the client
subscribed), then continues live, skipping what it already replayed: no gap, no duplicate. For an
instance stream a bare entry id (``1718000000000-0``) is accepted too. The CloudEvent id (the
idempotency key) is inside each frame's data for clients that dedupe by event.

Resuming works as far back as the bus retains entries (``relay.retention`` and the scheduler group's
trimming); older than that, re-read the task with ``GET /tasks/{id}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bridge.bus.base import Delivery, EventBus, entry_order, partition_for
from bridge.core.backoff import Backoff
from bridge.core.errors import first_line
from bridge.core.events import TASK_CHANGE_TYPES

log = logging.getLogger(__name__)

#: Most entries the hub reads per partition per call (fewer with small client buffers: see Hub), and the
#: longest it blocks in one call.
READ_COUNT = 500
READ_BLOCK = 1.0
#: Entries a resuming stream replays per partition per call.
REPLAY_COUNT = 500
#: Backoff of the hub after a failed read (doubling up to the maximum).
RETRY_MIN = 0.2
RETRY_MAX = 5.0


class CursorError(ValueError):
    """A ``Last-Event-ID`` that is not a cursor of this stream (400)."""


def format_cursor(positions: Mapping[int, str]) -> str:
    return ",".join(f"{p}:{positions[p]}" for p in sorted(positions))


def parse_cursor(text: str, partitions: Sequence[int], total: int) -> dict[int, str]:
    """The positions of ``text`` for ``partitions`` (those the stream covers); every one must be there."""
    text = text.strip()
    positions: dict[int, str] = {}
    if ":" not in text and len(partitions) == 1:
        positions[partitions[0]] = text  # a bare entry id on an instance stream
    else:
        for part in text.split(","):
            head, sep, entry = part.strip().partition(":")
            if not sep or not head.isdigit() or int(head) >= total:
                raise CursorError(f"Last-Event-ID {text!r} is not a cursor of 'partition:entry_id' pairs "
                                  f"(partitions 0..{total - 1})")
            positions[int(head)] = entry
    for p, entry in positions.items():
        try:
            entry_order(entry)
        except ValueError:
            raise CursorError(f"Last-Event-ID {text!r}: {entry!r} is not a bus entry id") from None
        if p not in partitions:
            raise CursorError(f"Last-Event-ID {text!r} names partition {p}, which this stream does not cover")
    missing = [p for p in partitions if p not in positions]
    if missing:
        raise CursorError(f"Last-Event-ID {text!r} has no position for partition(s) "
                          f"{', '.join(map(str, missing))}")
    return positions


@dataclass(frozen=True)
class Item:
    """One event as the streams send it."""

    partition: int
    entry_id: str
    event_type: str
    payload: str  # the CloudEvent JSON, one line


@dataclass(frozen=True)
class Filter:
    """Which events a stream wants: one instance's, or one workflow type's."""

    kind: str  # 'instance' or 'type'
    value: str

    def matches(self, d: Delivery) -> bool:
        if d.event is None or d.event.type not in TASK_CHANGE_TYPES:
            return False
        if self.kind == "instance":
            return d.event.partitionkey == self.value
        return str(d.event.data.get("workflow_type")) == self.value


def item_of(d: Delivery) -> Item:
    payload = d.payload if "\n" not in d.payload and "\r" not in d.payload else \
        json.dumps(json.loads(d.payload), separators=(",", ":"))
    return Item(d.partition, d.entry_id, d.event.type if d.event is not None else "", payload)


class Subscriber:
    """One SSE client's bounded buffer. ``offer`` runs on the hub's thread; the rest on the event loop."""

    def __init__(self, filter_: Filter, partitions: Sequence[int], buffer_size: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.filter = filter_
        self.partitions = tuple(partitions)
        self.buffer_size = buffer_size
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[Item] = deque()
        self._wake = asyncio.Event()
        self._wake_scheduled = False
        self.dropped: str | None = None

    def offer(self, item: Item) -> bool:
        """Buffer ``item``; ``False`` when the client is (now) dropped. Never blocks on the client."""
        with self._lock:
            if self.dropped is not None:
                return False
            if len(self._items) >= self.buffer_size:
                self.dropped = (f"too slow: {self.buffer_size} events were waiting for this client (serve.sse_buffer);"
                                " reconnect with the last event id to resume")
                self._items.clear()
                self._schedule_wake()
                return False
            self._items.append(item)
            self._schedule_wake()
            return True

    def close(self, reason: str) -> None:
        """End the stream with ``reason`` (server shutting down)."""
        with self._lock:
            if self.dropped is None:
                self.dropped = reason
                self._items.clear()
            self._schedule_wake()

    def _schedule_wake(self) -> None:
        if self._wake_scheduled:
            return
        self._wake_scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._set_wake)

    def _set_wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        self._wake.set()

    def take(self) -> list[Item]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._wake.clear()
        return items

    async def wait(self, timeout: float) -> bool:
        """Wait for an offer or a drop; ``False`` when ``timeout`` passed without one."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            return False
        return True


@dataclass
class HubStats:
    entries_read: int = 0
    events_routed: int = 0
    reads: int = 0
    failures: int = 0
    last_read_at: float = 0.0  # time.time() of the last successful read
    last_error: str | None = None
    dropped: int = 0
    clients: dict[str, int] = field(default_factory=lambda: {"instance": 0, "type": 0})


class Hub:
    """The process's one bus reader and its subscribers (see the module docstring)."""

    def __init__(self, bus: EventBus, *, buffer_size: int, read_count: int = READ_COUNT,
                 read_block: float = READ_BLOCK, on_drop: Callable[[Subscriber], None] | None = None) -> None:
        self.bus = bus
        self.buffer_size = buffer_size
        # One read must fit in a client's buffer even when every entry is for that client (a type stream over
        # every partition), so a client that keeps up is never dropped by a single burst.
        self._count = max(1, min(read_count, buffer_size // (2 * bus.partitions)))
        self._block = read_block
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._positions: dict[int, str] = {}
        self._by_instance: dict[str, set[Subscriber]] = {}
        self._by_type: dict[str, set[Subscriber]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = HubStats()
        self.healthy = False

    # --- life cycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start at the bus's current end (a failure to read it is retried by the thread)."""
        self._thread = threading.Thread(target=self._run, name="pollbridge-sse-hub", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.close_all("the server is shutting down; reconnect with the last event id to resume")
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def positions(self) -> dict[int, str]:
        with self._lock:
            return dict(self._positions)

    # --- subscribers -------------------------------------------------------------------------------
    def subscribe(self, filter_: Filter, loop: asyncio.AbstractEventLoop) -> tuple[Subscriber, dict[int, str]]:
        """Register a client; returns it and the hub's positions at that moment on the partitions it covers:
        everything after them reaches its buffer."""
        partitions = self.partitions_of(filter_)
        sub = Subscriber(filter_, partitions, self.buffer_size, loop)
        with self._lock:
            index = self._by_instance if filter_.kind == "instance" else self._by_type
            index.setdefault(filter_.value, set()).add(sub)
            self.stats.clients[filter_.kind] += 1
            snapshot = {p: self._positions.get(p, "0") for p in partitions}
        return sub, snapshot

    def unsubscribe(self, sub: Subscriber) -> None:
        with self._lock:
            self._remove(sub)

    def _remove(self, sub: Subscriber) -> None:
        index = self._by_instance if sub.filter.kind == "instance" else self._by_type
        subs = index.get(sub.filter.value)
        if subs is not None and sub in subs:
            subs.discard(sub)
            self.stats.clients[sub.filter.kind] -= 1
            if not subs:
                del index[sub.filter.value]

    def close_all(self, reason: str) -> None:
        with self._lock:
            subs = [s for index in (self._by_instance, self._by_type) for group in index.values() for s in group]
        for sub in subs:
            sub.close(reason)

    def partitions_of(self, filter_: Filter) -> list[int]:
        if filter_.kind == "instance":
            return [partition_for(filter_.value, self.bus.partitions)]
        return list(range(self.bus.partitions))

    @property
    def ready(self) -> bool:
        """The hub knows where the bus ends (it has read the end positions at least once)."""
        with self._lock:
            return len(self._positions) == self.bus.partitions

    # --- the reader thread -------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = Backoff(RETRY_MIN, RETRY_MAX)
        while not self._stop.is_set():
            try:
                if not self.ready:
                    end = self.bus.end_positions(range(self.bus.partitions))
                    with self._lock:
                        self._positions = dict(end)
                    self.healthy = True
                    self.stats.last_read_at = time.time()
                    after = dict(end)
                else:
                    after = self.positions()
                got = self.bus.tail(after, self._count, self._block)
                self._route(got)
                self.healthy = True
                self.stats.reads += 1
                self.stats.last_read_at = time.time()
                self.stats.last_error = None
                backoff.reset()
            except Exception as exc:  # the bus is down or timing out: report, back off, try again
                text = first_line(exc)
                if text != self.stats.last_error:
                    log.warning("SSE bus reader: %s (retrying)", text)
                self.healthy = False
                self.stats.failures += 1
                self.stats.last_error = text
                self._stop.wait(backoff.next())

    def _route(self, deliveries: list[Delivery]) -> None:
        if not deliveries:
            return
        dropped: list[Subscriber] = []
        with self._lock:
            for d in deliveries:
                self._positions[d.partition] = d.entry_id
                event = d.event
                if event is None or event.type not in TASK_CHANGE_TYPES:
                    continue
                targets = list(self._by_instance.get(event.partitionkey, ()))
                workflow_type = event.data.get("workflow_type")
                if workflow_type is not None:
                    targets.extend(self._by_type.get(str(workflow_type), ()))
                if not targets:
                    continue
                item = item_of(d)
                self.stats.events_routed += 1
                for sub in targets:
                    if not sub.offer(item):
                        dropped.append(sub)
                        self._remove(sub)
            self.stats.entries_read += len(deliveries)
        for sub in dropped:
            self.stats.dropped += 1
            if self._on_drop is not None:
                self._on_drop(sub)


# --- the stream of one client ------------------------------------------------------------------------------

def frame(item: Item, cursor: Mapping[int, str]) -> bytes:
    return f"id: {format_cursor(cursor)}\nevent: {item.event_type}\ndata: {item.payload}\n\n".encode()


async def event_stream(hub: Hub, filter_: Filter, resume: dict[int, str] | None, keepalive: float,
                       on_sent: Callable[[int], None] | None = None) -> AsyncIterator[bytes]:
    """The bytes of one SSE response. It subscribes when it starts (and unsubscribes however it ends); ``start``
    is the hub's positions at that moment; ``resume`` the client's cursor (``Last-Event-ID``), replayed from
    the bus up to ``start`` before going live."""
    sub, start = hub.subscribe(filter_, asyncio.get_running_loop())
    try:
        cursor = dict(resume if resume is not None else start)
        yield f"retry: 2000\nid: {format_cursor(cursor)}\n: connected\n\n".encode()
        if resume is not None:
            async for chunk in _replay(hub, sub, cursor, start, on_sent):
                yield chunk
        while True:
            items = sub.take()
            if sub.dropped is not None:  # its buffer was emptied when it was dropped
                yield f"event: dropped\ndata: {json.dumps({'reason': sub.dropped})}\n\n".encode()
                return
            if not items:
                if not await sub.wait(keepalive):
                    yield b": keepalive\n\n"
                continue
            out: list[bytes] = []
            for item in items:
                if entry_order(item.entry_id) <= entry_order(cursor[item.partition]):
                    continue  # already sent while replaying
                cursor[item.partition] = item.entry_id
                out.append(frame(item, cursor))
            if out:
                if on_sent is not None:
                    on_sent(len(out))
                yield b"".join(out)
    finally:
        hub.unsubscribe(sub)


async def _replay(hub: Hub, sub: Subscriber, cursor: dict[int, str], start: Mapping[int, str],
                  on_sent: Callable[[int], None] | None) -> AsyncIterator[bytes]:
    """What the bus holds after ``cursor`` up to ``start`` (the live buffer has everything after ``start``)."""
    pending = {p: cursor[p] for p in cursor if entry_order(cursor[p]) < entry_order(start[p])}
    while pending:
        got = await asyncio.to_thread(hub.bus.tail, dict(pending), REPLAY_COUNT, 0)
        if not got:
            break  # trimmed, or the bus lost data: nothing more to replay
        out: list[bytes] = []
        for d in got:
            if d.partition not in pending or entry_order(d.entry_id) > entry_order(start[d.partition]):
                pending.pop(d.partition, None)
                continue
            pending[d.partition] = d.entry_id
            if sub.filter.matches(d):
                cursor[d.partition] = d.entry_id
                out.append(frame(item_of(d), cursor))
            if entry_order(d.entry_id) >= entry_order(start[d.partition]):
                pending.pop(d.partition, None)
        if out:
            if on_sent is not None:
                on_sent(len(out))
            yield b"".join(out)
    # Positions passed without a matching event: live items at or before them are not this stream's anyway.
    for p in cursor:
        if entry_order(cursor[p]) < entry_order(start[p]):
            cursor[p] = start[p]


def stream_headers() -> dict[str, str]:
    return {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def describe(stats: HubStats) -> dict[str, Any]:
    return {"entries_read": stats.entries_read, "events_routed": stats.events_routed, "reads": stats.reads,
            "failures": stats.failures, "last_error": stats.last_error, "dropped": stats.dropped,
            "clients": dict(stats.clients)}
