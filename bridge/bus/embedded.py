"""The embedded bus: an event log in pollbridge's own database, with Redis Streams group semantics.

It needs no server, so the default installation (SQLite) and small PostgreSQL ones get the same
event path as production; the one contract suite proves both backends behave alike. The tables
are ``pollbridge_bus_log`` (the log; a row id is an entry id), ``pollbridge_bus_groups`` (per
group and partition, the id of the last entry delivered: the group's offset),
``pollbridge_bus_pending`` (delivered, not acknowledged; who has it, since when, how many times)
and ``pollbridge_bus_dead``.

Why it is built the way it is:

* **read** takes the entries after the group's offsets, records them as pending and advances the
  offsets in *one* transaction, so an entry is delivered by ``read`` once per group even with
  many consumers. On PostgreSQL the group rows are locked ``FOR UPDATE`` (in partition order, so
  two consumers never deadlock); on SQLite every transaction is ``BEGIN IMMEDIATE`` already. On
  PostgreSQL, once a group's rows are known, that transaction is one statement (:data:`_PG_TAKE`,
  which also carries the previous batch's acknowledgements in ``ack_and_read``) on a connection each
  reading thread keeps: no pool ping, no BEGIN and COMMIT, per take.
* **Commit order.** A reader that advances an offset past an id must never meet a smaller id
  later. PostgreSQL hands out ids when a row is inserted, not when it commits, so two concurrent
  publishers could commit ids 10 and 9 in that order and a reader between the commits would skip
  9 forever. ``publish`` therefore takes a transaction-level advisory lock per partition it writes
  (in partition order) before inserting: within a partition, id order is commit order. SQLite
  serialises writers anyway. On SQLite the highest row of the log is never trimmed either: without
  ``AUTOINCREMENT`` SQLite reuses the largest deleted rowid, which would hide a new entry behind
  an offset that already passed that id.
* **Blocking read** on a SQLite file waits for a commit about the bus (:mod:`bridge.db.changes`: this
  process's publishes at once, another process's commits within a few ms, seen by a file watcher). Surely
  woken by one, a reader of every partition takes at once; woken by what only may be one (the watcher's
  start, another program's commit), or reading some partitions only, it first looks with a cheap lock-free
  query (the offsets, then "is anything after them"), as it does every :data:`CHANGES_IDLE_LOOK` seconds on
  its own: an idle consumer sends no statement in between (it looked about ten times a second before).
  Elsewhere it re-checks every ``poll_interval`` while entries flow, less often the longer the bus has been
  idle (:func:`bridge.core.idle.idle_poll`: a tenth of the idle time, at most 0.1 s), and a process-wide
  condition per database, notified by ``publish``, wakes a same-process consumer at once. On PostgreSQL a
  publish also NOTIFYs (delivered at its commit) and a waiting reader's process LISTENs on one connection of
  its own, which wakes its readers at once: an entry reaches another process's idle reader without waiting
  for a poll, and an idle reader checks only once a second (the fallback, should a notification be lost
  while the listener reconnects).
* **Time** is the database clock (:func:`bridge.db.engine.db_now`) everywhere, so idle times and
  retention do not depend on which host's clock a consumer has.
* **epoch** is a constant: the embedded log is lost only with the database itself, and then the
  relay's stored epoch (in the same database) is lost with it, so there is nothing to detect.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

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
    Handler,
    partition_for,
)
from bridge.core.errors import first_line
from bridge.core.events import CloudEvent, EventFormatError
from bridge.core.idle import MAX_IDLE_POLL, idle_poll
from bridge.db.changes import TopicView, changes_of, database_path, mark_about
from bridge.db.engine import about, autocommit, db_now, discard, quiet, read_only
from bridge.db.listen import wait_notifies
from bridge.db.schema import bus_dead, bus_groups, bus_log, bus_pending

#: First key of the PostgreSQL advisory locks that order publishes per partition (the second key
#: is the partition). Derived from the table name so it will not collide with other users' locks.
ADVISORY_LOCK_CLASS = zlib.crc32(b"pollbridge_bus_log") & 0x7FFFFFFF

#: The embedded epoch (see the module docstring for why a constant is right).
EMBEDDED_EPOCH = "embedded-1"

log = logging.getLogger(__name__)

_EVENT_ID_LENGTH = 36  # pollbridge_bus_log.event_id; informational only, the payload has the full id


#: The channel a PostgreSQL publish notifies (at its commit) and idle readers of other processes listen on.
NOTIFY_CHANNEL = "pollbridge_bus"
#: The longest wait between checks of an idle reader while its process listens for publishes: a lost
#: notification (a listener reconnecting) delays an entry by at most this.
LISTENING_IDLE_POLL = 1.0
#: SQLite: an idle reader looks on its own this often (every commit to the database file wakes it sooner).
CHANGES_IDLE_LOOK = 5.0
#: A listener with no reader waiting for this long closes its connection (a reader starts it again).
LISTENER_IDLE_CLOSE = 10.0


class _Wakeup:
    """A generation counter under a condition: waiters compare generations so no notify is missed.

    On PostgreSQL it also LISTENs for other processes' publishes (:data:`NOTIFY_CHANNEL`) on one
    connection of its own, while readers wait: started by the first waiting reader, closed after
    :data:`LISTENER_IDLE_CLOSE` seconds without one or when its connection fails (the next waiting reader
    starts it again, at most once a second)."""

    def __init__(self, conninfo: str | None = None) -> None:
        self._cond = threading.Condition()
        self.generation = 0
        self._conninfo = conninfo
        self._listener: threading.Thread | None = None
        self._last_wait = 0.0
        self._failed_at = -1e9
        #: True while a LISTEN connection is up: idle readers may then check less often.
        self.listening = False

    def notify(self) -> None:
        with self._cond:
            self.generation += 1
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> int:
        """Wait until the generation moves past ``seen`` or ``timeout`` passes; the current generation."""
        if self._conninfo is not None:
            self._listen()
        with self._cond:
            if self.generation == seen:
                self._cond.wait(timeout)
            return self.generation

    def _listen(self) -> None:
        now = time.monotonic()
        self._last_wait = now
        with self._cond:
            if (self._listener is not None and self._listener.is_alive()) or now - self._failed_at < 1.0:
                return
            self._listener = threading.Thread(target=self._run_listener, name="pollbridge-bus-listener",
                                              daemon=True)
            self._listener.start()

    def _run_listener(self) -> None:
        assert self._conninfo is not None
        try:
            with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=10) as conn:
                conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                self.listening = True
                self.notify()  # a publish between the reader's check and the LISTEN: look again now
                while time.monotonic() - self._last_wait < LISTENER_IDLE_CLOSE:
                    if wait_notifies(conn, 0.5):
                        self.notify()
        except psycopg.Error as exc:
            self._failed_at = time.monotonic()
            log.info("bus listener stopped (%s); idle readers poll every %.1f s", first_line(exc), MAX_IDLE_POLL)
        finally:
            self.listening = False


_wakeups: dict[str, _Wakeup] = {}
_wakeups_lock = threading.Lock()


def _wakeup_for(engine: Engine, listen: bool) -> _Wakeup:
    """One wake-up per database per process, so two bus objects on one database wake each other (and, on
    PostgreSQL with ``listen``, one listener per database per process wakes them for other processes'
    publishes)."""
    key = engine.url.render_as_string(hide_password=False)
    conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False) \
        if engine.dialect.name == "postgresql" and listen else None
    with _wakeups_lock:
        return _wakeups.setdefault(f"{key} listen={listen}", _Wakeup(conninfo))


class EmbeddedBus(EventBus):
    """The bus inside pollbridge's database (SQLite or PostgreSQL). Thread-safe."""

    in_database = True

    def __init__(self, engine: Engine, *, partitions: int = 8, poll_interval: float = 0.01,
                 listen: bool = True) -> None:
        """``listen`` (``[bus] listen``, PostgreSQL): NOTIFY on publish, LISTEN while a reader waits."""
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        self.partitions = partitions
        self._engine = engine
        # SQLite: what a write of the bus wakes (bridge.db.changes): a publish wakes its readers; the readers'
        # own writes (offsets, pending entries, acknowledgements, dead letters, trims) wake no one.
        self._publishing = about(engine, "bus")
        self._bookkeeping = quiet(engine)
        # Lock-free checks: on SQLite a deferred transaction, so idle polling takes no write lock.
        self._reader = read_only(engine)
        # Looks of one statement: no transaction around them (no BEGIN and COMMIT; on SQLite no write lock).
        self._looker = autocommit(engine)
        self._dialect = engine.dialect.name
        # SQLite: every transaction that writes takes the database's one lock, so a consumer looks first.
        self._look_first = self._dialect == "sqlite"
        self._poll = poll_interval
        self._listen = listen and self._dialect == "postgresql"
        # SQLite file: every commit to it (this process's, or another's seen by a file watcher) wakes readers.
        self._changes = changes_of(engine, "bus")
        self._wakeup: _Wakeup | TopicView = self._changes or _wakeup_for(engine, self._listen)
        #: SQLite: by (group, partitions), when the last look that found nothing was made, at which generation.
        self._looked: dict[tuple[str, tuple[int, ...]], tuple[float, int]] = {}
        #: (group, partitions) whose group rows a take found all present (their offsets can be joined).
        self._groups_present: set[tuple[str, tuple[int, ...]]] = set()
        self._last_delivery = time.monotonic()
        #: PostgreSQL: each reading thread's kept autocommit connection for its takes (:meth:`_take_pg`), let go
        #: when the thread ends or the bus closes.
        self._kept = threading.local()
        self._kept_all: weakref.WeakSet[_Kept] = weakref.WeakSet()
        self._kept_lock = threading.Lock()  # guards _kept_all
        #: SQLite: per reading thread, the wake-up generation its last take read holding the write lock.
        self._take_generation = threading.local()

    def __repr__(self) -> str:
        return f"EmbeddedBus({self._engine.url.render_as_string(hide_password=True)}, partitions={self.partitions})"

    @property
    def engine(self) -> Engine:
        """The engine the log lives in (for tools and tests that look at the tables)."""
        return self._engine

    # ------------------------------------------------------------------ publishing

    def publish(self, events: Sequence[CloudEvent]) -> None:
        if not events:
            return
        with self._publishing.begin() as conn:
            self._append(conn, events)
        if self._changes is None:  # SQLite: the commit itself woke the readers (a "bus" commit)
            self._wakeup.notify()

    def publish_in(self, conn: Connection, events: Sequence[CloudEvent]) -> None:
        """Publish inside the caller's open transaction on this bus's database; durable when it commits.

        Not part of :class:`EventBus`: it exists because the embedded log shares the caller's
        database. On SQLite a caller that holds a write transaction (every transaction there is
        ``BEGIN IMMEDIATE``) and calls :meth:`publish` waits for its own lock until the busy timeout;
        this writes through the caller's connection instead, which also makes "mark the outbox rows
        published" and "append them to the log" one atomic step. On SQLite the commit wakes the readers (the
        transaction is marked a "bus" commit, :mod:`bridge.db.changes`); elsewhere same-process readers are
        woken now and, not finding the rows until the commit, pick them up on their next poll."""
        if events:
            self._append(conn, events)
            if self._changes is None:
                self._wakeup.notify()
            else:
                mark_about(conn, "bus")

    def _append(self, conn: Connection, events: Sequence[CloudEvent]) -> None:
        rows: list[dict[str, Any]] = [
            {"partition": self.partition_of(e), "event_id": e.id[:_EVENT_ID_LENGTH], "payload": e.to_json()}
            for e in events
        ]
        if self._dialect == "postgresql":
            # Held to commit: within a partition, ids commit in id order (see the module docstring).
            conn.execute(
                sa.text(
                    "SELECT pg_advisory_xact_lock(:cls, s.p) FROM "
                    "(SELECT unnest(CAST(:parts AS integer[])) AS p ORDER BY 1) AS s"
                ),
                {"cls": ADVISORY_LOCK_CLASS, "parts": sorted({int(r["partition"]) for r in rows})},
            )
        _insert_rows(conn, bus_log, rows, "created_at")
        if self._listen:
            # Delivered at the commit, folded to one per transaction: wakes idle readers in other processes
            # (their listener), so an entry does not wait for their next poll.
            conn.execute(sa.text("SELECT pg_notify(:channel, '')"), {"channel": NOTIFY_CHANNEL})

    # ------------------------------------------------------------------ groups

    def ensure_group(self, group: str) -> None:
        with self._bookkeeping.begin() as conn:
            self._insert_group_rows(conn, group, range(self.partitions))

    def _insert_group_rows(self, conn: Connection, group: str, partitions: Iterable[int]) -> None:
        """Offset 0 for each partition that has none: a new group starts at the start of the log."""
        rows = [{"group_name": _group(group), "partition": p, "last_delivered_id": 0} for p in partitions]
        if not rows:
            return
        insert = postgresql.insert(bus_groups) if self._dialect == "postgresql" else sqlite.insert(bus_groups)
        conn.execute(insert.on_conflict_do_nothing(index_elements=["group_name", "partition"]), rows)

    def _offsets(self, conn: Connection, group: str, parts: Sequence[int], *, lock: bool) -> dict[int, int]:
        query = (
            sa.select(bus_groups.c.partition, bus_groups.c.last_delivered_id)
            .where(bus_groups.c.group_name == group, bus_groups.c.partition.in_(parts))
            .order_by(bus_groups.c.partition)
        )
        if lock:
            query = query.with_for_update()  # rendered on PostgreSQL only; SQLite is BEGIN IMMEDIATE
        return {int(p): int(off) for p, off in conn.execute(query).all()}

    # ------------------------------------------------------------------ reading

    def _read_args(self, group: str, partitions: Sequence[int], count: int) -> list[int]:
        """The partitions to read, once the arguments of a group read are checked."""
        parts = self._checked(partitions)
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        _group(group)
        return parts

    def read(self, group: str, consumer: str, partitions: Sequence[int], count: int, block: float) -> list[Delivery]:
        parts = self._read_args(group, partitions, count)
        if not parts:
            return []
        return self._read(group, consumer, parts, count, block, None)

    def _read(self, group: str, consumer: str, parts: list[int], count: int, block: float,
              took_at: int | None, acks: list[int] | None = None, handling: _Handling | None = None
              ) -> list[Delivery]:
        """:meth:`read`; ``took_at``: the wake-up generation at which the caller's own take just found nothing
        (its first take is then skipped: nothing was published since). ``acks`` (SQLite, from
        :meth:`ack_and_read`): entry ids to acknowledge in the write transaction of the take that ends the wait,
        or on their own when the wait ends without one, and whatever fails: always before this returns.
        ``handling`` (SQLite, from :meth:`read_handled`): the handler the take runs."""
        left = list(acks or ())
        try:
            return self._wait_and_take(group, consumer, parts, count, block, took_at, left, handling)
        finally:
            if left:  # not made with a take: made on their own, as the contract has them made
                self.ack_ids(group, left)

    def _wait_and_take(self, group: str, consumer: str, parts: list[int], count: int, block: float,
                       took_at: int | None, acks: list[int], handling: _Handling | None = None) -> list[Delivery]:
        """:meth:`_read`'s loop; ``acks`` is emptied once a take has made them."""
        deadline = time.monotonic() + max(block, 0.0)
        # On SQLite a take is a write transaction, found or not: look first, without the lock.
        known = not self._look_first
        key = (group, tuple(parts))
        while True:
            seen = self._wakeup.generation if took_at is None else took_at
            skip, took_at = took_at is not None, None
            got: list[Delivery] = []
            if not skip and (known or (self._look_due(key, seen) and self._look(key, seen, group, parts))):
                got = self._take(group, consumer, parts, count, acks, handling)
                acks.clear()
                seen = self._generation_at_take(seen)
            if got:
                self._took(key, seen, len(got), count)
                return got
            # Nothing now: wait for a same-process publish or the next poll, then look cheaply.
            while True:
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    return []
                moved = self._wakeup.wait(seen, min(self._idle_wait(now, key), remaining))
                if moved != seen:  # a publish (this process's, or another's through the listener): busy again
                    self._last_delivery = time.monotonic()
                    if not self._look_first:  # PostgreSQL takes without a lock to avoid: take at once
                        known = True
                        break
                    if self._changes is not None and len(parts) == self.partitions \
                            and self._changes.surely_since(seen):
                        # SQLite, surely woken by a commit about the bus, and every partition is this reader's:
                        # the commit was a publish for it, so it takes at once (the look first was a read
                        # transaction per event: `bench.cost`, embedded, 2 completions/s, 4 of 33 statements
                        # per completion). A reader of some partitions looks first (the publish may be
                        # another's, and an empty take holds the write lock), and so does one woken by what only
                        # may be a publish (the watcher's start, a commit whose topics could not be told).
                        known = True
                        break
                seen = moved
                if self._look_due(key, seen) and self._look(key, seen, group, parts):
                    known = True
                    break

    def _idle_wait(self, now: float, key: tuple[str, tuple[int, ...]]) -> float:
        """How long an idle reader waits before it looks on its own. SQLite: until its fallback look is due
        (every commit to the file wakes it before that); while the process listens (PostgreSQL): a second;
        otherwise a tenth of the idle time, at most 0.1 s."""
        if self._changes is not None:
            looked = self._looked.get(key)
            return CHANGES_IDLE_LOOK if looked is None else max(0.001, looked[0] + CHANGES_IDLE_LOOK - now)
        if isinstance(self._wakeup, _Wakeup) and self._wakeup.listening:  # every publish wakes it: a fallback
            return LISTENING_IDLE_POLL
        return idle_poll(self._poll, now - self._last_delivery, MAX_IDLE_POLL)

    def _look_due(self, key: tuple[str, tuple[int, ...]], seen: int) -> bool:
        """SQLite: a look is worth a statement only if the database changed since the last one that found
        nothing (``seen``, the generation then), or the fallback look is due. Elsewhere: always."""
        if self._changes is None:
            return True
        looked = self._looked.get(key)
        return looked is None or looked[1] != seen or time.monotonic() - looked[0] >= CHANGES_IDLE_LOOK

    def _look(self, key: tuple[str, tuple[int, ...]], seen: int, group: str, parts: list[int]) -> bool:
        """The lock-free look; remembers one that found nothing (with the generation it looked at)."""
        found = self._has_undelivered(group, parts)
        if found:
            self._looked.pop(key, None)
        else:
            self._looked[key] = (time.monotonic(), seen)
        return found

    def ack_and_read(self, group: str, acks: Sequence[Delivery], consumer: str, partitions: Sequence[int],
                     count: int, block: float) -> list[Delivery]:
        """On SQLite the acknowledgements and the next take share one write transaction (the lock is taken
        once, not twice, per batch a draining consumer handles); elsewhere as :class:`EventBus` does."""
        ids = sorted({int(d.entry_id) for d in acks})
        if ids and self._dialect == "postgresql":
            # The acknowledgements go with the first take (one statement once the group's rows are known).
            parts = self._read_args(group, partitions, count)
            if not parts:
                self.ack_ids(group, ids)
                return []
            seen = self._wakeup.generation
            try:
                got = self._take(group, consumer, parts, count, ids)
            except Exception:
                with contextlib.suppress(Exception):  # made on their own, as the contract has them made
                    self.ack_ids(group, ids)
                raise
            if got:
                self._took((group, tuple(parts)), seen, len(got), count)
                return got
            # Nothing: wait for a publish (no second take at once; nothing was published since ``seen``).
            return self._read(group, consumer, parts, count, block, seen)
        if not ids or not self._look_first:
            return super().ack_and_read(group, acks, consumer, partitions, count, block)
        parts = self._read_args(group, partitions, count)
        seen = self._wakeup.generation
        # SQLite: no publish since a take that left room means nothing to take now. The acknowledgements wait for
        # the take that ends the read's wait, in its write transaction, or are made on their own when the wait
        # ends without one (before this returns, whatever happens): at a trickle every batch's acknowledgements
        # were a write transaction of their own, BEGIN IMMEDIATE and the DELETE (`bench.cost`, embedded, 2
        # completions/s). Meanwhile they stay pending: for up to ``block`` (the scheduler's 0.5 s), far below any
        # visibility timeout after which another consumer would claim them; a crash meanwhile redelivers them.
        if parts and self._nothing_since((group, tuple(parts)), seen):
            return self._read(group, consumer, parts, count, block, None, ids)
        take = bool(parts)
        try:
            with self._bookkeeping.begin() as conn:
                self._delete_pending(conn, group, ids)
                got = self._take_in(conn, group, consumer, parts, count) if take else []
        except Exception:
            # The acknowledgements went down with the take: make them on their own, as the contract has them
            # made whatever the read does (if this fails too the entries are redelivered, never lost).
            with contextlib.suppress(Exception):
                self.ack(group, acks)
            raise
        if take:
            self._took((group, tuple(parts)), self._generation_at_take(seen), len(got), count)
        if got:
            return got
        return self.read(group, consumer, partitions, count, block)

    def _generation_at_take(self, before: int) -> int:
        """SQLite: the wake-up generation read inside this thread's last take, holding the write lock (every
        publish before it is in the take, so only a later one may wake the reader to take at once); else
        ``before``, the generation read before the take."""
        value: int | None = getattr(self._take_generation, "value", None)
        self._take_generation.value = None
        return before if value is None else value

    def _nothing_since(self, key: tuple[str, tuple[int, ...]], seen: int) -> bool:
        """SQLite: whether the last look (or take that left room) for ``key`` found nothing at generation
        ``seen``, the current one: no publish since, so nothing to take (the fallback look aside)."""
        return self._changes is not None and not self._look_due(key, seen)

    def _took(self, key: tuple[str, tuple[int, ...]], seen: int, got: int, count: int) -> None:
        """After a take of ``got`` entries (of ``count`` asked) that started at generation ``seen``. On SQLite a
        take that left room took everything there was (it held the write lock, so no publish came between its
        read and its end): it counts as a look that found nothing at ``seen``, and the next read looks only
        after a commit (measured: an empty look after every take, 3 statements, half the looks at a trickle)."""
        if got:
            self._last_delivery = time.monotonic()
        if self._changes is None:
            return
        if got < count:
            self._looked[key] = (time.monotonic(), seen)
        else:
            self._looked.pop(key, None)

    def _take(self, group: str, consumer: str, parts: list[int], count: int,
              acks: Sequence[int] = (), handling: _Handling | None = None) -> list[Delivery]:
        """Deliver up to ``count`` entries after the offsets: select, mark pending, advance, one transaction
        (on PostgreSQL, once the group's rows are known, one statement: :data:`_PG_TAKE`). ``acks``: entry ids
        acknowledged in the same transaction. ``handling`` (SQLite): its handler runs inside the transaction
        (:meth:`_take_handled`)."""
        if handling is not None:
            return self._take_handled(group, consumer, parts, count, acks, handling)
        key = (group, tuple(parts))
        if self._dialect == "postgresql" and key in self._groups_present:
            return self._take_pg(group, consumer, parts, count, acks)
        with self._bookkeeping.begin() as conn:
            if acks:  # in the take's write transaction (one BEGIN, not two)
                self._delete_pending(conn, group, list(acks))
            return self._take_in(conn, group, consumer, parts, count)

    def _take_pg(self, group: str, consumer: str, parts: list[int], count: int,
                 acks: Sequence[int]) -> list[Delivery]:
        """PostgreSQL: acknowledge ``acks`` and take, in one autocommit statement. Measured beside Airflow, the
        take as six round trips (a pool ping, BEGIN, the offsets locked, the log read, the pending rows, the
        offsets advanced, COMMIT) took 4 ms p50 of every shadow decision's latency on a loaded machine, and an
        acknowledgement as many again."""
        params = {"b_group": group, "b_parts": parts, "b_count": count, "b_consumer": consumer,
                  "b_acks": sorted(acks)}
        for attempt in (1, 2):
            kept: _Kept | None = getattr(self._kept, "holder", None)
            if kept is None or kept.conn is None:
                # Kept per thread: a pool checkout per take would add the pool's ping, a round trip and a
                # transaction of its own, to every take.
                kept = _Kept(self._bookkeeping.connect().execution_options(isolation_level="AUTOCOMMIT"))
                self._kept.holder = kept
                with self._kept_lock:
                    self._kept_all.add(kept)
            try:
                with kept.lock:  # close() from another thread waits for the statement
                    if kept.conn is None:
                        continue  # released meanwhile (the bus closed): take a new one
                    rows = kept.conn.execute(_PG_TAKE, params).all()
                break
            except sa.exc.DBAPIError as exc:
                kept.release()
                # A kept connection skips the pool's ping: one the server dropped while idle (a restart, a
                # failover, a timeout) fails its next statement. Once, on a fresh one. Should the lost one's take
                # have committed after all, its entries are pending under this consumer and are claimed again
                # once stale: late, never lost.
                if attempt == 2 or not exc.connection_invalidated:
                    raise
            except BaseException:
                kept.release()
                raise
        else:  # released twice in a row by a concurrent close: nothing taken, the acknowledgements on their own
            self.ack_ids(group, list(acks))
            return []
        if not rows or int(rows[0].groups) < len(parts):
            # A group row went (another bus emptied the bus: purge_all): the next take registers it again.
            self._groups_present.discard((group, tuple(parts)))
        return [_delivery(r.id, r.partition, r.payload, 1) for r in rows if r.id is not None]

    def _take_in(self, conn: Connection, group: str, consumer: str, parts: list[int], count: int) -> list[Delivery]:
        """:meth:`_take` inside the caller's write transaction."""
        rows = self._take_rows(conn, group, parts, count)
        if not rows:
            return []
        self._record_taken(conn, group, consumer, rows, rows)
        return [_delivery(r.id, r.partition, r.payload, 1) for r in rows]

    def _take_rows(self, conn: Connection, group: str, parts: list[int], count: int) -> list[Any]:
        """The entries a take delivers (id, partition, payload), read inside the caller's write transaction."""
        key = (group, tuple(parts))
        if self._look_first and key in self._groups_present:
            # SQLite, the group's rows known to exist: the offsets joined in the read, one prebuilt statement
            # (the write lock is held: nobody moves them in between). Building the read per take, with the
            # offsets as literals, cost more Python time than running it (profiled).
            rows = conn.execute(_TAKE_AFTER_OFFSETS, {"b_group": group, "b_parts": parts, "b_count": count}).all()
        else:
            offsets = self._offsets(conn, group, parts, lock=True)
            if len(offsets) < len(parts):
                self._insert_group_rows(conn, group, [p for p in parts if p not in offsets])
                offsets = self._offsets(conn, group, parts, lock=True)
            else:  # present (inserted rows count only once committed: the next take finds them)
                self._groups_present.add(key)
            rows = conn.execute(
                sa.select(bus_log.c.id, bus_log.c.partition, bus_log.c.payload)
                .where(_after(offsets))
                .order_by(bus_log.c.id)
                .limit(count)
            ).all()
        if self._changes is not None:  # holding the write lock (:meth:`_generation_at_take`)
            self._take_generation.value = self._changes.generation
        return list(rows)

    @staticmethod
    def _record_taken(conn: Connection, group: str, consumer: str, rows: Sequence[Any], pending: Sequence[Any]
                      ) -> None:
        """After :meth:`_take_rows`: ``pending`` (of ``rows``) recorded as pending for ``consumer``, the group's
        offsets moved past ``rows``."""
        if pending:
            _insert_rows(conn, bus_pending, [{"group_name": group, "entry_id": r.id, "partition": r.partition,
                                              "consumer": consumer, "deliveries": 1} for r in pending],
                         "delivered_at")
        last: dict[int, int] = {}
        for r in rows:
            last[int(r.partition)] = max(last.get(int(r.partition), 0), int(r.id))
        _advance_offsets(conn, group, last)

    def handles_in_take(self, engine: Engine) -> bool:
        """On a SQLite file, for ``engine`` on the same file (see :meth:`read_handled`)."""
        if self._changes is None:
            return False
        mine = database_path(self._engine)
        return mine is not None and mine == database_path(engine)

    def read_handled(self, group: str, consumer: str, partitions: Sequence[int], count: int, block: float,
                     handle: Handler, acks: Sequence[Delivery] = ()) -> tuple[list[Delivery], bool]:
        """On a SQLite file the handler runs inside the take's write transaction (the contract): a batch costs one
        write transaction, its ``BEGIN IMMEDIATE``, the read, ``handle``'s writes and the offsets, where a
        :meth:`ack_and_read` and a handler with writes of its own cost three (the take with its pending rows,
        the handler's, the acknowledgements' ``DELETE``, which rode with the next take): `bench.cost`, embedded,
        2 completions/s, 9.3-9.6 statements per completion against 12.8-12.9. The write lock is held while
        ``handle`` runs (the event scheduler's evaluation of a small batch: a few milliseconds). Elsewhere as
        :class:`EventBus`."""
        if self._changes is None:
            return super().read_handled(group, consumer, partitions, count, block, handle, acks)
        parts = self._read_args(group, partitions, count)
        ids = sorted({int(d.entry_id) for d in acks})
        if not parts:
            self.ack_ids(group, ids)
            return [], False
        handling = _Handling(handle)
        key = (group, tuple(parts))
        seen = self._wakeup.generation
        if not ids or self._nothing_since(key, seen):  # wait (the acknowledgements ride with the take)
            return self._read(group, consumer, parts, count, block, None, ids, handling), handling.handled
        try:  # a take that left no room: at once
            got = self._take(group, consumer, parts, count, ids, handling)
        except Exception:
            with contextlib.suppress(Exception):  # made on their own, as the contract has them made
                self.ack_ids(group, ids)
            raise
        self._took(key, self._generation_at_take(seen), len(got), count)
        if got:
            return got, handling.handled
        return self._read(group, consumer, parts, count, block, None, [], handling), handling.handled

    def _take_handled(self, group: str, consumer: str, parts: list[int], count: int, acks: Sequence[int],
                      handling: _Handling) -> list[Delivery]:
        """SQLite: the take with ``handling``'s handler inside its write transaction; the entries the handler did
        not return recorded as pending. Should the handler fail, or the transaction once the handler ran (its
        pending rows, the commit: a deferred constraint its writes broke), everything it wrote is rolled back with
        the take, and the take is made again as :meth:`read` makes it (every entry pending, for the caller to
        handle: ``handling.handled`` is False), so a batch that always fails reaches the caller's dead letters. A
        failure before the handler ran (the write lock not had, the read) is raised, with the acknowledgements not
        made: the callers make them on their own."""
        handling.handled = False
        ran = False
        try:
            with self._bookkeeping.begin() as conn:
                if acks:
                    self._delete_pending(conn, group, list(acks))
                rows = self._take_rows(conn, group, parts, count)
                got = [_delivery(r.id, r.partition, r.payload, 1) for r in rows]
                if rows:
                    ran = True
                    done = {d.entry_id for d in handling.handle(conn, got)}
                    self._record_taken(conn, group, consumer, rows, [r for r in rows if str(r.id) not in done])
        except Exception as exc:
            if not ran:
                raise
            log.warning("handling %s's batch inside the take failed (%s: %s); taken again, handled apart", group,
                        type(exc).__name__, first_line(exc))
            return self._take(group, consumer, parts, count, acks)
        handling.handled = True
        return got

    def _has_undelivered(self, group: str, parts: list[int]) -> bool:
        """Lock-free peek: is there any entry after the group's offsets (0 where it has none)?"""
        with self._looker.connect() as conn:
            n, any_entry = conn.execute(_UNDELIVERED, {"b_group": group, "b_parts": parts}).one()
        if int(n) < len(parts):
            # A group never ensured, or whose rows went (another bus emptied the bus: purge_all): a take registers
            # it again (and trim then respects it), by the statement that checks its rows.
            self._groups_present.discard((group, tuple(parts)))
            return True
        return bool(any_entry)

    # ------------------------------------------------------------------ tailing (read-only, no group)

    def end_positions(self, partitions: Sequence[int]) -> dict[int, str]:
        parts = self._checked(partitions)
        with self._reader.connect() as conn:
            # One index probe per partition ((partition, id) index), not a grouped scan of the log.
            newest = {p: conn.execute(sa.select(sa.func.max(bus_log.c.id)).where(bus_log.c.partition == p))
                      .scalar() for p in parts}
            conn.rollback()
        return {p: str(int(n or 0)) for p, n in newest.items()}

    def tail(self, after: Mapping[int, str], count: int, block: float) -> list[Delivery]:
        """Read-only: the log rows after each position, in id order (within a partition, commit order:
        see the module docstring), with the lock-free reader; waits like :meth:`read` when there are none."""
        parts = self._checked(list(after))
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if not parts:
            return []
        offsets = {p: _position(after[p]) for p in parts}
        deadline = time.monotonic() + max(block, 0.0)
        seen = self._wakeup.generation
        while True:
            with self._reader.connect() as conn:
                rows = conn.execute(sa.select(bus_log.c.id, bus_log.c.partition, bus_log.c.payload)
                                    .where(_after(offsets)).order_by(bus_log.c.id).limit(count)).all()
                conn.rollback()
            if rows:
                return [_delivery(r.id, r.partition, r.payload, 1) for r in rows]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            seen = self._wakeup.wait(seen, min(self._poll, remaining))

    # ------------------------------------------------------------------ acknowledging and redelivery

    def ack(self, group: str, deliveries: Sequence[Delivery]) -> None:
        self.ack_ids(group, sorted({int(d.entry_id) for d in deliveries}))

    def ack_ids(self, group: str, ids: list[int]) -> None:
        """:meth:`ack` by entry ids."""
        if not ids:
            return
        with self._bookkeeping.begin() as conn:
            self._delete_pending(conn, group, ids)

    @staticmethod
    def _delete_pending(conn: Connection, group: str, ids: list[int]) -> None:
        conn.execute(bus_pending.delete().where(bus_pending.c.group_name == group, bus_pending.c.entry_id.in_(ids)))

    def claim_stale(self, group: str, consumer: str, partitions: Sequence[int], min_idle: float,
                    count: int) -> list[Delivery]:
        parts = self._checked(partitions)
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if not parts:
            return []
        # Look first, in one statement and without the write lock: nearly every call (the scheduler's, every
        # claim_interval) finds nothing, and took a write transaction to say so (idle embedded default:
        # 0.4 of its 4.4 statements a second, `bench.cost --rates 0`).
        with self._looker.connect() as conn:
            if conn.execute(sa.select(bus_pending.c.entry_id).where(
                    bus_pending.c.group_name == group, bus_pending.c.partition.in_(parts),
                    bus_pending.c.delivered_at <= self._ago(min_idle)).limit(1)).first() is None:
                return []
        with self._bookkeeping.begin() as conn:
            query = (
                sa.select(bus_pending.c.entry_id, bus_pending.c.partition, bus_pending.c.deliveries,
                          bus_log.c.payload)
                .select_from(bus_pending.outerjoin(bus_log, bus_log.c.id == bus_pending.c.entry_id))
                .where(bus_pending.c.group_name == group,
                       bus_pending.c.partition.in_(parts),
                       bus_pending.c.delivered_at <= self._ago(min_idle))
                .order_by(bus_pending.c.entry_id)
                .limit(count)
            )
            if self._dialect == "postgresql":
                # Two claimers never take the same rows; a row being acked is skipped, not waited for.
                query = query.with_for_update(of=bus_pending, skip_locked=True)
            rows = conn.execute(query).all()
            if not rows:
                return []
            gone = [int(r.entry_id) for r in rows if r.payload is None]
            live = [r for r in rows if r.payload is not None]
            if gone:
                # Like XAUTOCLAIM: an entry no longer in the log leaves the pending list.
                conn.execute(bus_pending.delete().where(bus_pending.c.group_name == group,
                                                        bus_pending.c.entry_id.in_(gone)))
            if live:
                conn.execute(
                    bus_pending.update()
                    .where(bus_pending.c.group_name == group,
                           bus_pending.c.entry_id.in_([int(r.entry_id) for r in live]))
                    .values(consumer=consumer, delivered_at=db_now(self._dialect),
                            deliveries=bus_pending.c.deliveries + 1)
                )
        return [_delivery(r.entry_id, r.partition, r.payload, int(r.deliveries) + 1) for r in live]

    def pending_count(self, group: str) -> int:
        with self._reader.connect() as conn:
            n = conn.execute(sa.select(sa.func.count()).select_from(bus_pending)
                             .where(bus_pending.c.group_name == group)).scalar_one()
            conn.rollback()
        return int(n)

    def lag(self, group: str) -> dict[int, int]:
        parts = list(range(self.partitions))
        # One statement, no transaction: each group row's entries after its offset, through the (partition,
        # id) index (the scheduler's gauge every 5 s: it was a read transaction of two statements).
        with self._looker.connect() as conn:
            lags = {int(p): int(n) for p, n in conn.execute(_LAG, {"b_group": group}) if int(p) in parts}
            missing = [p for p in parts if p not in lags]
            if missing:  # a group not registered there yet: everything in the partition is ahead of it
                lags.update({int(p): int(n) for p, n in conn.execute(
                    sa.select(bus_log.c.partition, sa.func.count()).where(bus_log.c.partition.in_(missing))
                    .group_by(bus_log.c.partition))})
        return {p: lags.get(p, 0) for p in parts}

    # ------------------------------------------------------------------ dead letters

    def dead_letter(self, group: str, delivery: Delivery, reason: str) -> None:
        with self._bookkeeping.begin() as conn:
            conn.execute(bus_dead.insert().values(
                group_name=group, entry_id=delivery.entry_id, partition=delivery.partition,
                payload=delivery.payload, reason=reason, created_at=db_now(self._dialect)))
            conn.execute(bus_pending.delete().where(bus_pending.c.group_name == group,
                                                    bus_pending.c.entry_id == int(delivery.entry_id)))

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        if limit < 1:
            return []
        with self._reader.connect() as conn:
            rows = conn.execute(sa.select(bus_dead).order_by(bus_dead.c.id).limit(limit)).all()
            conn.rollback()
        return [DeadLetter(id=str(r.id), group=r.group_name, entry_id=r.entry_id, partition=int(r.partition),
                           payload=r.payload, reason=r.reason) for r in rows]

    def remove_dead_letters(self, ids: Sequence[str]) -> int:
        numeric = sorted({int(i) for i in ids if str(i).isdigit()})
        if not numeric:
            return 0
        with self._bookkeeping.begin() as conn:
            return int(conn.execute(bus_dead.delete().where(bus_dead.c.id.in_(numeric))).rowcount)

    def dead_letter_count(self) -> int:
        with self._reader.connect() as conn:
            n = conn.execute(sa.select(sa.func.count()).select_from(bus_dead)).scalar_one()
            conn.rollback()
        return int(n)

    def purge_all(self) -> int:
        """Empty the bus's four tables in one transaction (``uninstall`` then drops them with the migrations)."""
        self._groups_present.clear()  # the group rows go: a take checks them again
        with self._bookkeeping.begin() as conn:
            return sum(int(conn.execute(table.delete()).rowcount)
                       for table in (bus_pending, bus_groups, bus_dead, bus_log))

    # ------------------------------------------------------------------ looking up events (read-only)

    def delivery_states(self, group: str, events: Sequence[EventRef]) -> dict[str, EventDelivery]:
        """The log rows of the events (by event id within their partition), the group's offsets, its pending
        rows and its dead letters: four index look-ups with the lock-free reader, whatever the count."""
        name = _group(group)
        by_partition: dict[int, list[EventRef]] = {}
        for ref in events:
            by_partition.setdefault(partition_for(ref.partition_key, self.partitions), []).append(ref)
        out: dict[str, EventDelivery] = {}
        for partition, refs in sorted(by_partition.items()):
            out.update(self._delivery_states(name, partition, refs))
        return out

    def _delivery_states(self, group: str, partition: int, refs: list[EventRef]) -> dict[str, EventDelivery]:
        ids = sorted({ref.event_id[:_EVENT_ID_LENGTH] for ref in refs})
        with self._reader.connect() as conn:
            entries: dict[str, int] = {}
            for row in conn.execute(sa.select(bus_log.c.id, bus_log.c.event_id)
                                    .where(bus_log.c.partition == partition, bus_log.c.event_id.in_(ids))
                                    .order_by(bus_log.c.id)):
                entries.setdefault(str(row.event_id), int(row.id))  # the earliest entry of an event
            offset = conn.execute(sa.select(bus_groups.c.last_delivered_id).where(
                bus_groups.c.group_name == group, bus_groups.c.partition == partition)).scalar()
            found = sorted(set(entries.values()))
            pending = {int(r.entry_id): r for r in conn.execute(
                sa.select(bus_pending.c.entry_id, bus_pending.c.consumer, bus_pending.c.deliveries)
                .where(bus_pending.c.group_name == group, bus_pending.c.entry_id.in_(found)))} if found else {}
            dead: dict[str, str] = {}
            if found:
                for r in conn.execute(sa.select(bus_dead.c.entry_id, bus_dead.c.reason)
                                      .where(bus_dead.c.group_name == group, bus_dead.c.partition == partition,
                                             bus_dead.c.entry_id.in_([str(i) for i in found]))
                                      .order_by(bus_dead.c.id)):
                    dead.setdefault(str(r.entry_id), str(r.reason))
            conn.rollback()
        out: dict[str, EventDelivery] = {}
        for ref in refs:
            entry = entries.get(ref.event_id[:_EVENT_ID_LENGTH])
            if entry is None:
                out[ref.event_id] = EventDelivery(
                    NOT_FOUND, partition, detail="not in the embedded bus log (trimmed after retention, or published "
                                                 "before a change of bus.partitions)")
            elif str(entry) in dead:
                out[ref.event_id] = EventDelivery(DEAD_LETTERED, partition, str(entry), reason=dead[str(entry)])
            elif entry in pending:
                p = pending[entry]
                out[ref.event_id] = EventDelivery(PENDING, partition, str(entry), int(p.deliveries), str(p.consumer))
            elif offset is not None and entry <= int(offset):
                out[ref.event_id] = EventDelivery(ACKNOWLEDGED, partition, str(entry))
            else:
                out[ref.event_id] = EventDelivery(UNDELIVERED, partition, str(entry))
        return out

    # ------------------------------------------------------------------ trimming and loss detection

    def trim(self, retention: float) -> int:
        """Delete entries at least ``retention`` old that every group has read and none has pending."""
        removed = 0
        with self._bookkeeping.begin() as conn:
            offsets: dict[str, dict[int, int]] = {}
            for g, p, off in conn.execute(sa.select(bus_groups.c.group_name, bus_groups.c.partition,
                                                    bus_groups.c.last_delivered_id)).all():
                offsets.setdefault(g, {})[int(p)] = int(off)
            partitions = set(range(self.partitions)).union(*(set(o) for o in offsets.values()))
            newest = None
            if self._dialect == "sqlite":
                newest = conn.execute(sa.select(sa.func.max(bus_log.c.id))).scalar_one()
            cutoff = self._ago(retention)
            for p in sorted(partitions):
                conds: list[ColumnElement[bool]] = [
                    bus_log.c.partition == p,
                    bus_log.c.created_at <= cutoff,
                    ~sa.exists().where(bus_pending.c.entry_id == bus_log.c.id),
                ]
                if offsets:
                    # A group without a row for p has read nothing there (offset 0).
                    below = min(o.get(p, 0) for o in offsets.values())
                    if below == 0:
                        continue
                    conds.append(bus_log.c.id <= below)
                if newest is not None:
                    conds.append(bus_log.c.id < int(newest))
                removed += int(conn.execute(bus_log.delete().where(*conds)).rowcount)
        return removed

    def epoch(self) -> str:
        return EMBEDDED_EPOCH

    def close(self) -> None:
        """The kept connections of the takes go; the engine belongs to the caller."""
        with self._kept_lock:
            kept_all = list(self._kept_all)
        for kept in kept_all:
            kept.release()

    # ------------------------------------------------------------------ helpers

    def _ago(self, seconds: float) -> ColumnElement[Any]:
        """The database clock minus ``seconds``, comparable with the timestamps this bus writes."""
        seconds = max(seconds, 0.0)
        if self._dialect == "postgresql":
            return sa.func.clock_timestamp() - sa.cast(sa.literal(f"{seconds:.6f} seconds"), sa.Interval())
        return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", f"-{seconds:.3f} seconds")



