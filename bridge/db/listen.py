"""LISTEN/NOTIFY wake-ups: waiting for a notification on a channel, or a fallback timer.

The relay (the outbox's channel) and the flag router (the flags' channel) use it. On PostgreSQL with
``notify`` or ``adaptive`` capture, the relay LISTENs on a dedicated
autocommit connection and waits for a notification or its fallback timer, whichever comes first:
a lost notification or a reconnecting listener delays events by at most the fallback interval,
never loses them, because every wake-up (timer included) probes the outbox.
"""

from __future__ import annotations

import logging
import math
import select
import threading
import time

import psycopg
from sqlalchemy.engine import Engine

from bridge.db.changes import TopicView

log = logging.getLogger(__name__)

#: About how long a long-lived connection (a listener, a relay's leadership) whose network path silently died
#: goes unnoticed: keepalive idle time plus its probes.
KEEPALIVE_SECONDS = 20


def kept_connection(engine: Engine) -> psycopg.Connection[tuple[object, ...]]:
    """An autocommit psycopg connection for a session that mostly waits (LISTEN, an advisory lock): TCP
    keepalives turn a silently dropped network path into a closed connection within :data:`KEEPALIVE_SECONDS`,
    where it would otherwise wait for the server forever."""
    url = engine.url.set(drivername="postgresql")
    return psycopg.connect(url.render_as_string(hide_password=False), autocommit=True, connect_timeout=10,
                           keepalives=1, keepalives_idle=KEEPALIVE_SECONDS // 2,
                           keepalives_interval=KEEPALIVE_SECONDS // 10, keepalives_count=5)


def wait_notifies(conn: psycopg.Connection[tuple[object, ...]], timeout: float) -> list[str]:
    """The payloads of the notifications on ``conn`` (LISTENing, autocommit), waiting up to ``timeout`` seconds for
    the first; every one that arrived with it is taken too. An empty list: none came in time.

    The wait is a ``poll`` on the connection's socket, the reading psycopg's ``notifies(timeout=0)``:
    ``notifies(timeout=t)`` spins through the last millisecond of every wait (poll with a zero timeout until the
    deadline): measured 0.75 ms of CPU per 2 ms wait, 0.95 ms per 0.1 s one. The relay waits 2 ms between claims
    when busy: at 500 completions/s its CPU went from 0.42 to 0.19 of a core with this wait (``bench.cost``)."""
    deadline = time.monotonic() + timeout
    while True:
        # What psycopg already holds (received beside another command) or what the socket has: never blocks.
        got = [n.payload for n in conn.notifies(timeout=0)]
        if got:
            return got
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return []
        # poll, not select (no limit on the descriptor's number); the timeout rounded up, as a zero one would spin.
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        poller.poll(math.ceil(remaining * 1000))


class Waiter:
    """Sleeps between probes; ``wait`` returns True when woken by a notification."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        #: The payloads of the notifications received since :meth:`take_payloads` last took them.
        self._payloads: set[str] = set()

    def take_payloads(self) -> set[str]:
        """The payloads received since the last call (each wait adds its own; none is lost between calls)."""
        taken, self._payloads = self._payloads, set()
        return taken

    def take_notices(self, prefix: str) -> list[str]:
        """The payloads starting with ``prefix`` received since last taken, taken out (the others stay for
        :meth:`take_payloads`)."""
        if not self._payloads:
            return []
        taken = [p for p in self._payloads if p.startswith(prefix)]
        if taken:
            self._payloads.difference_update(taken)
        return taken

    def heard_other(self) -> bool:
        """Whether a payload received since last taken is still untaken (after :meth:`take_notices`: one that is
        not a notice)."""
        return bool(self._payloads)

    def wait(self, timeout: float) -> bool:
        self.stop.wait(timeout)
        return False

    def hear_pending(self) -> bool:
        """Take in, without waiting, the notifications that arrived since the last wait (they join what
        :meth:`take_payloads` and :meth:`take_notices` return); True if any did. Never connects: a listener that is
        closed has nothing pending."""
        return False

    def close(self) -> None:
        pass


class ListenWaiter(Waiter):
    """Waits for a notification on ``channel`` or the timeout."""

    def __init__(self, engine: Engine, stop: threading.Event, channel: str) -> None:
        super().__init__(stop)
        self._engine = engine
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self.channel = channel
        self._fresh = False  # connected since ensure_listening last said so

    def ensure_listening(self) -> bool:
        """Connect and LISTEN (before the caller re-reads what the notifications are about, so none is
        missed in between). True when it (re)connected since the last call, here or inside a :meth:`wait`:
        what committed before is the caller's to read."""
        self._connect_if_needed()
        fresh, self._fresh = self._fresh, False
        return fresh

    def _connect_if_needed(self) -> None:
        if self._conn is None or self._conn.closed:
            self._conn = kept_connection(self._engine)
            self._conn.execute(f"LISTEN {self.channel}")
            self._fresh = True

    def wait(self, timeout: float) -> bool:
        try:
            self._connect_if_needed()
            assert self._conn is not None
            # Short slices so a stop request is honoured promptly.
            remaining = timeout
            while remaining > 0 and not self.stop.is_set():
                step = min(remaining, 0.25)
                got = wait_notifies(self._conn, step)
                if got:
                    self._payloads.update(got)
                    return True
                remaining -= step
            return False
        except psycopg.Error as exc:
            log.warning("listener on %s lost its connection (%s); falling back to the timer", self.channel,
                        type(exc).__name__)
            self.close()
            self.stop.wait(min(timeout, 1.0))
            return False

    def hear_pending(self) -> bool:
        if self._conn is None or self._conn.closed:
            return False
        try:
            got = [n.payload for n in self._conn.notifies(timeout=0)]
        except psycopg.Error as exc:  # as in wait: the next wait reconnects, and a fresh LISTEN is followed by a look
            log.warning("listener on %s lost its connection (%s); falling back to the timer", self.channel,
                        type(exc).__name__)
            self.close()
            return False
        self._payloads.update(got)
        return bool(got)

    def close(self) -> None:
        """Stop listening; what was heard and not taken is dropped (a new LISTEN is followed by a look at what
        committed meanwhile: :meth:`ensure_listening`)."""
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
        self._conn = None
        self._payloads.clear()


class ChangeWaiter(Waiter):
    """SQLite: waits for a commit to the database file (:mod:`bridge.db.changes`: this process's at once,
    another's within a few ms) or the timeout, at most once per ``min_gap`` seconds: a busy database commits
    all the time, and what the waiter re-reads (the flags) need not follow every commit."""

    def __init__(self, signal: TopicView, stop: threading.Event, min_gap: float) -> None:
        super().__init__(stop)
        self.signal = signal
        self.min_gap = min_gap
        self._seen = signal.generation
        self._returned = time.monotonic()

    def wait(self, timeout: float) -> bool:
        start = time.monotonic()
        if self.stop.wait(max(0.0, self._returned + self.min_gap - start)):
            return False
        remaining = timeout - (time.monotonic() - start)
        moved = self._seen
        while remaining > 0 and not self.stop.is_set() and moved == self._seen:
            step = min(remaining, 0.25)  # short slices so a stop request is honoured promptly
            moved = self.signal.wait(self._seen, step)
            remaining -= step
        woken = moved != self._seen
        self._seen = moved
        self._returned = time.monotonic()
        return woken
