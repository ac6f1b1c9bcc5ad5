"""The Redis Streams bus: one stream per partition, consumer groups, XAUTOCLAIM, MINID trimming.

Key names come from :mod:`bridge.bus.keys` (the layout is documented there). How each part of the
contract in :mod:`bridge.bus.base` maps onto Redis, and why:

* **publish** sends one pipeline (``transaction=False``: the partitions may live on different
  cluster slots, and a MULTI would buy nothing since publishing twice is allowed) of ``XADD``,
  one round trip per batch. ``maxlen_approx`` adds ``MAXLEN ~ N``, a memory cap that *can* drop
  undelivered entries; it is off by default because the contract says trimming never does.
* **read** honours ``count`` strictly. ``XREADGROUP COUNT n`` over several streams returns up to
  ``n`` entries *per stream*, and an entry handed out cannot be taken back. On one server, with
  ``count`` at least the number of partitions (the scheduler's 5,000 over 8), a read is one
  ``XREADGROUP`` over every stream with ``COUNT count // partitions`` and ``BLOCK`` (the wake-up
  and the read in one round trip), the acknowledgements of the previous batch in the same
  pipeline; streams that filled their share are read again at once for the rest of ``count`` (a
  backlog on one partition still comes ``count`` at a time). Otherwise (a smaller ``count``, a
  cluster, whose streams live on different slots) the count is split over the streams (in a
  rotating order, so no partition starves) and streams that filled their share are asked again for
  the rest; when nothing is available a blocking read waits with a plain ``XREAD BLOCK`` from each
  stream's group position (read with ``XINFO GROUPS``), or on a cluster's doorbell, and then reads
  through the group again. Waiting with ``XREAD`` instead of a blocking ``XREADGROUP`` keeps the
  count strict there (on Redis 7.2+ a woken ``XREADGROUP`` is re-run over every stream) and loses
  nothing: anything added after the position was read wakes it. Every single wait is shorter than
  the client's socket timeout (redis-py's default of 5 s would otherwise turn a long block into a
  ``TimeoutError``); longer blocks are a loop of such waits.
* **Vanished data.** After ``FLUSHALL`` or a restart without persistence the streams and groups
  are gone and ``XREADGROUP`` answers ``NOGROUP``; the bus recreates the group (``MKSTREAM`` at
  id 0) and carries on, and :meth:`RedisStreamsBus.epoch` returns a new token so the relay knows
  to republish from its outbox.
* **claim_stale** uses ``XAUTOCLAIM`` (which increments the delivery count) on the partitions
  whose ``XPENDING`` summary is not empty, then reads each claimed entry's delivery count with
  ``XPENDING`` (one pipelined round trip).
* **trim** uses exact ``XTRIM MINID`` with, per stream, the smallest of: the retention cutoff
  (server clock), every group's oldest pending entry and every group's first undelivered entry.
  So it never removes a pending or undelivered entry; a stream without groups is trimmed by age.
* **Entry ids** are stream ids, unique per partition only: a delivery is identified by
  ``(partition, entry_id)``.
* **delivery_states** finds an event's entry by scanning its partition stream from just before its
  publish time (at most :data:`LOOKUP_SCAN` entries), then asks ``XINFO GROUPS`` (the group's
  position), ``XPENDING`` (consumer and delivery count) and the newest :data:`LOOKUP_DEAD_SCAN` dead
  letters: a few pipelined round trips per call, bounded whatever the streams hold.
* **leases** are kept beside the streams (:mod:`bridge.bus.redis_leases`).
* **Malformed entries** (no ``payload`` field, bytes that are not UTF-8, not a CloudEvent) are
  delivered with ``event=None`` and ``error`` set. The bus's own client does not decode replies
  (``decode_responses=False``) precisely so one non-UTF-8 entry cannot break every read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

from bridge.bus.base import (
    ACKNOWLEDGED,
    DEAD_LETTERED,
    NOT_FOUND,
    PENDING,
    UNDELIVERED,
    BusLeases,
    DeadLetter,
    Delivery,
    EventBus,
    EventDelivery,
    EventRef,
    partition_for,
)
from bridge.bus.keys import FIELD_ID, FIELD_PAYLOAD, BusKeys
from bridge.bus.redis_leases import RedisLeases
from bridge.core.events import CloudEvent, EventFormatError
from bridge.core.urls import mask_url

log = logging.getLogger(__name__)

StreamId = tuple[int, int]

#: Page size when the lag has to be counted by hand (``XINFO GROUPS`` did not know it).
_LAG_PAGE = 1000

#: Looking an event up: stream entries read, from just before its publish time, to find its entry.
LOOKUP_SCAN = 1000
#: Looking an event up: how far before its recorded publish time the scan starts (the publisher's clock and
#: Redis's differ a little).
LOOKUP_CLOCK_MARGIN_MS = 1000
#: Looking an event up: the newest dead letters searched for its entry.
LOOKUP_DEAD_SCAN = 200

#: Appends a batch to one partition stream in one call: one round trip per partition instead of one
#: pipelined command per event (redis-py's per-command packing and reply parsing, not Redis, was the
#: relay's bottleneck). KEYS[1]: the stream. ARGV: id field, payload field, maxlen ('' for none), then
#: (event id, payload) pairs. Returns the id of the last entry added (what the loss check looks for).
_XADD_BATCH = """
local id_field, payload_field, maxlen = ARGV[1], ARGV[2], ARGV[3]
local last = ''
for i = 4, #ARGV, 2 do
  if maxlen == '' then
    last = redis.call('XADD', KEYS[1], '*', id_field, ARGV[i], payload_field, ARGV[i + 1])
  else
    last = redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', id_field, ARGV[i], payload_field, ARGV[i + 1])
  end