class _Kept:
    """A reading thread's kept connection (PostgreSQL takes): let go when the thread ends (its thread-local
    holder is collected), when the bus closes, or after a failure (the next take opens another)."""

    __slots__ = ("__weakref__", "conn", "lock")

    def __init__(self, conn: Connection) -> None:
        self.conn: Connection | None = conn
        self.lock = threading.Lock()  # held while a statement runs on it

    def release(self) -> None:
        with self.lock:
            conn, self.conn = self.conn, None
        discard(conn)

    def __del__(self) -> None:
        self.release()


class _Handling:
    """A handler for :meth:`EmbeddedBus.read_handled`, and whether the last take ran it (committed)."""

    __slots__ = ("handle", "handled")

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.handled = False


def _group(name: str) -> str:
    if not name or any(ch.isspace() for ch in name):
        raise ValueError(f"invalid consumer group name {name!r}: non-empty, no whitespace")
    return name


def _position(entry_id: str) -> int:
    """An embedded tail position: a log id (``"0"``: before the first entry)."""
    if not entry_id.isdigit():
        raise ValueError(f"not an embedded bus entry id: {entry_id!r}")
    return int(entry_id)


#: SQLite: up to ``b_count`` entries after group ``b_group``'s offsets in partitions ``b_parts``, oldest first.
_TAKE_AFTER_OFFSETS = (
    sa.select(bus_log.c.id, bus_log.c.partition, bus_log.c.payload)
    .select_from(bus_log.join(bus_groups, sa.and_(bus_groups.c.partition == bus_log.c.partition,
                                                  bus_groups.c.group_name == sa.bindparam("b_group"),
                                                  bus_log.c.id > bus_groups.c.last_delivered_id)))
    .where(bus_groups.c.partition.in_(sa.bindparam("b_parts", expanding=True)))
    .order_by(bus_log.c.id)
    .limit(sa.bindparam("b_count"))
)
#: How many of partitions ``b_parts`` have a row of group ``b_group``, and whether any has an entry after its offset
#: (the lock-free look, one statement).
_UNDELIVERED = sa.select(
    sa.select(sa.func.count()).select_from(bus_groups)
    .where(bus_groups.c.group_name == sa.bindparam("b_group"),
           bus_groups.c.partition.in_(sa.bindparam("b_parts", expanding=True))).scalar_subquery(),
    sa.exists(_TAKE_AFTER_OFFSETS.with_only_columns(bus_log.c.id).order_by(None).limit(None)),
)
#: PostgreSQL: a take in one statement (autocommit, so atomic on its own): the group's offsets in partitions
#: ``b_parts`` locked in partition order (as the multi-statement take locks them: two consumers never
#: deadlock; one that waited reads the offsets its predecessor committed), up to ``b_count`` entries after
#: them oldest first (each partition through its (partition, id) index), recorded as pending for
#: ``b_consumer``, the offsets advanced, and the entries ``b_acks`` acknowledged. One row per entry, plus
#: ``groups`` (how many of the partitions have a group row: fewer means the rows must be inserted again); a
#: single row with a NULL id when nothing was taken.
_PG_TAKE = sa.text("""
WITH off AS (
    SELECT partition, last_delivered_id FROM pollbridge_bus_groups
     WHERE group_name = :b_group AND partition = ANY(:b_parts)
     ORDER BY partition FOR UPDATE
), acked AS (
    DELETE FROM pollbridge_bus_pending WHERE group_name = :b_group AND entry_id = ANY(:b_acks)
), taken AS (
    SELECT entry.id, entry.partition, entry.payload
      FROM off CROSS JOIN LATERAL (
           SELECT l.id, l.partition, l.payload FROM pollbridge_bus_log AS l
            WHERE l.partition = off.partition AND l.id > off.last_delivered_id
            ORDER BY l.id LIMIT :b_count) AS entry
     ORDER BY entry.id LIMIT :b_count
), pending AS (
    INSERT INTO pollbridge_bus_pending (group_name, entry_id, partition, consumer, delivered_at, deliveries)
    SELECT :b_group, id, partition, :b_consumer, clock_timestamp(), 1 FROM taken
), advanced AS (
    UPDATE pollbridge_bus_groups AS g SET last_delivered_id = m.last
      FROM (SELECT partition, max(id) AS last FROM taken GROUP BY partition) AS m
     WHERE g.group_name = :b_group AND g.partition = m.partition
)
SELECT t.id, t.partition, t.payload, c.groups
  FROM (SELECT count(*) AS groups FROM off) AS c LEFT JOIN taken AS t ON true
 ORDER BY t.id
""").bindparams(sa.bindparam("b_parts", type_=postgresql.ARRAY(sa.Integer)),
                sa.bindparam("b_acks", type_=postgresql.ARRAY(sa.BigInteger)))
