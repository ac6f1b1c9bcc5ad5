"""Partition leases in the database: which scheduler process consumes which bus partition.

This is the store that goes with a bus that keeps no leases itself (the embedded bus). A bus that
does (Redis Streams: :meth:`bridge.bus.base.EventBus.leases`) gets :class:`BusPartitionLeases`, whose
rounds run on the bus's server. :func:`lease_store` picks one through the bus interface,
:func:`lease_snapshot` reads either; both keep :class:`event_scheduler.protocols.PartitionLeaseStore`'s
contract.

Each process heartbeats in ``pollbridge_scheduler_members`` and holds at most its fair share,
``ceil(partitions / live members)``, of rows in ``pollbridge_scheduler_leases``, renewing them every
refresh. A partition whose lease expired (its holder died) is taken over by whoever is short of its
share; a process above its share (a new member joined) releases the excess. One holder per
partition means one instance's events are handled by one consumer at a time, in bus order.

Times are the host's UTC clock (naive on SQLite): every process of one installation compares the
same kind of timestamps, and a lease is many seconds long, so small clock skew only delays takeover.

On a SQLite file (the embedded default, one host) :class:`FileLockPartitionLeases` keeps the same contract with
lock files beside the database (:mod:`bridge.db.filelock`) and no table: a member holds a member slot's lock, a
partition is its holder's while it holds the partition's lock, and the kernel releases both the moment the
process dies. A round asks the files, never the database: the table store's idle round on SQLite was a write
transaction of six statements every ``lease_ttl / 3``, 1.6 of the idle embedded event path's 2.5 statements
a second (``python -m bench.cost --rates 0 --configs embedded``). A member touches its slot's file at each
round: that time is its heartbeat for ``status`` and the checks.

On PostgreSQL a round starts with one statement (:data:`ROUND_SQL`: heartbeat, renewal, and what a
rebalance would need to know) and goes on to the full round only when something changed: a member
joined or died, a partition is free, this process is above or short of its share with a partition to
take. An idle, settled scheduler so costs one statement per round.
"""

from __future__ import annotations

import glob
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from bridge.bus.base import BusLeases, EventBus, LeaseSnapshot
from bridge.db.clock import as_utc
from bridge.db.engine import quiet, read_only
from bridge.db.filelock import FileLock, holder_of, lock_path
from bridge.db.schema import scheduler_leases, scheduler_members
from event_scheduler.protocols import PartitionLeaseStore

#: The settled round's one statement (PostgreSQL): heartbeat and renew, then the facts that decide
#: whether a full round is needed. Every subquery reads the statement's snapshot (the renewal's own
#: effect is not visible to them, which the checks below allow for).
ROUND_SQL = sa.text("""
WITH beat AS (
    UPDATE pollbridge_scheduler_members SET heartbeat_at = :now WHERE holder = :holder RETURNING holder
), renewed AS (
    UPDATE pollbridge_scheduler_leases SET expires_at = :until WHERE holder = :holder RETURNING partition
)
SELECT (SELECT count(*) FROM beat) AS beat,
       (SELECT count(*) FROM pollbridge_scheduler_members
        WHERE holder <> :holder AND heartbeat_at >= :stale) AS others,
       (SELECT count(*) FROM pollbridge_scheduler_members WHERE heartbeat_at < :stale) AS stale_members,
       (SELECT count(*) FROM pollbridge_scheduler_leases
        WHERE holder IS NULL OR expires_at IS NULL OR expires_at < :now) AS free,
       ARRAY(SELECT partition FROM renewed ORDER BY partition) AS mine
""")


