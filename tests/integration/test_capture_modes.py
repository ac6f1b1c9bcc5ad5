"""One capture contract, two modes (issue 19): row triggers (SQLite, PostgreSQL) and the write-ahead log
(PostgreSQL, ``[capture] mode = "wal"``, wal_level = logical).

Each case writes to the reference task table as a scheduler would and reads what was captured: the trigger
writes the outbox in the writer's transaction; the WAL capture streams the slot (``WalCapture.catch_up``: up
to everything committed so far) and writes the same rows, already published. Then what only the log does:
changes arrive in commit order, a change streamed again after a crash before the confirmation is a
duplicate with the same event id, and the slot and publication are pollbridge's only objects (nothing in the
scheduler's schema), removed by ``uninstall``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.app import install
from bridge.bus import open_bus
from bridge.bus.base import EventBus
from bridge.capture import wal
from bridge.capture.gaps import WAL_SLOT, gaps_after
from bridge.capture.queries import widened_xid_sql
from bridge.capture.triggers import installed_triggers
from bridge.capture.wal import WalCapture, capture_state, slot_state
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import CaptureSettings, RelaySettings, Settings
from bridge.db.engine import create_engine
from bridge.db.schema import outbox
from bridge.reconcile.status import gather_status
from bridge.reference.schema import create_demo_schema
from bridge.tasktable.tables import reflect_tables
from tests.support import Audit, wait_for
from tests.support.buses import Recording, UnderMemoryPressure
from tests.support.wal import wal_available

#: ``wal-redis``: the log streamed to a bus outside the database (published before the batch's commit; on the
#: embedded bus the events are written in it).
MODES = ["trigger-sqlite", pytest.param("trigger-postgresql", marks=pytest.mark.postgres),
         pytest.param("wal-postgresql", marks=pytest.mark.postgres),
         pytest.param("wal-redis", marks=[pytest.mark.postgres, pytest.mark.redis])]


class Capture:
    """The reference tables with capture installed in one mode; :meth:`rows` reads what was captured."""

    def __init__(self, url: str, mode: str, mapping: TaskTableMapping | None = None, *,
                 bus_url: str = "embedded", namespace: str | None = None) -> None:
        self.mode = mode
        self.engine = create_engine(url)
        self.mapping = mapping or TaskTableMapping()
        install.init(self.engine, demo_schema=True, mapping=self.mapping, capture=CaptureSettings(mode=mode))
        self.tables = reflect_tables(self.engine, self.mapping)
        named = {"namespace": namespace} if namespace else {}
        self.bus = open_bus(bus_url, engine=self.engine, partitions=2, **named)
        self.streamer = WalCapture(self.engine, self.tables, self.bus) if mode == "wal" else None

    def rows(self, instance_id: str | None = None) -> list[Any]:
        if self.streamer is not None:
            self.streamer.catch_up()
        q = sa.select(outbox).order_by(outbox.c.id)
        if instance_id is not None:
            q = q.where(outbox.c.instance_id == instance_id)
        with self.engine.connect() as conn:
            return list(conn.execute(q).all())

    def close(self) -> None:
        install.uninstall(self.engine, self.mapping)  # the slot first: a database with one cannot be dropped
        self.bus.close()
        self.engine.dispose()


def _database(request: pytest.FixtureRequest, tmp_path: Path, mode: str) -> tuple[str, str, dict[str, Any]]:
    """The mode's capture kind, its database's URL and the :class:`Capture` keywords that name its bus."""
    kind, _, where = mode.partition("-")
    url = f"sqlite:///{tmp_path / 'capture.db'}" if where == "sqlite" else str(request.getfixturevalue("pg_empty_url"))
    if kind == "wal":
        wal_available(url)
    bus: dict[str, Any] = {}
    if where == "redis":
        bus = {"bus_url": request.getfixturevalue("redis_server"),
               "namespace": request.getfixturevalue("redis_namespace")}
    return kind, url, bus


def _open(request: pytest.FixtureRequest, tmp_path: Path, mode: str,
          mapping: TaskTableMapping | None = None) -> Capture:
    kind, url, bus = _database(request, tmp_path, mode)
    return Capture(url, kind, mapping, **bus)


@pytest.fixture(params=MODES)
def cap(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Capture]:
    c = _open(request, tmp_path, request.param)
    yield c
    c.close()


def _new_instance(c: Capture, instance_id: str, keys: list[str]) -> dict[str, int]:
    t = c.tables.tasks
    with c.engine.begin() as conn:
        conn.execute(c.tables.instances.insert().values(id=instance_id, workflow_type="orders"))  # type: ignore[union-attr]
        conn.execute(t.insert(), [{"instance_id": instance_id, "task_key": k, "depends_on": []} for k in keys])
        rows = conn.execute(sa.select(t.c.task_key, t.c.id).where(t.c.instance_id == instance_id)).all()
    return {k: i for k, i in rows}


# --- the contract, both modes ----------------------------------------------------------------------------

def test_insert_and_status_change_are_captured_with_their_facts(cap: Capture) -> None:
    ids = _new_instance(cap, "m1", ["a"])
    t = cap.tables.tasks
    with cap.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(status="queued", attempts=1))
    rows = cap.rows("m1")
    assert [(r.change, r.old_status, r.new_status, r.attempt) for r in rows] == [
        ("insert", None, "pending", 0), ("status", "pending", "queued", 1)]
    for r in rows:
        assert (r.task_id, r.task_key, r.workflow_type) == (str(ids["a"]), "a", "orders")
        assert uuid.UUID(r.event_id) and len(r.trace_id) == 32 and r.created_at is not None
        # The trigger leaves publishing to the relay; the WAL capture publishes in its own transaction.
        assert (r.published_at is None) == (cap.mode == "trigger")
    assert rows[0].event_id != rows[1].event_id
    assert rows[0].id < rows[1].id


def test_status_says_which_capture(cap: Capture) -> None:
    assert gather_status(cap.engine).to_json()["capture"]["mode"] == cap.mode


def test_no_op_and_unwatched_updates_capture_nothing(cap: Capture) -> None:
    ids = _new_instance(cap, "m2", ["a"])
    t = cap.tables.tasks
    with cap.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(status="pending"))  # the same value
        conn.execute(t.update().where(t.c.id == ids["a"]).values(attempts=2, max_attempts=5))  # not watched
    assert [r.change for r in cap.rows("m2")] == ["insert"]


def test_due_and_signal_changes_are_captured_in_order(cap: Capture) -> None:
    ids = _new_instance(cap, "m3", ["a"])
    t = cap.tables.tasks
    now = sa.func.clock_timestamp() if cap.engine.dialect.name == "postgresql" else sa.func.datetime("now")
    with cap.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(due_at=now))
        conn.execute(t.update().where(t.c.id == ids["a"]).values(awaits_signal="approval"))
        conn.execute(t.update().where(t.c.id == ids["a"]).values(signal_received_at=now))
    assert [r.change for r in cap.rows("m3")] == ["insert", "due", "signal", "signal"]


def test_a_rolled_back_change_is_not_captured(cap: Capture) -> None:
    ids = _new_instance(cap, "m4", ["a"])
    t = cap.tables.tasks

    class Abort(Exception):
        pass

    with pytest.raises(Abort), cap.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(status="queued"))
        raise Abort
    assert [r.change for r in cap.rows("m4")] == ["insert"]


def test_a_new_row_id_is_an_identity_change(cap: Capture) -> None:
    ids = _new_instance(cap, "m5", ["a", "b"])
    t = cap.tables.tasks
    with cap.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(id=ids["a"] + 1000))
        conn.execute(t.update().where(t.c.id == ids["b"]).values(id=ids["b"] + 1000, status="queued"))
    rows = cap.rows("m5")
    assert sorted((r.task_key, r.change, r.task_id) for r in rows if r.change != "insert") == [
        ("a", "identity", str(ids["a"] + 1000)), ("b", "status", str(ids["b"] + 1000))]


@pytest.mark.parametrize("mode", MODES)
def test_composite_keys_a_null_status_and_the_attempt(request: pytest.FixtureRequest, tmp_path: Path,
                                                      mode: str) -> None:
    mapping = TaskTableMapping.from_dict({
        "columns": {"instance_id": ["instance_id", "task_key"], "task_key": ["task_key", "id"]},
        "statuses": {"null": "pending"}})
    c = _open(request, tmp_path, mode, mapping)
    try:
        t = c.tables.tasks
        with c.engine.begin() as conn:
            conn.execute(c.tables.instances.insert().values(id="k/a", workflow_type="orders"))  # type: ignore[union-attr]
            task_id = conn.execute(t.insert().values(instance_id="k", task_key="a", depends_on=[], attempts=3)
                                   .returning(t.c.id)).scalar_one()
        with c.engine.begin() as conn:
            conn.execute(t.update().where(t.c.id == task_id).values(status="queued"))
        rows = c.rows()
        assert [(r.instance_id, r.task_key, r.workflow_type, r.change, r.attempt) for r in rows] == [
            ("k/a", f"a/{task_id}", "orders", "insert", 3), ("k/a", f"a/{task_id}", "orders", "status", 3)]
    finally:
        c.close()


@pytest.mark.parametrize("source", ["depth", "spawned_by"])
@pytest.mark.parametrize("mode", MODES)
def test_the_causation_depth_travels_on_the_event(request: pytest.FixtureRequest, tmp_path: Path, mode: str,
                                                  source: str) -> None:
    """With ``mapping.columns.depth`` the captured row's depth, with ``spawned_by`` the length of its spawning
    chain, is the CloudEvent's ``depth`` (it was 0 on every event before), in both capture modes."""
    kind, url, bus = _database(request, tmp_path, mode)
    setup = create_engine(url)
    with setup.begin() as conn:
        create_demo_schema(conn)
        conn.execute(sa.text(f"ALTER TABLE tasks ADD COLUMN {source} INTEGER"))
    setup.dispose()
    c = Capture(url, kind, TaskTableMapping.from_dict({"columns": {source: source}}), **bus)
    try:
        t = c.tables.tasks
        with c.engine.begin() as conn:
            conn.execute(c.tables.instances.insert().values(id="d1", workflow_type="agents"))  # type: ignore[union-attr]
            root = conn.execute(t.insert().values(instance_id="d1", task_key="root", depends_on=[])
                                .returning(t.c.id)).scalar_one()
            child = conn.execute(t.insert().values(instance_id="d1", task_key="child", depends_on=[],
                                                   **{source: 1 if source == "depth" else root})
                                 .returning(t.c.id)).scalar_one()
            conn.execute(t.insert().values(instance_id="d1", task_key="grandchild", depends_on=[],
                                           **{source: 2 if source == "depth" else child}))
        rows = c.rows("d1")
        assert len(rows) == 3
        group = "depth-test"
        c.bus.ensure_group(group)
        if c.streamer is None:  # trigger mode: the relay publishes the outbox rows
            from bridge.capture.relay import Relay
            from bridge.core.settings import RelaySettings
            from bridge.tasktable.queries import spawn_depths

            tables = c.tables
            Relay(c.engine, c.bus, RelaySettings(), statuses=tables.mapping.statuses,
                  depth_of=(lambda conn, ids: spawn_depths(conn, tables, ids)) if source == "spawned_by" else None
                  ).publish_batch()
        events = [d.event for d in c.bus.read(group, "t", {0, 1}, 10, 0.5)]
        assert sorted((e.data["task_key"], e.depth) for e in events) == [("child", 1), ("grandchild", 2), ("root", 0)]
    finally:
        c.close()


