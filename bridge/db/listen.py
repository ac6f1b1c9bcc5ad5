"""LISTEN/NOTIFY wake-ups: waiting for a notification on a channel, or a fallback timer.

The relay (the outbox's channel) and the flag router (the flags' channel) use it. On PostgreSQL with
``notify`` or ``adaptive`` capture, the relay LISTENs on a dedicated
autocommit connection and waits for a notification or its fallback timer, whichever comes first:
a lost notification or a reconnecting listener delays events by at most the fallback interval,
never loses them, because every wake-up (timer included) probes the outbox.
"""

from __future__ import annotations

import logging
import threading

import psycopg
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)


class Waiter:
    """Sleeps between probes; ``wait`` returns True when woken by a notification."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def wait(self, timeout: float) -> bool:
        self.stop.wait(timeout)
        return False

    def close(self) -> None:
        pass


class ListenWaiter(Waiter):
    """Waits for a notification on ``channel`` or the timeout."""

    def __init__(self, engine: Engine, stop: threading.Event, channel: str) -> None:
        super().__init__(stop)
        self._conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self.channel = channel

    def ensure_listening(self) -> None:
        """Connect and LISTEN (before the caller re-reads what the notifications are about, so none is
        missed in between)."""
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._conninfo, autocommit=True, connect_timeout=10)
            self._conn.execute(f"LISTEN {self.channel}")

    def wait(self, timeout: float) -> bool:
        try:
            self.ensure_listening()
            assert self._conn is not None
            woken = False
            # Short slices so a stop request is honoured promptly.
            remaining = timeout
            while remaining > 0 and not self.stop.is_set():
                step = min(remaining, 0.25)
                for _ in self._conn.notifies(timeout=step, stop_after=1):
                    woken = True
                if woken:
                    for _ in self._conn.notifies(timeout=0):  # drain the ones that piled up
                        pass
                    return True
                remaining -= step
            return False
        except psycopg.Error as exc:
            log.warning("listener on %s lost its connection (%s); falling back to the timer", self.channel,
                        type(exc).__name__)
            self.close()
            self.stop.wait(min(timeout, 1.0))
            return False

    def close(self) -> None:
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
        self._conn = None