class PartitionLeases:
    """:class:`event_scheduler.protocols.PartitionLeaseStore` in the database."""

    def __init__(self, engine: Engine, partitions: int, holder: str, ttl: float) -> None:
        self.engine = engine
        self.partitions = partitions
        self.holder = holder
        self.ttl = ttl
        self.owned: set[int] = set()
        self._sqlite = engine.dialect.name == "sqlite"
        self._ensure_rows()

    def _now(self) -> datetime:
        now = datetime.now(UTC)
        return now.replace(tzinfo=None) if self._sqlite else now

    def _ensure_rows(self) -> None:
        with self.engine.begin() as conn:
            have = set(conn.execute(sa.select(scheduler_leases.c.partition)).scalars())
            missing = [{"partition": p} for p in range(self.partitions) if p not in have]
            if missing:
                try:
                    with conn.begin_nested():
                        conn.execute(scheduler_leases.insert(), missing)
                except sa.exc.IntegrityError:
                    pass  # another process created them

    def refresh(self, conn: Connection | None = None) -> tuple[set[int], set[int]]:
        """Heartbeat, renew, rebalance. Returns ``(acquired, lost)`` since the last refresh.

        ``conn``: an autocommit PostgreSQL connection the caller keeps, for the settled round's one
        statement (no pool checkout, no pre-ping); the full round takes a connection of its own."""
        now = self._now()
        until = now + timedelta(seconds=self.ttl)
        stale = now - timedelta(seconds=self.ttl)
        before = set(self.owned)
        if conn is not None and not self._sqlite and self._settled(conn, now, until, stale):
            return set(), set()
        lc, mc = scheduler_leases.c, scheduler_members.c
        # Quiet: on SQLite a renewal wakes none of this process's waiters (bridge.db.changes).
        with quiet(self.engine).begin() as conn:
            updated = conn.execute(scheduler_members.update().where(mc.holder == self.holder)
                                   .values(heartbeat_at=now)).rowcount
            if not updated:
                conn.execute(scheduler_members.insert().values(holder=self.holder, heartbeat_at=now))
            conn.execute(scheduler_members.delete().where(mc.heartbeat_at < stale))
            members = int(conn.execute(sa.select(sa.func.count()).select_from(scheduler_members)).scalar_one())
            share = math.ceil(self.partitions / max(members, 1))
            conn.execute(scheduler_leases.update().where(lc.holder == self.holder).values(expires_at=until))
            mine = sorted(conn.execute(sa.select(lc.partition).where(lc.holder == self.holder)).scalars())
            for p in mine[share:]:  # above the fair share: give the excess back
                conn.execute(scheduler_leases.update().where(lc.partition == p, lc.holder == self.holder)
                             .values(holder=None, expires_at=None))
            mine = mine[:share]
            if len(mine) < share:
                free = list(conn.execute(sa.select(lc.partition).where(
                    sa.or_(lc.holder.is_(None), lc.expires_at.is_(None), lc.expires_at < now))
                    .order_by(lc.partition)).scalars())
                for p in free[: share - len(mine)]:
                    took = conn.execute(scheduler_leases.update().where(
                        lc.partition == p,
                        sa.or_(lc.holder.is_(None), lc.expires_at.is_(None), lc.expires_at < now))
                        .values(holder=self.holder, expires_at=until)).rowcount
                    if took:
                        mine.append(p)
        self.owned = set(mine)
        return self.owned - before, before - self.owned

    def _settled(self, conn: Connection, now: datetime, until: datetime, stale: datetime) -> bool:
        """The one-statement round: True when it renewed everything and nothing asks for a rebalance."""
        row = conn.execute(ROUND_SQL, {"holder": self.holder, "now": now, "until": until, "stale": stale}).one()
        mine = {int(p) for p in row.mine}
        share = math.ceil(self.partitions / (int(row.others) + 1))
        # Short of the share with nothing free is settled too: the members above it release on their round.
        return (row.beat == 1 and row.stale_members == 0 and mine == self.owned and len(mine) <= share
                and (len(mine) == share or row.free == 0))

    def release_all(self) -> None:
        lc, mc = scheduler_leases.c, scheduler_members.c
        with self.engine.begin() as conn:
            conn.execute(scheduler_leases.update().where(lc.holder == self.holder).values(holder=None, expires_at=None))
            conn.execute(scheduler_members.delete().where(mc.holder == self.holder))
        self.owned = set()

    def holders(self) -> dict[int, Any]:
        with self.engine.connect() as conn:
            return {p: h for p, h in conn.execute(sa.select(scheduler_leases.c.partition, scheduler_leases.c.holder))}