# --- what only the write-ahead log does ---------------------------------------------------------------------
@contextlib.contextmanager
def streaming(c: Capture, *, wait_active: bool = True, kind: type[WalCapture] = WalCapture) -> Iterator[WalCapture]:
    """A WAL capture (of ``kind``) streaming in a thread (as the relay runs it), stopped on the way out; entered
    once the slot is streamed (``wait_active``)."""
    stop = threading.Event()
    capture = kind(c.engine, c.tables, c.bus)
    thread = threading.Thread(target=capture.run, args=(stop,), daemon=True)
    thread.start()
    try:
        if wait_active:
            wait_for(lambda: slot_active(c), 20.0, what="the slot to be streamed")
        yield capture
    finally:
        stop.set()
        thread.join(10)


def slot_active(c: Capture) -> bool:
    with c.engine.connect() as conn:
        return slot_state(conn).active


@pytest.fixture
def walcap(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Capture]:
    c = _open(request, tmp_path, "wal-postgresql")
    yield c
    c.close()


@pytest.fixture(params=["wal-postgresql", pytest.param("wal-redis", marks=pytest.mark.redis)])
def walcap_each(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Capture]:
    """:func:`walcap`, and the same streaming to Redis (published before the batch's commit, where the embedded
    bus writes in it): the cases where that order matters."""
    c = _open(request, tmp_path, request.param)
    yield c
    c.close()


@pytest.mark.postgres
def test_quiet_changes_wait_for_the_next_change_that_can_make_a_task_ready(walcap: Capture) -> None:
    """A dispatch cannot make a task ready: streamed alone, dispatches are held (unconfirmed) and written with the
    next change that can, in one transaction of pollbridge's (at a trickle each was a transaction of its own, and
    one more the walsender decoded); held alone, they go out at the hold's end."""
    capture = WalCapture(walcap.engine, walcap.tables, walcap.bus, hold_quiet=60.0)
    stop = threading.Event()
    streamer = threading.Thread(target=capture.run, args=(stop,), daemon=True)
    streamer.start()
    t = walcap.tables.tasks

    def written() -> list[Any]:
        with walcap.engine.connect() as conn:
            return list(conn.execute(sa.select(outbox.c.new_status, sa.literal_column("xmin::text").label("xid"))
                                     .where(outbox.c.instance_id == "hold").order_by(outbox.c.id)).all())

    def move(key: str, status: str) -> None:
        with walcap.engine.begin() as conn:
            conn.execute(t.update().where(t.c.id == ids[key]).values(status=status))

    try:
        ids = _new_instance(walcap, "hold", ["a", "b", "c", "d"])
        wait_for(lambda: len(written()) == 4, 30.0, what="the inserts captured")
        move("a", "queued")
        move("b", "queued")
        wait_for(lambda: len(capture.pending.rows) == 2, 10.0, what="the two dispatches held")
        assert len(written()) == 4 and capture.confirmed_lsn < capture.pending.end_lsn
        move("a", "running")
        wait_for(lambda: len(written()) == 7, 10.0, what="the start written with the held dispatches")
        rows = written()[4:]
        assert [r.new_status for r in rows] == ["queued", "queued", "running"]
        assert len({r.xid for r in rows}) == 1, rows
        capture.hold_quiet = 0.5
        move("c", "queued")
        wait_for(lambda: len(written()) == 8, 10.0, what="a quiet change alone written at its hold's end")
        capture.hold_quiet = 60.0
        move("d", "queued")
        wait_for(lambda: len(capture.pending.rows) == 1, 10.0, what="a dispatch held")
        stop.set()
        streamer.join(15)
        assert len(written()) == 9, "a held dispatch is written when the capture stops"
    finally:
        stop.set()
        streamer.join(15)


