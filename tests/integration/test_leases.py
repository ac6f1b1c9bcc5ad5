"""Partition leases: fair shares, takeover of a dead member's partitions, a lease taken while its holder
stalled. One suite for every store (database on SQLite and PostgreSQL, Redis beside the bus, lock files
beside a SQLite file); the
PostgreSQL store's settled round is one statement on the caller's connection and must fall back to the
full round whenever something changed; the Redis store's round costs the database nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from bridge.bus.embedded import EmbeddedBus
from bridge.bus.redis_streams import RedisStreamsBus
from bridge.db.engine import create_engine
from bridge.db.schema import scheduler_members
from event_scheduler.leases import (
    BusPartitionLeases,
    FileLockPartitionLeases,
    PartitionLeases,
    file_members,
    lease_store,
)
from event_scheduler.protocols import PartitionLeaseStore
from tests.support import LEASE_STORE_PARAMS, age_scheduler_member

PARTITIONS = 4
TTL = 10.0


class Stores:
    """Makes the members of one store and plays a member's death (its heartbeat and leases 60 s old)."""

    def __init__(self, kind: str, engine: Engine, bus: RedisStreamsBus | None) -> None:
        self.kind, self.engine, self.bus = kind, engine, bus
        self._kept: list[Connection] = []
        self._members: dict[str, PartitionLeaseStore] = {}

    def member(self, holder: str) -> PartitionLeaseStore:
        store: PartitionLeaseStore
        if self.bus is not None:  # chosen through the bus interface: the leases the bus keeps beside it
            store = lease_store(self.engine, self.bus, holder, ttl=TTL)
            assert isinstance(store, BusPartitionLeases)
        elif self.kind == "files":  # chosen through the bus interface too: the embedded bus on a SQLite file
            store = lease_store(self.engine, EmbeddedBus(self.engine, partitions=PARTITIONS), holder, ttl=TTL)
            assert isinstance(store, FileLockPartitionLeases)
        else:
            store = PartitionLeases(self.engine, PARTITIONS, holder, ttl=TTL)
        self._members[holder] = store
        return store

    def kept(self) -> Connection | None:
        """The scheduler loop's kept autocommit connection (the PostgreSQL store's cheap round)."""
        if self.kind != "postgresql":
            return None
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        self._kept.append(conn)
        return conn

    def age(self, holder: str | None = None) -> None:
        """``holder`` (every member if None) stalls: its heartbeat and leases are 60 s old. Lock files: it dies
        (a lock has no age; a stalled holder keeps it)."""
        for name, store in self._members.items():
            if holder is None or name == holder:
                age_scheduler_member(self.engine, self.bus, name, 60, store=store)

    def members(self) -> list[str]:
        if self.kind == "files":
            return list(file_members(self.engine))
        if self.bus is not None:
            return [m.decode() for m in self.bus.client.zrange(self.bus.keys.scheduler_members, 0, -1)]
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(scheduler_members.c.holder)).scalars())

    def close(self) -> None:
        for conn in self._kept:
            conn.close()


@pytest.fixture(params=[*LEASE_STORE_PARAMS, "files"])
def stores(request: pytest.FixtureRequest) -> Iterator[Stores]:
    kind = str(request.param)
    url = request.getfixturevalue("sqlite_url" if kind in ("sqlite", "files") else "pg_url")
    engine = create_engine(url)
    bus = None
    if kind == "redis":
        bus = RedisStreamsBus(request.getfixturevalue("redis_server"), partitions=PARTITIONS,
                              namespace=request.getfixturevalue("redis_namespace"))
    s = Stores(kind, engine, bus)
    yield s
    s.close()
    if bus is not None:
        bus.close()
    engine.dispose()


@pytest.fixture
def statements(stores: Stores) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    event.listen(stores.engine, "before_cursor_execute", record)
    yield seen
    event.remove(stores.engine, "before_cursor_execute", record)