#: Lock-file names (:func:`bridge.db.filelock.lock_path`) of the file store's member slots and partitions.
MEMBER_LOCK = "scheduler_member_{}"
PARTITION_LOCK = "scheduler_partition_{}"


class FileLockPartitionLeases:
    """:class:`event_scheduler.protocols.PartitionLeaseStore` in lock files beside a SQLite database file.

    A member is a process holding one member slot's lock (the lowest free slot); the live members are the
    slots whose lock someone holds. A partition is leased while its holder holds its lock: there is no expiry,
    so ``ttl`` only paces the caller's rounds, a stalled member keeps what it holds (it cannot lose a
    partition to another, the contract's strongest case) and a dead one's partitions are free at once."""

    def __init__(self, engine: Engine, partitions: int, holder: str, ttl: float) -> None:
        path = lock_path(engine, MEMBER_LOCK.format(0))
        if path is None:
            raise ValueError("lock-file leases need a SQLite database file")
        self.engine = engine
        self.partitions = partitions
        self.holder = holder
        self.ttl = ttl
        self.owned: set[int] = set()
        self._member: FileLock | None = None
        self._locks: dict[int, FileLock] = {}

    def _path(self, name: str) -> Path:
        path = lock_path(self.engine, name)
        assert path is not None  # checked in __init__
        return path

    def _join(self) -> None:
        """Hold a member slot: the lowest one nobody holds (slots are never removed but by ``uninstall``)."""
        if self._member is not None and self._member.held():
            self._member.touch()  # this member's heartbeat: the checks tell a stalled one by its time
            return
        slot = 0
        while True:
            lock = FileLock(self._path(MEMBER_LOCK.format(slot)))
            if lock.acquire(self.holder):
                self._member = lock
                return
            slot += 1

    def refresh(self, conn: object = None) -> tuple[set[int], set[int]]:
        """Join, count the live members, give back the excess over the fair share, take free partitions up to
        it. No statement; ``conn`` is accepted for the database store's signature and not used."""
        before = set(self.owned)
        self._join()
        members = len(file_members(self.engine))
        share = math.ceil(self.partitions / max(members, 1))
        mine = sorted(p for p, lock in self._locks.items() if lock.held())  # a file removed: the lease is lost
        for p in mine[share:]:  # above the fair share: give the excess back
            self._locks.pop(p).release()
        mine = mine[:share]
        for p in range(self.partitions):
            if len(mine) >= share:
                break
            if p in mine:
                continue
            lock = FileLock(self._path(PARTITION_LOCK.format(p)))
            if lock.acquire(self.holder):
                self._locks[p] = lock
                mine.append(p)
        self._locks = {p: lock for p, lock in self._locks.items() if p in mine}
        self.owned = set(mine)
        return self.owned - before, before - self.owned

    def release_all(self) -> None:
        for lock in self._locks.values():
            lock.release()
        self._locks = {}
        if self._member is not None:
            self._member.release()
            self._member = None
        self.owned = set()

    def holders(self) -> dict[int, Any]:
        return {p: file_holder(self.engine, PARTITION_LOCK.format(p)) for p in range(self.partitions)}


def file_members(engine: Engine) -> dict[str, datetime]:
    """The holders of the member slots' locks beside ``engine``'s SQLite file, each with its last round's time."""
    return {h.name: h.touched_at for f in _numbered(engine, MEMBER_LOCK) if (h := holder_of(f)) is not None}