@pytest.mark.postgres
def test_a_streamed_batch_publishes_the_changes_that_can_make_a_task_ready_first(walcap: Capture) -> None:
    """Held dispatches go out in the batch of the next change that can make a task ready, after it (the scheduler,
    woken by the first write, read a dispatch alone and went back to the bus for the change that mattered); one
    instance's events keep their order."""
    recording = Recording(walcap.bus)
    capture = WalCapture(walcap.engine, walcap.tables, recording, hold_quiet=60.0)  # type: ignore[arg-type]
    stop = threading.Event()
    streamer = threading.Thread(target=capture.run, args=(stop,), daemon=True)
    streamer.start()
    t = walcap.tables.tasks

    def move(*changes: tuple[str, str, str]) -> None:
        with walcap.engine.begin() as conn:
            for instance, key, status in changes:
                conn.execute(t.update().where(t.c.instance_id == instance, t.c.task_key == key).values(status=status))

    try:
        for instance in ("quiet", "loud", "both"):
            _new_instance(walcap, instance, ["a", "b"])
        wait_for(lambda: sum(map(len, recording.published)) == 6, 30.0, what="the inserts published")
        recording.published.clear()
        move(("quiet", "a", "queued"))
        move(("both", "a", "queued"))
        wait_for(lambda: len(capture.pending.rows) == 2, 10.0, what="the two dispatches held")
        move(("loud", "a", "completed"), ("both", "b", "completed"))
        wait_for(lambda: sum(map(len, recording.published)) == 4, 10.0, what="the batch published")
        published = [(e.partitionkey, json.loads(e.to_json())["data"]["new_status"])
                     for batch in recording.published for e in batch]
        assert published == [("both", "queued"), ("loud", "completed"), ("both", "completed"), ("quiet", "queued")]
    finally:
        stop.set()
        streamer.join(15)


@pytest.mark.postgres
def test_changes_are_captured_in_commit_order(walcap_each: Capture) -> None:
    """A transaction that wrote first but commits last (the case the trigger's outbox ids get wrong) comes
    last: the log is in commit order, and so are the outbox ids."""
    ids = _new_instance(walcap_each, "m6", ["early", "late"])
    t = walcap_each.tables.tasks
    first_wrote = walcap_each.engine.connect()
    try:
        txn = first_wrote.begin()
        first_wrote.execute(t.update().where(t.c.id == ids["early"]).values(status="queued"))
        with walcap_each.engine.begin() as conn:
            conn.execute(t.update().where(t.c.id == ids["late"]).values(status="queued"))
        txn.commit()
    finally:
        first_wrote.close()
    rows = [r for r in walcap_each.rows("m6") if r.change == "status"]
    assert [r.task_key for r in rows] == ["late", "early"]
    assert rows[0].created_at <= rows[1].created_at  # the commit times


@pytest.mark.postgres
def test_the_owner_setting_replica_identity_full_never_fails_the_schedulers_writes(walcap: Capture) -> None:
    """With a column-list publication (before), PostgreSQL refused every UPDATE of the task table once its owner
    set REPLICA IDENTITY FULL ("Column list used by the publication does not cover the replica identity"). The
    publication carries every column now: the update succeeds, and the capture uses the whole old row."""
    ids = _new_instance(walcap, "ri", ["a"])
    t = walcap.tables.tasks
    with walcap.engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE tasks REPLICA IDENTITY FULL"))
    try:
        with walcap.engine.begin() as conn:
            assert conn.execute(t.update().where(t.c.id == ids["a"]).values(status="queued")).rowcount == 1
        rows = [r for r in walcap.rows("ri") if r.change == "status"]
        assert [(r.old_status, r.new_status) for r in rows] == [("pending", "queued")]
        with walcap.engine.connect() as conn:
            ok, detail = wal.wal_status(conn, walcap.tables)
        assert ok, detail
    finally:
        with walcap.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE tasks REPLICA IDENTITY DEFAULT"))


@pytest.mark.postgres
def test_a_column_list_publication_is_not_current_and_init_regenerates_it(walcap: Capture) -> None:
    """An installation from before carries a column list: doctor says so (the owner's REPLICA IDENTITY FULL would
    fail the scheduler's updates), and `init` replaces it with the whole table."""
    with walcap.engine.begin() as conn:
        conn.execute(sa.text(f"ALTER PUBLICATION {wal.PUBLICATION} SET TABLE tasks (id, instance_id, task_key, "
                             "status)"))
    with walcap.engine.connect() as conn:
        ok, detail = wal.wal_status(conn, walcap.tables)
    assert not ok and "has a column list" in detail and "pollbridge init" in detail
    install.init(walcap.engine, mapping=walcap.mapping, capture=CaptureSettings(mode="wal"))
    with walcap.engine.connect() as conn:
        ok, detail = wal.wal_status(conn, walcap.tables)
    assert ok, detail


@pytest.mark.postgres
def test_a_batch_streamed_again_after_a_crash_repeats_its_event_ids(walcap_each: Capture) -> None:
    """Written but not confirmed (the process died between its commit and telling the server): the slot sends
    the changes again; the outbox then holds each twice, with the same event id (consumers dedupe on it)."""
    ids = _new_instance(walcap_each, "m7", ["a"])
    t = walcap_each.tables.tasks
    with walcap_each.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(status="queued"))
    crashed = WalCapture(walcap_each.engine, walcap_each.tables, walcap_each.bus)
    crashed._flush_and_confirm = lambda cur: crashed.flush()  # type: ignore[method-assign]
    crashed._await_confirmation = lambda cur, deadline: None  # type: ignore[method-assign]
    crashed.catch_up()
    first = [(r.change, r.event_id) for r in walcap_each.rows("m7")]  # walcap_each's own streamer: streams them again
    assert len(first) == 4
    assert sorted(first[:2]) == sorted(first[2:])
    assert walcap_each.streamer is not None and walcap_each.streamer.catch_up() == 0  # confirmed now: nothing again


@pytest.mark.postgres
def test_nothing_in_the_schedulers_schema_and_uninstall_removes_slot_and_publication(walcap: Capture) -> None:
    with walcap.engine.connect() as conn:
        assert installed_triggers(conn) == []
        assert conn.exec_driver_sql(
            "SELECT count(*) FROM pg_proc WHERE proname LIKE 'pollbridge\\_capture%%'").scalar() == 0
        ok, line = capture_state(conn, walcap.tables)
        assert ok and "write-ahead-log capture of 'tasks'" in line
        assert slot_state(conn).exists
    status = gather_status(walcap.engine).to_json()["capture"]
    assert status["mode"] == "wal" and status["slot"]["exists"] and not status["slot"]["active"]
    assert status["slot"]["retained_bytes"] >= 0
    install.uninstall(walcap.engine, walcap.mapping)
    with walcap.engine.connect() as conn:
        assert not slot_state(conn).exists
        assert conn.exec_driver_sql("SELECT count(*) FROM pg_publication").scalar() == 0
    install.init(walcap.engine, mapping=walcap.mapping, capture=CaptureSettings(mode="wal"))  # for the teardown


@pytest.mark.postgres
def test_a_dropped_slot_is_reported_and_a_streaming_one_cannot_be_removed(walcap: Capture) -> None:
    with walcap.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        slot = wal.slot_name(conn)
        conn.exec_driver_sql(f"SELECT pg_drop_replication_slot('{slot}')")
        ok, line = capture_state(conn, walcap.tables)
    assert not ok and f"replication slot {slot} missing; run `pollbridge init`" in line
    install.init(walcap.engine, mapping=walcap.mapping, capture=CaptureSettings(mode="wal"))
    with streaming(walcap), pytest.raises(Exception, match="stop the relay first"):
        install.uninstall(walcap.engine, walcap.mapping)