#: A group's offset in one partition moved to the last entry delivered.
_ADVANCE_OFFSET = (
    bus_groups.update()
    .where(bus_groups.c.group_name == sa.bindparam("b_group"), bus_groups.c.partition == sa.bindparam("b_partition"))
    .values(last_delivered_id=sa.bindparam("b_last"))
)


def _insert_rows(conn: Connection, table: sa.Table, rows: list[dict[str, Any]], now_column: str) -> None:
    """Insert ``rows``, each with the database clock in ``now_column``. SQLite: one multi-row ``INSERT ...
    VALUES``, which SQLite runs once; ``executemany`` ran the statement once per row (``bench.cost``, embedded,
    2 completions/s: the log's and the pending list's inserts were 3.9 of 16.5 statements per completion, at two
    rows a claim and a take). Its text is built once per table, columns and row count (:func:`_multi_insert`):
    SQLAlchemy's ``insert().values([...])``, built and compiled per call, cost more CPU than the statements saved
    (at 100 completions/s, 5.3 to 5.7 CPU-seconds per 1,000 completions against 4.0). PostgreSQL:
    ``executemany`` (psycopg pipelines it)."""
    if conn.dialect.name != "sqlite" or len(rows) < 2:
        conn.execute(table.insert().values(**{now_column: db_now(conn.dialect.name)}), rows)
        return
    columns = tuple(rows[0])
    for start in range(0, len(rows), _MULTI_ROWS):
        chunk = rows[start:start + _MULTI_ROWS]
        statement = _multi_insert(table.name, columns, len(chunk), now_column)
        conn.execute(statement, {f"{c}_{i}": row[c] for i, row in enumerate(chunk) for c in columns})


