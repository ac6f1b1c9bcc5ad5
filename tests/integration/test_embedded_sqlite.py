"""The embedded bus on SQLite: a publish of several events and a take of several entries each insert their
rows with one statement run once (a multi-row INSERT), not once per row, and a take moves the offsets of all
its partitions with one UPDATE; the rows are the same."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from bridge.bus.embedded import EmbeddedBus
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent, new_event_id
from bridge.db.engine import create_engine
from bridge.db.schema import bus_groups, bus_log, bus_pending


def _event(instance: str) -> CloudEvent:
    return CloudEvent(id=new_event_id(), type=TASK_STATUS_CHANGED, subject=instance, partitionkey=instance,
                      time=datetime.now(UTC), data={"task_id": instance})


def test_a_publish_and_a_take_of_many_rows_are_one_insert_each(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    bus = EmbeddedBus(engine, partitions=1)
    inserts: list[tuple[str, bool]] = []

    def seen(_conn: Any, _cursor: Any, statement: str, _params: Any, _context: Any, many: bool) -> None:
        if statement.lstrip().upper().startswith("INSERT"):
            inserts.append((statement.split("(")[0].split()[-1], many))

    try:
        events = [_event(f"i-{k}") for k in range(5)]
        sa.event.listen(engine, "before_cursor_execute", seen)
        bus.publish(events)
        got = bus.read("g", "c1", [0], 10, 0.0)
        sa.event.remove(engine, "before_cursor_execute", seen)
        assert [d.event.id for d in got if d.event is not None] == [e.id for e in events]
        # One statement each, run once (before: executemany, the statement once per row).
        assert [i for i in inserts if i[0] in ("pollbridge_bus_log", "pollbridge_bus_pending")] == [
            ("pollbridge_bus_log", False), ("pollbridge_bus_pending", False)], inserts
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(bus_log)).scalar_one() == 5
            pending = conn.execute(sa.select(bus_pending.c.consumer, bus_pending.c.deliveries,
                                             bus_pending.c.delivered_at)).all()
        assert len(pending) == 5 and {(p.consumer, p.deliveries) for p in pending} == {("c1", 1)}
        assert all(p.delivered_at is not None for p in pending)
    finally:
        bus.close()
        engine.dispose()


def test_a_take_over_several_partitions_moves_their_offsets_with_one_update(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    bus = EmbeddedBus(engine, partitions=4)
    updates: list[tuple[str, bool]] = []

    def seen(_conn: Any, _cursor: Any, statement: str, _params: Any, _context: Any, many: bool) -> None:
        if "pollbridge_bus_groups" in statement and statement.lstrip().upper().startswith("UPDATE"):
            updates.append((statement, many))

    try:
        bus.ensure_group("g")
        events = [_event(f"i-{k}") for k in range(12)]
        bus.publish(events)
        with engine.connect() as conn:
            last = dict(conn.execute(sa.select(bus_log.c.partition, sa.func.max(bus_log.c.id))
                                     .group_by(bus_log.c.partition)).all())
        assert len(last) >= 2  # the instances spread over several partitions
        sa.event.listen(engine, "before_cursor_execute", seen)
        got = bus.read("g", "c1", [0, 1, 2, 3], 100, 0.0)
        sa.event.remove(engine, "before_cursor_execute", seen)
        assert sorted(d.event.id for d in got if d.event is not None) == sorted(e.id for e in events)
        assert len(updates) == 1 and not updates[0][1], updates  # one statement, run once
        with engine.connect() as conn:
            offsets = dict(conn.execute(sa.select(bus_groups.c.partition, bus_groups.c.last_delivered_id)
                                        .where(bus_groups.c.group_name == "g")).all())
        assert offsets == {p: last.get(p, 0) for p in range(4)}
        more = _event("i-late")
        bus.publish([more])
        assert [d.event.id for d in bus.read("g", "c1", [0, 1, 2, 3], 100, 0.0) if d.event is not None] == [more.id]
    finally:
        bus.close()
        engine.dispose()


def _write_transactions(engine: sa.Engine, into: list[str]) -> Any:
    def seen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if statement.startswith("BEGIN IMMEDIATE") or statement.lstrip().upper().startswith("DELETE"):
            into.append(statement.split()[0].upper())
    sa.event.listen(engine, "before_cursor_execute", seen)
    return seen


def test_acknowledgements_with_nothing_new_ride_with_the_take_that_ends_the_wait(sqlite_url: str) -> None:
    """A drained consumer acknowledges its batch and waits for the next: the acknowledgements go in the write
    transaction of the take that a publish during the wait brings (one BEGIN IMMEDIATE, not one for them and
    one for the take), and are made before the call returns."""
    engine = create_engine(sqlite_url)
    bus = EmbeddedBus(engine, partitions=2)
    publisher = EmbeddedBus(engine, partitions=2)
    statements: list[str] = []
    try:
        bus.ensure_group("g")
        bus.publish([_event("i-1")])
        first = bus.read("g", "c", [0, 1], 10, 0.0)
        assert len(first) == 1 and bus.pending_count("g") == 1
        late = _event("i-2")
        timer = threading.Timer(0.3, lambda: publisher.publish([late]))
        seen = _write_transactions(engine, statements)
        timer.start()
        try:
            got = bus.ack_and_read("g", first, "c", [0, 1], 10, 10.0)
        finally:
            sa.event.remove(engine, "before_cursor_execute", seen)
            timer.join(10)
        assert [d.event.id for d in got if d.event is not None] == [late.id]
        assert bus.pending_count("g") == 1  # the new one; the first acknowledged
        # The publisher's write transaction, then the take's with the acknowledgement's DELETE in it.
        assert statements == ["BEGIN", "BEGIN", "DELETE"], statements
    finally:
        bus.close()
        publisher.close()
        engine.dispose()


def test_acknowledgements_are_made_when_the_wait_ends_with_nothing_or_the_take_fails(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = create_engine(sqlite_url)
    bus = EmbeddedBus(engine, partitions=2)
    try:
        bus.ensure_group("g")
        bus.publish([_event("i-1"), _event("i-2")])
        first, second = bus.read("g", "c", [0, 1], 1, 0.0), bus.read("g", "c", [0, 1], 1, 0.0)
        assert bus.pending_count("g") == 2
        assert bus.ack_and_read("g", first, "c", [0, 1], 10, 0.2) == []  # nothing came
        assert bus.pending_count("g") == 1
        bus.publish([_event("i-3")])

        def broken(*_args: Any, **_kwargs: Any) -> Any:
            raise sa.exc.OperationalError("SELECT", {}, Exception("disk I/O error"))

        monkeypatch.setattr(bus, "_take_in", broken)
        with pytest.raises(sa.exc.OperationalError):
            bus.ack_and_read("g", second, "c", [0, 1], 10, 1.0)
        assert bus.pending_count("g") == 0  # acknowledged all the same
    finally:
        bus.close()
        engine.dispose()


def test_a_batch_handled_inside_the_take_is_one_write_transaction_and_a_failed_one_writes_nothing(
        sqlite_url: str) -> None:
    """The handler's writes, the take and the acknowledgement of what it handled are one write transaction (one
    BEGIN IMMEDIATE, no pending row written or deleted); a handler that raises leaves none of its writes, and the
    batch is taken again as a read takes it."""
    engine = create_engine(sqlite_url)
    bus = EmbeddedBus(engine, partitions=2)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE handled (instance TEXT)"))
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        statements.append(" ".join(statement.split()[:3]).upper())

    def note(conn: Any, got: list[Any]) -> list[Any]:
        conn.execute(sa.text("INSERT INTO handled VALUES (:i)"), [{"i": d.event.partitionkey} for d in got])
        return list(got)

    def note_then_fail(conn: Any, got: list[Any]) -> list[Any]:
        note(conn, got)
        raise RuntimeError("the evaluation failed")

    try:
        assert bus.handles_in_take(engine)
        bus.ensure_group("g")
        bus.read("g", "c", [0, 1], 10, 0.0)  # the group's rows known
        bus.publish([_event("i-1"), _event("i-2")])
        sa.event.listen(engine, "before_cursor_execute", seen)
        got, inside = bus.read_handled("g", "c", [0, 1], 10, 1.0, note)
        sa.event.remove(engine, "before_cursor_execute", seen)
        assert inside and len(got) == 2
        assert [s for s in statements if s.startswith("BEGIN")] == ["BEGIN IMMEDIATE"], statements
        assert not [s for s in statements if "PENDING" in s], statements  # no pending row written or deleted
        assert bus.pending_count("g") == 0
        with engine.connect() as conn:
            assert sorted(conn.execute(sa.text("SELECT instance FROM handled")).scalars()) == ["i-1", "i-2"]

        bus.publish([_event("i-3")])
        got, inside = bus.read_handled("g", "c", [0, 1], 10, 1.0, note_then_fail)
        assert not inside and [d.event.partitionkey for d in got] == ["i-3"]
        assert bus.pending_count("g") == 1  # for the caller to handle and acknowledge
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM handled WHERE instance = 'i-3'")).scalar() == 0
        assert bus.read("g", "c", [0, 1], 10, 0.0) == []  # taken once
    finally:
        bus.close()
        engine.dispose()


def test_read_handled_makes_its_acknowledgements_when_its_take_fails(sqlite_url: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A take made at once (the last one was full) that fails for a reason not the handler's (the write lock
    not had, a broken database) raises with the acknowledgements made on their own, as ``ack_and_read``'s are."""
    engine = create_engine(sqlite_url)
    bus = EmbeddedBus(engine, partitions=2)
    try:
        bus.ensure_group("g")
        bus.publish([_event("i-1"), _event("i-2")])
        first = bus.read("g", "c", [0, 1], 1, 0.0)  # a full take: the next one is made at once
        assert len(first) == 1 and bus.pending_count("g") == 1
        handled: list[Any] = []

        def broken(*_args: Any, **_kwargs: Any) -> Any:
            raise sa.exc.OperationalError("BEGIN IMMEDIATE", {}, Exception("database is locked"))

        monkeypatch.setattr(bus, "_take_rows", broken)
        with pytest.raises(sa.exc.OperationalError):
            bus.read_handled("g", "c", [0, 1], 1, 1.0, lambda _conn, got: handled.extend(got) or list(got),
                             acks=first)
        assert handled == []
        assert bus.pending_count("g") == 0  # the acknowledgement made on its own
        monkeypatch.undo()
        got, inside = bus.read_handled("g", "c", [0, 1], 10, 1.0, lambda _conn, got: list(got))
        assert inside and [d.event.partitionkey for d in got if d.event is not None] == ["i-2"]
    finally:
        bus.close()
        engine.dispose()


def test_a_transaction_that_fails_after_the_handler_ran_is_taken_again_for_the_caller(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure once the handler ran (its pending rows, the commit: a deferred constraint its writes broke) is
    the batch's, not an outage's: rolled back and taken again as a read takes it, so a batch that always fails
    reaches the caller's own handling (and its dead letters) instead of failing every take."""
    engine = create_engine(sqlite_url)
    bus = EmbeddedBus(engine, partitions=2)
    try:
        bus.ensure_group("g")
        bus.publish([_event("i-1")])
        real = EmbeddedBus._record_taken
        calls: list[int] = []

        def fails_once(*args: Any) -> None:
            calls.append(1)
            if len(calls) == 1:
                raise sa.exc.IntegrityError("COMMIT", {}, Exception("FOREIGN KEY constraint failed"))
            real(*args)

        monkeypatch.setattr(EmbeddedBus, "_record_taken", staticmethod(fails_once))
        got, inside = bus.read_handled("g", "c", [0, 1], 10, 1.0, lambda _conn, got: list(got))
        assert not inside and [d.event.partitionkey for d in got if d.event is not None] == ["i-1"]
        assert bus.pending_count("g") == 1
    finally:
        bus.close()
        engine.dispose()
