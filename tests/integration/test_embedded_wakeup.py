"""The embedded bus on PostgreSQL wakes an idle reader of another process by NOTIFY, not by its next poll.

Two engines on one database with different URLs have different process-wide wake-ups, as two processes
do: a publish through one cannot wake the other's reader in memory, only through PostgreSQL. The idle polls
are made longer than the read's block, so an entry read before the block ends was announced by the
notification. Then: with no reader waiting, the listener closes its connection.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Engine

from bridge.bus import embedded
from bridge.bus.base import Delivery
from bridge.bus.embedded import EmbeddedBus
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent, new_event_id, new_trace_id
from bridge.db.engine import create_engine
from tests.support import wait_for, when_waiting

pytestmark = pytest.mark.postgres


@pytest.fixture
def engines(pg_url: str) -> Iterator[tuple[Engine, Engine]]:
    reader = create_engine(f"{pg_url}?application_name=pb_reader")
    writer = create_engine(f"{pg_url}?application_name=pb_writer")
    yield reader, writer
    reader.dispose()
    writer.dispose()


def _event() -> CloudEvent:
    return CloudEvent(id=new_event_id(), type=TASK_STATUS_CHANGED, subject="i-1", partitionkey="i-1",
                      time=datetime.now(UTC), traceid=new_trace_id(), data={"instance_id": "i-1"})


def test_a_publish_wakes_an_idle_reader_of_another_process(engines: tuple[Engine, Engine],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    reader_engine, writer_engine = engines
    monkeypatch.setattr(embedded, "MAX_IDLE_POLL", 120.0)
    monkeypatch.setattr(embedded, "LISTENING_IDLE_POLL", 120.0)
    monkeypatch.setattr(embedded, "LISTENER_IDLE_CLOSE", 0.5)
    reader = EmbeddedBus(reader_engine, partitions=2)
    writer = EmbeddedBus(writer_engine, partitions=2)
    assert reader._wakeup is not writer._wakeup  # as in two processes
    reader.ensure_group("g")
    # The process listens (a waiting reader starts it; here first, so the listener's own start-up wake-up comes
    # before the read) and its bus has been idle long: no poll within the block.
    reader._wakeup._listen()
    wait_for(lambda: reader._wakeup.listening, 10.0, what="the reader's process to LISTEN")
    reader._last_delivery -= 10_000
    waiting = when_waiting(monkeypatch, reader._wakeup)
    got: list[Delivery] = []
    done = threading.Event()

    def read() -> None:
        got.extend(reader.read("g", "c1", [0, 1], 10, block=90.0))
        done.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert waiting.wait(10.0), "the reader did not wait"
    event = _event()
    writer.publish([event])
    # A deadline, not a timing: without the notification the reader looks again only when its 90 s block ends.
    assert done.wait(30.0), "the reader was not woken by the publish"
    assert [d.event.id for d in got if d.event is not None] == [event.id], "the reader ran out its block: not woken"
    thread.join(5)

    # No reader waits any more: the listener lets its connection go.
    wait_for(lambda: not reader._wakeup.listening, 10.0, what="the idle listener to close")


def test_a_take_is_one_statement_on_a_kept_connection_let_go_with_its_thread(
        engines: tuple[Engine, Engine]) -> None:
    """On PostgreSQL a reading thread keeps one connection for its takes (no pool checkout, ping and
    transaction per take) and a take, once the group is known, is one statement that also carries the previous
    batch's acknowledgements; the connection goes back when the thread ends, and with the bus."""
    engine, _ = engines
    bus = EmbeddedBus(engine, partitions=2)
    bus.ensure_group("g")
    bus.publish([_event(), _event()])
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    got: list[list[Delivery]] = []

    def reader() -> None:
        got.append(bus.read("g", "c", [0, 1], 1, 0.0))  # the first take registers the group's rows
        sa_event.listen(engine, "before_cursor_execute", count)
        try:
            got.append(bus.ack_and_read("g", got[0], "c", [0, 1], 1, 0.0))
        finally:
            sa_event.remove(engine, "before_cursor_execute", count)
        checked_out.append(engine.pool.checkedout())

    checked_out: list[int] = []
    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(30)
    assert [len(g) for g in got] == [1, 1]
    assert len(statements) == 1, statements  # no ping, no BEGIN: the take with the acknowledgement
    assert bus.pending_count("g") == 1  # the first entry acknowledged by that statement, the second pending
    assert checked_out == [1]  # the thread's kept connection, while it ran
    gc.collect()
    assert engine.pool.checkedout() == 0  # let go with its thread
    bus.read("g", "c", [0, 1], 1, 0.0)
    assert engine.pool.checkedout() == 1
    bus.close()
    assert engine.pool.checkedout() == 0


def test_a_kept_connection_the_server_dropped_is_replaced_without_an_error(engines: tuple[Engine, Engine]) -> None:
    """The kept connection skips the pool's ping: when the server drops it while idle (a restart, a failover, an
    idle timeout), the next take fails on it once and is made again on a fresh one, delivering what is there."""
    engine, writer_engine = engines
    bus = EmbeddedBus(engine, partitions=2)
    bus.ensure_group("g")
    bus.publish([_event()])
    assert len(bus.read("g", "c", [0, 1], 10, 0.0)) == 1  # registers the group's rows
    bus.publish([_event()])
    assert len(bus.read("g", "c", [0, 1], 10, 0.0)) == 1  # a one-statement take on the kept connection
    kept = bus._kept.holder.conn
    pid = kept.connection.dbapi_connection.info.backend_pid
    with writer_engine.connect() as admin:
        assert admin.exec_driver_sql(f"SELECT pg_terminate_backend({pid})").scalar() is True
    bus.publish([_event()])
    got = bus.read("g", "c", [0, 1], 10, 0.0)
    assert len(got) == 1
    assert bus._kept.holder.conn is not kept  # replaced
    bus.close()