def _advance_offsets(conn: Connection, group: str, last: dict[int, int]) -> None:
    """Move ``group``'s offset of each partition to its entry in ``last`` (the take's last entry there). SQLite,
    several partitions: one ``UPDATE`` with a ``CASE`` (:func:`_multi_advance`); ``executemany`` ran it once per
    partition (``bench.cost``, embedded, 2 completions/s: 2 statements a take, a completion and the previous
    dispatch being of two instances, mostly in two partitions)."""
    if conn.dialect.name != "sqlite" or len(last) < 2:
        conn.execute(_ADVANCE_OFFSET, [{"b_group": group, "b_partition": p, "b_last": v} for p, v in last.items()])
        return
    params: dict[str, Any] = {"b_group": group}
    for i, (p, v) in enumerate(sorted(last.items())):
        params[f"p_{i}"], params[f"v_{i}"] = p, v
    conn.execute(_multi_advance(len(last)), params)


@functools.lru_cache(maxsize=64)
def _multi_advance(n: int) -> sa.TextClause:
    """``UPDATE`` of ``n`` partitions' offsets of one group, each to its own value (SQLite)."""
    cases = " ".join(f"WHEN :p_{i} THEN :v_{i}" for i in range(n))
    places = ", ".join(f":p_{i}" for i in range(n))
    return sa.text(f'UPDATE {bus_groups.name} SET last_delivered_id = CASE "partition" {cases} END '
                   f'WHERE group_name = :b_group AND "partition" IN ({places})')


