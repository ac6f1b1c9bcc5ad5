"""The embedded bus on SQLite: a publish of several events and a take of several entries each insert their
rows with one statement run once (a multi-row INSERT), not once per row; the rows are the same."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from bridge.bus.embedded import EmbeddedBus
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent, new_event_id
from bridge.db.engine import create_engine
from bridge.db.schema import bus_log, bus_pending


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
