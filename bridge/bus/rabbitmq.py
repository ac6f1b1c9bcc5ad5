"""The RabbitMQ bus: one stream per partition as the log, consumer-group state in a replicated document.

Opened from ``amqp://user:password@host:5672/vhost`` or ``amqps://`` (TLS) URLs with pika, the kept
synchronous AMQP 0.9.1 client. Every name lives in :class:`RabbitMQNames` (its docstring is the layout).
Why this shape, and how each clause of the contract in :mod:`bridge.bus.base` maps onto RabbitMQ:

* **The log** is one RabbitMQ *stream* per partition (``<ns>.events.p<N>``), consumed over AMQP 0.9.1
  with ``x-stream-offset``. A stream keeps every entry after it is read (queues delete on ack), so the
  read-only tail of ``serve``, looking an event up and a group created late (it starts at the beginning
  of the retained log) all read the same log, in publish order. **Entry ids** are ``offset + 1`` (``"0"``
  stays "before every entry"), unique per partition; :func:`bridge.bus.base.entry_order` sorts them.
* **Consumer groups** are not a RabbitMQ concept a stream has over AMQP (and quorum queues per group
  cannot give ``claim_stale`` after ``min_idle``, delivery states or ``pending_count`` across processes:
  unacknowledged messages belong to the channel that holds them, and are invisible to everyone else). So
  the groups' state (per group and partition: the next offset to deliver and the pending entries with
  consumer, delivery count and delivery time; the trim floors; the epoch) is one JSON *document*, the
  single message of the quorum queue ``<ns>.state`` (replicated by Raft). Dead letters are the document of
  ``<ns>.dead``. Every change is made under a lock: an *exclusive consumer* on the empty classic queue
  ``<ns>.lock`` (quorum queues ignore ``exclusive``; measured). The holder takes the document(s) with
  ``basic.get``, publishes the next version (publisher confirm) and only then acknowledges the old one;
  if it dies anywhere in between its connection closes, the lock is released and the old version returns
  to the queue. The next holder drains the queue and keeps the highest version, so a crash between the
  confirm and the acknowledgement leaves two versions and never a wrong one. A missing document under the
  lock means the broker lost it: a new one is made with a new epoch.
* **publish** sends every event with ``mandatory`` and waits for all publisher confirms of the batch
  together (one round trip per batch, not per event). A return (the stream vanished) declares the stream
  again and publishes those events again. Each entry carries its event id, its publish time (ms) and a
  tag of the publishing bus object (read-your-writes below).
* **Knowing where a stream ends.** AMQP 0.9.1 on RabbitMQ 3.10 cannot tell a stream's last offset
  (``queue.declare`` says 0 messages; ``last`` attaches at the last *chunk*). Each bus object therefore
  *watches* the partitions it uses: a consumer attached at ``last``, then a small **sync marker** entry
  published and awaited; once the marker arrives everything up to it is known, and every later entry is
  pushed to the watch (a bounded cache of the newest entries serves reads that keep up). The bus object's
  own publishes are awaited on the watch before it reads (read-your-writes); other processes' entries
  arrive within milliseconds. Markers (one per partition per bus object that reads or tails it) are never
  delivered, tailed, counted or looked up.
* **read** (under the lock) delivers up to ``count`` entries from each group's next offset, in a
  rotating partition order, records them pending and moves the offsets: ``count`` is strict and an entry
  is never read twice by one group. A blocking read waits on the watch: a push on one of its partitions
  (any process's publish, or a raw write) wakes it at once; with nothing new nobody takes the lock.
* **claim_stale** reassigns pending entries idle at least ``min_idle`` (delivery times by the hosts'
  clocks: keep them synchronised), ``deliveries + 1``. **ack** removes pending entries (twice: harmless).
* **lag** counts the entries after a group's next offset up to the watched end (read exactly up to
  :data:`LAG_EXACT` entries, beyond that the offset difference). A missing group: everything retained.
* **dead letters**: ``dead_letter`` appends to the dead document and acknowledges in the state document
  under one lock (the dead letter first: a crash in between redelivers, never loses).
* **trim(retention)** moves a per-partition *floor* (entries below it are gone for every reader) up to the
  smallest of each group's next offset and oldest pending entry and the first entry younger than the
  cutoff: exact, and never past a pending or undelivered entry. A stream frees disk only by whole
  segments, by its own retention: ``max_age`` (``x-max-age``, default 7 days) is that physical cap, like
  Redis's ``maxlen_approx`` a limit beyond the contract (the relay's outbox can republish).
* **epoch** is a random token in the state document: a broker that lost its data lost the document too,
  and the next one has a new token.
* **purge_all** deletes every stream, document and the lock queue of the namespace (nothing else, and
  nothing when run again) and returns how many existed. **close** closes the bus's own connection.
* **Reconnecting.** A dropped connection (broker restart, ``rabbitmqctl close_connection``) is reopened
  and the call retried once; the watches re-attach at the offset after the last one seen, so nothing is
  skipped. A read whose reply was lost leaves its entries pending: ``claim_stale`` hands them out again.
* **Malformed entries** (a body that is not UTF-8, not a CloudEvent) are delivered with ``event=None``
  and ``error`` set.
* **leases** stay in the database (``None``): RabbitMQ has no server-side compare-and-set with expiry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import pika  # type: ignore[import-untyped]  # pika ships no type information
from pika import exceptions as amqp_errors

from bridge.bus.base import (
    ACKNOWLEDGED,
    DEAD_LETTERED,
    NOT_FOUND,
    PENDING,
    UNDELIVERED,
    DeadLetter,
    Delivery,
    EventBus,
    EventDelivery,
    EventRef,
    entry_order,
    partition_for,
)
from bridge.core.errors import ConfigError
from bridge.core.events import CloudEvent, EventFormatError
from bridge.core.urls import mask_url, validate_namespace

log = logging.getLogger(__name__)

#: Entry headers. ``id``: the event id (as on Redis); the others are the bus's own.
HEADER_ID = "id"
HEADER_TIME = "pb-ts"  # publish time, ms since the epoch, the publisher's clock (trim by age)
HEADER_PUBLISHER = "pb-pub"  # "<bus object token>:<n>": read-your-writes
HEADER_MARKER = "pb-marker"  # a sync marker, not an entry
_OFFSET = "x-stream-offset"

#: Newest entries kept per partition by a bus object's watch (reads that keep up never fetch).
CACHE_ENTRIES = 5000
#: Unacknowledged pushes per watch / fetch consumer (streams need a prefetch; acks give credit back).
WATCH_PREFETCH = 2000
FETCH_PREFETCH = 1000
#: A read from behind the cache fetches this many entries at least and keeps them for the next reads.
READ_AHEAD = 1000
#: ``lag`` reads and counts up to this many entries exactly; beyond, the offset difference.
LAG_EXACT = 10_000
#: Looking an event up: entries read from just before its publish time (or from the floor).
LOOKUP_SCAN = 1000
LOOKUP_CLOCK_MARGIN_S = 1.0
#: How long a call waits for the lock, a marker, its own publish or a fetch before giving up.
WAIT_LIMIT_S = 30.0
#: The longest single wait for I/O while blocking: other threads get the connection in between.
_SLICE_S = 0.05


class RabbitMQNames:
    """Every name the RabbitMQ bus uses, for namespace ``ns`` (``[bus] namespace``, default ``pollbridge``):

    =========================  ================================  =============================================
    name                       kind                              contents
    =========================  ================================  =============================================
    ``ns.events.p0`` …         stream, one per partition         the entries (body: CloudEvent JSON; headers
    ``ns.events.p<P-1>``                                         ``id``, ``pb-ts``, ``pb-pub``) and sync markers
    ``ns.state``               quorum queue, one message         groups' offsets and pending entries, trim
                                                                 floors, the epoch (JSON, versioned)
    ``ns.dead``                quorum queue, one message         the dead letters (JSON, versioned)
    ``ns.lock``                classic durable queue, empty      its exclusive consumer holds the lock
    =========================  ================================  =============================================

    No exchange is declared: everything is published through the default exchange by queue name. Every
    name starts with ``ns.``; the namespace allows letters, digits, ``_``, ``-`` and ``.``.
    """

    def __init__(self, namespace: str = "pollbridge") -> None:
        self.namespace = validate_namespace(namespace)

    def stream(self, partition: int) -> str:
        return f"{self.namespace}.events.p{partition}"

    def streams(self, partitions: int) -> list[str]:
        return [self.stream(p) for p in range(partitions)]

    @property
    def state(self) -> str:
        return f"{self.namespace}.state"

    @property
    def dead(self) -> str:
        return f"{self.namespace}.dead"

    @property
    def lock(self) -> str:
        return f"{self.namespace}.lock"

    def all(self, partitions: int) -> list[str]:
        """Every name of an installation with ``partitions`` partitions."""
        return [*self.streams(partitions), self.state, self.dead, self.lock]


@dataclass
class _Entry:
    offset: int
    headers: dict[str, Any]
    body: bytes

    @property
    def marker(self) -> bool:
        return HEADER_MARKER in self.headers


@dataclass
class _Watch:
    """What this bus object knows of one partition's stream."""

    tag: str | None = None  # the watch consumer, when attached
    seen_end: int = -1  # the highest offset pushed to us (every offset up to it exists); -1: none
    cache: deque[_Entry] = field(default_factory=lambda: deque(maxlen=CACHE_ENTRIES))
    ahead: list[_Entry] = field(default_factory=list)  # the last fetch from behind the cache, contiguous
    pushes: int = 0
    own_seen: int = 0  # the newest of our own publishes seen on the watch
    marker: str | None = None  # the marker we wait for
    marker_covers: int = 0  # our publishes made before the marker: seen once it arrives
    synced: bool = False  # the marker arrived: seen_end is the stream's end as of then