#: Rows in one multi-row INSERT on SQLite (:func:`_insert_rows`; 500 rows of 5 columns stay well within SQLite's
#: 32,766 bound parameters).
_MULTI_ROWS = 500
#: The database clock (:func:`bridge.db.engine.db_now`) as SQLite text.
_SQLITE_NOW = str(db_now("sqlite").compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True}))


@functools.lru_cache(maxsize=1024)
def _multi_insert(table: str, columns: tuple[str, ...], n: int, now_column: str) -> sa.TextClause:
    """``INSERT INTO table (columns, now_column) VALUES (:c_0, ..., <clock>), ...`` for ``n`` rows (SQLite)."""
    values = ", ".join("(" + ", ".join([*(f":{c}_{i}" for c in columns), _SQLITE_NOW]) + ")" for i in range(n))
    return sa.text(f"INSERT INTO {table} ({', '.join([*columns, now_column])}) VALUES {values}")


#: Per partition of group ``b_group`` with a group row: how many log entries lie after its offset.
_LAG = sa.select(
    bus_groups.c.partition,
    sa.select(sa.func.count()).select_from(bus_log)
    .where(bus_log.c.partition == bus_groups.c.partition, bus_log.c.id > bus_groups.c.last_delivered_id)
    .scalar_subquery(),
).where(bus_groups.c.group_name == sa.bindparam("b_group"))


def _after(offsets: dict[int, int]) -> ColumnElement[bool]:
    """Log rows after each partition's offset (an OR per partition; each uses the (partition, id) index)."""
    return sa.or_(*[sa.and_(bus_log.c.partition == p, bus_log.c.id > off) for p, off in sorted(offsets.items())])


def _delivery(entry_id: Any, partition: Any, payload: str, deliveries: int) -> Delivery:
    try:
        event: CloudEvent | None = CloudEvent.from_json(payload)
        error = None
    except EventFormatError as exc:
        event, error = None, str(exc)
    return Delivery(str(entry_id), int(partition), payload, event, deliveries, error)