def _terminate_and_drop(conn: sa.Connection, slot: str) -> bool:
    """End the walsender streaming ``slot`` and drop the slot; False while a walsender still holds it."""
    conn.exec_driver_sql("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                         f"WHERE slot_name = '{slot}' AND active_pid IS NOT NULL")
    try:
        conn.exec_driver_sql(f"SELECT pg_drop_replication_slot('{slot}')")
    except sa.exc.OperationalError as exc:
        if "is active" not in str(exc):
            raise
        return False
    return True


@pytest.mark.postgres
def test_a_lost_slot_is_recreated_and_the_unfinished_tasks_re_derived(walcap_each: Capture) -> None:
    """The slot dropped by hand while the capture streams (as an invalidated one would be lost): the change made
    while it was gone is in no log, so the capture recreates the slot and publishes the current state of every
    unfinished task; the finished one is left alone. The gap is counted."""
    ids = _new_instance(walcap_each, "m8", ["open", "done"])
    t = walcap_each.tables.tasks
    with walcap_each.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["done"]).values(status="completed"))
    walcap_each.rows()  # streamed and confirmed so far
    with streaming(walcap_each) as capture:
        with walcap_each.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            slot = wal.slot_name(conn)
            # The capture reconnects 0.5 s after its walsender is ended and takes the slot again, so a loaded
            # machine can miss the moment the slot is free: end the walsender and try the drop until it lands.
            wait_for(lambda: _terminate_and_drop(conn, slot), 20.0, what="the slot to be dropped")
            conn.execute(t.update().where(t.c.id == ids["open"]).values(status="queued"))  # in no log now
        wait_for(lambda: capture.gaps == 1, 30.0, what="the lost slot to be recreated")
    with walcap_each.engine.connect() as conn:
        assert slot_state(conn).exists
        rederived = conn.execute(sa.select(outbox.c.task_key, outbox.c.change, outbox.c.old_status,
                                           outbox.c.new_status, outbox.c.published_at.is_not(None))
                                 .where(outbox.c.instance_id == "m8", outbox.c.new_status == "queued")).all()
    assert [tuple(r) for r in rederived] == [("open", "status", None, "queued", True)]
    assert capture.rederived >= 1
    # Recorded for the reconciler, the gates and the guardian (bridge.capture.gaps).
    with walcap_each.engine.connect() as conn:
        (gap,) = gaps_after(conn, 0)
    assert gap.source == WAL_SLOT and gap.rederived == capture.rederived and slot in gap.detail


class _FailsTheFirstRederivation(WalCapture):
    """Its first write of a slot recovery's re-derivation fails, as a database or bus outage at that moment
    would."""

    failed = 0

    def flush(self, *, closing: sa.Update | None = None) -> int:
        # The re-derivation's flush, the one that closes its gap (`closing`); the code before never passed one, and
        # the test then fails on `failed`.
        if not self.failed and closing is not None:
            self.failed += 1
            raise sa.exc.OperationalError("INSERT", {}, Exception("the database went away"))
        return super().flush(closing=closing)


@pytest.mark.postgres
def test_a_slot_recovery_cut_short_by_a_failure_is_finished_before_streaming_on(walcap_each: Capture) -> None:
    """The re-derivation after a lost slot fails once (the slot made again already): the capture must not stream
    on from the new slot as if nothing were missing. The gap was recorded pending before the slot was made; the
    next round finishes the re-derivation and closes the gap with its count (before, the change made while the
    slot was gone was never published, and no gap was recorded)."""
    ids = _new_instance(walcap_each, "m9", ["open"])
    walcap_each.rows()  # streamed and confirmed so far
    t = walcap_each.tables.tasks
    with streaming(walcap_each, kind=_FailsTheFirstRederivation) as capture:
        with walcap_each.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            slot = wal.slot_name(conn)
            wait_for(lambda: _terminate_and_drop(conn, slot), 20.0, what="the slot to be dropped")
            conn.execute(t.update().where(t.c.id == ids["open"]).values(status="queued"))  # in no log now
        wait_for(lambda: capture.gaps == 1, 30.0, what="the recovery to be finished")
        assert isinstance(capture, _FailsTheFirstRederivation) and capture.failed == 1
    with walcap_each.engine.connect() as conn:
        rederived = conn.execute(sa.select(outbox.c.task_key).where(
            outbox.c.instance_id == "m9", outbox.c.new_status == "queued", outbox.c.published_at.is_not(None))).all()
        (gap,) = gaps_after(conn, 0)
    assert [r.task_key for r in rederived] == ["open"]
    assert gap.source == WAL_SLOT and not gap.pending and gap.rederived == 1 and "was re-derived" in gap.detail


