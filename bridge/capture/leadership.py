"""One active relay per partition.

PostgreSQL: a session-level advisory lock held on a dedicated connection. If the holder dies its
connection closes and the lock is released at once; a standby polling ``try_acquire`` takes over
within its retry interval. The holder checks that it still holds the lock without a statement: the
lock lives exactly as long as the connection, so it reads what the server may have sent (a
termination notice, the end of the stream) and asks the socket; TCP keepalives turn a silently
dropped network path into a closed socket within :data:`bridge.db.listen.KEEPALIVE_SECONDS`. An idle relay so sends
its database nothing for its leadership. SQLite on a file (the embedded default, one host): an exclusive
lock on a file beside the database (:mod:`bridge.db.filelock`), held as long as the process lives, so an
idle relay sends nothing for its leadership there either. SQLite in memory (one process): a lease row in
``pollbridge_relay_state`` renewed by heartbeat, taken over when the heartbeat is older than the lease
timeout. Every kind writes who holds the partition, and since when, into ``pollbridge_relay_state`` when it
takes it (for ``status`` and the checks).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import uuid
from abc import ABC, abstractmethod
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import sqlalchemy as sa
from psycopg.pq import ConnStatus
from sqlalchemy.engine import Engine

from bridge.core.errors import first_line
from bridge.db.engine import quiet
from bridge.db.filelock import FileLock, lock_path
from bridge.db.listen import kept_connection
from bridge.db.schema import relay_state

log = logging.getLogger(__name__)

#: First key of the two-key advisory lock; the second is the relay partition.
ADVISORY_NAMESPACE = 0x70B1  # "pb"

def holder_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def ensure_state_row(engine: Engine, partition: int) -> None:
    with engine.begin() as conn:
        exists = conn.execute(sa.select(relay_state.c.relay_partition)
                              .where(relay_state.c.relay_partition == partition)).first()
        if exists is None:
            try:
                with conn.begin_nested():
                    conn.execute(relay_state.insert().values(relay_partition=partition, armed=False))
            except sa.exc.IntegrityError:
                pass  # another relay created it first


class Leadership(ABC):
    holder: str

    @abstractmethod
    def try_acquire(self) -> bool:
        """True if this process now holds (or still holds) the partition."""

    @abstractmethod
    def release(self) -> None: ...


class AdvisoryLockLeadership(Leadership):
    def __init__(self, engine: Engine, partition: int) -> None:
        self.engine = engine
        self.partition = partition
        self.holder = holder_name()
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._held = False

    def _connect(self) -> psycopg.Connection[tuple[object, ...]]:
        return kept_connection(self.engine)

    def try_acquire(self) -> bool:
        try:
            if self._conn is None or self._conn.closed:
                self._held = False
                self._conn = self._connect()
            if self._held:
                if _alive(self._conn):  # the lock lives exactly as long as this connection does
                    return True
                raise psycopg.OperationalError("the server closed the connection that held the lock")
            row = self._conn.execute("SELECT pg_try_advisory_lock(%s, %s)",
                                     (ADVISORY_NAMESPACE, self.partition)).fetchone()
            self._held = bool(row and row[0])
        except psycopg.Error as exc:
            log.warning("relay leadership connection lost: %s", first_line(exc))
            self._held = False
            if self._conn is not None:
                self._conn.close()
            self._conn = None
        if self._held:  # just taken: who holds it and since when (for status and preflight)
            _record_holder(self.engine, self.partition, self.holder, sa.func.clock_timestamp())
        return self._held

    def release(self) -> None:
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
        self._conn = None
        self._held = False


def _record_holder(engine: Engine, partition: int, holder: str, since: object) -> None:
    with engine.begin() as conn:
        conn.execute(relay_state.update().where(relay_state.c.relay_partition == partition)
                     .values(holder=holder, heartbeat_at=since))


def relay_lock_name(partition: int) -> str:
    """The name of relay partition ``partition``'s lock file (:func:`bridge.db.filelock.lock_path`)."""
    return f"relay_{partition}"


class FileLockLeadership(Leadership):
    """SQLite on a file: the partition is this process's while it holds the partition's lock file. Checking
    that it still does is a ``stat`` (:meth:`FileLock.held`); only taking it writes ``pollbridge_relay_state``."""

    def __init__(self, engine: Engine, partition: int, path: Path) -> None:
        self.engine = engine
        self.partition = partition
        self.holder = holder_name()
        self._lock = FileLock(path)

    def try_acquire(self) -> bool:
        if self._lock.held():
            self._lock.touch()  # working: the checks tell a stalled holder by this time
            return True
        if not self._lock.acquire(self.holder):
            return False
        try:
            _record_holder(self.engine, self.partition, self.holder, datetime.now(UTC).replace(tzinfo=None))
        except BaseException:
            self._lock.release()  # not recorded: taken again at the next try
            raise
        return True

    def release(self) -> None:
        self._lock.release()


class LeaseLeadership(Leadership):
    def __init__(self, engine: Engine, partition: int, lease_timeout: float) -> None:
        self.engine = engine
        self.partition = partition
        self.lease_timeout = lease_timeout
        self.holder = holder_name()

    def try_acquire(self) -> bool:
        now = datetime.now(UTC).replace(tzinfo=None)
        stale = now - timedelta(seconds=self.lease_timeout)
        rs = relay_state.c
        # Quiet: a renewal wakes none of this process's waiters (bridge.db.changes).
        with quiet(self.engine).begin() as conn:
            won = conn.execute(
                relay_state.update()
                .where(rs.relay_partition == self.partition,
                       sa.or_(rs.holder.is_(None), rs.holder == self.holder, rs.heartbeat_at.is_(None),
                              rs.heartbeat_at < stale))
                .values(holder=self.holder, heartbeat_at=now)
            ).rowcount
        return won == 1

    def release(self) -> None:
        rs = relay_state.c
        with self.engine.begin() as conn:
            conn.execute(relay_state.update().where(rs.relay_partition == self.partition, rs.holder == self.holder)
                         .values(holder=None, heartbeat_at=None))


def _alive(conn: psycopg.Connection[tuple[object, ...]]) -> bool:
    """Whether the server side of an idle connection still exists, without a round trip: read what is
    waiting while the socket has something (a terminated backend sends its error, then closes: the
    second read meets the end of the stream) and look at the state."""
    pgconn = conn.pgconn
    if conn.closed or pgconn.status != ConnStatus.OK:
        return False
    try:
        for _ in range(4):
            if not select.select([pgconn.socket], [], [], 0)[0]:
                break
            pgconn.consume_input()
    except psycopg.OperationalError:
        return False
    return pgconn.status == ConnStatus.OK


def leadership_for(engine: Engine, partition: int, lease_timeout: float) -> Leadership:
    if engine.dialect.name == "postgresql":
        return AdvisoryLockLeadership(engine, partition)
    path = lock_path(engine, relay_lock_name(partition))
    if path is not None:
        return FileLockLeadership(engine, partition, path)
    return LeaseLeadership(engine, partition, lease_timeout)