end
return last
"""

_XADD_SHA = hashlib.sha1(_XADD_BATCH.encode()).hexdigest()

#: The doorbell of a cluster bus keeps about this many rings (a waiting reader only needs the newest).
WAKE_MAXLEN = 1000


class RedisStreamsBus(EventBus):
    """The production bus. Thread-safe as far as redis-py is (one client, a connection pool)."""

    def __init__(
        self,
        url_or_client: str | redis.Redis[Any],
        *,
        partitions: int = 8,
        namespace: str = "pollbridge",
        socket_timeout: float = 30.0,
        maxlen_approx: int | None = None,
    ) -> None:
        """``url_or_client`` is a URL (the bus creates its client with ``socket_timeout`` and closes
        it in :meth:`close`) or a client (used as it is and left open; its own socket timeout then
        bounds each blocking wait and ``socket_timeout`` is ignored)."""
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        if maxlen_approx is not None and maxlen_approx < 1:
            raise ValueError(f"maxlen_approx must be >= 1 or None, got {maxlen_approx}")
        self.partitions = partitions
        self.keys = BusKeys(namespace)
        self._stream_partition = {self.keys.stream(p): p for p in range(partitions)}
        self._maxlen = maxlen_approx
        self._rotation = 0
        # Per partition, the newest entry this bus object added (publish's script answers it): the loss
        # check looks for it after a failover (see :meth:`epochs`).
        self._added: dict[int, str] = {}
        self._lock = threading.Lock()
        self._url: str | None = None
        self._client_obj: Any = None
        self._cluster = False
        client_timeout: float | None
        if isinstance(url_or_client, str):
            if socket_timeout <= 0:
                raise ValueError(f"socket_timeout must be > 0, got {socket_timeout}")
            self._display = _masked(url_or_client)
            self._url = url_or_client
            self._socket_timeout = socket_timeout
            self._owned = True
            client_timeout = socket_timeout
        else:
            self._client_obj = url_or_client
            self._cluster = isinstance(url_or_client, RedisCluster)
            self._owned = False
            self._display = f"redis client {_client_host(url_or_client)}"
            raw_timeout = _client_kwargs(url_or_client).get("socket_timeout")
            client_timeout = float(raw_timeout) if raw_timeout else None
        # The longest single blocking call: safely below the socket timeout (None: no timeout).
        self._max_wait = (
            None if client_timeout is None else max(client_timeout - 1.0, client_timeout / 2)
        )

    def _is_cluster(self) -> bool:
        """Whether the server is a cluster (known once the client is made, which this makes)."""
        self._client  # noqa: B018 (made on first use, and with it _cluster)
        return self._cluster

    @property
    def _client(self) -> Any:
        """The redis-py client, made on first use (a bus object connects lazily): a ``redis.Redis`` for one
        server, a ``RedisCluster`` when the URL's node says it is part of a cluster."""
        client = self._client_obj
        if client is None:
            with self._lock:
                if self._client_obj is None:
                    assert self._url is not None
                    self._client_obj, self._cluster = connect(self._url, socket_timeout=self._socket_timeout)
                client = self._client_obj
        return client

    @property
    def cluster(self) -> bool:
        """Whether the bus runs on a Redis Cluster (known once it connected)."""
        _ = self._client
        return self._cluster

    def __repr__(self) -> str:
        return f"RedisStreamsBus({self._display}, namespace={self.keys.namespace!r}, partitions={self.partitions})"

    @property
    def client(self) -> Any:
        """The redis-py client, ``redis.Redis`` or ``RedisCluster`` (for tools and tests that look at the raw
        streams)."""
        return self._client

    # ------------------------------------------------------------------ publishing

    def publish(self, events: Sequence[CloudEvent]) -> None:
        if not events:
            return
        by_partition: dict[int, list[str]] = {}
        for event in events:
            by_partition.setdefault(self.partition_of(event), []).extend((event.id, event.to_json()))
        maxlen = "" if self._maxlen is None else str(self._maxlen)
        batches = [(self.keys.stream(partition), [FIELD_ID, FIELD_PAYLOAD, maxlen, *args])
                   for partition, args in by_partition.items()]
        # EVALSHA straight in the pipeline: a registered script in a pipeline costs a SCRIPT EXISTS round
        # trip on every execute (redis-py's load_scripts), a third of the relay's time per batch. A
        # script cache that was flushed (a restarted Redis) answers NOSCRIPT without running anything:
        # load the script and run those batches again.
        failed = self._evalsha_batches(batches)
        if failed:
            cast(Any, self._client).script_load(_XADD_BATCH)  # every primary of a cluster; untyped in redis-py
            failed = self._evalsha_batches(failed)
            if failed:
                raise NoScriptError(f"bus {self._display}: the batch script vanished again right after loading")
        if self._cluster:
            # Only once every entry is stored: a reader woken by the ring must find them (a reader that reads
            # before the ring finds them anyway, see _wait_for_rings).
            self._client.xadd(self.keys.wake, {b"p": ",".join(map(str, sorted(by_partition))).encode()},
                              maxlen=WAKE_MAXLEN, approximate=True)

    def _evalsha_batches(self, batches: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
        """Run the batch script on each (stream, args) in one pipeline; return those that found no script."""
        pipe = self._client.pipeline(transaction=False)
        for stream, args in batches:
            pipe.evalsha(_XADD_SHA, 1, stream, *args)
        failed = []
        for batch, result in zip(batches, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(result, NoScriptError):
                failed.append(batch)
            elif isinstance(result, Exception):
                raise result
            elif result:
                self._remember_added(batch[0], _text(result))
        return failed

    def _remember_added(self, stream: str, entry_id: str) -> None:
        partition = self._stream_partition[stream]
        with self._lock:
            known = self._added.get(partition)
            if known is None or _parse_id(entry_id) > _parse_id(known):
                self._added[partition] = entry_id

    def memory_pressure(self) -> float | None:
        """On a cluster, the fullest primary's (publishing stops when any shard is near its limit)."""
        if self._cluster:
            per_node = self._client.info("memory", target_nodes=RedisCluster.PRIMARIES)
            infos = list(per_node.values()) if per_node and isinstance(next(iter(per_node.values())), dict) \
                else [per_node]
        else:
            infos = [self._client.info("memory")]
        pressures = [int(i.get("used_memory", 0)) / int(i.get("maxmemory", 0))
                     for i in infos if int(i.get("maxmemory", 0) or 0) > 0]
        return float(max(pressures)) if pressures else None

    # ------------------------------------------------------------------ groups

    def ensure_group(self, group: str) -> None:
        self._create_groups(group, range(self.partitions))

    def _recreate_groups(self, group: str, partitions: list[int]) -> None:
        """A read found the group gone (``NOGROUP``, ``UNBLOCKED``): said, and made again."""
        log.warning("bus %s: consumer group %r missing on partitions %s (data lost?); recreating it",
                    self._display, group, partitions)
        self._create_groups(group, partitions)

    def _create_groups(self, group: str, partitions: Iterable[int]) -> None:
        """``XGROUP CREATE ... 0 MKSTREAM`` on each partition; an existing group (BUSYGROUP) is fine."""
        name = self.keys.group(group)
        pipe = self._client.pipeline(transaction=False)
        for p in partitions:
            pipe.xgroup_create(self.keys.stream(p), name, id="0", mkstream=True)
        for result in pipe.execute(raise_on_error=False):
            if isinstance(result, ResponseError) and not str(result).startswith("BUSYGROUP"):
                raise result

    # ------------------------------------------------------------------ reading

    def read(self, group: str, consumer: str, partitions: Sequence[int], count: int, block: float) -> list[Delivery]:
        return self.ack_and_read(group, (), consumer, partitions, count, block)

    def ack_and_read(self, group: str, acks: Sequence[Delivery], consumer: str, partitions: Sequence[int],
                     count: int, block: float) -> list[Delivery]:
        """The ``XACK``s ride in the pipeline of the first read (see the module docstring)."""
        parts = self._checked(partitions)
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        name = self.keys.group(group)
        if not parts:
            self.ack(group, acks)
            return []
        deadline = time.monotonic() + max(block, 0.0)
        if not self._is_cluster() and count >= len(parts):
            # One round trip per read: the acknowledgements and one XREADGROUP over every stream, which blocks
            # only when nothing is there. At 500 completions/s, one entry a batch, the read before was a pipeline
            # of an XREADGROUP per stream (9 commands with the XACK) that came back empty, then the blocking read:
            # two round trips and 10 commands per batch (bench.cost, trigger at 500/s, alternating: the
            # scheduler's CPU 5.73-5.78 -> 5.26-5.37 s per 20 s window).
            while True:
                remaining = deadline - time.monotonic()
                wait = remaining if self._max_wait is None else min(remaining, self._max_wait)
                got = self._read_blocking(name, consumer, parts, count, wait, acks)
                acks = ()
                if got:
                    return self._topped_up(name, consumer, parts, count, got)
                if deadline - time.monotonic() <= 0:
                    return got
        rings: str | None = None  # a cluster's doorbell position to wait from
        while True:
            got = self._read_available(name, consumer, parts, count, acks)
            acks = ()
            if got:
                return got
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            wait = remaining if self._max_wait is None else min(remaining, self._max_wait)
            if self._cluster:
                # A blocking read cannot span several slots: wait on the doorbell instead. Its position is
                # taken before the next read, so a publish after that read rings after the position.
                rings = self._ring_position() if rings is None else self._wait_for_rings(rings, parts, wait)
                continue
            # One server, a count smaller than the partitions: a per-stream COUNT could exceed ``count``, so wait
            # first, then read through the group.
            positions = self._group_positions(name, parts)
            self._client.xread(positions, count=1, block=max(1, int(wait * 1000)))

    def _topped_up(self, group: str, consumer: str, parts: list[int], count: int,
                   got: list[Delivery]) -> list[Delivery]:
        """``got`` (a read of ``count // len(parts)`` per stream) with the rest of ``count`` read at once from the
        streams that filled their share, so a backlog on a few partitions (a fan-out of one instance) still comes
        ``count`` at a time; one more round trip, only then."""
        share = max(1, count // len(parts))
        per: dict[int, int] = {}
        for d in got:
            per[d.partition] = per.get(d.partition, 0) + 1
        full = [p for p in parts if per.get(p, 0) >= share]
        if not full or len(got) >= count:
            return got
        return got + self._read_available(group, consumer, full, count - len(got))

    def _read_blocking(self, group: str, consumer: str, parts: list[int], count: int, wait: float,
                       acks: Sequence[Delivery] = (), recreated: bool = False) -> list[Delivery]:
        """One ``XREADGROUP`` over all the partitions, ``BLOCK`` for ``wait`` seconds if ``wait`` > 0: the wake-up
        and the read in one round trip, with ``acks`` acknowledged before it in the same pipeline.

        ``COUNT`` applies per stream, so each stream is asked for ``count // len(parts)``: the total stays
        within ``count`` (the caller uses this path only when ``count >= len(parts)``)."""
        streams = {self.keys.stream(p): ">" for p in parts}
        by_stream = {self.keys.stream(p).encode(): p for p in parts}
        share = max(1, count // len(parts))
        block = max(1, int(wait * 1000)) if wait > 0 else None  # BLOCK 0 would wait for ever
        ack_commands = self._ack_commands(acks)
        reply: Any
        if ack_commands:
            pipe = self._client.pipeline(transaction=False)
            for stream, ids in ack_commands:
                pipe.xack(stream, group, *ids)
            pipe.xreadgroup(group, consumer, streams, count=share, block=block)
            results = pipe.execute(raise_on_error=False)
            self._check_acks(results[:-1])
            reply = results[-1]
        else:
            try:
                reply = self._client.xreadgroup(group, consumer, streams, count=share, block=block)
            except ResponseError as exc:
                reply = exc
        if isinstance(reply, ResponseError):
            # Redis 7 answers a read blocked on a stream deleted meanwhile (FLUSHALL, a lost server's restart)
            # with UNBLOCKED: the data is gone, as with NOGROUP.
            if not (_is_nogroup(reply) or str(reply).startswith("UNBLOCKED")) or recreated:
                raise reply
            self._recreate_groups(group, parts)
            return self._read_blocking(group, consumer, parts, count, wait, recreated=True)
        out: list[Delivery] = []
        items = reply.items() if isinstance(reply, dict) else (reply or [])
        for item in items:
            stream, entries = item[0], item[1]
            key = stream if isinstance(stream, bytes) else str(stream).encode()
            partition = by_stream[key]
            for entry_id, fields in _stream_entries([[stream, entries]]):
                if fields is not None:
                    out.append(_delivery(entry_id, fields, partition))
        return out

    def _read_available(self, group: str, consumer: str, parts: list[int], count: int,
                        acks: Sequence[Delivery] = ()) -> list[Delivery]:
        """Everything undelivered up to ``count``, without blocking; recreates vanished groups once. ``acks``
        are acknowledged in the first pipeline, before its reads."""
        out: list[Delivery] = []
        ack_commands = self._ack_commands(acks)
        remaining = count
        start = self._rotation % len(parts)
        self._rotation += 1
        candidates = parts[start:] + parts[:start]
        recreated = False
        while remaining > 0 and candidates:
            asked = candidates[:remaining]
            base, extra = divmod(remaining, len(asked))
            shares = [base + (1 if i < extra else 0) for i in range(len(asked))]
            pipe = self._client.pipeline(transaction=False)
            for stream, ids in ack_commands:
                pipe.xack(stream, group, *ids)
            for p, share in zip(asked, shares, strict=True):
                pipe.xreadgroup(group, consumer, {self.keys.stream(p): ">"}, count=share)
            results = pipe.execute(raise_on_error=False)
            self._check_acks(results[:len(ack_commands)])
            results = results[len(ack_commands):]
            ack_commands = []
            again: list[int] = []
            vanished: list[int] = []
            for p, share, result in zip(asked, shares, results, strict=True):
                if isinstance(result, ResponseError):
                    if not _is_nogroup(result) or recreated:
                        raise result
                    vanished.append(p)
                    continue
                entries = _stream_entries(result)
                out.extend(_delivery(entry_id, fields, p) for entry_id, fields in entries if fields is not None)
                remaining -= len(entries)
                if len(entries) >= share:
                    again.append(p)  # it filled its share: it may hold more
            if vanished:
                self._recreate_groups(group, vanished)
                recreated = True
            candidates = vanished + again + candidates[len(asked):]
        return out

    def _group_positions(self, group: str, parts: list[int]) -> dict[Any, Any]:
        """Per stream, the group's last-delivered id: an ``XREAD`` from there wakes on anything undelivered."""
        pipe = self._client.pipeline(transaction=False)
        for p in parts:
            pipe.xinfo_groups(self.keys.stream(p))
        positions: dict[Any, Any] = {}
        for p, result in zip(parts, pipe.execute(raise_on_error=False), strict=True):
            info = None if isinstance(result, Exception) else _find_group(result, group)
            positions[self.keys.stream(p)] = "0-0" if info is None else _text(info.get("last-delivered-id", "0-0"))
        return positions

    def _ring_position(self) -> str:
        """The newest ring of a cluster's doorbell (``"0-0"`` when it has none)."""
        newest = self._client.xrevrange(self.keys.wake, max="+", min="-", count=1)
        return _text(newest[0][0]) if newest else "0-0"

    def _wait_for_rings(self, position: str, parts: Sequence[int], wait: float) -> str:
        """Block on the doorbell after ``position`` until a ring names one of ``parts`` (or ``wait`` seconds
        passed); the position of the newest ring seen. Rings for other partitions are passed over."""
        deadline = time.monotonic() + wait
        wanted = {str(p) for p in parts}
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return position
            reply = self._client.xread({self.keys.wake: position}, count=WAKE_MAXLEN,
                                       block=max(1, int(remaining * 1000)))
            entries = _stream_entries(reply)
            if not entries:
                return position
            position = _text(entries[-1][0])
            if any(wanted.intersection(_field(fields, "p").split(",")) for _, fields in entries):
                return position

    # ------------------------------------------------------------------ tailing (read-only, no group)

    def end_positions(self, partitions: Sequence[int]) -> dict[int, str]:
        """``XREVRANGE + - COUNT 1`` per stream (one pipelined round trip); ``"0"`` for an empty or missing one."""
        parts = self._checked(partitions)
        pipe = self._client.pipeline(transaction=False)
        for p in parts:
            pipe.xrevrange(self.keys.stream(p), max="+", min="-", count=1)
        out: dict[int, str] = {}
        for p, result in zip(parts, pipe.execute(), strict=True):
            out[p] = _text(result[0][0]) if result else "0"
        return out

    def tail(self, after: Mapping[int, str], count: int, block: float) -> list[Delivery]:
        """Plain ``XREAD`` (no group: nothing pending, no offset moved) from each position; ``COUNT`` is per
        stream. Long blocks are a loop of waits shorter than the socket timeout, as in :meth:`read`."""
        parts = self._checked(list(after))
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if not parts:
            return []
        for p in parts:
            _parse_id(after[p])  # a ValueError for a position that is no stream id
        streams: dict[Any, Any] = {self.keys.stream(p): after[p] for p in parts}
        by_stream = {self.keys.stream(p).encode(): p for p in parts}
        deadline = time.monotonic() + max(block, 0.0)
        if self._cluster:
            return self._tail_cluster(streams, by_stream, count, deadline)
        while True:
            remaining = deadline - time.monotonic()
            wait = remaining if self._max_wait is None else min(remaining, self._max_wait)
            reply = self._client.xread(streams, count=count, block=max(1, int(wait * 1000)) if wait > 0 else None)
            out: list[Delivery] = []
            items = reply.items() if isinstance(reply, dict) else (reply or [])
            for item in items:
                stream, entries = item[0], item[1]
                key = stream if isinstance(stream, bytes) else str(stream).encode()
                partition = by_stream[key]
                out.extend(_delivery(entry_id, fields, partition)
                           for entry_id, fields in _stream_entries([[stream, entries]]) if fields is not None)
            if out or deadline - time.monotonic() <= 0:
                return out

    def _tail_cluster(self, streams: dict[Any, Any], by_stream: dict[bytes, int], count: int,
                      deadline: float) -> list[Delivery]:
        """:meth:`tail` on a cluster: one non-blocking ``XREAD`` per stream (a command cannot span slots), in
        one pipeline; when nothing is there, the doorbell is the wait."""
        rings: str | None = None
        parts = list(by_stream.values())
        while True:
            pipe = self._client.pipeline(transaction=False)
            for stream, position in streams.items():
                pipe.xread({stream: position}, count=count)
            out: list[Delivery] = []
            for stream, reply in zip(streams, pipe.execute(), strict=True):
                partition = by_stream[stream.encode()]
                out.extend(_delivery(entry_id, fields, partition)
                           for entry_id, fields in _stream_entries(reply) if fields is not None)
            remaining = deadline - time.monotonic()
            if out or remaining <= 0:
                return out
            wait = remaining if self._max_wait is None else min(remaining, self._max_wait)
            rings = self._ring_position() if rings is None else self._wait_for_rings(rings, parts, wait)

    # ------------------------------------------------------------------ acknowledging and redelivery

    def ack(self, group: str, deliveries: Sequence[Delivery]) -> None:
        commands = self._ack_commands(deliveries)
        if not commands:
            return
        pipe = self._client.pipeline(transaction=False)
        for stream, ids in commands:
            pipe.xack(stream, self.keys.group(group), *ids)
        self._check_acks(pipe.execute(raise_on_error=False))

    def _ack_commands(self, deliveries: Sequence[Delivery]) -> list[tuple[str, list[str]]]:
        by_partition: dict[int, list[str]] = {}
        for d in deliveries:
            by_partition.setdefault(d.partition, []).append(d.entry_id)
        return [(self.keys.stream(p), ids) for p, ids in by_partition.items()]

    @staticmethod
    def _check_acks(results: Sequence[Any]) -> None:
        for result in results:
            # Acknowledging in a group that vanished with the data is as harmless as acking twice.
            if isinstance(result, ResponseError) and not _is_nogroup(result):
                raise result

    def claim_stale(self, group: str, consumer: str, partitions: Sequence[int], min_idle: float,
                    count: int) -> list[Delivery]:
        parts = self._checked(partitions)
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        name = self.keys.group(group)
        min_idle_ms = max(0, int(min_idle * 1000))
        summaries = self._pending_summaries(name, parts)
        claimed: list[Delivery] = []
        for p in parts:
            if summaries.get(p, 0) == 0:
                continue
            cursor: Any = "0-0"
            while len(claimed) < count:
                try:
                    reply = self._client.xautoclaim(self.keys.stream(p), name, consumer, min_idle_ms,
                                                    start_id=cursor, count=count - len(claimed))
                except ResponseError as exc:
                    if _is_nogroup(exc):
                        break
                    raise
                cursor, entries = reply[0], reply[1]
                # Entries deleted from the stream come back without fields (Redis 6.2) or not at
                # all (7.x); either way XAUTOCLAIM already dropped them from the pending list.
                claimed.extend(_delivery(entry_id, fields, p) for entry_id, fields in entries if fields is not None)
                if _text(cursor) == "0-0":
                    break
            if len(claimed) >= count:
                break
        return self._with_delivery_counts(name, claimed)

    def _with_delivery_counts(self, group: str, claimed: list[Delivery]) -> list[Delivery]:
        if not claimed:
            return []
        pipe = self._client.pipeline(transaction=False)
        for d in claimed:
            pipe.xpending_range(self.keys.stream(d.partition), group, min=d.entry_id, max=d.entry_id, count=1)
        out: list[Delivery] = []
        for d, result in zip(claimed, pipe.execute(raise_on_error=False), strict=True):
            deliveries = d.deliveries
            if not isinstance(result, Exception) and result:
                deliveries = int(result[0].get("times_delivered", deliveries))
            out.append(Delivery(d.entry_id, d.partition, d.payload, d.event, deliveries, d.error))
        return out

    def _pending_summaries(self, group: str, parts: Sequence[int]) -> dict[int, int]:
        pipe = self._client.pipeline(transaction=False)
        for p in parts:
            pipe.xpending(self.keys.stream(p), group)
        counts: dict[int, int] = {}
        for p, result in zip(parts, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(result, ResponseError):
                if _is_nogroup(result):
                    continue
                raise result
            counts[p] = int(result["pending"] if isinstance(result, dict) else result[0])
        return counts

    def pending_count(self, group: str) -> int:
        return sum(self._pending_summaries(self.keys.group(group), range(self.partitions)).values())

    def lag(self, group: str) -> dict[int, int]:
        """Per partition, entries not yet delivered to ``group`` (all of them if the group is missing)."""
        name = self.keys.group(group)
        pipe = self._client.pipeline(transaction=False)
        for p in range(self.partitions):
            pipe.xinfo_groups(self.keys.stream(p))
            pipe.xlen(self.keys.stream(p))
        results = pipe.execute(raise_on_error=False)
        lags: dict[int, int] = {}
        for p in range(self.partitions):
            groups, length = results[2 * p], results[2 * p + 1]
            if isinstance(groups, Exception) or isinstance(length, Exception):
                lags[p] = 0  # no such stream
                continue
            info = _find_group(groups, name)
            if info is None:
                lags[p] = int(length)
            elif info.get("lag") is not None:
                lags[p] = int(info["lag"])
            else:
                # Redis < 7 or a stream with deleted entries past the group: count by hand.
                lags[p] = self._count_after(self.keys.stream(p), _text(info.get("last-delivered-id", "0-0")))
        return lags

    def _count_after(self, stream: str, last_id: str) -> int:
        total, start = 0, f"({last_id}"
        while True:
            page = self._client.xrange(stream, min=start, max="+", count=_LAG_PAGE)
            total += len(page)
            if len(page) < _LAG_PAGE:
                return total
            start = f"({_text(page[-1][0])}"

    # ------------------------------------------------------------------ dead letters

    def dead_letter(self, group: str, delivery: Delivery, reason: str) -> None:
        name = self.keys.group(group)
        pipe = self._client.pipeline(transaction=False)
        pipe.xadd(self.keys.dead, {"group": name, "entry_id": delivery.entry_id, "partition": delivery.partition,
                                   "payload": delivery.payload, "reason": reason})
        # Only after the dead letter is stored: a crash in between redelivers, never loses.
        pipe.xack(self.keys.stream(delivery.partition), name, delivery.entry_id)
        results = pipe.execute(raise_on_error=False)
        if isinstance(results[0], Exception):
            raise results[0]
        if isinstance(results[1], ResponseError) and not _is_nogroup(results[1]):
            raise results[1]

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        if limit < 1:
            return []
        out: list[DeadLetter] = []
        for entry_id, fields in self._client.xrange(self.keys.dead, min="-", max="+", count=limit):
            f = {_text(k): v for k, v in (fields or {}).items()}
            try:
                partition = int(_text(f.get("partition", "-1")))
            except ValueError:
                partition = -1
            out.append(DeadLetter(
                id=_text(entry_id),
                group=_text(f.get("group", "")),
                entry_id=_text(f.get("entry_id", "")),
                partition=partition,
                payload=_text(f.get("payload", "")),
                reason=_text(f.get("reason", "")),
            ))
        return out

    def remove_dead_letters(self, ids: Sequence[str]) -> int:
        if not ids:
            return 0
        return int(self._client.xdel(self.keys.dead, *ids))

    def dead_letter_count(self) -> int:
        return int(self._client.xlen(self.keys.dead))

    # ------------------------------------------------------------------ looking up events (read-only)

    def delivery_states(self, group: str, events: Sequence[EventRef]) -> dict[str, EventDelivery]:
        name = self.keys.group(group)
        refs = [(ref, partition_for(ref.partition_key, self.partitions)) for ref in events]
        if not refs:
            return {}
        parts = sorted({p for _, p in refs})
        pipe = self._client.pipeline(transaction=False)
        for p in parts:
            pipe.xinfo_groups(self.keys.stream(p))
        for ref, p in refs:
            start = "-" if ref.published_at is None else \
                f"{max(0, int(ref.published_at.timestamp() * 1000) - LOOKUP_CLOCK_MARGIN_MS)}-0"
            pipe.xrange(self.keys.stream(p), min=start, max="+", count=LOOKUP_SCAN)
        pipe.xrevrange(self.keys.dead, max="+", min="-", count=LOOKUP_DEAD_SCAN)
        results = pipe.execute(raise_on_error=False)
        for result in results[len(parts):]:
            if isinstance(result, Exception):
                raise result
        positions: dict[int, StreamId] = {}
        for p, groups in zip(parts, results[:len(parts)], strict=True):
            if isinstance(groups, ResponseError):
                continue  # no such stream: no group either
            if isinstance(groups, Exception):
                raise groups
            info = _find_group(groups, name)
            if info is not None:
                positions[p] = _parse_id(info.get("last-delivered-id", "0-0"))
        entries: dict[str, str | None] = {}
        for (ref, _), scanned in zip(refs, results[len(parts):-1], strict=True):
            entries[ref.event_id] = next((_text(entry_id) for entry_id, fields in scanned
                                          if _field(fields, FIELD_ID) == ref.event_id), None)
        dead: dict[tuple[str, str], str] = {}
        for _, fields in results[-1]:  # newest first
            if _field(fields, "group") == name:
                dead.setdefault((_field(fields, "partition"), _field(fields, "entry_id")), _field(fields, "reason"))
        asks = [(ref, p, entries[ref.event_id]) for ref, p in refs
                if entries[ref.event_id] is not None and p in positions]
        pending: dict[str, tuple[str, int]] = {}
        if asks:
            pipe = self._client.pipeline(transaction=False)
            for _, p, entry in asks:
                pipe.xpending_range(self.keys.stream(p), name, min=entry, max=entry, count=1)
            for (ref, _, _), result in zip(asks, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(result, ResponseError) and _is_nogroup(result):
                    continue  # the group vanished meanwhile
                if isinstance(result, Exception):
                    raise result
                for row in result or []:
                    pending[ref.event_id] = (_text(row["consumer"]), int(row["times_delivered"]))
        out: dict[str, EventDelivery] = {}
        for ref, p in refs:
            entry = entries[ref.event_id]
            if entry is None:
                out[ref.event_id] = EventDelivery(
                    NOT_FOUND, p, detail=f"not among the {LOOKUP_SCAN} entries of {self.keys.stream(p)} from its "
                                         "publish time (trimmed, the bus lost its data, or the clocks disagree)")
            elif (str(p), entry) in dead:
                out[ref.event_id] = EventDelivery(DEAD_LETTERED, p, entry, reason=dead[(str(p), entry)])
            elif ref.event_id in pending:
                consumer, times = pending[ref.event_id]
                out[ref.event_id] = EventDelivery(PENDING, p, entry, times, consumer)
            elif p in positions and _parse_id(entry) <= positions[p]:
                out[ref.event_id] = EventDelivery(ACKNOWLEDGED, p, entry)
            else:
                out[ref.event_id] = EventDelivery(UNDELIVERED, p, entry)
        return out

    def placement(self) -> dict[int, str] | None:
        """On a cluster, the primary holding each partition's stream (its hash tag's slot), from the client's slot
        map; ``None`` on a single server."""
        if not self.cluster:
            return None
        client = self._client
        out: dict[int, str] = {}
        for p in range(self.partitions):
            node = client.get_node_from_key(self.keys.stream(p))
            out[p] = f"{node.host}:{node.port}" if node is not None else "?"
        return out

    # ------------------------------------------------------------------ partition leases

    def leases(self) -> BusLeases:
        """The scheduler's leases beside the streams: one Lua script per round, Redis's clock
        (:mod:`bridge.bus.redis_leases`)."""
        return RedisLeases(self._client, self.keys, self.partitions)

    # ------------------------------------------------------------------ trimming and loss detection

    def trim(self, retention: float) -> int:
        sec, usec = self._client.time()
        cutoff_ms = int(sec) * 1000 + int(usec) // 1000 - int(max(retention, 0.0) * 1000)
        # MINID removes ids below it: everything published at or before the cutoff millisecond.
        by_age: StreamId = (cutoff_ms + 1, 0)
        streams = self.keys.streams(self.partitions)
        pipe = self._client.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        infos = pipe.execute(raise_on_error=False)
        thresholds: dict[str, StreamId] = {}
        pending_asks: list[tuple[str, Any]] = []
        for stream, groups in zip(streams, infos, strict=True):
            if isinstance(groups, Exception):
                continue  # no such stream
            limit = by_age
            for info in _group_dicts(groups):
                # Entries after the group's position are undelivered: keep them.
                ms, seq = _parse_id(info.get("last-delivered-id", "0-0"))
                limit = min(limit, (ms, seq + 1))
                if int(info.get("pending", 0) or 0) > 0:
                    pending_asks.append((stream, info.get("name")))
            thresholds[stream] = limit
        if pending_asks:
            pipe = self._client.pipeline(transaction=False)
            for stream, group in pending_asks:
                pipe.xpending(stream, group)
            for (stream, _), summary in zip(pending_asks, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(summary, Exception):
                    # The group vanished between the two calls: keep everything this time.
                    thresholds[stream] = (0, 0)
                    continue
                oldest = summary.get("min") if isinstance(summary, dict) else summary[1]
                if oldest is not None:
                    thresholds[stream] = min(thresholds[stream], _parse_id(oldest))
        todo = [(s, t) for s, t in thresholds.items() if t > (0, 1)]
        if not todo:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for stream, threshold in todo:
            pipe.xtrim(stream, minid=f"{threshold[0]}-{threshold[1]}", approximate=False)
        return sum(int(n) for n in pipe.execute())

    def epoch(self) -> str:
        """One token over every partition's (:meth:`epochs`): it changes when any partition lost its data."""
        tokens = self.epochs()
        return hashlib.sha1(",".join(tokens[p] for p in sorted(tokens)).encode()).hexdigest()

    def epochs(self) -> dict[int, str]:
        """Per partition, the token at ``ns:epoch:{ns:pN}`` (created if missing: a new token means the
        partition lost its data), in one pipelined round trip (one per shard on a cluster).

        A key that survived does not prove the writes did: replication is asynchronous, so a primary killed
        right after acknowledging an ``XADD`` can fail over to a replica that never received it, while the
        old epoch key is there. So the same round trip asks ``XINFO STREAM`` of every partition this bus
        object published to: its newest entry added is lost when the stream never generated that id, or
        when it is missing between the oldest entry kept and the newest (trimming only removes the oldest).
        Such a partition gets a new token, which every relay then sees."""
        with self._lock:
            added = dict(self._added)
        pipe = self._client.pipeline(transaction=False)
        for p in range(self.partitions):
            pipe.set(self.keys.epoch(p), secrets.token_hex(8), nx=True)
            pipe.get(self.keys.epoch(p))
        for p, entry_id in added.items():
            pipe.xinfo_stream(self.keys.stream(p))
            pipe.xrange(self.keys.stream(p), min=entry_id, max=entry_id, count=1)
        results = pipe.execute(raise_on_error=False)
        for result in results[:2 * self.partitions]:
            if isinstance(result, Exception):
                raise result
        tokens = {p: _text(results[2 * p + 1]) for p in range(self.partitions)}
        lost: list[int] = []
        for i, (p, entry_id) in enumerate(added.items()):
            info, found = results[2 * self.partitions + 2 * i], results[2 * self.partitions + 2 * i + 1]
            if isinstance(found, Exception):
                raise found
            if found:
                continue
            if isinstance(info, ResponseError):  # no such stream: it is gone with what we added
                lost.append(p)
                continue
            if isinstance(info, Exception):
                raise info
            last = _parse_id(info.get("last-generated-id", "0-0"))
            first = info.get("first-entry")
            mine = _parse_id(entry_id)
            if last < mine or (first is not None and _parse_id(first[0]) < mine):
                lost.append(p)
        if lost:
            pipe = self._client.pipeline(transaction=False)
            for p in lost:
                tokens[p] = secrets.token_hex(8)
                pipe.set(self.keys.epoch(p), tokens[p])
            pipe.execute()
            log.warning("bus %s: entries this process published to partition(s) %s are gone (a failover to a "
                        "replica that had not received them?): their epochs are renewed so they are republished",
                        self._display, lost)
        with self._lock:
            for p in lost:  # renewed once; what this bus publishes next is checked afresh
                if self._added.get(p) == added[p]:
                    del self._added[p]
        return tokens

    def purge_all(self) -> int:
        """Delete every key of this bus's namespace (:func:`delete_namespace`); how many there were."""
        with self._lock:
            self._added.clear()
        return delete_namespace(self._client, self.keys.namespace)

    def close(self) -> None:
        client = self._client_obj
        if self._owned and client is not None:
            client.close()
            if not self._cluster:
                client.connection_pool.disconnect()


def connect(url: str, *, socket_timeout: float = 30.0) -> tuple[Any, bool]:
    """A client for the Redis at ``url`` and whether it is a cluster: ``RedisCluster`` (which finds every
    node from this one and follows slots, MOVED and failovers) when that node has cluster mode on, else
    ``redis.Redis``. Replies are not decoded (see the module docstring)."""
    single = single_client(url, socket_timeout=socket_timeout)
    try:
        enabled = str(single.info("cluster").get("cluster_enabled", 0)) == "1"
    except ResponseError:  # a server without INFO cluster: not a cluster
        enabled = False
    except BaseException:
        single.close()
        raise
    if not enabled:
        return single, False
    single.close()
    single.connection_pool.disconnect()
    return RedisCluster.from_url(url, **_options(socket_timeout)), True


def _options(socket_timeout: float) -> dict[str, Any]:
    return {"decode_responses": False, "socket_timeout": socket_timeout,
            "socket_connect_timeout": min(socket_timeout, 10.0)}


def single_client(url: str, *, socket_timeout: float = 30.0) -> Any:
    """The one-server client the bus opens for ``url`` (connecting lazily: nothing is sent until a command): what
    the URL's user, password, database and TLS options become (a cluster's client takes the same URL)."""
    return redis.Redis.from_url(url, health_check_interval=30, **_options(socket_timeout))


def _client_kwargs(client: Any) -> dict[str, Any]:
    if isinstance(client, RedisCluster):
        node = client.get_default_node()
        return dict(node.redis_connection.connection_pool.connection_kwargs) if node and node.redis_connection \
            else {}
    return dict(client.connection_pool.connection_kwargs)


def _client_host(client: Any) -> str:
    kwargs = _client_kwargs(client)
    return str(kwargs.get("host", kwargs.get("path", "?")))


def delete_namespace(client: Any, namespace: str) -> int:
    """Delete every key of one bus namespace, and nothing else (a Redis "lost its data" in tests and
    benchmarks, or a namespace's cleanup); how many keys there were. On a cluster the scan visits every
    primary and the delete is split by slot (redis-py's cluster client does both)."""
    keys = list(client.scan_iter(match=BusKeys(namespace).pattern, count=1000))
    if keys:
        client.delete(*keys)
    return len(keys)


def _masked(url: str) -> str:
    """The URL without its password (in the userinfo or a ``password=`` query parameter)."""
    return re.sub(r"(?i)(password=)[^&]*", r"\1***", mask_url(url))


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _field(fields: Any, name: str) -> str:
    """One field of a stream entry as text (``""`` when missing), whether the client decodes replies or not."""
    for key, value in (fields or {}).items():
        if _text(key) == name:
            return _text(value)
    return ""


def _parse_id(value: Any) -> StreamId:
    ms, _, seq = _text(value).partition("-")
    return int(ms), int(seq or 0)


def _is_nogroup(exc: Exception) -> bool:
    return str(exc).startswith("NOGROUP")


def _group_dicts(groups: Any) -> list[dict[str, Any]]:
    return [{_text(k): v for k, v in g.items()} for g in groups or []]


def _find_group(groups: Any, name: str) -> dict[str, Any] | None:
    for info in _group_dicts(groups):
        if _text(info.get("name")) == name:
            return info
    return None


def _stream_entries(reply: Any) -> list[tuple[Any, Any]]:
    """The ``(id, fields)`` entries of an XREAD/XREADGROUP reply, whatever shape this client gives it.

    redis-py answers ``[[stream, entries]]`` (RESP2 and RESP3 "legacy"), ``{stream: entries}``
    (unified) or ``{stream: [entries]}`` (RESP3), depending on how the client was built."""
    if not reply:
        return []
    per_stream = list(reply.values()) if isinstance(reply, dict) else [item[1] for item in reply]
    out: list[tuple[Any, Any]] = []
    for entries in per_stream:
        for item in entries or []:
            if isinstance(item, (list, tuple)) and item and isinstance(item[0], (bytes, str)):
                out.append((item[0], item[1]))
            else:  # one more level of nesting
                out.extend((e[0], e[1]) for e in item)
    return out


def _delivery(entry_id: Any, fields: Any, partition: int) -> Delivery:
    """A delivery; a malformed entry gets ``event=None`` and says why in ``error``."""
    f = {_text(k): v for k, v in dict(fields).items()}
    raw = f.get(FIELD_PAYLOAD)
    if raw is None:
        payload = json.dumps({k: _text(v) for k, v in f.items()}, sort_keys=True)
        return Delivery(_text(entry_id), partition, payload, None, 1, f"entry has no {FIELD_PAYLOAD!r} field")
    if isinstance(raw, bytes):
        try:
            payload = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Delivery(_text(entry_id), partition, raw.decode("utf-8", "replace"), None, 1,
                            f"payload is not UTF-8: {exc}")
    else:
        payload = str(raw)
    try:
        event = CloudEvent.from_json(payload)
    except EventFormatError as exc:
        return Delivery(_text(entry_id), partition, payload, None, 1, str(exc))
    return Delivery(_text(entry_id), partition, payload, event, 1, None)