@pytest.mark.postgres
def test_switching_capture_while_the_scheduler_writes_loses_and_doubles_nothing(
        request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Two writers flip task statuses without pause while capture goes trigger → wal → trigger: every committed
    change is captured exactly once, by whichever capture owned its commit (the switch's mark separates them)."""
    c = _open(request, tmp_path, "trigger-postgresql")
    wal_available(str(c.engine.url.render_as_string(hide_password=False)))
    try:
        ids = _new_instance(c, "m9", ["x", "y"])
        t = c.tables.tasks
        committed: list[tuple[str, str]] = []
        lock = threading.Lock()
        stop = threading.Event()

        def writer(task_id: int) -> None:
            status = "pending"
            while not stop.is_set():
                status = "queued" if status == "pending" else "pending"
                with c.engine.begin() as conn:
                    conn.execute(t.update().where(t.c.id == task_id).values(status=status))
                with lock:
                    committed.append((str(task_id), status))

        threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in ids.values()]
        for th in threads:
            th.start()

        def writes(n: int) -> None:
            target = len(committed) + n
            wait_for(lambda: len(committed) >= target, 30.0, what=f"{n} more writes")

        writes(50)
        install.switch_capture(c.engine, c.tables, CaptureSettings(mode="wal"))
        writes(50)
        install.switch_capture(c.engine, c.tables, CaptureSettings(mode="trigger"), bus=c.bus)
        writes(50)
        stop.set()
        for th in threads:
            th.join(10)
        with c.engine.connect() as conn:
            assert not slot_state(conn).exists  # the log's share was streamed to its end, then the slot dropped
            rows = conn.execute(sa.select(outbox.c.task_id, outbox.c.new_status, outbox.c.published_at)
                                .where(outbox.c.instance_id == "m9", outbox.c.change == "status")
                                .order_by(outbox.c.id)).all()
        by_wal = sum(1 for r in rows if r.published_at is not None)
        assert by_wal > 0 and len(rows) - by_wal > 0  # both captures had a share
        for task_id in (str(i) for i in ids.values()):
            mine = [status for tid, status in committed if tid == task_id]
            captured = [r.new_status for r in rows if r.task_id == task_id]
            assert len(captured) == len(mine), f"task {task_id}: {len(captured)} captured, {len(mine)} committed"
            assert sorted(captured) == sorted(mine)
    finally:
        c.close()


@pytest.mark.postgres
def test_an_idle_table_does_not_keep_the_rest_of_the_databases_wal(walcap: Capture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's table is quiet while other tables write megabytes of WAL: the server streams none of it,
    yet the slot's confirmed position moves past it (measured: PostgreSQL 15 with psycopg2's keepalive replies,
    even with the capture's own feedback held back), so the WAL it retains stays small. A regression guard:
    a slot that kept the database's WAL while its table idles would fill the disk."""
    monkeypatch.setattr(wal, "FEEDBACK_INTERVAL", 3600.0)
    with streaming(walcap, wait_active=False):
        with walcap.engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE other_work (id serial PRIMARY KEY, body text)")
            conn.exec_driver_sql("INSERT INTO other_work (body) SELECT repeat('x', 500) FROM generate_series(1, 20000)")

        def lag() -> int:
            with walcap.engine.connect() as c:
                return slot_state(c).lag_bytes or 0

        assert lag() > 5_000_000  # the other table's WAL, not yet confirmed
        # The confirmation rides on the keepalive replies: the walsender asks for one after decoding what it
        # skipped, and at the latest every wal_sender_timeout / 2 (30 s by default). Beside a CPU hog in CI the
        # decoding of the 10 MB took long enough that a 30 s deadline was missed once (2026-12-06).
        wait_for(lambda: lag() < 1_000_000, 120.0, what="the slot to confirm past the other table's WAL")


@pytest.mark.postgres
def test_the_guardian_demotes_when_nobody_streams_the_slot(walcap: Capture) -> None:
    """With capture from the log the outbox holds no backlog, so a dead relay would show in no outbox age: the
    guardian counts how long the slot has been without a reader instead, and demotes guarded types past
    max_outbox_age; a streamed slot counts nothing."""
    from bridge.core.settings import GuardianSettings
    from bridge.flags.store import FlagStore
    from bridge.rollout.guardian import Guardian

    store = FlagStore(walcap.engine)
    store.change("orders", "cutover", actor="test", reason="test", forced=True)
    guardian = Guardian(walcap.engine, GuardianSettings(max_outbox_age=30), store=store)
    assert guardian.check_once().demoted == []  # just seen without a reader: 0 s so far
    assert guardian._slot_down_since is not None
    guardian._slot_down_since -= 60  # as if its checks had seen no reader for a minute
    report = guardian.check_once()
    assert report.demoted == ["orders"]
    assert store.all()["orders"].phase == "polling"
    assert "slot has had no reader for" in report.verdicts[0].reason

    with streaming(walcap):
        store.change("orders", "cutover", actor="test", reason="again", forced=True)
        assert guardian.check_once().demoted == []
        assert guardian._slot_down_since is None


@pytest.mark.postgres
@pytest.mark.redis
def test_a_lost_bus_gets_the_logs_changes_again(walcap: Capture, redis_server: str, redis_namespace: str) -> None:
    """Redis flushed (restarted without persistence) while capture is from the log: the captured rows are in the
    outbox as with the trigger, so the relay's bus-loss replay republishes them; a consumer group made after the
    loss receives every change, old and new, once per event id."""
    import redis

    from bridge.capture.relay import Relay
    from bridge.core.settings import RelaySettings

    bus = open_bus(redis_server, partitions=4, namespace=redis_namespace)
    relay = Relay(walcap.engine, bus, RelaySettings(poll_interval=0.002, arm_after=0.05, fallback_interval=0.2,
                                                     epoch_check_interval=0.05, lease_timeout=1.0,
                                                     purge_interval=3600), statuses=walcap.mapping.statuses)
    stop = threading.Event()
    relay_thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    relay_thread.start()
    capture = WalCapture(walcap.engine, walcap.tables, bus)
    streamer = threading.Thread(target=capture.run, args=(stop,), daemon=True)
    streamer.start()

    def event_ids() -> set[str]:
        with walcap.engine.connect() as conn:
            return set(conn.execute(sa.select(outbox.c.event_id)).scalars())

    try:
        _new_instance(walcap, "before", [f"t{i}" for i in range(10)])
        wait_for(lambda: len(event_ids()) == 10, 30.0, what="the log's changes captured")
        before = event_ids()
        assert Audit(open_bus(redis_server, partitions=4, namespace=redis_namespace), "first").collect(before) == before
        # The loss is a change of the epochs the relay stored: it must have stored them first (a relay whose first
        # check comes after the loss has nothing to compare with; a CI run beside a hog deleted the keys first).
        wait_for(lambda: relay._epochs is not None and len(relay._epochs) == 4, 20.0,
                 what="the relay to store the bus's epochs")
        client = redis.Redis.from_url(redis_server)
        client.delete(*list(client.scan_iter(match=f"{redis_namespace}:*")))
        client.close()
        wait_for(lambda: relay.metrics.value("pollbridge_relay_bus_resets_total") >= 1, 20.0,
                 what="the bus loss detected")
        _new_instance(walcap, "after", [f"u{i}" for i in range(5)])
        wait_for(lambda: len(event_ids()) == 15, 30.0, what="the new changes captured")
        everything = event_ids()
        audit = Audit(open_bus(redis_server, partitions=4, namespace=redis_namespace), "after-loss")
        assert audit.collect(everything) == everything
        assert relay.metrics.value("pollbridge_relay_republished_total") >= 10
    finally:
        stop.set()
        relay_thread.join(15)
        streamer.join(15)
        bus.close()


@pytest.mark.postgres
def test_a_commit_decoded_before_it_is_visible_is_not_published_until_it_is(walcap_each: Capture) -> None:
    """PostgreSQL writes and flushes a commit record, and wakes the walsender, before the committing session
    leaves the process array: under CPU load the log can hand a commit to the relay while other sessions still
    see the transaction in progress. A scheduler woken by that event would read the task as it was before the
    change and acknowledge the event (measured: 4 of 399 completions never dispatched at 20/s with the machine
    busy). The capture publishes a batch only once each of its transactions is visible.

    The race is injected: the commit that is streamed carries the transaction id of one that is still open."""
    ids = _new_instance(walcap_each, "vis", ["a"])
    walcap_each.rows()  # the instance's inserts captured: only the change below is left
    t = walcap_each.tables.tasks
    with walcap_each.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(status="queued"))
    open_txn = walcap_each.engine.connect()
    txn = open_txn.begin()
    xid = int(open_txn.exec_driver_sql("SELECT pg_current_xact_id()::text").scalar_one()) & 0xFFFFFFFF
    streamer = walcap_each.streamer
    assert streamer is not None
    decoded = threading.Event()
    real_handle = streamer.handle

    def handle(payload: bytes) -> None:
        if payload[:1] == b"B":  # the commit's Begin: now with the open transaction's id
            payload = payload[:17] + xid.to_bytes(4, "big")
        real_handle(payload)
        if payload[:1] == b"C":
            decoded.set()

    streamer.handle = handle  # type: ignore[method-assign]
    done = threading.Event()
    caught: list[BaseException] = []

    def catch_up() -> None:
        try:
            streamer.catch_up(timeout=60)
        except BaseException as exc:  # reported by the test
            caught.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=catch_up, daemon=True)
    worker.start()
    try:
        assert decoded.wait(30), "the commit was not streamed"
        # Not published while the transaction is invisible (before the fix: written at once).
        assert not done.wait(1.0)
        with walcap_each.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(outbox)
                                .where(outbox.c.instance_id == "vis", outbox.c.change == "status")).scalar_one() == 0
    finally:
        txn.commit()
        open_txn.close()
    assert done.wait(30)
    assert not caught
    rows = [r for r in walcap_each.rows("vis") if r.change == "status"]
    assert [(r.task_key, r.new_status) for r in rows] == [("a", "queued")]
    assert streamer.invisible_waits >= 1