def _numbered(engine: Engine, name: str) -> list[Path]:
    """The lock files ``name.format(n)`` (n = 0, 1, ...) that exist beside ``engine``'s SQLite file."""
    first = lock_path(engine, name.format(0))
    if first is None:
        return []
    prefix = first.name[:-1]
    return sorted(f for f in first.parent.glob(f"{glob.escape(prefix)}*") if f.name[len(prefix):].isdigit())


def file_holder(engine: Engine, name: str) -> str | None:
    path = lock_path(engine, name)
    holder = None if path is None else holder_of(path)
    return None if holder is None else holder.name


class BusPartitionLeases:
    """:class:`event_scheduler.protocols.PartitionLeaseStore` kept beside the bus (:meth:`EventBus.leases`):
    each refresh is one atomic round on the bus's server, by its clock; the database is not asked."""

    def __init__(self, store: BusLeases, holder: str, ttl: float) -> None:
        self.store = store
        self.partitions = store.partitions
        self.holder = holder
        self.ttl = ttl
        self.owned: set[int] = set()

    def refresh(self, conn: object = None) -> tuple[set[int], set[int]]:
        """Heartbeat, renew, rebalance in one round. ``conn`` is accepted for the database store's
        signature and not used."""
        before = set(self.owned)
        self.owned = self.store.round(self.holder, self.ttl)
        return self.owned - before, before - self.owned

    def release_all(self) -> None:
        self.store.release(self.holder)
        self.owned = set()

    def holders(self) -> dict[int, Any]:
        leased = self.store.snapshot().leases
        return {p: leased.get(p, (None, None))[0] for p in range(self.partitions)}


def lease_store(engine: Engine, bus: EventBus, holder: str, ttl: float) -> PartitionLeaseStore:
    """The leases that go with ``bus``: beside it when it keeps them (Redis Streams: an idle round then
    costs the database nothing), in the database otherwise."""
    beside = bus.leases()
    if beside is not None:
        return BusPartitionLeases(beside, holder, ttl)
    if lock_path(engine, MEMBER_LOCK.format(0)) is not None:  # a SQLite file: lock files beside it
        return FileLockPartitionLeases(engine, bus.partitions, holder, ttl)
    return PartitionLeases(engine, bus.partitions, holder, ttl)


def lease_snapshot(engine: Engine, bus: EventBus | None) -> LeaseSnapshot:
    """The leases of the store :func:`lease_store` would use with ``bus`` (None: the database's), read only."""
    beside = bus.leases() if bus is not None else None
    if beside is not None:
        return beside.snapshot()
    if lock_path(engine, MEMBER_LOCK.format(0)) is not None:
        # Lock files: a member's heartbeat is its slot file's time (touched every round); a partition is leased
        # exactly while its lock is held (no expiry: "now" plus a second), by a member the caller may find stale.
        now = datetime.now(UTC)
        partitions = bus.partitions if bus is not None else _file_partitions(engine)
        leased = {p: file_holder(engine, PARTITION_LOCK.format(p)) for p in range(partitions)}
        return LeaseSnapshot(now=now, members=file_members(engine),
                             leases={p: (h, now + timedelta(seconds=1) if h else None) for p, h in leased.items()},
                             locks=True)
    mc, lc = scheduler_members.c, scheduler_leases.c
    with read_only(engine).connect() as conn:
        members = conn.execute(sa.select(mc.holder, mc.heartbeat_at)).all()
        leases = conn.execute(sa.select(lc.partition, lc.holder, lc.expires_at)).all()
    return LeaseSnapshot(
        now=datetime.now(UTC),
        members={str(m.holder): t for m in members if (t := as_utc(m.heartbeat_at)) is not None},
        leases={int(r.partition): (r.holder, as_utc(r.expires_at)) for r in leases})


def _file_partitions(engine: Engine) -> int:
    """How many partition lock files there are beside ``engine``'s SQLite file (no bus to ask)."""
    return len(_numbered(engine, PARTITION_LOCK))


__all__ = ["BusPartitionLeases", "FileLockPartitionLeases", "LeaseSnapshot", "PartitionLeases", "lease_snapshot",
           "lease_store"]