@dataclass
class _Docs:
    state: dict[str, Any] | None
    dead: dict[str, Any] | None
    state_changed: bool = False
    dead_changed: bool = False


class _Vanished(Exception):
    """A document queue this bus object believed to exist is gone (the broker lost it): look again."""


_CONNECTION_ERRORS = (amqp_errors.AMQPConnectionError, amqp_errors.ConnectionWrongStateError,
                      amqp_errors.StreamLostError, amqp_errors.ChannelWrongStateError)


class RabbitMQBus(EventBus):
    """The RabbitMQ bus. One connection per bus object; calls from several threads take turns on it."""

    def __init__(self, url: str, *, partitions: int = 8, namespace: str = "pollbridge",
                 max_age: float | None = 7 * 86400.0, segment_bytes: int = 50_000_000,
                 socket_timeout: float = WAIT_LIMIT_S) -> None:
        """``max_age`` (seconds, ``None``: keep forever) is the streams' physical retention; ``segment_bytes``
        their segment size (retention frees whole segments). Both are fixed when a stream is created.
        ``socket_timeout`` bounds connecting and every wait of one call for the broker (the lock, a publisher
        confirm, a sync marker, a fetch); a blocking read's ``block`` is not such a wait."""
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        if max_age is not None and max_age <= 0:
            raise ValueError(f"max_age must be > 0 or None, got {max_age}")
        self.partitions = partitions
        self.names = RabbitMQNames(namespace)
        self._display = mask_url(url)
        if socket_timeout <= 0:
            raise ValueError(f"socket_timeout must be > 0, got {socket_timeout}")
        self._wait_limit = float(socket_timeout)
        try:
            self._params = pika.URLParameters(url)
            self._params.socket_timeout = min(self._wait_limit, 10.0)
            self._params.blocked_connection_timeout = self._wait_limit
        except Exception as exc:  # pika's own message may quote the URL, password included
            raise ConfigError(f"invalid RabbitMQ URL {self._display!r}: {type(exc).__name__}") from None
        self._stream_args: dict[str, Any] = {"x-queue-type": "stream", "x-stream-max-segment-size-bytes":
                                             int(segment_bytes)}
        if max_age is not None:
            self._stream_args["x-max-age"] = f"{max(1, int(max_age))}s"
        self._token = secrets.token_hex(6)
        #: Shown by ``rabbitmqctl list_connections client_properties`` and the management UI: whose connection.
        self.connection_name = f"pollbridge bus {namespace} {self._token}"
        self._params.client_properties = {"connection_name": self.connection_name}
        self._mutex = threading.RLock()
        self._conn: Any = None
        self._ops: Any = None  # confirm mode: documents and markers
        self._pub: Any = None  # events, with batched confirms
        self._watch_ch: Any = None
        self._lock_ch: Any = None
        self._watches: dict[int, _Watch] = {}
        self._by_tag: dict[str, int] = {}
        self._declared: set[str] = set()
        self._published: dict[int, int] = {}  # partition -> our newest publish number
        self._confirms: dict[str, Any] = {}
        self._returned: list[tuple[str, Any, bytes]] = []
        self._floors: dict[int, int] | None = None
        self._next_seen: dict[str, dict[int, int]] = {}  # group -> partition -> next offset, as last seen
        self._epochs_seen: dict[int, str] = {}  # partition -> its epoch token, as last seen in the state document
        #: Partitions whose stream this object saw vanish (its watch cancelled, a publish returned): partition ->
        #: the epoch token it knew then. The next locked step renews that epoch unless someone already did.
        self._vanished: dict[int, str | None] = {}
        self._tail_epochs: dict[int, str] = {}  # partition -> its epoch when this object last tailed
        self._rotation = 0
        self._closed = False
        self._watch_unacked = 0
        self._lock_tag = ""

    def __repr__(self) -> str:
        return f"RabbitMQBus({self._display}, namespace={self.names.namespace!r}, partitions={self.partitions})"

    # ------------------------------------------------------------------ connection

    def _connection(self) -> Any:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._conn is None or not self._conn.is_open:
            self._reset_connection()
            try:
                self._conn = pika.BlockingConnection(self._params)
            except amqp_errors.AMQPError as exc:
                raise ConnectionError(f"cannot connect to RabbitMQ at {self._display}: {type(exc).__name__}: "
                                      f"{_safe(exc, self._params)}") from None
        return self._conn

    def _reset_connection(self) -> None:
        """Forget the channels and consumers of a dead connection. The watches start afresh (at the stream's end,
        with a marker): the broker may have come back with a stream shorter than what they saw (its data wiped),
        and a watch re-attached after its last offset would wait there and never see the new entries."""
        conn, self._conn = self._conn, None
        self._ops = self._pub = self._watch_ch = self._lock_ch = None
        self._watch_unacked = 0
        self._by_tag.clear()
        self._confirms.clear()
        self._returned.clear()
        self._watches.clear()
        self._declared.clear()
        self._floors = None
        if conn is not None:
            with contextlib.suppress(Exception):  # it is already broken
                conn.close()

    def _channel(self, attr: str) -> Any:
        ch = getattr(self, attr)
        if ch is None or not ch.is_open:
            ch = self._connection().channel()
            if attr == "_ops":
                ch.confirm_delivery()
            elif attr == "_pub":
                ch.add_on_return_callback(self._on_return)
                ch._impl.confirm_delivery(self._on_confirm)  # batched confirms (see _send_confirmed)
                self._confirms = {"next": 1, "outstanding": set(), "nacked": 0}
            elif attr == "_watch_ch":
                # The watches of a closed channel are gone with it: they start afresh on this one.
                self._watches.clear()
                self._by_tag.clear()
                self._watch_unacked = 0
                ch.basic_qos(prefetch_count=WATCH_PREFETCH)
                ch.add_on_cancel_callback(self._on_watch_cancelled)
            setattr(self, attr, ch)
        return ch

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run one public operation; a dropped connection is reopened and the operation run once more."""
        with self._mutex:
            try:
                return fn()
            except _Vanished:
                self._declared.clear()
                return fn()
            except _CONNECTION_ERRORS as exc:
                log.warning("RabbitMQ bus %s: connection lost (%s); reconnecting", self._display, type(exc).__name__)
                self._reset_connection()
                return fn()

    def _pump(self, seconds: float) -> None:
        """Process I/O for up to ``seconds`` (returns early when something arrived); give credit back."""
        self._connection().process_data_events(time_limit=max(0.0, seconds))
        ch = self._watch_ch
        if ch is not None and ch.is_open and self._watch_unacked:
            ch.basic_ack(self._watch_unacked, multiple=True)
            self._watch_unacked = 0

    def _exists(self, name: str) -> bool:
        """Whether a queue or stream exists, creating nothing (a failed passive declare closes its channel)."""
        ch = self._connection().channel()
        try:
            ch.queue_declare(name, passive=True)
            return True
        except amqp_errors.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return False
            raise
        finally:
            if ch.is_open:
                ch.close()

    def _declare_stream(self, partition: int) -> None:
        name = self.names.stream(partition)
        if name in self._declared:
            return
        ch = self._connection().channel()
        try:
            ch.queue_declare(name, durable=True, arguments=self._stream_args)
        except amqp_errors.ChannelClosedByBroker as exc:
            if exc.reply_code != 406:
                raise
            # Created with other retention settings (they are fixed at creation): use it as it is.
            log.warning("RabbitMQ stream %s exists with other arguments (%s); using it as it is", name, exc.reply_text)
        finally:
            if ch.is_open:
                ch.close()
        self._declared.add(name)

    # ------------------------------------------------------------------ publishing

    def publish(self, events: Sequence[CloudEvent]) -> None:
        if not events:
            return
        messages = []
        for event in events:
            p = self.partition_of(event)
            messages.append((p, event.id, event.to_json().encode("utf-8")))
        self._call(lambda: self._publish(messages))

    def _publish(self, messages: list[tuple[int, str, bytes]]) -> None:
        for p in {p for p, _, _ in messages}:
            self._declare_stream(p)
        now_ms = int(time.time() * 1000)
        todo: list[tuple[str, Any, bytes]] = []
        for p, event_id, body in messages:
            n = self._published.get(p, 0) + 1
            self._published[p] = n
            headers = {HEADER_ID: event_id, HEADER_TIME: now_ms, HEADER_PUBLISHER: f"{self._token}:{n}"}
            todo.append((self.names.stream(p), pika.BasicProperties(headers=headers, delivery_mode=2), body))
        for _ in range(3):
            returned = self._send_confirmed(todo)
            if not returned:
                return
            # The stream vanished (the broker lost it, or a purge): declare it again and send those again.
            for name, _, _ in returned:
                p = int(name.rsplit(".p", 1)[1])
                if name in self._declared:  # it existed for us: deleted since (its entries are gone)
                    self._note_vanished(p)
                self._declared.discard(name)
                self._declare_stream(p)
            todo = returned
        raise RuntimeError(f"bus {self._display}: {len(todo)} events kept coming back unroutable")

    def _send_confirmed(self, todo: list[tuple[str, Any, bytes]]) -> list[tuple[str, Any, bytes]]:
        """Publish everything, then wait for every confirm at once; the messages the broker returned."""
        ch = self._channel("_pub")
        self._returned = []
        outstanding: set[int] = self._confirms["outstanding"]
        for name, props, body in todo:
            # Registered before sending: pika's basic_publish reads the socket too, and may meet the confirm.
            outstanding.add(self._confirms["next"])
            self._confirms["next"] += 1
            ch.basic_publish("", name, body, props, mandatory=True)
        deadline = time.monotonic() + self._wait_limit
        while outstanding:
            if time.monotonic() > deadline:
                raise TimeoutError(f"bus {self._display}: no publisher confirm within {self._wait_limit:.0f} s")
            self._pump(_SLICE_S)
        self._pump(0)  # returns arrive before their confirm, but are dispatched only by a pump
        if self._confirms["nacked"]:
            self._confirms["nacked"] = 0
            raise RuntimeError(f"bus {self._display}: the broker refused to store published events (nack)")
        return list(self._returned)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag = int(method.delivery_tag)
        outstanding: set[int] = self._confirms["outstanding"]
        done = {t for t in outstanding if t <= tag} if method.multiple else {tag}
        outstanding.difference_update(done)
        if isinstance(method, pika.spec.Basic.Nack):
            self._confirms["nacked"] += len(done)
        if not outstanding:
            self._wake()

    def _wake(self) -> None:
        """End the current ``process_data_events`` now. A confirm or a channel's close-ok is handled inside pika's
        I/O without an event for the blocking connection to dispatch, so the wait would run to its time limit
        (measured: every publish took the full 50 ms slice)."""
        if self._conn is not None and self._conn.is_open:
            self._conn.add_callback_threadsafe(_ignore)

    def _on_return(self, _ch: Any, method: Any, props: Any, body: bytes) -> None:
        self._returned.append((str(method.routing_key), props, body))

    # ------------------------------------------------------------------ watching the streams

    def _on_watch_message(self, _ch: Any, method: Any, props: Any, body: bytes) -> None:
        self._watch_unacked = int(method.delivery_tag)
        p = self._by_tag.get(str(method.consumer_tag))
        if p is None:
            return
        w = self._watches[p]
        headers = dict(props.headers or {})
        offset = int(headers.get(_OFFSET, -1))
        if offset <= w.seen_end:
            return  # a re-attached watch resending the start of its chunk: known already
        entry = _Entry(offset, headers, body)
        w.seen_end = max(w.seen_end, offset)
        w.cache.append(entry)
        w.pushes += 1
        if entry.marker and headers.get(HEADER_MARKER) == w.marker:
            w.synced = True
            w.marker = None
            w.own_seen = max(w.own_seen, w.marker_covers)
        pub = headers.get(HEADER_PUBLISHER)
        if isinstance(pub, (str, bytes)):
            token, _, n = (pub.decode() if isinstance(pub, bytes) else pub).partition(":")
            if token == self._token and n.isdigit():
                w.own_seen = max(w.own_seen, int(n))

    def _on_watch_cancelled(self, frame: Any) -> None:
        """The broker cancelled a watch: its stream was deleted. Whatever we knew of it is void."""
        p = self._by_tag.pop(str(frame.method.consumer_tag), None)
        if p is not None:
            self._forget_partition(p, vanished=True)

    def _forget_partition(self, p: int, vanished: bool = False) -> None:
        """Forget what we knew of a partition's stream; ``vanished``: it existed and is gone (deleted, or shorter
        than what we saw), so its entries are lost: noted for its epoch."""
        w = self._watches.pop(p, None)
        if vanished and w is not None and w.seen_end >= 0:
            self._note_vanished(p)
        self._declared.discard(self.names.stream(p))
        self._floors = None
        self._next_seen.clear()

    def _note_vanished(self, p: int) -> None:
        self._vanished.setdefault(p, self._epochs_seen.get(p))

    def _sync(self, parts: Sequence[int], create: bool) -> list[int]:
        """Make the watches of ``parts`` current: attached, and past our own publishes. The partitions whose
        stream exists (``create``: declared when missing)."""
        self._pump(0)
        deadline = time.monotonic() + self._wait_limit
        while True:
            try:
                attaching = self._attach(parts, create)
                break
            except amqp_errors.ChannelClosedByBroker as exc:
                # The watch channel is closed, with every watch on it (they start afresh on the next one). 404: the
                # stream vanished between looking and attaching; 406: a stream just declared, or recovering after
                # a broker restart, has no member running yet ("does not have a replica on the local node").
                self._watch_ch = None
                if exc.reply_code not in (404, 406) or time.monotonic() > deadline:
                    raise
                self._pump(_SLICE_S)
        ops = self._channel("_ops")
        for p in attaching:
            w = self._watches[p]
            w.marker_covers = self._published.get(p, 0)
            try:
                ops.basic_publish("", self.names.stream(p), b"", pika.BasicProperties(
                    headers={HEADER_MARKER: w.marker}, delivery_mode=2), mandatory=True)
            except amqp_errors.UnroutableError:
                self._forget_partition(p, vanished=True)

        def behind() -> list[int]:
            return [p for p in parts if p in self._watches and self._watches[p].tag is not None
                    and (self._watches[p].marker is not None
                         or self._watches[p].own_seen < self._published.get(p, 0))]

        while behind():
            if time.monotonic() > deadline:
                raise TimeoutError(f"bus {self._display}: partitions {behind()} did not catch up within "
                                   f"{self._wait_limit:.0f} s")
            self._pump(_SLICE_S)
            if self._watch_ch is None or not self._watch_ch.is_open:
                return self._sync(parts, create)  # the channel closed under the watches: attach them again
        return [p for p in parts if p in self._watches and self._watches[p].tag is not None]

    def _attach(self, parts: Sequence[int], create: bool) -> list[int]:
        """Attach a watch to each partition of ``parts`` whose stream exists (``create``: declared when missing) and
        has none; the partitions newly attached (their marker is still to be published)."""
        ch = self._channel("_watch_ch")
        attaching: list[int] = []
        for p in parts:
            w = self._watches.get(p)
            if w is not None and w.tag is not None:
                continue
            if create:
                self._declare_stream(p)
            elif not self._exists(self.names.stream(p)):
                continue
            try:
                tag = ch.basic_consume(self.names.stream(p), self._on_watch_message, arguments={_OFFSET: "last"})
            except amqp_errors.ChannelClosedByBroker as exc:
                if exc.reply_code == 404:
                    self._forget_partition(p, vanished=True)
                raise
            # At the last chunk, then a marker: once it arrives, everything up to it is known.
            w = self._watches[p] = _Watch(tag=tag, marker=secrets.token_hex(8))
            self._by_tag[tag] = p
            attaching.append(p)
        return attaching

    def _end(self, p: int) -> int:
        w = self._watches.get(p)
        return -1 if w is None else w.seen_end

    def _fetch(self, p: int, start: int, stop: int, limit: int) -> tuple[list[_Entry], int]:
        """Up to ``limit`` entries (not markers) with ``start <= offset <= stop``, and the last offset examined
        (``start - 1``: none). From the watch's cache when it reaches back far enough, else from the stream."""
        if start > stop or limit < 1:
            return [], start - 1
        w = self._watches.get(p)
        if w is not None and w.cache and w.cache[0].offset <= start:
            return _take(list(w.cache), start, stop, limit)
        if w is not None and w.ahead and w.ahead[0].offset <= start:
            got_ahead, last_ahead = _take(w.ahead, start, stop, limit)
            if len(got_ahead) >= limit or w.ahead[-1].offset >= stop:
                return got_ahead, last_ahead
        want = max(limit, READ_AHEAD)
        fetched: list[_Entry] = []
        got: list[_Entry] = []
        done = threading.Event()
        ch = self._connection().channel()
        last = start - 1
        try:
            ch.basic_qos(prefetch_count=min(FETCH_PREFETCH, stop - start + 1, want + 100))
            unacked = [0]

            def on_message(_c: Any, method: Any, props: Any, body: bytes) -> None:
                nonlocal last
                unacked[0] = int(method.delivery_tag)
                if done.is_set():
                    return
                headers = dict(props.headers or {})
                offset = int(headers.get(_OFFSET, -1))
                if offset < start:
                    return  # the chunk's earlier records
                if offset > stop:
                    done.set()
                    return
                last = offset
                entry = _Entry(offset, headers, body)
                fetched.append(entry)
                if not entry.marker:
                    got.append(entry)
                if len(got) >= want or offset >= stop:
                    done.set()

            try:
                ch.basic_consume(self.names.stream(p), on_message, arguments={_OFFSET: start})
            except amqp_errors.ChannelClosedByBroker as exc:
                if exc.reply_code == 404:
                    self._forget_partition(p)
                    return [], start - 1
                raise
            deadline = time.monotonic() + self._wait_limit
            while not done.is_set():
                if time.monotonic() > deadline:
                    # Offsets we saw exist no more: the stream was recreated. Start afresh.
                    log.warning("bus %s: %s ends before offset %d; forgetting what was known of it",
                                self._display, self.names.stream(p), stop)
                    self._forget_partition(p, vanished=True)
                    break
                self._pump(_SLICE_S)
                if unacked[0]:
                    ch.basic_ack(unacked[0], multiple=True)
                    unacked[0] = 0
        finally:
            self._discard(ch)
        if w is not None and self._watches.get(p) is w:
            w.ahead = fetched
        if len(got) > limit:  # read ahead: hand out ``limit``, keep the rest for the next reads
            return _take(fetched, start, stop, limit)
        return got, last

    def _discard(self, ch: Any) -> None:
        """Close a channel that has a stream consumer. Not with pika's ``close``/``basic_cancel``: they reject
        the deliveries still in flight, and a stream answers a reject by closing the whole connection
        (NOT_IMPLEMENTED). The underlying channel, once closing, drops such deliveries instead."""
        impl = ch._impl
        if impl.is_open:
            impl.add_on_close_callback(lambda *_: self._wake())
            impl.close()
        deadline = time.monotonic() + self._wait_limit
        while not impl.is_closed and time.monotonic() < deadline:
            self._connection().process_data_events(time_limit=_SLICE_S)

    # ------------------------------------------------------------------ the documents and the lock

    @contextmanager
    def _documents(self, create: bool) -> Iterator[_Docs]:
        """The state and dead-letter documents under the lock. ``create``: make what is missing (a missing
        state document gets a new epoch); otherwise a missing installation yields ``None`` documents and
        nothing is created. Changes are written when the block ends without an exception."""
        if create:
            self._declare_documents()
        elif self.names.state not in self._declared:
            if not self._exists(self.names.state):
                yield _Docs(None, None)
                return
            self._declared.add(self.names.state)  # created together with the dead-letter and lock queues
        self._acquire_lock()
        ops = self._channel("_ops")
        state_tags: list[int] = []
        dead_tags: list[int] = []
        try:
            state = self._drain(ops, self.names.state, state_tags)
            dead = self._drain(ops, self.names.dead, dead_tags)
            docs = _Docs(state, dead)
            if docs.state is None and create:
                docs.state, docs.state_changed = _new_state(), True
            if docs.dead is None and create:
                docs.dead, docs.dead_changed = {"v": 0, "seq": 0, "items": []}, True
            try:
                yield docs
            except BaseException:
                # Give the documents back unchanged; on a dead connection the broker already took them back.
                with contextlib.suppress(*_CONNECTION_ERRORS):
                    for tag in state_tags + dead_tags:
                        ops.basic_nack(tag, requeue=True)
                raise
            # The new versions first, then the old ones acknowledged: a crash in between leaves both, and the
            # next holder keeps the highest version.
            for doc, changed, queue in ((docs.dead, docs.dead_changed, self.names.dead),
                                        (docs.state, docs.state_changed, self.names.state)):
                if changed and doc is not None:
                    doc["v"] = int(doc.get("v", 0)) + 1
                    ops.basic_publish("", queue, json.dumps(doc, separators=(",", ":")).encode(),
                                      pika.BasicProperties(delivery_mode=2), mandatory=True)
            for tags, changed in ((state_tags, docs.state_changed), (dead_tags, docs.dead_changed)):
                for tag in tags:
                    if changed:
                        ops.basic_ack(tag)  # replaced by the version just confirmed
                    else:
                        ops.basic_nack(tag, requeue=True)  # unchanged: back as it was
            if docs.state is not None:
                self._remember(docs.state)
        finally:
            self._release_lock()

    def _declare_documents(self) -> None:
        if self.names.state in self._declared:
            return
        ch = self._channel("_ops")
        for name in (self.names.state, self.names.dead):
            ch.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
        ch.queue_declare(self.names.lock, durable=True)
        self._declared.add(self.names.state)

    def _drain(self, ch: Any, queue: str, tags: list[int]) -> dict[str, Any] | None:
        """Take every version of a document (normally one), keep the highest; the delivery tags in ``tags``."""
        best: dict[str, Any] | None = None
        while True:
            try:
                method, _props, body = ch.basic_get(queue)
            except amqp_errors.ChannelClosedByBroker as exc:
                self._ops = None  # closed; the documents taken so far return to their queues
                if exc.reply_code == 404:
                    raise _Vanished(queue) from None
                raise
            if method is None:
                return best
            tags.append(int(method.delivery_tag))
            try:
                doc = json.loads(body)
            except ValueError:
                log.error("bus %s: unreadable document in %s dropped", self._display, queue)
                continue
            if isinstance(doc, dict) and (best is None or int(doc.get("v", 0)) > int(best.get("v", 0))):
                best = doc
            if int(method.message_count) == 0:
                return best

    def _acquire_lock(self) -> None:
        deadline = time.monotonic() + self._wait_limit
        delay = 0.001
        while True:
            ch = self._channel("_lock_ch")
            try:
                self._lock_tag = ch.basic_consume(self.names.lock, _ignore, exclusive=True)
                return
            except amqp_errors.ChannelClosedByBroker as exc:
                self._lock_ch = None
                if exc.reply_code == 404:  # the lock queue is missing (the documents exist)
                    self._channel("_ops").queue_declare(self.names.lock, durable=True)
                    continue
                if exc.reply_code != 403:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"bus {self._display}: the lock {self.names.lock} stayed held for "
                                   f"{self._wait_limit:.0f} s")
            time.sleep(delay * (0.5 + random.random()))  # another process holds it for a few ms
            delay = min(delay * 2, 0.02)

    def _release_lock(self) -> None:
        ch = self._lock_ch
        if ch is not None and ch.is_open:
            with contextlib.suppress(*_CONNECTION_ERRORS):  # a dead connection released it already
                ch.basic_cancel(self._lock_tag)

    def _remember(self, state: dict[str, Any]) -> None:
        self._floors = {int(p): int(o) for p, o in state.get("floors", {}).items()}
        self._next_seen = {g: {int(p): int(o) for p, o in info.get("next", {}).items()}
                           for g, info in state.get("groups", {}).items()}
        self._epochs_seen = _epoch_map(state, self.partitions)

    # ------------------------------------------------------------------ a partition's stream that went back

    def _marks(self, state: dict[str, Any], p: int) -> int:
        """How many offsets of partition ``p`` the state document knows to exist: the end recorded, the floor,
        every group's next offset and every pending entry."""
        key = str(p)
        marks = max(int(state.get("ends", {}).get(key, 0)), int(state.get("floors", {}).get(key, 0)))
        for info in state.get("groups", {}).values():
            marks = max(marks, int(info["next"].get(key, 0)))
            pend = info["pending"].get(key)
            if pend:
                marks = max(marks, max(int(o) for o in pend) + 1)
        return marks

    def _resync(self, p: int) -> None:
        """Make the watch of ``p`` know the stream's end as of now: a marker published and awaited (our watch may
        not have had the pushes of what another process published and a third one already read)."""
        w = self._watches.get(p)
        if w is None or w.tag is None:
            return
        w.marker = secrets.token_hex(8)
        w.marker_covers = self._published.get(p, 0)
        try:
            self._channel("_ops").basic_publish("", self.names.stream(p), b"", pika.BasicProperties(
                headers={HEADER_MARKER: w.marker}, delivery_mode=2), mandatory=True)
        except amqp_errors.UnroutableError:
            self._forget_partition(p, vanished=True)
            return
        deadline = time.monotonic() + self._wait_limit
        while p in self._watches and self._watches[p].marker is not None:
            if self._watch_ch is None or not self._watch_ch.is_open:
                self._sync([p], create=False)  # the channel closed under the watch: a fresh one knows the end
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"bus {self._display}: partition {p}'s marker did not arrive within "
                                   f"{self._wait_limit:.0f} s")
            self._pump(_SLICE_S)

    def _check_partitions(self, docs: _Docs, live: Sequence[int]) -> list[int]:
        """Under the lock: find the partitions of ``live`` (watched, synced) whose stream went back (this object saw
        it vanish, or the document knows of offsets beyond its end: it was deleted and made again) and recover
        them: a new epoch token for the partition (the relay republishes its retained rows), every group's offset
        and the floor back to the new stream's start, their pending entries there dropped. Records how far each
        stream is known to reach. The partitions recovered."""
        state = docs.state
        if state is None:
            return []
        epochs = state.setdefault("epochs", {})
        ends = state.setdefault("ends", {})
        recovered: list[int] = []
        for p in range(self.partitions):
            known = self._vanished.get(p, "")
            if p not in self._vanished:
                continue
            current = epochs.get(str(p), state.get("epoch"))
            if known is not None and known != current:
                del self._vanished[p]  # renewed by someone else since we knew it: that renewal covers ours
        for p in live:
            w = self._watches.get(p)
            if w is None or w.tag is None:
                continue
            marks = self._marks(state, p)
            went_back = p in self._vanished
            if not went_back and marks > w.seen_end + 1:
                self._resync(p)  # our watch may only be behind: ask the stream where it ends now
                w = self._watches.get(p)
                if w is None:
                    continue
                went_back = marks > w.seen_end + 1
            end = w.seen_end + 1
            if went_back:
                self._vanished.pop(p, None)
                log.warning("bus %s: %s went back (known to %d offsets, now %d): its entries were lost; new "
                            "epoch for partition %d, consumer groups restart at its beginning", self._display,
                            self.names.stream(p), marks, end, p)
                epochs[str(p)] = secrets.token_hex(16)
                ends[str(p)] = end
                state.setdefault("floors", {}).pop(str(p), None)
                for info in state.get("groups", {}).values():
                    info["next"][str(p)] = 0
                    info["pending"].pop(str(p), None)
                docs.state_changed = True
                recovered.append(p)
            elif end > int(ends.get(str(p), 0)):
                ends[str(p)] = end
                docs.state_changed = True
        return recovered

    def _group(self, docs: _Docs, group: str) -> dict[str, Any]:
        """The group's state, created (at the floors: the beginning of what is retained) when missing."""
        assert docs.state is not None
        groups = docs.state.setdefault("groups", {})
        info = groups.get(group)
        if info is None:
            floors = docs.state.get("floors", {})
            info = groups[group] = {"next": {str(p): int(floors.get(str(p), 0)) for p in range(self.partitions)},
                                    "pending": {}}
            docs.state_changed = True
        return cast(dict[str, Any], info)

    # ------------------------------------------------------------------ groups and reading

    def ensure_group(self, group: str) -> None:
        def run() -> None:
            for p in range(self.partitions):
                self._declare_stream(p)
            with self._documents(create=True) as docs:
                self._group(docs, group)

        self._call(run)

    def read(self, group: str, consumer: str, partitions: Sequence[int], count: int, block: float) -> list[Delivery]:
        return self.ack_and_read(group, (), consumer, partitions, count, block)

    def ack_and_read(self, group: str, acks: Sequence[Delivery], consumer: str, partitions: Sequence[int],
                     count: int, block: float) -> list[Delivery]:
        """The acknowledgements are made in the first locked step, before any wait."""
        parts = self._checked(partitions)
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        deadline = time.monotonic() + max(block, 0.0)

        def run() -> list[Delivery]:
            pending_acks = list(acks)
            while True:
                got = self._take(group, consumer, parts, count, pending_acks)
                pending_acks = []
                if got:
                    return got
                if not self._wait(parts, deadline, lambda: self._maybe_available(group, parts)):
                    return []

        return cast(list[Delivery], self._call(run))

    def _take(self, group: str, consumer: str, parts: list[int], count: int,
              acks: Sequence[Delivery]) -> list[Delivery]:
        live = self._sync(parts, create=True) if parts else []
        out: list[Delivery] = []
        with self._documents(create=True) as docs:
            self._check_partitions(docs, live)
            info = self._group(docs, group)
            if acks:
                docs.state_changed |= _remove_pending(info, acks)
            if not parts:
                return []
            floors = docs.state.get("floors", {}) if docs.state else {}
            now_ms = int(time.time() * 1000)
            start = self._rotation % len(parts)
            self._rotation += 1
            for p in parts[start:] + parts[:start]:
                if len(out) >= count or p not in live:
                    continue
                nxt = max(int(info["next"].get(str(p), 0)), int(floors.get(str(p), 0)))
                entries, last = self._fetch(p, nxt, self._end(p), count - len(out))
                if last < nxt:
                    continue
                info["next"][str(p)] = last + 1
                pend = info["pending"].setdefault(str(p), {})
                for e in entries:
                    pend[str(e.offset)] = [consumer, 1, now_ms]
                    out.append(_delivery(e, p, 1))
                docs.state_changed = True
        return out

    def _maybe_available(self, group: str, parts: list[int]) -> bool:
        """Whether a partition may hold entries the group has not had, by what this object last saw of the
        group (offsets only grow, so a stale view never hides anything)."""
        seen = self._next_seen.get(group)
        if seen is None:
            return True
        return any(self._end(p) >= seen.get(p, 0) for p in parts)

    def _wait(self, parts: list[int], deadline: float, ready: Callable[[], bool]) -> bool:
        """Wait for pushes on ``parts`` until ``ready()`` or the deadline; whether to look again. The connection
        is given up between slices so other threads can use the bus meanwhile."""
        before = {p: (self._watches[p].pushes if p in self._watches else -1) for p in parts}
        unwatched_check = time.monotonic() + 0.5
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._pump(min(remaining, _SLICE_S))
            moved = any((self._watches[p].pushes if p in self._watches else -1) != before[p] for p in parts)
            if moved and ready():
                return True
            if time.monotonic() >= unwatched_check:
                # A partition whose stream is missing has no watch: look for it now and then.
                unwatched_check = time.monotonic() + 0.5
                if any(p not in self._watches or self._watches[p].tag is None for p in parts):
                    return True
            self._mutex.release()
            try:
                time.sleep(0)  # let a waiting thread take the connection
            finally:
                self._mutex.acquire()

    def ack(self, group: str, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return

        def run() -> None:
            with self._documents(create=False) as docs:
                if docs.state is not None and group in docs.state.get("groups", {}):
                    docs.state_changed |= _remove_pending(docs.state["groups"][group], deliveries)

        self._call(run)

    def claim_stale(self, group: str, consumer: str, partitions: Sequence[int], min_idle: float,
                    count: int) -> list[Delivery]:
        parts = self._checked(partitions)
        if count < 1 or not parts:
            return []

        def run() -> list[Delivery]:
            out: list[Delivery] = []
            watched = self._sync(parts, create=False)
            with self._documents(create=False) as docs:
                self._check_partitions(docs, watched)
                if docs.state is None or group not in docs.state.get("groups", {}):
                    return []
                info = docs.state["groups"][group]
                now_ms = int(time.time() * 1000)
                idle_ms = max(min_idle, 0.0) * 1000
                chosen: list[tuple[int, int, int]] = []  # (partition, offset, deliveries)
                for p in parts:
                    pend = info["pending"].get(str(p), {})
                    for off in sorted(pend, key=int):
                        if len(chosen) >= count:
                            break
                        _holder, times, at = pend[off]
                        if now_ms - int(at) >= idle_ms:
                            chosen.append((p, int(off), int(times) + 1))
                if not chosen:
                    return []
                live = set(self._sync(sorted({p for p, _, _ in chosen}), create=False))
                for p in sorted({p for p, _, _ in chosen}):
                    offsets = sorted(o for q, o, _ in chosen if q == p)
                    found: dict[int, _Entry] = {}
                    if p in live:
                        entries, _ = self._fetch(p, offsets[0], offsets[-1], len(offsets) + LOOKUP_SCAN)
                        found = {e.offset: e for e in entries}
                    for q, off, times in chosen:
                        if q != p:
                            continue
                        info["pending"][str(p)][str(off)] = [consumer, times, now_ms]
                        entry = found.get(off)
                        if entry is None:  # removed by the stream's own retention (max_age)
                            out.append(Delivery(str(off + 1), p, "", None, times,
                                                "entry no longer on the stream (removed by its retention)"))
                        else:
                            out.append(_delivery(entry, p, times))
                docs.state_changed = True
            return out

        return cast(list[Delivery], self._call(run))

    def pending_count(self, group: str) -> int:
        def run() -> int:
            with self._documents(create=False) as docs:
                info = (docs.state or {}).get("groups", {}).get(group)
                return 0 if info is None else sum(len(v) for v in info["pending"].values())

        return cast(int, self._call(run))

    def lag(self, group: str) -> dict[int, int]:
        def run() -> dict[int, int]:
            live = set(self._sync(range(self.partitions), create=False))
            with self._documents(create=False) as docs:
                self._check_partitions(docs, sorted(live))
                state = docs.state or {}
            floors = state.get("floors", {})
            nxt = state.get("groups", {}).get(group, {}).get("next", {})
            lags: dict[int, int] = {}
            for p in range(self.partitions):
                if p not in live:
                    lags[p] = 0
                    continue
                start = max(int(nxt.get(str(p), 0)), int(floors.get(str(p), 0)))
                lags[p] = self._count(p, start, self._end(p))
            return lags

        return cast(dict[int, int], self._call(run))

    def _count(self, p: int, start: int, stop: int) -> int:
        if stop < start:
            return 0
        if stop - start + 1 > LAG_EXACT:
            return stop - start + 1  # sync markers counted too: a handful in a large backlog
        entries, _ = self._fetch(p, start, stop, stop - start + 1)
        return len(entries)

    # ------------------------------------------------------------------ dead letters

    def dead_letter(self, group: str, delivery: Delivery, reason: str) -> None:
        def run() -> None:
            with self._documents(create=True) as docs:
                assert docs.dead is not None and docs.state is not None
                docs.dead["seq"] = int(docs.dead.get("seq", 0)) + 1
                docs.dead.setdefault("items", []).append({
                    "id": str(docs.dead["seq"]), "group": group, "entry_id": delivery.entry_id,
                    "partition": delivery.partition, "payload": delivery.payload, "reason": reason})
                docs.dead_changed = True
                info = docs.state.get("groups", {}).get(group)
                if info is not None:
                    docs.state_changed |= _remove_pending(info, [delivery])

        self._call(run)

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        if limit < 1:
            return []

        def run() -> list[DeadLetter]:
            with self._documents(create=False) as docs:
                items = (docs.dead or {}).get("items", [])[:limit]
            return [DeadLetter(id=str(i["id"]), group=str(i["group"]), entry_id=str(i["entry_id"]),
                               partition=int(i["partition"]), payload=str(i["payload"]), reason=str(i["reason"]))
                    for i in items]

        return cast(list[DeadLetter], self._call(run))

    def remove_dead_letters(self, ids: Sequence[str]) -> int:
        if not ids:
            return 0
        wanted = {str(i) for i in ids}

        def run() -> int:
            with self._documents(create=False) as docs:
                if docs.dead is None:
                    return 0
                items = docs.dead.get("items", [])
                kept = [i for i in items if str(i["id"]) not in wanted]
                removed = len(items) - len(kept)
                if removed:
                    docs.dead["items"] = kept
                    docs.dead_changed = True
                return removed

        return cast(int, self._call(run))

    def dead_letter_count(self) -> int:
        def run() -> int:
            with self._documents(create=False) as docs:
                return len((docs.dead or {}).get("items", []))

        return cast(int, self._call(run))

    # ------------------------------------------------------------------ trimming, epoch, purge

    def trim(self, retention: float) -> int:
        cutoff_ms = int((time.time() - max(retention, 0.0)) * 1000)

        def run() -> int:
            removed = 0
            with self._documents(create=False) as docs:
                if docs.state is None:
                    return 0
                live = set(self._sync(range(self.partitions), create=False))
                floors = docs.state.setdefault("floors", {})
                for p in sorted(live):
                    floor = int(floors.get(str(p), 0))
                    limit = self._end(p) + 1
                    for info in docs.state.get("groups", {}).values():
                        limit = min(limit, int(info["next"].get(str(p), 0)))
                        pend = info["pending"].get(str(p), {})
                        if pend:
                            limit = min(limit, min(int(o) for o in pend))
                    if limit <= floor:
                        continue
                    entries, _ = self._fetch(p, floor, limit - 1, limit - floor)
                    new_floor, count = limit, 0
                    for e in entries:
                        if _int_header(e.headers, HEADER_TIME) > cutoff_ms:
                            new_floor = e.offset  # the first one young enough to stay
                            break
                        count += 1
                    if new_floor > floor:
                        floors[str(p)] = new_floor
                        docs.state_changed = True
                        removed += count
            return removed

        return cast(int, self._call(run))

    def epoch(self) -> str:
        """One token over every partition's: the state document's epoch while no partition lost its stream alone."""
        epochs = self.epochs()
        tokens = set(epochs.values())
        if len(tokens) == 1:
            return tokens.pop()
        return hashlib.sha256(" ".join(epochs[p] for p in sorted(epochs)).encode()).hexdigest()[:32]

    def epochs(self) -> dict[int, str]:
        """Per partition, its epoch token. Every stream is watched (declared when missing, as a publish would) and
        compared with what the state document knows of it: a stream that went back gets a new token (above)."""
        def run() -> dict[int, str]:
            live = self._sync(range(self.partitions), create=True)
            with self._documents(create=True) as docs:
                assert docs.state is not None
                self._check_partitions(docs, live)
                return _epoch_map(docs.state, self.partitions)

        return cast(dict[int, str], self._call(run))

    def purge_all(self) -> int:
        """Delete every stream, document and the lock queue of the namespace; how many existed."""
        def run() -> int:
            removed = 0
            for name in self.names.all(self.partitions):
                if self._exists(name):
                    ch = self._connection().channel()
                    try:
                        ch.queue_delete(name)
                        removed += 1
                    finally:
                        if ch.is_open:
                            ch.close()
            for p in list(self._watches):
                self._forget_partition(p)
            self._declared.clear()
            self._vanished.clear()
            return removed

        return cast(int, self._call(run))

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            conn, self._conn = self._conn, None
            watch, self._watch_ch = self._watch_ch, None
            if watch is not None and watch.is_open:
                # Not pika's close: it would reject the pushes in flight, and a stream answers a reject by
                # closing the connection (see _discard).
                with contextlib.suppress(Exception):
                    watch._impl.close()
            if conn is not None and conn.is_open:
                with contextlib.suppress(Exception):  # closing a broken connection
                    conn.close()

    # ------------------------------------------------------------------ tailing (read-only)

    def end_positions(self, partitions: Sequence[int]) -> dict[int, str]:
        parts = self._checked(partitions)

        def run() -> dict[int, str]:
            live = set(self._sync(parts, create=False))
            out: dict[int, str] = {}
            for p in parts:
                out[p] = "0"
                if p not in live:
                    continue
                newest = self._newest_entry(p)
                if newest is not None:
                    out[p] = str(newest + 1)
            return out

        return cast(dict[int, str], self._call(run))

    def _newest_entry(self, p: int) -> int | None:
        """The offset of the newest entry (not a marker) of a watched partition, looking back past markers."""
        w = self._watches[p]
        for e in reversed(w.cache):
            if not e.marker:
                return e.offset
        stop = (w.cache[0].offset if w.cache else w.seen_end + 1) - 1
        step = 64
        while stop >= 0:
            start = max(0, stop - step + 1)
            entries, _ = self._fetch_uncached(p, start, stop)
            if entries:
                return entries[-1].offset
            stop, step = start - 1, step * 4
        return None

    def _fetch_uncached(self, p: int, start: int, stop: int) -> tuple[list[_Entry], int]:
        w = self._watches.pop(p)
        try:
            return self._fetch(p, start, stop, stop - start + 1)
        finally:
            self._watches.setdefault(p, w)

    def tail(self, after: Mapping[int, str], count: int, block: float) -> list[Delivery]:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        positions = {p: entry_order(pos)[0] for p, pos in after.items()}  # ValueError for what is not an id
        parts = self._checked(list(positions))
        deadline = time.monotonic() + max(block, 0.0)

        def run() -> list[Delivery]:
            while True:
                live = set(self._sync(parts, create=False))
                beyond = [p for p in sorted(live) if positions[p] > self._end(p) + 1]
                for p in beyond:
                    self._resync(p)  # our watch may only be behind
                beyond = [p for p in beyond if p in self._watches and positions[p] > self._end(p) + 1]
                if (self._floors is None and live) or beyond or self._vanished:
                    with self._documents(create=False) as docs:
                        self._check_partitions(docs, sorted(live))
                        self._floors = {int(p): int(o) for p, o in (docs.state or {}).get("floors", {}).items()}
                    if docs.state is not None:
                        epochs = _epoch_map(docs.state, self.partitions)
                        # A partition whose epoch changed since this object last tailed it: positions are of the
                        # lost stream.
                        beyond += [p for p in parts if p not in beyond and self._tail_epochs.get(p, epochs[p])
                                   != epochs[p]]
                        self._tail_epochs = epochs
                floors = self._floors or {}
                for p in beyond:
                    # The stream went back (deleted and made again): what it holds now is all new.
                    positions[p] = floors.get(p, 0)
                out: list[Delivery] = []
                for p in parts:
                    if p not in live:
                        continue
                    # Entry id N is offset N - 1: the entries after id N start at offset N.
                    start = max(positions[p], floors.get(p, 0))
                    entries, _ = self._fetch(p, start, self._end(p), count)
                    out.extend(_delivery(e, p, 1) for e in entries)
                if out:
                    return out
                if not self._wait(parts, deadline, lambda: any(self._end(p) >= positions[p] for p in parts)):
                    return []

        return cast(list[Delivery], self._call(run))

    # ------------------------------------------------------------------ looking up events (read-only)

    def delivery_states(self, group: str, events: Sequence[EventRef]) -> dict[str, EventDelivery]:
        refs = [(ref, partition_for(ref.partition_key, self.partitions)) for ref in events]
        if not refs:
            return {}

        def run() -> dict[str, EventDelivery]:
            with self._documents(create=False) as docs:
                state, dead = docs.state or {}, docs.dead or {}
            live = set(self._sync(sorted({p for _, p in refs}), create=False))
            floors = state.get("floors", {})
            info = state.get("groups", {}).get(group)
            dead_reasons: dict[tuple[int, str], str] = {}
            for item in dead.get("items", []):
                if item["group"] == group:
                    dead_reasons.setdefault((int(item["partition"]), str(item["entry_id"])), str(item["reason"]))
            out: dict[str, EventDelivery] = {}
            for ref, p in refs:
                offset = self._find(p, ref, int(floors.get(str(p), 0))) if p in live else None
                if offset is None:
                    out[ref.event_id] = EventDelivery(
                        NOT_FOUND, p, detail=f"not among the {LOOKUP_SCAN} entries of {self.names.stream(p)} from "
                        "its publish time (trimmed, the bus lost its data, or the clocks disagree)")
                    continue
                entry_id = str(offset + 1)
                pend = None if info is None else info["pending"].get(str(p), {}).get(str(offset))
                if (p, entry_id) in dead_reasons:
                    out[ref.event_id] = EventDelivery(DEAD_LETTERED, p, entry_id, reason=dead_reasons[(p, entry_id)])
                elif pend is not None:
                    out[ref.event_id] = EventDelivery(PENDING, p, entry_id, int(pend[1]), str(pend[0]))
                elif info is not None and offset < int(info["next"].get(str(p), 0)):
                    out[ref.event_id] = EventDelivery(ACKNOWLEDGED, p, entry_id)
                else:
                    out[ref.event_id] = EventDelivery(UNDELIVERED, p, entry_id)
            return out

        return cast(dict[str, EventDelivery], self._call(run))

    def _find(self, p: int, ref: EventRef, floor: int) -> int | None:
        """The offset of the event's earliest entry at or above the floor, within :data:`LOOKUP_SCAN` entries
        from just before its publish time (or from the floor)."""
        end = self._end(p)
        start = floor
        if ref.published_at is not None:
            start = max(floor, self._offset_at(p, ref.published_at.timestamp() - LOOKUP_CLOCK_MARGIN_S))
        entries, _ = self._fetch(p, start, end, LOOKUP_SCAN)
        for e in entries:
            if _text(e.headers.get(HEADER_ID, b"")) == ref.event_id:
                return e.offset
        return None

    def _offset_at(self, p: int, seconds: float) -> int:
        """The first offset of the stream's first chunk at or after ``seconds`` (the broker's chunk times)."""
        found: list[int] = []
        ch = self._connection().channel()
        try:
            ch.basic_qos(prefetch_count=1)

            def on_message(_c: Any, _m: Any, props: Any, _b: bytes) -> None:
                if not found:
                    found.append(int(dict(props.headers or {}).get(_OFFSET, 0)))

            when = datetime.fromtimestamp(max(seconds, 0.0), UTC)  # pika sends a datetime as an AMQP timestamp
            ch.basic_consume(self.names.stream(p), on_message, arguments={_OFFSET: when})
            deadline = time.monotonic() + 0.5  # nothing that recent: the watched end is the answer
            while not found and time.monotonic() < deadline:
                self._pump(_SLICE_S)
        except amqp_errors.ChannelClosedByBroker:
            return 0
        finally:
            self._discard(ch)
        return found[0] if found else self._end(p) + 1

    # ------------------------------------------------------------------ helpers



def _ignore(*_args: Any) -> None:
    """The lock consumer's callback: the lock queue never holds a message."""


def _new_state() -> dict[str, Any]:
    return {"v": 0, "epoch": secrets.token_hex(16), "epochs": {}, "ends": {}, "floors": {}, "groups": {}}


def _epoch_map(state: Mapping[str, Any], partitions: int) -> dict[int, str]:
    """Each partition's epoch token: its own once its stream went back, else the document's (a document made
    before tokens per partition existed has only that one)."""
    own = state.get("epochs", {})
    return {p: str(own.get(str(p), state.get("epoch", ""))) for p in range(partitions)}


def _remove_pending(info: dict[str, Any], deliveries: Sequence[Delivery]) -> bool:
    changed = False
    for d in deliveries:
        try:
            offset = int(d.entry_id) - 1
        except ValueError:
            continue
        pend = info["pending"].get(str(d.partition))
        if pend is not None and pend.pop(str(offset), None) is not None:
            changed = True
            if not pend:
                del info["pending"][str(d.partition)]
    return changed


def _take(entries: list[_Entry], start: int, stop: int, limit: int) -> tuple[list[_Entry], int]:
    got: list[_Entry] = []
    last = start - 1
    for e in entries:
        if e.offset < start:
            continue
        if e.offset > stop or len(got) >= limit:
            break
        last = e.offset
        if not e.marker:
            got.append(e)
    return got, last


def _int_header(headers: Mapping[str, Any], name: str) -> int:
    try:
        return int(headers.get(name, 0))
    except (TypeError, ValueError):
        return 0


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _safe(exc: BaseException, params: Any) -> str:
    """An exception's text without the password, should a library have quoted it."""
    text = str(exc)
    password = getattr(getattr(params, "credentials", None), "password", None)
    return text.replace(password, "***") if password else text


def _delivery(entry: _Entry, partition: int, deliveries: int) -> Delivery:
    """A delivery; a malformed entry gets ``event=None`` and says why in ``error``."""
    entry_id = str(entry.offset + 1)
    try:
        payload = entry.body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Delivery(entry_id, partition, entry.body.decode("utf-8", "replace"), None, deliveries,
                        f"payload is not UTF-8: {exc}")
    try:
        event = CloudEvent.from_json(payload)
    except EventFormatError as exc:
        return Delivery(entry_id, partition, payload, None, deliveries, str(exc))
    return Delivery(entry_id, partition, payload, event, deliveries, None)