@pytest.mark.postgres
@pytest.mark.parametrize("database", ["pg_empty_url", "pg_sql_ascii_url"])
def test_text_beyond_ascii_and_a_transaction_larger_than_a_batch(request: pytest.FixtureRequest,
                                                                  database: str) -> None:
    """The relay writes a batch's rows as one JSON document: text beyond ASCII goes as it is (a ``SQL_ASCII``
    database refuses ``\\u`` escapes above U+007F in JSON, and the relay would retry the batch for ever), and a
    transaction of more rows than a batch holds is written in chunks, in commit order."""
    url = str(request.getfixturevalue(database))
    if database == "pg_sql_ascii_url":  # the drivers decode text as UTF-8, as such a database's clients write it
        url += "?client_encoding=utf8"
    wal_available(url)
    c = Capture(url, "wal")
    try:
        keys = [f"café-{i:02d}" for i in range(7)]
        ids = _new_instance(c, "ünïcode", keys)
        assert c.streamer is not None
        c.streamer.batch_rows = 3
        t = c.tables.tasks
        with c.engine.begin() as conn:
            for key in reversed(keys):
                conn.execute(t.update().where(t.c.id == ids[key]).values(status="queued"))
        rows = c.rows("ünïcode")
        assert [(r.change, r.task_key) for r in rows] == [("insert", k) for k in keys] + [
            ("status", k) for k in reversed(keys)]
        assert [r.id for r in rows] == sorted(r.id for r in rows)
    finally:
        c.close()


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[sa.Engine]:
    """One engine for every example of a property test (the fixture is made once per test function)."""
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.mark.postgres
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(xmax=st.integers(min_value=2**32, max_value=2**62),
       distance=st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_a_logged_transaction_id_widens_to_the_64_bit_id_it_came_from(pg_engine: sa.Engine, xmax: int,
                                                                        distance: int) -> None:
    """The log names a transaction by its low 32 bits; the visibility check widens it to the 64-bit id within
    2^31 of the snapshot's xmax, across an epoch boundary too (a 64-bit id cannot wrap)."""
    true_id = xmax + distance
    with pg_engine.connect() as conn:
        widened = conn.execute(sa.text(f"SELECT {widened_xid_sql('CAST(:xmax AS bigint)', 'CAST(:xid AS bigint)')}"),
                               {"xmax": xmax, "xid": true_id & 0xFFFFFFFF}).scalar_one()
    assert widened == true_id



@pytest.mark.postgres
def test_a_long_transaction_holds_back_nothing_but_its_own_changes(walcap: Capture) -> None:
    """A transaction left open for seconds (a migration, a batch job) while others commit: the log is decoded at
    each commit, so the others are published while it is still open, and its own change once it commits."""
    keys = [f"k{i}" for i in range(20)]
    ids = _new_instance(walcap, "m10", ["long", *keys])
    t = walcap.tables.tasks

    def published(key: str) -> bool:
        with walcap.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(outbox).where(
                outbox.c.instance_id == "m10", outbox.c.task_key == key, outbox.c.new_status == "queued",
                outbox.c.published_at.is_not(None))).scalar_one() > 0

    with streaming(walcap):
        long = walcap.engine.connect()
        try:
            txn = long.begin()
            long.execute(t.update().where(t.c.id == ids["long"]).values(status="queued"))
            for key in keys:
                with walcap.engine.begin() as conn:
                    conn.execute(t.update().where(t.c.id == ids[key]).values(status="queued"))
            wait_for(lambda: all(published(k) for k in keys), 20.0, what="the others' changes, published")
            assert not published("long")  # not in the log until it commits
            txn.commit()
        finally:
            long.close()
        wait_for(lambda: published("long"), 20.0, what="the long transaction's change, once committed")


@pytest.mark.postgres
def test_a_change_sent_again_after_a_failed_flush_is_captured(walcap_each: Capture) -> None:
    """A batch decoded and then lost (the database went away while it was written) is sent again by the slot
    when the capture reconnects; the watched values remembered while decoding it must not make the change look
    unchanged the second time (it was: a restart mid-run lost a write)."""
    ids = _new_instance(walcap_each, "m11", ["a"])
    walcap_each.rows()
    t = walcap_each.tables.tasks
    with streaming(walcap_each) as capture:
        real_flush = capture.flush
        failed: list[bool] = []

        def flush_failing_once() -> None:
            if not failed and any(r.get("instance_id") == "m11" for r in capture.pending.rows):
                failed.append(True)
                raise RuntimeError("the database went away while the batch was written")
            real_flush()

        capture.flush = flush_failing_once  # type: ignore[method-assign]
        with walcap_each.engine.begin() as conn:
            conn.execute(t.update().where(t.c.id == ids["a"]).values(status="queued"))

        def captured() -> bool:
            with walcap_each.engine.connect() as conn:
                return conn.execute(sa.select(sa.func.count()).select_from(outbox).where(
                    outbox.c.instance_id == "m11", outbox.c.new_status == "queued",
                    outbox.c.published_at.is_not(None))).scalar_one() > 0
        wait_for(lambda: bool(failed), 20.0, what="the failed flush")
        wait_for(captured, 20.0, what="the change, sent again by the slot, to be captured")


@pytest.mark.parametrize("mode", MODES)
def test_a_column_only_the_view_has_is_read_through_it_and_the_rest_is_the_changes_own(
        request: pytest.FixtureRequest, tmp_path: Path, mode: str) -> None:
    """The task key is computed by the user's read view ('k:' || task_key), the status is on the captured table: the
    key is read through the view, and each change keeps its own status even when the log is read after a later
    change (WAL: queued then running in two commits, streamed together, are captured as queued and running)."""
    sql_file = tmp_path / "view.sql"
    sql_file.write_text("-- name: install\nCREATE VIEW pollbridge_test_tasks_v AS SELECT t.*, 'k:' || t.task_key AS "
                        "vkey FROM tasks t;\n\n-- name: uninstall\nDROP VIEW IF EXISTS pollbridge_test_tasks_v;\n")
    mapping = TaskTableMapping.from_dict({"read_table": "pollbridge_test_tasks_v", "install_sql": str(sql_file),
                                          "columns": {"task_key": "vkey"}})
    c = _open(request, tmp_path, mode, mapping)
    try:
        base = sa.Table("tasks", sa.MetaData(), autoload_with=c.engine)
        with c.engine.begin() as conn:
            conn.execute(c.tables.instances.insert().values(id="m9v", workflow_type="orders"))  # type: ignore[union-attr]
            task_id = conn.execute(base.insert().values(instance_id="m9v", task_key="a", depends_on=[])
                                   .returning(base.c.id)).scalar_one()
        for status in ("queued", "running"):
            with c.engine.begin() as conn:
                conn.execute(base.update().where(base.c.id == task_id).values(status=status))
        rows = c.rows("m9v")
        assert [(r.change, r.new_status, r.task_key, r.workflow_type) for r in rows] == [
            ("insert", "pending", "k:a", "orders"), ("status", "queued", "k:a", "orders"),
            ("status", "running", "k:a", "orders")]
    finally:
        c.close()


@pytest.mark.postgres
def test_the_relays_per_batch_statements_run_straight_through_the_driver(walcap: Capture) -> None:
    """The batch's insert and its visibility and type look, once per batch: compiled once and run by psycopg
    (bridge.db.driver), not rendered per call (an expanding IN was: 4 % of the relay's CPU at 8 writers)."""
    capture = WalCapture(walcap.engine, walcap.tables, walcap.bus)
    assert capture._insert.direct
    assert capture._facts_run.direct


class _FeedbackLost(WalCapture):
    """A WAL capture whose confirmations never reach the server (as when the stream breaks between a batch's
    commit and the server taking its confirmation)."""

    def _flush_and_confirm(self, cur: Any) -> None:
        self._holding_since, self._switching = None, False
        self.flush()