def test_two_members_split_the_partitions_and_settle(stores: Stores, statements: list[str]) -> None:
    a, b = stores.member("a"), stores.member("b")
    conn_a, conn_b = stores.kept(), stores.kept()
    assert a.refresh(conn_a) == ({0, 1, 2, 3}, set())  # alone: everything
    acquired_b, _ = b.refresh(conn_b)
    assert acquired_b == set()  # a holds its share and more: b waits for a's next round
    assert a.refresh(conn_a) == (set(), {2, 3})  # a sees b and gives back the excess
    assert b.refresh(conn_b) == ({2, 3}, set())
    assert a.owned == {0, 1} and b.owned == {2, 3}
    statements.clear()
    assert a.refresh(conn_a) == (set(), set())
    assert b.refresh(conn_b) == (set(), set())
    if stores.kind == "postgresql":
        assert len(statements) == 2, statements  # settled: one statement per round
    if stores.kind in ("redis", "files"):
        assert statements == []  # the database is not asked at all
    assert a.holders() == {0: "a", 1: "a", 2: "b", 3: "b"} == b.holders()


def test_a_dead_members_partitions_are_taken_over(stores: Stores) -> None:
    a, b = stores.member("a"), stores.member("b")
    conn_a = stores.kept()
    a.refresh(conn_a)
    b.refresh()
    a.refresh(conn_a)
    b.refresh()
    assert b.owned == {2, 3}
    stores.age("b")  # b dies: its heartbeat and its leases age past the ttl
    assert a.refresh(conn_a) == ({2, 3}, set())
    assert a.owned == {0, 1, 2, 3}
    assert stores.members() == ["a"]  # the dead member is removed


def test_a_lease_taken_while_stalled_is_reported_lost(stores: Stores) -> None:
    """A member that stalled past its ttl finds a partition taken by another: the round must not call
    itself settled, and reports the partition lost."""
    a = stores.member("a")
    conn_a = stores.kept()
    a.refresh(conn_a)
    assert a.owned == {0, 1, 2, 3}
    if stores.kind == "files":  # a lock has no ttl: a stalled holder keeps its partitions, nobody takes them
        b = stores.member("b")
        assert b.refresh() == (set(), set())
        assert a.refresh(conn_a) == (set(), {2, 3})  # a gives back the excess over its share to the live b
        assert b.refresh() == ({2, 3}, set())
        return
    stores.age()  # a stalls past its ttl
    b = stores.member("b")
    acquired_b, _ = b.refresh()
    assert acquired_b == {0, 1, 2, 3}  # a is stale: b is alone and takes everything
    assert a.refresh(conn_a) == (set(), {0, 1, 2, 3})  # a notices: not a settled round
    assert a.owned == set()


def test_release_all_hands_the_partitions_over_at_the_next_round(stores: Stores) -> None:
    a, b = stores.member("a"), stores.member("b")
    a.refresh(stores.kept())
    b.refresh()
    assert (a.owned, b.owned) == ({0, 1, 2, 3}, set())
    a.release_all()
    assert a.owned == set() and stores.members() == ["b"]
    assert b.refresh() == ({0, 1, 2, 3}, set())  # no ttl to wait for
    assert set(b.holders().values()) == {"b"}


def test_three_members_never_share_a_partition(stores: Stores) -> None:
    """Whatever order the rounds run in, no partition has two owners and, once everyone ran twice,
    every partition is owned and nobody holds more than its share."""
    members = [stores.member(h) for h in ("a", "b", "c")]
    for order in ([0, 1, 2, 0, 1, 2], [2, 2, 1, 0, 0, 1, 2, 1, 0]):
        for i in order:
            members[i].refresh()
            owned = [m.owned for m in members]
            assert sum(len(o) for o in owned) == len(set().union(*owned))  # disjoint
    assert set().union(*(m.owned for m in members)) == set(range(PARTITIONS))
    assert max(len(m.owned) for m in members) <= 2  # ceil(4 / 3)
