"""Partition leases: fair shares, takeover of a dead member's partitions, and (PostgreSQL) the settled
round's one statement on the caller's connection, which must fall back to the full round whenever
something changed."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from bridge.schema import scheduler_leases, scheduler_members
from event_scheduler.leases import PartitionLeases

PARTITIONS = 4


def _keep(engine: Engine) -> Connection | None:
    """The scheduler loop's kept autocommit connection (PostgreSQL only)."""
    if engine.dialect.name != "postgresql":
        return None
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


@pytest.fixture
def statements(engine: Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    yield seen
    event.remove(engine, "before_cursor_execute", record)


def test_two_members_split_the_partitions_and_settle(engine: Engine, statements: list[str]) -> None:
    a = PartitionLeases(engine, PARTITIONS, "a", ttl=10.0)
    b = PartitionLeases(engine, PARTITIONS, "b", ttl=10.0)
    conn_a, conn_b = _keep(engine), _keep(engine)
    try:
        assert a.refresh(conn_a) == ({0, 1, 2, 3}, set())  # alone: everything
        acquired_b, _ = b.refresh(conn_b)
        assert acquired_b == set()  # a holds its share and more: b waits for a's next round
        assert a.refresh(conn_a) == (set(), {2, 3})  # a sees b and gives back the excess
        assert b.refresh(conn_b) == ({2, 3}, set())
        assert a.owned == {0, 1} and b.owned == {2, 3}
        statements.clear()
        assert a.refresh(conn_a) == (set(), set())
        assert b.refresh(conn_b) == (set(), set())
        if engine.dialect.name == "postgresql":
            assert len(statements) == 2, statements  # settled: one statement per round
        with engine.connect() as conn:
            holders = dict(conn.execute(sa.select(scheduler_leases.c.partition, scheduler_leases.c.holder)).all())
        assert holders == {0: "a", 1: "a", 2: "b", 3: "b"}
    finally:
        for c in (conn_a, conn_b):
            if c is not None:
                c.close()


def test_a_dead_members_partitions_are_taken_over(engine: Engine) -> None:
    a = PartitionLeases(engine, PARTITIONS, "a", ttl=10.0)
    b = PartitionLeases(engine, PARTITIONS, "b", ttl=10.0)
    conn_a = _keep(engine)
    try:
        a.refresh(conn_a)
        b.refresh()
        a.refresh(conn_a)
        b.refresh()
        assert b.owned == {2, 3}
        # b dies: its heartbeat and its leases age past the ttl.
        past = a._now() - timedelta(seconds=60)
        with engine.begin() as conn:
            conn.execute(scheduler_members.update().where(scheduler_members.c.holder == "b")
                         .values(heartbeat_at=past))
            conn.execute(scheduler_leases.update().where(scheduler_leases.c.holder == "b")
                         .values(expires_at=past))
        assert a.refresh(conn_a) == ({2, 3}, set())
        assert a.owned == {0, 1, 2, 3}
        with engine.connect() as conn:
            members = conn.execute(sa.select(scheduler_members.c.holder)).scalars().all()
        assert members == ["a"]  # the dead member is removed
    finally:
        if conn_a is not None:
            conn_a.close()


def test_a_lease_taken_while_stalled_is_reported_lost(engine: Engine) -> None:
    """A member that stalled past its ttl finds a partition taken by another: the round must not call
    itself settled, and reports the partition lost."""
    a = PartitionLeases(engine, PARTITIONS, "a", ttl=10.0)
    conn_a = _keep(engine)
    try:
        a.refresh(conn_a)
        assert a.owned == {0, 1, 2, 3}
        past = a._now() - timedelta(seconds=60)  # a stalls past its ttl
        with engine.begin() as conn:
            conn.execute(scheduler_members.update().values(heartbeat_at=past))
            conn.execute(scheduler_leases.update().values(expires_at=past))
        b = PartitionLeases(engine, PARTITIONS, "b", ttl=10.0)
        acquired_b, _ = b.refresh()
        assert acquired_b == {0, 1, 2, 3}  # a is stale: b is alone and takes everything
        assert a.refresh(conn_a) == (set(), {0, 1, 2, 3})  # a notices: not a settled round
        assert a.owned == set()
    finally:
        if conn_a is not None:
            conn_a.close()