@pytest.mark.postgres
def test_a_stream_restarted_in_the_relay_starts_after_what_it_captured(walcap: Capture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream breaks after a batch was written but before the server took its confirmation; the relay's
    next stream starts at what the process confirmed, so the batch is not captured a second time (before, it
    started at the slot's position and captured it again, with the same event ids)."""
    monkeypatch.setattr(wal, "FEEDBACK_INTERVAL", 3600.0)  # no idle feedback either, however slow the machine
    with streaming(walcap, kind=_FeedbackLost) as capture:
        ids = _new_instance(walcap, "restart", ["a"])
        wait_for(lambda: len(_outbox_rows(walcap)) == 1, 20.0, what="the insert captured")
        with walcap.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            pid = conn.exec_driver_sql("SELECT active_pid FROM pg_replication_slots "
                                       f"WHERE slot_name = '{capture.slot}'").scalar()
            assert pid is not None
            conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
        wait_for(lambda: _streamed_by_another(walcap, capture.slot, int(pid)), 20.0, what="a new stream")
        t = walcap.tables.tasks
        with walcap.engine.begin() as conn:
            conn.execute(t.update().where(t.c.id == ids["a"]).values(status="queued"))
        wait_for(lambda: len(_outbox_rows(walcap)) >= 2, 20.0, what="the status change captured")
    rows = _outbox_rows(walcap)
    assert [(r.change, r.new_status) for r in rows] == [("insert", "pending"), ("status", "queued")]


@pytest.mark.postgres
def test_a_stream_starts_at_the_processs_position_only_on_the_server_it_confirmed_on(walcap: Capture) -> None:
    """Another system or timeline (a failover, a restore), or a server whose log is not past the position: the
    slot's own position (0), since a start ahead of the server's history would skip its commits silently."""
    import psycopg2
    import psycopg2.extras

    capture = WalCapture(walcap.engine, walcap.tables, walcap.bus)
    dsn = walcap.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        cur = conn.cursor()
        assert capture._start_position(cur) == 0  # nothing confirmed yet
        server = capture._server
        assert server is not None
        with walcap.engine.connect() as sa_conn:
            now = int(sa_conn.exec_driver_sql(
                "SELECT pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), '0/0')").scalar_one())
        capture.confirmed_lsn = now - 1
        assert capture._start_position(cur) == now - 1  # the same server, its log past the position
        capture._server = (server[0], server[1] + 1)  # the timeline this process confirmed on is not this one
        assert capture._start_position(cur) == 0
        capture._server = ("another system", server[1])
        assert capture._start_position(cur) == 0
        capture.confirmed_lsn = now + 2**32  # ahead of the server's log (a restore)
        assert capture._start_position(cur) == 0
    finally:
        conn.close()


def _outbox_rows(c: Capture) -> list[Any]:
    with c.engine.connect() as conn:
        return list(conn.execute(sa.select(outbox).where(outbox.c.instance_id == "restart").order_by(outbox.c.id)))


def _streamed_by_another(c: Capture, slot: str, pid: int) -> bool:
    with c.engine.connect() as conn:
        now = conn.exec_driver_sql(f"SELECT active_pid FROM pg_replication_slots WHERE slot_name = '{slot}'").scalar()
    return now is not None and int(now) != pid


# --- the relay of partition 0 and its stream ----------------------------------------------------------------
#: Fast housekeeping: a purge looks every 50 ms, rows are kept 0.5 s, an idle probe (with triggers) every 0.3 s.
RELAY_BESIDE_LOG = RelaySettings(poll_interval=0.002, arm_after=0.05, fallback_interval=0.2, idle_probe_interval=0.3,
                                 epoch_check_interval=0.05, lease_timeout=1.0, purge_interval=0.05, retention=0.5)


@contextlib.contextmanager
def relay_beside_log(c: Capture, stop: threading.Event | None = None, *, wait_active: bool = True,
                     settings: RelaySettings = RELAY_BESIDE_LOG, relay_partitions: int = 1,
                     threads: list[threading.Thread] | None = None,
                     bus: EventBus | None = None) -> Iterator[tuple[Any, list[WalCapture]]]:
    """The relay of partition 0 and its write-ahead log's stream, as ``relay run`` wires them (the composition
    root), and the relays of the other partitions, each in its thread (collected in ``threads``); stopped
    (``stop``) on the way out."""
    from bridge.app.components import Components

    components = Components(Settings(database_url=c.engine.url.render_as_string(hide_password=False),
                                     capture=CaptureSettings(mode="wal", relay_partitions=relay_partitions),
                                     relay=settings))
    bus = bus or c.bus
    relay = components.relay(c.engine, bus)
    ran: list[WalCapture] = []
    stream = components.log_stream(c.engine, bus, relay, ran)
    assert stream is not None
    stop = stop or threading.Event()
    threads = threads if threads is not None else []
    threads += [threading.Thread(target=relay.run, args=(stop,), daemon=True),
                threading.Thread(target=stream, args=(stop,), daemon=True)]
    threads += [threading.Thread(target=components.relay(c.engine, c.bus, partition=p).run, args=(stop,), daemon=True)
                for p in range(1, relay_partitions)]
    for thread in threads:
        thread.start()
    try:
        if wait_active:
            wait_for(lambda: slot_active(c), 20.0, what="the slot to be streamed")
        yield relay, ran
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)


@pytest.mark.postgres
def test_the_log_stream_pauses_with_the_relay_while_the_bus_is_near_its_memory_limit(walcap: Capture) -> None:
    """The relay pauses publishing while the bus is near its memory limit (``relay.max_bus_memory``); the log's
    stream pauses with it (it went on publishing into a full bus), and the slot keeps the changes until it
    resumes."""

    full = UnderMemoryPressure(walcap.bus)
    with relay_beside_log(walcap, bus=full) as (relay, ran):  # type: ignore[arg-type]
        wait_for(lambda: not relay.publishing.is_set(), 10.0, what="the relay to pause")
        _new_instance(walcap, "mem", ["a", "b"])
        threading.Event().wait(0.5)  # paused: time the stream must not use
        assert sum(w.captured for w in ran) == 0
        assert _outbox_count(walcap) == 0
        full.pressure = 0.5
        wait_for(lambda: sum(w.captured for w in ran) == 2, 20.0, what="the stream to resume")
        assert relay.metrics.value("pollbridge_relay_paused") == 0


@pytest.mark.postgres
def test_the_stream_looks_at_its_lead_after_each_full_batch(walcap: Capture) -> None:
    """After a full batch the stream looks at its lead (and its stop and a pause) before it reads on: a relay that
    lost its partition stops streaming within one batch, not after up to DRAIN more messages (with a small
    ``batch_rows``, many more batches, each possibly waiting for a commit's visibility)."""
    for n in range(6):  # six transactions, one change each, all in the log before the stream starts
        _new_instance(walcap, f"lead{n}", ["a"])
    leading = threading.Event()
    leading.set()
    capture = WalCapture(walcap.engine, walcap.tables, walcap.bus, batch_rows=2, leading=leading,
                         on_flush=lambda rows: leading.clear())  # the partition lost at the first batch's commit
    stopped = threading.Event()
    thread = threading.Thread(target=capture.run, args=(stopped,), daemon=True)
    thread.start()
    thread.join(30)
    stopped.set()
    assert not thread.is_alive()
    # One batch, not the six changes: two rows, or one when the walsender had not sent the second change yet as the
    # stream found nothing waiting (what is pending then goes out: seen once in the full suite on two busy cores).
    assert capture.captured in (1, 2)


@pytest.mark.postgres
def test_a_paused_stream_keeps_its_walsender_past_the_servers_timeout(walcap: Capture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Paused, the stream reads nothing, so its status updates must go out by themselves (psycopg2 sends an unforced
    one only from inside read_message): with the server's wal_sender_timeout at 1 s and a pause of three of them,
    the walsender that streamed before the pause streams after it (it was ended for a replication timeout, and the
    stream restarted, forgetting what it had decoded and the values it had seen)."""
    monkeypatch.setenv("PGOPTIONS", "-c wal_sender_timeout=1s")
    monkeypatch.setattr(wal, "FEEDBACK_INTERVAL", 0.2)
    full = UnderMemoryPressure(walcap.bus, pressure=0.5)
    with relay_beside_log(walcap, bus=full) as (relay, ran):  # type: ignore[arg-type]
        before = _walsender(walcap)
        full.pressure = 0.97
        wait_for(lambda: not relay.publishing.is_set(), 10.0, what="the relay to pause")
        _new_instance(walcap, "slow", ["a"])
        threading.Event().wait(3.0)  # paused for three of the server's timeouts
        full.pressure = 0.5
        wait_for(lambda: sum(w.captured for w in ran) == 1, 20.0, what="the stream to resume")
        assert _walsender(walcap) == before


def _walsender(c: Capture) -> int | None:
    with c.engine.connect() as conn:
        pid = conn.exec_driver_sql("SELECT active_pid FROM pg_replication_slots "
                                   "WHERE database = current_database()").scalar()
    return None if pid is None else int(pid)


def _outbox_count(c: Capture) -> int:
    with c.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(outbox)).scalar_one())


@pytest.mark.postgres
def test_the_rows_the_log_wrote_are_purged_and_the_idle_relay_asks_the_database_nothing(walcap: Capture) -> None:
    """The relay purges the rows the log's capture wrote once they pass the retention window (it purged only
    rows it had published itself: with the log capturing, the outbox grew without end, and the bus with it),
    and then, idle, its loop sends the database no statement at all: no probe, since without capture triggers
    nothing reaches the outbox unpublished without a notification (issue 19: the stream pushes)."""
    with relay_beside_log(walcap) as (relay, ran):
        _new_instance(walcap, "p1", ["a", "b", "c"])
        wait_for(lambda: sum(w.captured for w in ran) == 3, 20.0, what="the log's three changes written")
        wait_for(lambda: relay.metrics.value("pollbridge_outbox_purged_total") == 3, 20.0,
                 what="the log's rows purged after the retention window")
        assert _outbox_count(walcap) == 0
        # Settled: past its arming horizon (a start-up cost), nothing left to purge.
        wait_for(lambda: relay._horizon is None and relay._purge_due is None and relay._triggers is False, 20.0,
                 what="the relay to settle")
        statements: list[str] = []

        def seen(conn: object, cursor: object, statement: str, *rest: object) -> None:
            statements.append(statement)

        sa.event.listen(walcap.engine, "before_cursor_execute", seen)
        try:
            # Five idle probe intervals, twenty bus epoch checks and lease checks: none is a statement.
            threading.Event().wait(1.5)
        finally:
            sa.event.remove(walcap.engine, "before_cursor_execute", seen)
        assert statements == []
        # Still listening: a review release's notification is claimed at once.
        with walcap.engine.begin() as conn:
            conn.execute(outbox.insert().values(
                event_id=str(uuid.uuid4()), task_id="1", instance_id="p1", workflow_type="orders", task_key="a",
                change="status", old_status="pending", new_status="pending", trace_id=uuid.uuid4().hex,
                relay_partition=0, created_at=sa.func.now(), attempt=0))
            conn.execute(sa.select(sa.func.pg_notify("pollbridge_outbox", "")))
        wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 1, 5.0,
                 what="the notified row published")


@pytest.mark.postgres
def test_after_a_switch_back_to_the_triggers_the_idle_relay_probes_again(walcap: Capture) -> None:
    """The switch's notification tells the relay that triggers are back: it probes when idle again (here a row
    whose trigger read the NOTIFY flag down, as after a relay lowered it on its way out, is published by the
    probe) and raises the flag again if it finds it down."""
    with relay_beside_log(walcap) as (relay, _ran):
        wait_for(lambda: relay._triggers is False, 20.0, what="the relay to see no triggers")
        install.switch_capture(walcap.engine, walcap.tables, CaptureSettings(mode="trigger"), bus=walcap.bus,
                               timeout=30)
        wait_for(lambda: relay._triggers is True, 10.0, what="the relay to hear of the triggers")
        with walcap.engine.begin() as conn:  # a departing relay lowered the flag: the next change notifies no one
            conn.execute(sa.text("UPDATE pollbridge_relay_state SET armed = false"))
        published = relay.metrics.value("pollbridge_relay_published_total")
        _new_instance(walcap, "s1", ["a"])
        wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == published + 1, 10.0,
                 what="the un-notified change published by the idle probe")


@pytest.mark.postgres
def test_run_all_streams_the_log_when_it_captures(walcap: Capture) -> None:
    """``run-all`` on PostgreSQL with ``[capture] mode = "wal"`` streams the log beside its relay (it ran the
    relay alone, and nothing was captured at all)."""
    from bridge.app.runall import Stack

    stack = Stack(Settings(database_url=walcap.engine.url.render_as_string(hide_password=False),
                           capture=CaptureSettings(mode="wal"), relay=RELAY_BESIDE_LOG)).start()
    try:
        wait_for(lambda: slot_active(walcap), 20.0, what="the slot to be streamed")
        _new_instance(walcap, "r1", ["a", "b"])
        wait_for(lambda: sum(w.captured for w in stack.log_captures) >= 2, 20.0, what="the changes captured")
    finally:
        stack.stop()


@pytest.mark.postgres
def test_only_the_process_whose_relay_leads_partition_0_streams_the_log(walcap: Capture) -> None:
    """Two relays of partition 0: the one that leads streams the log (and so purges and hears what it wrote),
    the standby's process does not even try the slot; when the leader stops, the new leader streams and
    captures what comes next."""
    first_stop = threading.Event()
    keep = replace(RELAY_BESIDE_LOG, retention=3600)  # the rows stay in the outbox to be looked at
    first_threads: list[threading.Thread] = []
    with relay_beside_log(walcap, first_stop, settings=keep, threads=first_threads) as (first, first_ran):
        wait_for(lambda: first.leading.is_set(), 10.0, what="the first relay to lead")
        with relay_beside_log(walcap, wait_active=False, settings=keep) as (second, second_ran):
            _new_instance(walcap, "l1", ["a"])
            wait_for(lambda: sum(w.captured for w in first_ran) == 1, 20.0, what="the leader to capture")
            assert not second.leading.is_set() and second_ran == []
            first_stop.set()  # the leader's process stops
            wait_for(lambda: not any(t.is_alive() for t in first_threads), 20.0, what="the leader to stop")
            wait_for(lambda: second.leading.is_set(), 20.0, what="the standby to take over")
            _new_instance(walcap, "l2", ["a"])
            # At least once: l1 again too if the first's last confirmation was lost with its connection.
            wait_for(lambda: "l2" in _outbox_instances(walcap), 30.0, what="the new leader to capture")
            assert sum(w.captured for w in second_ran) >= 1
    assert sum(w.captured for w in first_ran) == 1


def _outbox_instances(c: Capture) -> set[str]:
    with c.engine.connect() as conn:
        return set(conn.execute(sa.select(outbox.c.instance_id)).scalars())


@pytest.mark.postgres
def test_every_partitions_relay_purges_the_rows_the_log_wrote_for_it(walcap: Capture) -> None:
    """With ``capture.relay_partitions`` = 2 the stream beside partition 0's relay writes rows of both partitions;
    partition 1's relay hears nothing of them, and without capture triggers it looks one retention window after
    a purge that left nothing (it had stopped purging for good)."""
    with relay_beside_log(walcap, relay_partitions=2) as (_relay, ran):
        _new_instance(walcap, "pp", [f"t{i}" for i in range(4)])
        for n in range(12):
            _new_instance(walcap, f"pp-{n}", ["a"])
        wait_for(lambda: sum(w.captured for w in ran) == 16, 20.0, what="the log's changes written")
        with walcap.engine.connect() as conn:
            written = dict(conn.execute(sa.select(outbox.c.relay_partition, sa.func.count())
                                        .group_by(outbox.c.relay_partition)).all())
        assert set(written) == {0, 1} or _outbox_count(walcap) < 16  # both partitions (unless already purged)
        wait_for(lambda: _outbox_count(walcap) == 0, 20.0, what="every partition's rows purged")
