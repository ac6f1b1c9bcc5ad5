"""The relay: every captured change reaches the bus at least once, under out-of-order commits, bus loss,
malformed rows and a standby takeover. Runs on SQLite + embedded bus, PostgreSQL + embedded bus and
PostgreSQL + Redis Streams (the tests after the ``env`` override also on a Redis Cluster and RabbitMQ)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import select
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from bridge.bus import open_bus
from bridge.capture import relay as relay_module
from bridge.capture.leadership import ADVISORY_NAMESPACE
from bridge.capture.relay import Relay
from bridge.core.settings import RelaySettings
from bridge.db.clock import as_utc
from bridge.db.listen import ListenWaiter
from bridge.db.schema import OUTBOX_CHANNEL, outbox, outbox_dead, relay_state
from tests.support import Audit, Env, wait_for, when_waiting
from tests.support.buses import Recording, UnderMemoryPressure, drops_single_entries, lose_bus_data
from tests.support.stacks import ENV_PARAMS_WITH_CLUSTER, make_env

FAST = RelaySettings(poll_interval=0.002, arm_after=0.05, fallback_interval=0.2, epoch_check_interval=0.05,
                     lease_timeout=1.0, purge_interval=3600)


def add_tasks(env: Env, instance: str, n: int) -> None:
    with env.engine.begin() as conn:
        conn.execute(env.tables.instances.insert().values(id=instance, workflow_type="orders"))  # type: ignore[union-attr]
        conn.execute(env.tables.tasks.insert(), [{"instance_id": instance, "task_key": f"k{i}", "depends_on": []}
                                                 for i in range(n)])


def outbox_event_ids(env: Env) -> set[str]:
    with env.engine.connect() as conn:
        return set(conn.execute(sa.select(outbox.c.event_id)).scalars())


@pytest.fixture
def running() -> Iterator[Callable[[Relay], threading.Event]]:
    started: list[tuple[threading.Thread, threading.Event]] = []

    def start(relay: Relay) -> threading.Event:
        stop = threading.Event()
        thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
        thread.start()
        started.append((thread, stop))
        return stop

    yield start
    for thread, stop in started:
        stop.set()
        thread.join(15)


def test_every_change_is_published_once_with_its_event(env: Env) -> None:
    add_tasks(env, "r1", 25)
    relay = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    while relay.publish_batch():
        pass
    expected = outbox_event_ids(env)
    assert len(expected) == 25
    audit = Audit(env.open_bus())
    assert audit.collect(expected) == expected
    assert len(audit.seen) == 25
    event = audit.seen[0].event
    assert event is not None
    assert event.type == "task.status_changed" and event.partitionkey == "r1"
    assert event.data["new_status"] == "pending" and event.data["change"] == "insert"
    assert event.traceid and len(event.traceid) == 32
    with env.engine.connect() as conn:
        unpublished = conn.execute(sa.select(sa.func.count()).where(outbox.c.published_at.is_(None))).scalar()
    assert unpublished == 0
    assert relay.metrics.value("pollbridge_relay_published_total") == 25


def test_a_row_committing_after_larger_ids_is_still_published(env: Env, running: Callable[[Relay], object]) -> None:
    if env.kind.startswith("sqlite"):
        pytest.skip("SQLite serialises writers: a transaction cannot stay open while others commit")
    relay = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    audit = Audit(env.open_bus())
    running(relay)
    with env.engine.begin() as conn:
        conn.execute(env.tables.instances.insert(), [{"id": "slow", "workflow_type": "w"},  # type: ignore[union-attr]
                                                     {"id": "fast", "workflow_type": "w"}])
    slow = env.engine.connect()
    slow_tx = slow.begin()
    slow.execute(env.tables.tasks.insert().values(instance_id="slow", task_key="a", depends_on=[]))
    slow_id = slow.execute(sa.select(sa.func.max(outbox.c.id))).scalar_one()  # this transaction's outbox row
    for i in range(5):  # later transactions take larger ids and commit first
        with env.engine.begin() as conn:
            conn.execute(env.tables.tasks.insert().values(instance_id="fast", task_key=f"k{i}", depends_on=[]))
    fast_ids = outbox_event_ids(env)
    assert audit.collect(fast_ids) == fast_ids
    with env.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.min(outbox.c.id))).scalar_one() > slow_id
    slow_tx.commit()
    slow.close()
    everything = outbox_event_ids(env)
    assert len(everything) == 6
    assert audit.collect(everything) == everything


def test_a_batch_publishes_the_changes_that_can_make_a_task_ready_first(env: Env) -> None:
    """A batch's events go out with the instances that have a change that can make a task ready first, then those
    whose changes are all quiet (dispatches), each instance's in its order. By id a quiet change came first: at a
    trickle it waits for the next loud one, and the scheduler, woken by the first write, read it alone and went
    back to the bus for the loud one."""
    for instance in ("quiet", "loud", "both"):
        add_tasks(env, instance, 2)
    recording = Recording(env.open_bus())
    relay = Relay(env.engine, recording, FAST, statuses=env.tables.mapping.statuses)  # type: ignore[arg-type]
    while relay.publish_batch():
        pass
    t = env.tables.tasks
    recording.published.clear()
    for instance, key, status in [("quiet", "k0", "queued"), ("both", "k0", "queued"), ("loud", "k0", "completed"),
                                  ("both", "k1", "completed"), ("quiet", "k1", "queued")]:
        with env.engine.begin() as conn:
            conn.execute(t.update().where(t.c.instance_id == instance, t.c.task_key == key).values(status=status))
    assert relay.publish_batch() == 5
    assert [[(e.partitionkey, json.loads(e.to_json())["data"]["new_status"]) for e in batch]
            for batch in recording.published] == [[
        ("both", "queued"), ("loud", "completed"), ("both", "completed"), ("quiet", "queued"), ("quiet", "queued")]]
    expected = outbox_event_ids(env)
    assert Audit(env.open_bus()).collect(expected) == expected


def test_malformed_row_is_dead_lettered_and_the_relay_carries_on(env: Env) -> None:
    add_tasks(env, "m1", 2)
    with env.engine.begin() as conn:
        conn.execute(outbox.insert().values(event_id="bad-1", task_id="999", instance_id="m1", task_key="x",
                                            change="status", old_status="pending", new_status="exploded",
                                            created_at=sa.func.current_timestamp()))
    add_tasks(env, "m2", 1)
    relay = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    while relay.publish_batch():
        pass
    with env.engine.connect() as conn:
        dead = conn.execute(sa.select(outbox_dead)).all()
        left = conn.execute(sa.select(sa.func.count()).where(outbox.c.published_at.is_(None))).scalar()
    assert len(dead) == 1 and "'exploded'" in dead[0].reason and "bad-1" in dead[0].payload
    assert left == 0
    expected = outbox_event_ids(env)
    assert len(expected) == 3 and "bad-1" not in expected
    assert Audit(env.open_bus()).collect(expected) == expected
    assert relay.metrics.value("pollbridge_outbox_dead_letters_total") == 1


@pytest.fixture(params=ENV_PARAMS_WITH_CLUSTER)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    """Every stack, and PostgreSQL + a Redis Cluster."""
    yield from make_env(request)


def test_bus_loss_is_detected_and_retained_rows_republished(env: Env, running: Callable[[Relay], object]) -> None:
    if env.bus_url is None:
        pytest.skip("the embedded bus lives in the database: it is lost only with the database")
    relay = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    running(relay)
    add_tasks(env, "before", 10)
    before = outbox_event_ids(env)
    assert Audit(env.open_bus(), "consumer").collect(before) == before
    # Redis restarted without persistence (a RabbitMQ node rebuilt without its disk): the namespace is gone.
    assert env.namespace is not None
    lose_bus_data(env.bus_url, env.open_bus())
    wait_for(lambda: relay.metrics.value("pollbridge_relay_bus_resets_total") >= 1, 10, what="bus reset detection")
    add_tasks(env, "after", 5)
    everything = outbox_event_ids(env)
    # A consumer group created after the loss still receives every change, old and new.
    assert Audit(env.open_bus(), "consumer").collect(everything) == everything
    assert relay.metrics.value("pollbridge_relay_republished_total") >= 10


def test_standby_takes_over_when_the_active_relay_stops(env: Env, running: Callable[[Relay], threading.Event]) -> None:
    first = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    second = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    stop_first = running(first)
    wait_for(lambda: first.metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 1, 10,
             what="first relay to lead")
    running(second)
    add_tasks(env, "a", 3)
    wait_for(lambda: first.metrics.value("pollbridge_relay_published_total") == 3, 10, what="first relay publishing")
    assert second.metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 0
    stop_first.set()
    wait_for(lambda: second.metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 1, 15,
             what="standby takeover")
    add_tasks(env, "b", 4)
    wait_for(lambda: second.metrics.value("pollbridge_relay_published_total") == 4, 10, what="standby publishing")
    expected = outbox_event_ids(env)
    assert Audit(env.open_bus()).collect(expected) == expected


def test_a_standby_says_once_that_it_is_one_and_logs_its_takeover(
        env: Env, running: Callable[[Relay], threading.Event], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="bridge.capture.relay")
    first = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    second = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    attempts: list[bool] = []
    acquire = second.leadership.try_acquire

    def counted() -> bool:
        attempts.append(acquire())
        return attempts[-1]

    monkeypatch.setattr(second.leadership, "try_acquire", counted)
    stop_first = running(first)
    wait_for(lambda: first.metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 1, 10,
             what="first relay to lead")
    running(second)
    wait_for(lambda: len(attempts) >= 4, 10, what="the standby to try for the partition a few times")
    assert not any(attempts)
    stop_first.set()
    one, two = first.leadership.holder, second.leadership.holder

    def relay_lines() -> list[str]:
        return [r.getMessage() for r in list(caplog.records) if r.name == "bridge.capture.relay"
                and r.levelno == logging.INFO]

    # The takeover's line, not the leader gauge: the relay sets the gauge a moment before it logs (a CI run
    # beside a CPU hog read the log in between).
    wait_for(lambda: any(line.startswith(f"relay {two}: took over") for line in relay_lines()), 15,
             what="standby takeover")
    assert second.metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 1
    said = relay_lines()
    assert f"relay {one} holds partition 0" in said, said
    assert [line for line in said if line.startswith(f"relay {two}")] == [
        f"relay {two}: standby for partition 0 (held by {one})",
        f"relay {two}: took over partition 0 (previously held by {one})"], said


def test_a_relay_whose_lock_connection_was_terminated_steps_down(
        env: Env, running: Callable[[Relay], threading.Event]) -> None:
    """The leader checks its advisory lock without a statement; a terminated lock connection is noticed
    within one lease_timeout, the standby takes the partition over and nothing is lost."""
    if not env.kind.startswith("postgresql"):
        pytest.skip("SQLite relays lead by a lock file (tests/integration/test_filelock.py), not a session lock")
    first = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    running(first)
    wait_for(lambda: first.metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 1, 10,
             what="first relay to lead")
    second = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    running(second)
    add_tasks(env, "a", 3)
    wait_for(lambda: first.metrics.value("pollbridge_relay_published_total") == 3, 10, what="first relay publishing")
    with env.engine.connect() as conn:
        killed = conn.execute(sa.text(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted AND classid = :ns AND objid = 0 AND objsubid = 2 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"),
            {"ns": ADVISORY_NAMESPACE}).scalar_one()
    assert killed == 1
    wait_for(lambda: first.metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 0, 10,
             what="the first relay to notice it lost its lock")
    wait_for(lambda: 1 in {r.metrics.value("pollbridge_relay_leader", {"partition": "0"}) for r in (first, second)},
             10, what="a relay to lead again")
    add_tasks(env, "b", 4)
    wait_for(lambda: first.metrics.value("pollbridge_relay_published_total")
             + second.metrics.value("pollbridge_relay_published_total") == 7, 10, what="the new rows published")
    expected = outbox_event_ids(env)
    assert len(expected) == 7 and Audit(env.open_bus()).collect(expected) == expected


def test_an_idle_relay_asks_the_database_nothing_but_its_probe(
        env: Env, running: Callable[[Relay], threading.Event]) -> None:
    """Idle, the relay's only statement on PostgreSQL is its fallback probe (the claim): no purge while
    nothing can have expired, no leadership check by statement. On SQLite no purge either, and no claim:
    it reads the unpublished rows' index in one statement, without a transaction around it or the write
    lock, and writes nothing: its leadership is a lock file (it renewed a lease row every lease_timeout / 2)."""
    settings = RelaySettings(poll_interval=0.002, arm_after=0.05, fallback_interval=0.2, idle_probe_interval=0.5,
                             epoch_check_interval=0.05, lease_timeout=0.2, purge_interval=0.05, retention=3600)
    add_tasks(env, "a", 3)
    relay = Relay(env.engine, env.open_bus(), settings, statuses=env.tables.mapping.statuses)
    running(relay)
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 3, 10, what="the rows published")
    # Settled: it purged once before publishing (nothing had expired), published, and (PostgreSQL) armed
    # its wake-up, the last statement before idling.
    if env.kind.startswith("postgresql"):
        # Armed, and past its arming horizon (on a busy server, other sessions' snapshots hold it a while).
        _settled(env, relay)
    statements: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *rest: object) -> None:
        statements.append(statement)

    lock_backend = _lock_backend_state(env)
    sa.event.listen(env.engine, "before_cursor_execute", seen)
    try:
        # A measurement window: 30 purge intervals, 7 probes; lease checks every lease_timeout (PostgreSQL)
        # or half of it (SQLite, about 15 renewals).
        threading.Event().wait(1.5)
    finally:
        sa.event.remove(env.engine, "before_cursor_execute", seen)
    probes = [s for s in statements if s.lstrip().upper().startswith("UPDATE POLLBRIDGE_OUTBOX")]
    assert not [s for s in statements if s.lstrip().upper().startswith("DELETE")]  # no purge: nothing expired
    if env.kind.startswith("sqlite"):
        # No NOTIFY, but nothing commits (its lease renewals are quiet commits): it waits for a commit to the
        # file and reads the unpublished rows' index, without the write lock, only at its idle probe (it
        # looked about every 20 ms to 0.1 s before); it claims nothing, and its only writes renew its lease.
        looks = [s for s in statements if s.lstrip().upper().startswith("SELECT") and "pollbridge_outbox" in s]
        assert 1 <= len(looks) <= 1.5 / 0.5 + 2, len(looks)
        assert probes == []
        assert statements == looks, [s.split()[0:3] for s in statements if s not in looks]  # no BEGIN, no write
    else:
        # Past its arming horizon, it probes every idle_probe_interval, making sure its flag is still up.
        horizon = [s for s in statements if "pg_snapshot_xmin" in s or "SET armed = true" in s]
        assert probes, "the fallback probe did not run"
        assert len(probes) <= 1.5 / 0.5 + 2, len(probes)  # one an idle_probe_interval
        assert not [s for s in horizon if "pg_snapshot_xmin" in s], horizon
        assert statements == [s for s in statements if s in probes or s in horizon], \
            [s.split()[0:3] for s in statements if s not in probes]
        assert _lock_backend_state(env) == lock_backend  # the lock's connection was sent nothing


def test_a_running_relay_purges_what_passes_the_retention_window_when_it_does(
        env: Env, running: Callable[[Relay], threading.Event]) -> None:
    """The purge is scheduled by the oldest row kept, not skipped: rows published in two waves go in two
    purges, each once its rows are past the window, and the outbox is empty with the relay idle since."""
    settings = RelaySettings(poll_interval=0.002, arm_after=0.05, fallback_interval=0.2, epoch_check_interval=0.05,
                             lease_timeout=1.0, purge_interval=0.05, retention=0.5)
    relay = Relay(env.engine, env.open_bus(), settings, statuses=env.tables.mapping.statuses)
    running(relay)
    add_tasks(env, "first", 3)
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 3, 10, what="the first wave")
    add_tasks(env, "second", 2)
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 5, 10, what="the second wave")
    wait_for(lambda: relay.metrics.value("pollbridge_outbox_purged_total") == 5, 10,
             what="both waves purged after the retention window")
    assert outbox_event_ids(env) == set()


def _armed(env: Env) -> bool:
    with env.engine.connect() as conn:
        return bool(conn.execute(sa.select(relay_state.c.armed).where(relay_state.c.relay_partition == 0)).scalar())


def _lock_backend_state(env: Env) -> object:
    """When the connection holding the relay's advisory lock last changed state (None on SQLite)."""
    if not env.kind.startswith("postgresql"):
        return None
    with env.engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT a.state_change FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = :ns AND l.objid = 0 AND l.objsubid = 2 "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"),
            {"ns": ADVISORY_NAMESPACE}).scalar_one()


def test_probe_reports_backlog_and_age(env: Env) -> None:
    add_tasks(env, "p", 7)
    relay = Relay(env.engine, env.open_bus(), FAST)
    assert relay.probe() == 7
    assert relay.metrics.value("pollbridge_outbox_backlog", {"partition": "0"}) == 7
    assert relay.metrics.value("pollbridge_outbox_oldest_unpublished_age_seconds", {"partition": "0"}) >= 0
    relay.publish_batch()
    assert relay.probe() == 0


def test_due_backlog_gauges_are_read_by_the_next_claim(env: Env) -> None:
    """At a purge time after a claim that took rows, the relay does not probe in a transaction of its own: it
    marks the gauges due, and the next claim reads them in its own transaction (at 2 completions/s: 3.03
    transactions per completion against 3.08 with the probe). What they show is what that claim left."""
    add_tasks(env, "due", 7)
    relay = Relay(env.engine, env.open_bus(), RelaySettings(batch_size=3))
    backlog = ("pollbridge_outbox_backlog", {"partition": "0"})
    assert relay.publish_batch() == 3
    assert relay.metrics.value(*backlog) == 0  # not due: the claim reads nothing more
    relay._backlog_due = True
    assert relay.publish_batch() == 3
    assert relay.metrics.value(*backlog) == 1 and not relay._backlog_due
    assert relay.metrics.value("pollbridge_outbox_oldest_unpublished_age_seconds", {"partition": "0"}) >= 0


def test_purge_keeps_the_retention_window(env: Env) -> None:
    add_tasks(env, "old", 3)
    relay = Relay(env.engine, env.open_bus(), RelaySettings(retention=3600, purge_batch=2))
    relay.publish_batch()
    assert relay.purge() == 0  # just published: inside the window
    with env.engine.begin() as conn:
        old = sa.func.datetime("now", "-2 hours") if env.kind.startswith("sqlite") else sa.text(
            "clock_timestamp() - interval '2 hours'")
        conn.execute(outbox.update().values(published_at=old))
    add_tasks(env, "new", 1)  # unpublished: never purged
    assert relay.purge() == 3
    with env.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(outbox)).scalar() == 1


def test_purge_trims_the_bus_of_what_every_group_acknowledged(env: Env) -> None:
    """The relay's purge cycle keeps the bus to the retention window too, but never drops an entry a
    consumer group has not read and acknowledged."""
    add_tasks(env, "trim", 3)
    bus = env.open_bus()
    bus.ensure_group("sched")
    relay = Relay(env.engine, bus, RelaySettings(retention=0.001))
    assert relay.publish_batch() == 3
    with env.engine.connect() as conn:
        newest = as_utc(conn.execute(sa.select(sa.func.max(outbox.c.published_at))).scalar_one())
    assert newest is not None
    wait_for(lambda: datetime.now(UTC) - newest > timedelta(milliseconds=2), 5, interval=0.001,
             what="the millisecond of retention to pass")
    assert relay.purge() == 3  # a millisecond of retention: the outbox rows go ...
    assert relay.metrics.value("pollbridge_bus_trimmed_total") == 0  # ... the entries stay: undelivered
    deliveries = bus.read("sched", "c1", list(range(bus.partitions)), 10, 0.0)
    assert len(deliveries) == 3
    relay.purge()
    assert relay.metrics.value("pollbridge_bus_trimmed_total") == 0  # delivered but pending: kept
    bus.ack("sched", deliveries)
    relay.purge()
    # SQLite's embedded log always keeps its newest entry (a deleted top rowid would be handed out again).
    assert relay.metrics.value("pollbridge_bus_trimmed_total") == (2 if env.kind.startswith("sqlite") else 3)


def test_database_built_payload_equals_the_python_event(env: Env) -> None:
    """The relay's hot path lets the database write the JSON; it must parse to the very same event."""
    from bridge.capture.relay import event_payload_sql, row_to_event
    from bridge.core.events import CloudEvent

    add_tasks(env, "eq", 2)
    with env.engine.begin() as conn:
        conn.execute(env.tables.tasks.update().where(env.tables.tasks.c.task_key == "k1").values(status="queued"))
        rows = conn.execute(sa.select(outbox, event_payload_sql(env.engine.dialect.name))).all()
    assert len(rows) == 3
    for row in rows:
        expected = row_to_event(row, env.tables.mapping.statuses)
        parsed = CloudEvent.from_json(row.payload)
        assert parsed == expected
        assert parsed.time.tzinfo is not None and abs((parsed.time - expected.time).total_seconds()) < 1e-3


def test_a_signal_has_its_own_event_type_from_both_builders(env: Env) -> None:
    """A recorded signal is ``task.signal_received``; every other change stays ``task.status_changed``."""
    from bridge.capture.relay import event_payload_sql, row_to_event
    from bridge.core.events import TASK_SIGNAL_RECEIVED, TASK_STATUS_CHANGED, CloudEvent

    add_tasks(env, "sig", 1)
    tasks = env.tables.tasks
    with env.engine.begin() as conn:
        conn.execute(tasks.update().where(tasks.c.task_key == "k0")
                     .values(signal_received_at=sa.func.current_timestamp()))
        rows = conn.execute(sa.select(outbox, event_payload_sql(env.engine.dialect.name))
                            .order_by(outbox.c.id)).all()
    changes = [row.change for row in rows]
    assert "signal" in changes, changes
    for row in rows:
        expected_type = TASK_SIGNAL_RECEIVED if row.change == "signal" else TASK_STATUS_CHANGED
        assert row_to_event(row, env.tables.mapping.statuses).type == expected_type
        assert CloudEvent.from_json(row.payload).type == expected_type


def test_relay_pauses_while_the_bus_is_near_its_memory_limit(env: Env, running: Callable[[Relay], object]) -> None:
    full = UnderMemoryPressure(env.open_bus())
    relay = Relay(env.engine, full, FAST, statuses=env.tables.mapping.statuses)  # type: ignore[arg-type]
    running(relay)
    wait_for(lambda: relay.metrics.value("pollbridge_relay_paused") == 1, 10, what="the relay to pause")
    add_tasks(env, "mem", 3)
    threading.Event().wait(0.3)  # the relay is paused: give it time it must not use
    assert relay.metrics.value("pollbridge_relay_published_total") == 0
    full.pressure = 0.5
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 3, 10, what="publishing to resume")
    assert relay.metrics.value("pollbridge_relay_paused") == 0


def test_a_paused_relay_still_purges_what_passed_its_retention(env: Env,
                                                              running: Callable[[Relay], object]) -> None:
    """While paused the relay still purges the outbox and trims the bus past the retention window: that trim of what
    every consumer acknowledged is what gives the bus room again (the pause skipped it, so a bus full of
    acknowledged entries kept the relay paused for good)."""
    full = UnderMemoryPressure(env.open_bus(), pressure=0.5)
    settings = dataclasses.replace(FAST, retention=1.0, purge_interval=0.05)
    relay = Relay(env.engine, full, settings, statuses=env.tables.mapping.statuses)  # type: ignore[arg-type]
    running(relay)
    add_tasks(env, "trim", 3)
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 3, 10, what="the rows published")
    full.pressure = 0.97
    wait_for(lambda: not relay.publishing.is_set(), 10, what="the relay to pause")
    assert relay.metrics.value("pollbridge_outbox_purged_total") == 0  # inside the retention window still
    wait_for(lambda: relay.metrics.value("pollbridge_outbox_purged_total") == 3, 10, what="the purge while paused")
    assert relay.metrics.value("pollbridge_relay_paused") == 1


@pytest.mark.redis
def test_redis_memory_pressure_reads_maxmemory(redis_server: str, redis_namespace: str) -> None:
    import redis

    bus = open_bus(redis_server, namespace=redis_namespace)
    client = redis.Redis.from_url(redis_server)
    before = client.config_get("maxmemory")["maxmemory"]
    try:
        client.config_set("maxmemory", 0)
        assert bus.memory_pressure() is None
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used * 4)
        pressure = bus.memory_pressure()
        assert pressure is not None and 0.1 < pressure < 0.5
    finally:
        client.config_set("maxmemory", before)
        client.close()
        bus.close()


def _outbox_row(conn: sa.Connection, event_id: str, change: str, old: str | None, new: str | None,
                attempt: int | None = None) -> None:
    conn.execute(outbox.insert().values(event_id=event_id, task_id="7", instance_id="st", workflow_type="w",
                                        task_key="k", change=change, old_status=old, new_status=new,
                                        attempt=attempt, created_at=sa.func.current_timestamp()))


def test_null_skipped_and_other_statuses_are_published_and_only_unknown_values_dead_lettered(env: Env) -> None:
    """A waiting task instance of a foreign scheduler has status NULL, and it stores values the mapping declares
    without a meaning of their own (``skipped``, ``other``): their events reach the bus (a retry's second try
    among them). A stored value the mapping does not know at all is still set aside, saying which it is."""
    from bridge.core.mapping import StatusValues

    statuses = StatusValues(skipped="skipped", other=["deferred", "upstream_failed"])
    with env.engine.begin() as conn:
        _outbox_row(conn, "null-insert", "insert", None, None)
        _outbox_row(conn, "to-other", "status", None, "deferred", attempt=1)
        _outbox_row(conn, "other-to-skipped", "status", "deferred", "skipped", attempt=1)
        _outbox_row(conn, "back-to-null", "identity", "failed", None, attempt=2)
        _outbox_row(conn, "unknown", "status", "pending", "exploded")
    relay = Relay(env.engine, env.open_bus(), FAST, statuses=statuses)
    while relay.publish_batch():
        pass
    with env.engine.connect() as conn:
        dead = conn.execute(sa.select(outbox_dead)).all()
    assert len(dead) == 1 and "unknown" in dead[0].payload
    assert "'exploded'" in dead[0].reason and "'deferred'" in dead[0].reason and "'queued'" in dead[0].reason
    published = {"null-insert", "to-other", "other-to-skipped", "back-to-null"}
    audit = Audit(env.open_bus())
    assert audit.collect(published) == published
    data = {d.event.id: d.event.data for d in audit.seen if d.event is not None}
    assert data["null-insert"]["new_status"] is None and "attempt" not in data["null-insert"]
    assert data["to-other"]["new_status"] == "deferred" and data["to-other"]["attempt"] == 1
    assert data["back-to-null"]["change"] == "identity" and data["back-to-null"]["attempt"] == 2


def test_a_null_status_is_published_even_when_the_mapping_gives_null_no_meaning(env: Env) -> None:
    with env.engine.begin() as conn:
        _outbox_row(conn, "null", "status", "pending", None)
    relay = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    assert relay.publish_batch() == 1
    with env.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(outbox_dead)).scalar_one() == 0
    assert Audit(env.open_bus()).collect({"null"}) == {"null"}


def test_the_attempt_is_in_the_event_from_both_builders(env: Env) -> None:
    """``data.attempt`` is there when the outbox row has one, from the database's JSON as from the Python event."""
    from bridge.capture.relay import event_payload_sql, row_to_event
    from bridge.core.events import CloudEvent

    add_tasks(env, "att", 1)
    tasks = env.tables.tasks
    with env.engine.begin() as conn:
        conn.execute(tasks.update().where(tasks.c.task_key == "k0").values(status="queued", attempts=3))
        _outbox_row(conn, "no-attempt", "status", "queued", "running")
        rows = conn.execute(sa.select(outbox, event_payload_sql(env.engine.dialect.name))
                            .order_by(outbox.c.id)).all()
    attempts = []
    for row in rows:
        parsed = CloudEvent.from_json(row.payload)
        assert parsed.data == row_to_event(row, env.tables.mapping.statuses).data
        attempts.append(parsed.data.get("attempt", "absent"))
    assert attempts == [0, 3, "absent"]


# --- the wake-up's cost follows the work (issue 20) ---------------------------------------------------------

#: Timers long enough that a test finishing well within them proves a notification, not a timer, woke the relay.
LISTENING = RelaySettings(poll_interval=0.002, arm_after=0.05, fallback_interval=5.0, idle_probe_interval=30.0,
                          epoch_check_interval=0.05, lease_timeout=1.0, purge_interval=3600)


def _postgres_only(env: Env) -> None:
    if not env.kind.startswith("postgresql"):
        pytest.skip("SQLite has no NOTIFY: its relay probes the outbox without the write lock")


@contextlib.contextmanager
def _statements(env: Env) -> Iterator[list[tuple[str, object]]]:
    seen: list[tuple[str, object]] = []

    def record(conn: object, cursor: object, statement: str, parameters: object, *rest: object) -> None:
        seen.append((statement, parameters))

    sa.event.listen(env.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(env.engine, "before_cursor_execute", record)


def _claims(seen: list[tuple[str, object]]) -> int:
    return sum(1 for s, _ in seen if s.lstrip().upper().startswith("UPDATE POLLBRIDGE_OUTBOX"))


def _settled(env: Env, relay: Relay) -> None:
    """Armed, and every transaction that could have missed the flag has ended: the relay sleeps on LISTEN."""
    wait_for(lambda: relay._armed and relay._horizon is None and _armed(env), 30,
             what="the relay to arm and pass its horizon")


def test_an_arming_whose_horizon_failed_leaves_its_flag_to_be_lowered(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag is raised before the arming horizon is read; when that read fails, the relay still counts the flag
    as its own to lower (on its way out, at a takeover): a relay that counted itself unarmed left it up for good,
    and every change that can make a task ready notified no one."""
    if not env.kind.startswith("postgresql"):
        pytest.skip("SQLite has no NOTIFY flag")
    import bridge.capture.relay as relay_module

    relay = Relay(env.engine, env.open_bus(), FAST, statuses=env.tables.mapping.statuses)
    monkeypatch.setattr(relay_module, "ARM_HORIZON_SQL", "SELECT pollbridge_no_such_function()")
    with pytest.raises(sa.exc.DBAPIError):
        relay._arm()
    assert _armed(env)
    relay._set_armed(False)  # what the relay's way out does
    assert not _armed(env)


def test_on_sqlite_a_relay_woken_by_a_change_claims_without_looking_first(
        env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite: a commit about data (a task write, whose trigger wrote the outbox row in it) surely woke the idle
    relay, so its claim goes first, without the lock-free look that would find what the wake-up said (a read
    transaction per change before)."""
    if not env.kind.startswith("sqlite"):
        pytest.skip("PostgreSQL relays are woken by NOTIFY and claim at once")
    from bridge.db.changes import changes_of

    signal = changes_of(env.engine, "data")
    assert signal is not None
    signal.wait(signal.generation, 0.1)  # the watcher runs (its start-up wake-up, not about data, is taken here)
    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    assert relay._changes is not None
    waiting = when_waiting(monkeypatch, relay._changes)
    running(relay)
    # Up to three changes: the file watcher may sample the file between this process's commit and its note of it
    # as its own, and a descheduled committer then makes it a stranger's (only maybe about data: a look first,
    # rightly). The code before looked before every claim.
    attempts = []
    for n in range(1, 4):
        assert waiting.wait(10), "the relay did not go idle"
        with _statements(env) as seen:
            add_tasks(env, f"woken-{n}", 1)
            wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == n, 10,  # noqa: B023
                     what="the change published")
        assert _claims(seen) >= 1
        attempts.append([s for s, _ in seen if s.lstrip().upper().startswith("SELECT POLLBRIDGE_OUTBOX.ID")])
        if not attempts[-1]:
            break
        waiting.clear()
    assert [] in attempts, attempts


def test_at_a_trickle_each_change_costs_the_relay_one_claim(
        env: Env, running: Callable[[Relay], threading.Event]) -> None:
    """Armed, a change's notification wakes the relay, and the one claim that takes the change is all it sends:
    no confirming empty claim, no 2 ms probes while it decides whether to arm (that was about 100 claims a
    change, 88 transactions per completion at 2 completions/s), and the flag is not lowered and raised again."""
    _postgres_only(env)
    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    running(relay)
    _settled(env, relay)

    def unrelated() -> float:
        # Claims that are no confirming claim: a look by a timer, and a cycle that failed and was retried (under a
        # loaded CI a publish to the bus can time out: its claim is rolled back and made again).
        failed = sum(sample.value for metric in relay.metrics.registry.collect()
                     if metric.name == "pollbridge_relay_errors" for sample in metric.samples
                     if sample.name == "pollbridge_relay_errors_total")
        return relay.metrics.value("pollbridge_relay_wakeups_total", {"cause": "timer"}) + failed

    before = unrelated()
    with _statements(env) as seen:
        for i in range(6):
            add_tasks(env, f"t{i}", 1)
            wait_for(lambda n=i + 1: relay.metrics.value("pollbridge_relay_published_total") == n, 4,
                     what=f"change {i + 1} published (by its notification: the timers are 5 and 30 s)")
            threading.Event().wait(0.05)  # a trickle: the relay goes back to sleep between changes
    extra = unrelated() - before
    assert _claims(seen) <= 6 + 1 + extra, (_claims(seen), extra, [str(p)[:200] for s, p in seen
                                                                   if s.lstrip().upper().startswith("UPDATE POLL")])
    assert not [s for s, _ in seen if "pollbridge_relay_state" in s]  # the flag stayed up


def test_a_dispatch_wakes_no_relay_and_rides_on_the_next_claim(
        env: Env, running: Callable[[Relay], threading.Event]) -> None:
    """A status change into a dispatched value cannot make a task ready: its commit notifies no relay (a claim and
    a notification read per change before: 2 of the 6 transactions per completion of ``bench.cost``, trigger,
    2/s), and its row is published with the claim of the next change that notifies. A start still notifies (a
    running timeout is armed from it)."""
    _postgres_only(env)
    import psycopg

    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    running(relay)
    _settled(env, relay)
    add_tasks(env, "quiet", 1)
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 1, 4, what="the insert published")
    statuses = env.tables.mapping.statuses
    status = env.tables.tasks.c[env.tables.mapping.columns.status]
    url = env.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener, _statements(env) as seen:
        listener.execute(f"LISTEN {OUTBOX_CHANNEL}")
        listener.execute("LISTEN pollbridge_test_sentinel")
        with env.engine.begin() as conn:
            conn.execute(env.tables.tasks.update().where(env.tables.tasks.c.instance_id == "quiet")
                         .values({status: statuses.write("dispatched")}))
        # Notifications reach a listener in commit order: one sent after the dispatch comes after the dispatch's.
        with env.engine.begin() as conn:
            conn.exec_driver_sql("NOTIFY pollbridge_test_sentinel")
        heard = []
        for n in listener.notifies(timeout=10):
            if n.channel == "pollbridge_test_sentinel":
                break
            heard.append(n.channel)
        assert heard == [], f"a dispatch notified {heard}"
        assert relay.metrics.value("pollbridge_relay_published_total") == 1
        with env.engine.begin() as conn:  # running: it notifies, and the claim takes the dispatch with it
            conn.execute(env.tables.tasks.update().where(env.tables.tasks.c.instance_id == "quiet")
                         .values({status: statuses.write("running")}))
        wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 3, 4,
                 what="the start and the quiet dispatch published (the timers are 5 and 30 s)")
    assert _claims(seen) == 1, [str(p)[:200] for s, p in seen if s.lstrip().upper().startswith("UPDATE POLL")]


def test_a_writer_that_read_the_flag_down_is_published_without_waiting_for_the_fallback(
        env: Env, running: Callable[[Relay], threading.Event]) -> None:
    """The race that arming opens: a writer's trigger reads the flag before the relay raises it (so its commit
    will not notify), the relay arms and re-probes, then the writer commits. The relay keeps looking, briefly,
    until every transaction older than its arming has ended, so the change is out long before the idle probe
    (30 s here), and then it stops looking."""
    _postgres_only(env)
    with env.engine.begin() as conn:
        conn.execute(env.tables.instances.insert().values(id="race", workflow_type="orders"))  # type: ignore[union-attr]
    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    writer = env.engine.connect()
    try:
        tx = writer.begin()
        writer.execute(env.tables.tasks.insert().values(instance_id="race", task_key="late", depends_on=[]))
        # The trigger has read the flag down (the relay has not run yet); the relay starts, arms and re-probes.
        with _statements(env) as seen:
            running(relay)
            # The horizon is noted in a transaction after the flag's (Relay._arm): waited for, not read at once
            # (read between the two, beside a CPU hog in CI, it was still None).
            wait_for(lambda: _armed(env) and _claims(seen) >= 1 and relay._horizon is not None, 10,
                     what="the relay to arm, note its horizon and re-probe")
        tx.commit()
        committed = time.monotonic()
        wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 1, 4.5,
                 what="the late writer's change published before the idle probe (30 s)")
        assert time.monotonic() - committed < 4.5
        wait_for(lambda: relay._horizon is None, 30, what="the relay to see the writer ended and stop looking")
    finally:
        writer.close()


def test_a_repeatable_read_writer_whose_snapshot_predates_the_arming_is_not_left_to_the_idle_probe(
        env: Env, running: Callable[[Relay], threading.Event]) -> None:
    """A REPEATABLE READ writer reads the flag with its first snapshot, taken before the relay armed, and takes
    its transaction id only when it writes, after the arming: no id-based horizon sees it. The relay's horizon
    also waits for every snapshot older than the arming (pg_stat_activity.backend_xmin), so it keeps looking
    while that snapshot lives and the change is out long before the idle probe (30 s here)."""
    _postgres_only(env)
    with env.engine.begin() as conn:
        conn.execute(env.tables.instances.insert().values(id="rr", workflow_type="orders"))  # type: ignore[union-attr]
    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    writer = env.engine.connect().execution_options(isolation_level="REPEATABLE READ")
    try:
        tx = writer.begin()
        writer.execute(sa.select(relay_state.c.armed)).all()  # the snapshot: the flag is down
        running(relay)
        wait_for(lambda: _armed(env), 10, what="the relay to arm")
        threading.Event().wait(0.3)
        assert relay._horizon is not None  # the old snapshot keeps it looking
        writer.execute(env.tables.tasks.insert().values(instance_id="rr", task_key="late", depends_on=[]))
        tx.commit()
        committed = time.monotonic()
        wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 1, 5,
                 what="the repeatable-read writer's change published")
        assert time.monotonic() - committed < 5
        wait_for(lambda: relay._horizon is None, 30, what="the relay to stop looking once the snapshot is gone")
    finally:
        writer.close()


def test_a_burst_turns_the_notifications_off_and_the_trickle_after_it_on(
        env: Env, running: Callable[[Relay], threading.Event]) -> None:
    """Above relay.notify_max_rate the relay lowers the flag (the writers' commits stop queueing on NOTIFY's
    lock) and polls; once the burst is over it raises the flag again and sleeps on LISTEN. Nothing is lost."""
    _postgres_only(env)
    settings = dataclasses.replace(LISTENING, notify_max_rate=20.0)
    relay = Relay(env.engine, env.open_bus(), settings, statuses=env.tables.mapping.statuses)
    running(relay)
    _settled(env, relay)
    with _statements(env) as seen:
        with env.engine.connect() as conn:
            conn.execute(env.tables.instances.insert().values(id="burst", workflow_type="orders"))  # type: ignore[union-attr]
            conn.commit()
            for i in range(150):  # one change per transaction, as fast as this connection goes
                conn.execute(env.tables.tasks.insert().values(instance_id="burst", task_key=f"b{i}", depends_on=[]))
                conn.commit()
        wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 150, 10, what="the burst")
        wait_for(lambda: _armed(env), 10, what="the flag raised again after the burst")
    flags = [p.get("armed") for s, p in seen if "SET armed" in s and isinstance(p, dict)]
    assert flags[:1] == [False] and flags[-1] is True, flags
    add_tasks(env, "after", 1)
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 151, 2.5,
             what="a change after the burst published by its notification")


def _instances_by_partition(partitions: int, per: int) -> dict[int, list[str]]:
    """Instance ids, ``per`` on each bus partition."""
    from bridge.bus.base import partition_for

    out: dict[int, list[str]] = {p: [] for p in range(partitions)}
    i = 0
    while any(len(v) < per for v in out.values()):
        name = f"inst-{i}"
        p = partition_for(name, partitions)
        if len(out[p]) < per:
            out[p].append(name)
        i += 1
    return out


def test_one_partitions_loss_republishes_only_that_partitions_rows(env: Env,
                                                                   running: Callable[[Relay], object]) -> None:
    """One shard of a cluster lost (its partition's stream and epoch gone): only the rows whose instances that
    partition holds are republished, and a consumer still receives every change."""
    if env.bus_url is None:
        pytest.skip("the embedded bus lives in the database: it is lost only with the database")
    bus = env.open_bus()
    relay = Relay(env.engine, bus, FAST, statuses=env.tables.mapping.statuses)
    running(relay)
    by_partition = _instances_by_partition(bus.partitions, 2)
    for names in by_partition.values():
        for name in names:
            add_tasks(env, name, 3)
    before = outbox_event_ids(env)
    assert Audit(env.open_bus(), "consumer").collect(before) == before
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == len(before), 10, what="published")
    lost = 2
    lose_bus_data(env.bus_url, bus, lost)  # Redis: its stream and epoch key; RabbitMQ: its stream
    wait_for(lambda: relay.metrics.value("pollbridge_relay_bus_resets_total") >= 1, 10, what="loss detection")
    assert relay.metrics.value("pollbridge_relay_republished_total") == 3 * len(by_partition[lost])
    everything = outbox_event_ids(env)
    assert Audit(env.open_bus(), "late").collect(everything) == everything


def test_an_acknowledged_write_that_vanished_renews_its_partitions_epoch(env: Env,
                                                                          running: Callable[[Relay], object]) -> None:
    """A failover to a replica that had not received the newest entries keeps the stream and its epoch key: the
    relay finds the entry it published gone (here: deleted) and has that partition's rows republished."""
    if env.bus_url is None:
        pytest.skip("the embedded bus lives in the database: it is lost only with the database")
    from bridge.bus.redis_streams import RedisStreamsBus

    bus = env.open_bus()
    if not drops_single_entries(bus):
        pytest.skip("this bus cannot lose one acknowledged entry alone (a RabbitMQ stream is append-only: it loses "
                    "a whole stream, tested above, or nothing)")
    assert isinstance(bus, RedisStreamsBus)
    relay = Relay(env.engine, bus, FAST, statuses=env.tables.mapping.statuses)
    running(relay)
    (name,) = _instances_by_partition(bus.partitions, 1)[1]
    add_tasks(env, name, 2)
    add_tasks(env, "other-" + name, 1)  # on some partition; its rows stay published unless it is partition 1
    ids = outbox_event_ids(env)
    assert Audit(env.open_bus(), "consumer").collect(ids) == ids
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == len(ids), 10, what="published")
    stream = bus.keys.stream(1)
    newest = bus.client.xrevrange(stream, count=1)[0][0]
    epoch_before = bus.client.get(bus.keys.epoch(1))
    assert bus.client.xdel(stream, newest) == 1  # what the failover lost
    wait_for(lambda: relay.metrics.value("pollbridge_relay_bus_resets_total") >= 1, 10, what="loss detection")
    assert bus.client.get(bus.keys.epoch(1)) != epoch_before
    from bridge.bus.base import partition_for

    on_one = 2 + (1 if partition_for("other-" + name, bus.partitions) == 1 else 0)
    assert relay.metrics.value("pollbridge_relay_republished_total") == on_one
    wait_for(lambda: bus.client.xlen(stream) >= on_one + 1, 10, what="the partition republished")


def _gated(relay: Relay, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Hold the relay's claims until the returned gate is set; the other event is set when a claim is held."""
    gate, held = threading.Event(), threading.Event()
    claim = relay.publish_batch

    def gated() -> int:
        held.set()
        assert gate.wait(30), "the test never opened the gate"
        return claim()

    monkeypatch.setattr(relay, "publish_batch", gated)
    return gate, held


def _idle_armed(relay: Relay, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once the relay, armed and past its horizon, goes to wait for a notification (install before it runs): from
    then on its next claim follows a wake-up, not the claim that came after its horizon passed."""
    idle = threading.Event()
    inner = relay._idle_listening

    def idle_listening(*args: object) -> None:
        if relay._armed and relay._horizon is None:
            idle.set()
        inner(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(relay, "_idle_listening", idle_listening)
    return idle


def _held_change(env: Env, relay: Relay, running: Callable[[Relay], threading.Event],
                 monkeypatch: pytest.MonkeyPatch, instance: str) -> tuple[threading.Event, str]:
    """Run the relay until it sleeps armed, hold its claims, write one change of ``instance`` and wait until the claim
    its notification brings is held (with a bus apart from the database, the claim that marks the row published from
    its notice, up to ``MARK_AFTER`` later): the gate to release the claim, and the change's event id."""
    idle = _idle_armed(relay, monkeypatch)
    running(relay)
    assert idle.wait(30), "the relay did not arm and go idle"
    gate, held = _gated(relay, monkeypatch)
    add_tasks(env, instance, 1)
    assert held.wait(10), "the notification did not wake the relay"
    [event_id] = _unpublished(env)  # the claim is held: the row is not marked yet
    return gate, event_id


def _listeners(env: Env) -> int:
    """The sessions of the test's database listening on the outbox channel."""
    with env.engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = :listen"),
            {"listen": f"LISTEN {OUTBOX_CHANNEL}"}).scalar_one())


def _unpublished(env: Env) -> list[str]:
    with env.engine.connect() as conn:
        return list(conn.execute(sa.select(outbox.c.event_id).where(outbox.c.published_at.is_(None))).scalars())


def test_a_notified_change_reaches_the_bus_before_its_claim_and_only_once(
        env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture trigger's notification carries its change's event, and the relay publishes it as soon as it hears
    it, before the claim (at a trickle the claim's BEGIN and statement were two round trips between a completion's
    commit and the dispatch it makes possible). The claim then marks the row published without a second publish.
    A bus inside the database (embedded) gains nothing from it: there the claim publishes, as before."""
    _postgres_only(env)
    bus = Recording(env.open_bus())
    relay = Relay(env.engine, bus, LISTENING, statuses=env.tables.mapping.statuses)  # type: ignore[arg-type]
    audit = Audit(env.open_bus())
    gate, event_id = _held_change(env, relay, running, monkeypatch, "noticed")
    if env.bus_url is None:
        assert bus.published == [], "an embedded bus publishes in the claim's transaction"
    else:
        assert audit.collect({event_id}, timeout=10) == {event_id}, "not on the bus before its claim"
        wait_for(lambda: relay.metrics.value("pollbridge_relay_notified_published_total") == 1, 10,
                 what="the relay to count the notified event (after the bus acknowledged it)")
    gate.set()
    wait_for(lambda: not _unpublished(env), 10, what="the claim to mark the row published")
    add_tasks(env, "after", 1)  # a later change, so that a second publish of the first would be on the bus by now
    everything = outbox_event_ids(env)
    assert audit.collect(everything) == everything
    ids = [d.event.id for d in audit.seen if d.event is not None]
    assert sorted(ids) == sorted(everything), f"published twice: {ids}"
    wait_for(lambda: relay.metrics.value("pollbridge_relay_published_total") == 2, 10,
             what="the claim to mark the later row published")


def test_a_bus_loss_before_the_claim_publishes_a_notified_change_again(
        env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """An event published from its notification and lost with the bus before its claim marked the row: the claim
    publishes it again (it was skipped as published already, and the row counted as published before the loss)."""
    _postgres_only(env)
    if env.bus_url is None:
        pytest.skip("the embedded bus lives in the database: it is lost only with the database")
    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    Audit(env.open_bus())  # a group, so that what is published is kept until read
    gate, event_id = _held_change(env, relay, running, monkeypatch, "lost")
    wait_for(lambda: relay.metrics.value("pollbridge_relay_notified_published_total") == 1, 10,
             what="the notified event published")
    lose_bus_data(env.bus_url, env.open_bus())
    assert relay.check_bus_epoch()  # what the held loop does at its next epoch check
    gate.set()
    assert Audit(env.open_bus(), "after").collect({event_id}) == {event_id}, "lost with the bus"


def _heard(env: Env, write: Callable[[], None]) -> list[str]:
    """The payloads of the outbox channel's notifications that ``write`` caused (a sentinel NOTIFY after it ends
    the listening: notifications arrive in commit order)."""
    import psycopg

    url = env.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f"LISTEN {OUTBOX_CHANNEL}")
        listener.execute("LISTEN pollbridge_test_sentinel")
        write()
        with env.engine.begin() as conn:
            conn.exec_driver_sql("NOTIFY pollbridge_test_sentinel")
        payloads = []
        for n in listener.notifies(timeout=10):
            if n.channel == "pollbridge_test_sentinel":
                return payloads
            payloads.append(n.payload)
    raise AssertionError("the sentinel notification never came")


def test_no_event_is_sent_ahead_of_an_earlier_change_of_its_instance(env: Env) -> None:
    """An event published before its claim must not overtake an earlier change of its instance that waits for the
    claim (a held dispatch: quiet, it notified no one): then the notification is empty, and the claim publishes
    both in their order. Another instance's change still sends its event."""
    _postgres_only(env)
    bus = Recording(env.open_bus())
    relay = Relay(env.engine, bus, LISTENING, statuses=env.tables.mapping.statuses)  # type: ignore[arg-type]
    relay._set_armed(True)
    add_tasks(env, "held", 1)
    add_tasks(env, "apart", 1)
    while relay.publish_batch():
        pass
    statuses = env.tables.mapping.statuses
    tasks = env.tables.tasks
    status = tasks.c[env.tables.mapping.columns.status]

    def move(instance: str, to: str) -> Callable[[], None]:
        def write() -> None:
            with env.engine.begin() as conn:
                conn.execute(tasks.update().where(tasks.c.instance_id == instance).values({status: statuses.write(to)}))
        return write

    assert _heard(env, move("held", "dispatched")) == []  # quiet
    assert _heard(env, move("held", "running")) == [""]  # the dispatch waits: no event ahead of it
    [apart] = _heard(env, move("apart", "running"))  # another instance: its event
    assert json.loads(apart[4:])["data"]["instance_id"] == "apart"
    bus.published.clear()
    while relay.publish_batch():
        pass
    held = [json.loads(e.to_json())["data"]["new_status"] for batch in bus.published for e in batch
            if e.partitionkey == "held"]
    assert held == [statuses.write("dispatched"), statuses.write("running")]


def test_the_trigger_notifies_the_event_of_the_first_change_of_a_transaction(env: Env) -> None:
    """What the notification carries is the event the claim builds for the row, and only the first notifying change
    of a transaction sends one (the others notify empty and are folded): a transaction of a thousand rows is not a
    thousand notifications. A notice too long for NOTIFY is sent empty, and the claim publishes its event."""
    _postgres_only(env)
    from bridge.capture.queries import EVENT_NOTICE, event_payload_sql

    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    relay._set_armed(True)  # the adaptive trigger notifies only while its relay is armed

    def heard(write: Callable[[], None]) -> list[str]:
        return _heard(env, write)

    payloads = heard(lambda: add_tasks(env, "three", 3))
    assert len(payloads) == 2 and "" in payloads, payloads
    [notice] = [p for p in payloads if p]
    assert notice.startswith(f"{EVENT_NOTICE}0:")
    sent = json.loads(notice[len(EVENT_NOTICE) + 2:])
    with env.engine.connect() as conn:
        built = conn.execute(sa.select(event_payload_sql("postgresql"))
                             .where(outbox.c.id == sent["data"]["version"])).scalar_one()
        first = conn.execute(sa.select(sa.func.min(outbox.c.id))).scalar_one()
    assert sent == json.loads(built)
    assert sent["data"]["version"] == first and sent["data"]["task_key"] == "k0"

    # The flag is the transaction's: the next transaction's first change sends its event again, and a change
    # rolled back to a savepoint takes its notification and the flag with it.
    [again] = heard(lambda: add_tasks(env, "next", 1))
    assert again.startswith(f"{EVENT_NOTICE}0:") and json.loads(again[4:])["data"]["instance_id"] == "next"

    def savepoint() -> None:
        with env.engine.begin() as conn:
            conn.execute(env.tables.instances.insert().values(id="kept", workflow_type="orders"))  # type: ignore[union-attr]
            with conn.begin_nested() as nested:
                conn.execute(env.tables.tasks.insert().values(instance_id="kept", task_key="undone", depends_on=[]))
                nested.rollback()
            conn.execute(env.tables.tasks.insert().values(instance_id="kept", task_key="kept", depends_on=[]))

    [kept] = heard(savepoint)
    assert json.loads(kept[4:])["data"]["task_key"] == "kept"

    # Only a READ COMMITTED writer looks at the outbox and sends an event: a SERIALIZABLE one's look would take
    # predicate locks where every concurrent outbox insert lands (serialization failures for the writers).
    for level, instance in (("SERIALIZABLE", "serializable"), ("REPEATABLE READ", "repeatable")):
        def isolated(level: str = level, instance: str = instance) -> None:
            with env.engine.connect().execution_options(isolation_level=level) as conn:
                conn.execute(env.tables.instances.insert().values(id=instance, workflow_type="orders"))  # type: ignore[union-attr]
                conn.execute(env.tables.tasks.insert().values(instance_id=instance, task_key="k", depends_on=[]))
                conn.commit()

        assert heard(isolated) == [""], level

    def long_key() -> None:
        with env.engine.begin() as conn:
            conn.execute(env.tables.instances.insert().values(id="long", workflow_type="orders"))  # type: ignore[union-attr]
            conn.execute(env.tables.tasks.insert().values(instance_id="long", task_key="k" * 8000, depends_on=[]))

    assert heard(long_key) == [""]
    while relay.publish_batch():
        pass
    assert not _unpublished(env)


def test_a_notice_read_after_its_row_was_claimed_is_not_published_again(env: Env) -> None:
    """A busy relay claims without waiting, so the notifications of the rows it took are read only at its next wait:
    publishing them then would only duplicate what the claims published."""
    _postgres_only(env)
    if env.bus_url is None:
        pytest.skip("with the embedded bus the relay publishes nothing from notifications")
    bus = Recording(env.open_bus())
    relay = Relay(env.engine, bus, LISTENING, statuses=env.tables.mapping.statuses)  # type: ignore[arg-type]
    relay._set_armed(True)
    waiter = ListenWaiter(env.engine, threading.Event(), OUTBOX_CHANNEL)
    try:
        waiter.ensure_listening()
        add_tasks(env, "claimed", 1)
        assert relay.publish_batch() == 1  # the busy relay's claim, before it reads the notification
        assert waiter.wait(10), "no notification"
        relay._publish_notices(waiter)
        assert [len(batch) for batch in bus.published] == [1], bus.published
        assert relay.metrics.value("pollbridge_relay_notified_published_total") == 0
        add_tasks(env, "fresh", 1)  # a change no claim took yet is published from its notification
        assert waiter.wait(10), "no notification"
        relay._publish_notices(waiter)
        assert relay.metrics.value("pollbridge_relay_notified_published_total") == 1
        # More than EVENT_WINDOW ids above the last claim (a relay just started, a busy spell of other partitions):
        # the trigger looked only that far back for an earlier row of the instance, so the claim publishes it.
        from bridge.capture.queries import EVENT_WINDOW

        assert relay.publish_batch() == 1
        relay._claimed_to -= EVENT_WINDOW
        add_tasks(env, "far", 1)
        assert waiter.wait(10), "no notification"
        relay._publish_notices(waiter)
        assert relay.metrics.value("pollbridge_relay_notified_published_total") == 1
    finally:
        waiter.close()


def test_a_made_up_notice_neither_skips_nor_replaces_the_rows_event(env: Env) -> None:
    """Anyone who can connect can NOTIFY: a notice naming a real outbox row with another event id is published (a
    hint, like any event: the scheduler reads the row), and the claim still publishes the row's own event."""
    _postgres_only(env)
    if env.bus_url is None:
        pytest.skip("with the embedded bus the relay publishes nothing from notifications")
    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    audit = Audit(env.open_bus())
    add_tasks(env, "real", 1)  # not armed: no notification
    with env.engine.connect() as conn:
        row = conn.execute(sa.select(outbox.c.id, outbox.c.event_id, outbox.c.instance_id, outbox.c.task_id)).one()
    fake = {"specversion": "1.0", "id": "00000000-0000-4000-8000-000000000000", "source": "pollbridge",
            "type": "task.status_changed", "subject": row.task_id, "time": "2026-12-07T00:00:00.000000Z",
            "datacontenttype": "application/json", "partitionkey": row.instance_id, "depth": 0, "traceid": None,
            "data": {"task_id": row.task_id, "instance_id": row.instance_id, "workflow_type": "orders",
                     "task_key": "k0", "old_status": None, "new_status": "pending", "change": "insert",
                     "version": row.id}}
    waiter = ListenWaiter(env.engine, threading.Event(), OUTBOX_CHANNEL)
    try:
        waiter.ensure_listening()
        with env.engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_notify(:channel, :payload)"),
                         {"channel": OUTBOX_CHANNEL, "payload": "e:0:" + json.dumps(fake)})
            conn.execute(sa.text("SELECT pg_notify(:channel, :payload)"),
                         {"channel": OUTBOX_CHANNEL, "payload": "e:0:" + "[" * 7_000})
        assert waiter.wait(10), "no notification"
        relay._publish_notices(waiter)  # the deep one is left alone, not raised
        assert relay.metrics.value("pollbridge_relay_notified_published_total") == 1
        assert relay.publish_batch() == 1
    finally:
        waiter.close()
    wanted = {row.event_id, fake["id"]}
    assert audit.collect(wanted) == wanted


def test_a_relay_that_lost_its_partition_stops_listening(
        env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL keeps every notification until each listener has read it, and a full queue fails the writers'
    commits: a standby must not listen unread (its listener would keep every event notice the leader's writers
    send)."""
    _postgres_only(env)
    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    idle = _idle_armed(relay, monkeypatch)
    running(relay)
    assert idle.wait(30), "the relay did not arm and go idle"
    assert _listeners(env) == 1
    monkeypatch.setattr(relay.leadership, "try_acquire", lambda: False)  # another relay took the partition
    wait_for(lambda: relay.metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 0, 10,
             what="the relay to step down at its next lease check")
    wait_for(lambda: _listeners(env) == 0, 10, what="the standby to stop listening")


def test_a_paused_relay_stops_listening(env: Env, running: Callable[[Relay], threading.Event],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Paused for a bus near its memory limit, the relay reads no notification, and other partitions' writers still
    send them: it does not keep a listener it does not read (the server's queue could not be trimmed past it)."""
    _postgres_only(env)
    bus = UnderMemoryPressure(env.open_bus(), pressure=0.0)
    relay = Relay(env.engine, bus, LISTENING, statuses=env.tables.mapping.statuses)  # type: ignore[arg-type]
    idle = _idle_armed(relay, monkeypatch)
    running(relay)
    assert idle.wait(30), "the relay did not arm and go idle"
    assert _listeners(env) == 1
    bus.pressure = 0.99
    wait_for(lambda: relay.metrics.value("pollbridge_relay_paused") == 1, 10, what="the relay to pause")
    wait_for(lambda: _listeners(env) == 0, 10, what="the paused relay to stop listening")
    bus.pressure = 0.0
    wait_for(lambda: _listeners(env) == 1, 10, what="the relay to listen again")


class _RefusesPublish:
    """A bus whose ``publish`` fails (the relay's early publish of a notified event); the claim's ``publish_in`` goes
    to the bus it wraps."""

    def __init__(self, bus: object) -> None:
        self.bus = bus

    def __getattr__(self, name: str) -> object:
        return getattr(self.bus, name)

    def publish(self, events: object) -> None:
        raise ConnectionError("the bus refused the publish")


def test_a_notified_event_whose_publish_failed_is_published_by_the_claim(env: Env) -> None:
    """The early publish is only a head start: when the bus refuses it, the relay goes on (no failed cycle), and the
    claim publishes the row's event as if no notice had come."""
    _postgres_only(env)
    if env.bus_url is None:
        pytest.skip("with the embedded bus the relay publishes nothing from notifications")
    relay = Relay(env.engine, _RefusesPublish(env.open_bus()), LISTENING,  # type: ignore[arg-type]
                  statuses=env.tables.mapping.statuses)
    relay._set_armed(True)
    audit = Audit(env.open_bus())
    waiter = ListenWaiter(env.engine, threading.Event(), OUTBOX_CHANNEL)
    try:
        waiter.ensure_listening()
        add_tasks(env, "refused", 1)
        [event_id] = _unpublished(env)
        assert waiter.wait(10), "no notification"
        relay._publish_notices(waiter)
        assert relay.metrics.value("pollbridge_relay_notified_published_total") == 0
        assert relay.publish_batch() == 1
    finally:
        waiter.close()
    assert audit.collect({event_id}) == {event_id}


def _claim_log(relay: Relay, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows each of the relay's claims from now on handled, in order."""
    calls: list[int] = []
    claim = relay.publish_batch

    def counted() -> int:
        handled = claim()
        calls.append(handled)
        return handled

    monkeypatch.setattr(relay, "publish_batch", counted)
    return calls


def _idle_with_deferred_marks(env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch,
                              mark_after: float) -> tuple[Relay, threading.Event, list[int], Audit]:
    """A relay on a bus apart from the database, run until it sleeps armed, rows published from their notifications
    marked ``mark_after`` seconds after the first: the relay, its stop, its claims from then on, an audit group."""
    _postgres_only(env)
    if env.bus_url is None:
        pytest.skip("with the embedded bus the relay publishes nothing from notifications")
    monkeypatch.setattr(relay_module, "MARK_AFTER", mark_after)
    # Nothing else wakes it meanwhile (a lease, the bus epoch, a purge): the marking claim needs its own timer.
    quiet = dataclasses.replace(LISTENING, lease_timeout=60.0, epoch_check_interval=60.0, purge_interval=60.0)
    relay = Relay(env.engine, env.open_bus(), quiet, statuses=env.tables.mapping.statuses)
    audit = Audit(env.open_bus())
    idle = _idle_armed(relay, monkeypatch)
    stop = running(relay)
    assert idle.wait(30), "the relay did not arm and go idle"
    return relay, stop, _claim_log(relay, monkeypatch), audit


def test_rows_published_from_notifications_wait_for_one_claim_to_mark_them(
        env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """At a trickle a claim per notified change was a third of the event path's database transactions: rows whose
    events went out from their notifications wait for one claim (``MARK_AFTER``), and a change whose notification
    carries no event brings that claim at once; each event is published once."""
    relay, _, claims, audit = _idle_with_deferred_marks(env, running, monkeypatch, 60.0)
    for name in ("m1", "m2", "m3"):
        add_tasks(env, name, 1)
    early = set(_unpublished(env))
    assert len(early) == 3
    assert audit.collect(early, timeout=10) == early, "not published from their notifications"
    wait_for(lambda: relay.metrics.value("pollbridge_relay_notified_published_total") == 3, 10,
             what="the relay to count the notified events")
    wait_for(lambda: relay._mark_due is not None or claims, 10, what="the relay to defer its claim")
    assert claims == [], "a claim came for changes that had all gone out"
    assert set(_unpublished(env)) == early
    add_tasks(env, "m4", 2)  # one transaction: the first change's notification carries its event, the second's none
    wait_for(lambda: claims == [5], 10, what="one claim for the five rows, brought by the change without its event")
    assert not _unpublished(env)
    everything = outbox_event_ids(env)
    assert audit.collect(everything) == everything
    ids = [d.event.id for d in audit.seen if d.event is not None]
    assert sorted(ids) == sorted(everything), f"published twice: {ids}"


def test_the_claim_that_marks_notified_rows_comes_on_its_own_timer(
        env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """No other wake-up needed (the relay's probe is 30 s away): the marking claim comes ``MARK_AFTER`` after the
    first row published from its notification."""
    relay, _, claims, audit = _idle_with_deferred_marks(env, running, monkeypatch, 2.0)
    add_tasks(env, "timer", 1)
    [event_id] = outbox_event_ids(env)
    assert audit.collect({event_id}, timeout=10) == {event_id}
    wait_for(lambda: relay._mark_due is not None or claims, 10, what="the notified event published")
    assert claims == [], "claimed at once: no wait for the mark"
    wait_for(lambda: claims == [1], 10, what="the marking claim")
    assert not _unpublished(env)
    assert relay.metrics.value("pollbridge_relay_notified_published_total") == 1


def test_a_relay_that_stops_marks_the_rows_it_published_from_notifications(
        env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """Left unmarked, the next relay would publish them again."""
    relay, stop, claims, audit = _idle_with_deferred_marks(env, running, monkeypatch, 60.0)
    add_tasks(env, "leaving", 1)
    [event_id] = _unpublished(env)
    wait_for(lambda: relay.metrics.value("pollbridge_relay_notified_published_total") == 1, 10,
             what="the notified event published")
    assert claims == []
    stop.set()
    wait_for(lambda: not _unpublished(env), 15, what="the row marked on the way out")
    assert claims == [], "marked, not claimed: nothing is published on the way out"
    # The next relay finds nothing to publish again.
    assert Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses).publish_batch() == 0
    assert audit.collect({event_id}) == {event_id}


def test_a_notice_heard_as_the_marking_claim_falls_due_goes_out_before_that_claim(
        env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """The race at the marking claim's timer: a change commits as the relay wakes for that claim. Its notification is
    published first, then the claim marks both rows; read only after the claim (and the housekeeping before it), its
    event went out with the claim's round trips (at 2 completions/s in ``bench.cost``: the slowest dispatch)."""
    relay, _, claims, audit = _idle_with_deferred_marks(env, running, monkeypatch, 0.3)
    listener: list[object] = []
    idle = relay._idle_listening

    def idle_listening(waiter: object, *args: object) -> None:
        listener[:] = [waiter]
        idle(waiter, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(relay, "_idle_listening", idle_listening)
    raced = threading.Event()
    housekeeping = relay._schedule_log_purge

    def race(now: float) -> None:
        # The marking iteration: the change commits, and its notification reaches the listener's socket, before the
        # relay goes on to the claim.
        if not raced.is_set() and relay._mark_due is not None and now >= relay._mark_due:
            raced.set()
            add_tasks(env, "race", 1)
            conn = listener[0]._conn  # type: ignore[attr-defined]
            poller = select.poll()
            poller.register(conn.fileno(), select.POLLIN)
            assert poller.poll(10_000), "the notification did not reach the relay's listener"
        housekeeping(now)

    monkeypatch.setattr(relay, "_schedule_log_purge", race)
    add_tasks(env, "first", 1)
    wait_for(lambda: claims, 15, what="the marking claim")
    assert raced.is_set()
    assert relay.metrics.value("pollbridge_relay_notified_published_total") == 2, \
        "the change that raced the marking claim went out with the claim, not from its notification"
    assert claims[0] == 2, "the claim did not mark both rows"
    assert not _unpublished(env)
    everything = outbox_event_ids(env)
    assert audit.collect(everything) == everything
    ids = [d.event.id for d in audit.seen if d.event is not None]
    assert sorted(ids) == sorted(everything), f"published twice: {ids}"


def test_a_notice_heard_when_a_claim_is_owed_is_left_to_that_claim(env: Env) -> None:
    """With a claim owed (a fresh LISTEN, a bus-loss replay, a full batch, the idle probe) a notification already
    waiting is not published ahead of it: that claim takes the row, in order with the rest (an event published ahead
    of a replay would overtake its instance's replayed rows), and is not put off to the marking timer. With no claim
    owed (the relay woke for a timer) the same notice goes out at once."""
    _postgres_only(env)
    if env.bus_url is None:
        pytest.skip("with the embedded bus the relay publishes nothing from notifications")
    relay = Relay(env.engine, env.open_bus(), LISTENING, statuses=env.tables.mapping.statuses)
    relay._arm()  # the trigger's flag up: its notifications carry their events
    waiter = ListenWaiter(env.engine, threading.Event(), OUTBOX_CHANNEL)
    try:
        waiter.ensure_listening()

        def heard(instance: str) -> None:
            add_tasks(env, instance, 1)
            poller = select.poll()
            poller.register(waiter._conn.fileno(), select.POLLIN)  # type: ignore[union-attr]
            assert poller.poll(10_000), "the notification did not reach the listener"

        heard("owed")
        relay._look = True
        relay._heard_meanwhile(waiter)
        assert relay._look, "the owed claim was put off"
        assert relay.metrics.value("pollbridge_relay_notified_published_total") == 0, \
            "a notice was published ahead of the owed claim"
        assert relay.publish_batch() == 1  # the owed claim takes the row
        # Its notice was left unread (in the loop the next wait reads it, finds its row claimed and leaves it to one
        # more claim, as before this change): read and dropped here, so that the next notice is the timer's.
        while waiter.hear_pending():
            pass
        waiter.take_payloads()
        heard("timer")
        relay._look = False
        relay._heard_meanwhile(waiter)
        assert relay.metrics.value("pollbridge_relay_notified_published_total") == 1
    finally:
        waiter.close()


def test_the_marking_claims_timer_is_spread() -> None:
    """Drawn from ``MARK_AFTER`` to ``(1 + MARK_SPREAD) * MARK_AFTER``: a fixed delay kept step with a load at a steady
    rate (2 completions/s: every other completion's notification came as the marking claim began)."""
    delays = [relay_module.mark_delay() for _ in range(200)]
    low, high = relay_module.MARK_AFTER, (1 + relay_module.MARK_SPREAD) * relay_module.MARK_AFTER
    assert all(low <= d <= high for d in delays)
    assert max(delays) - min(delays) > 0.6 * (high - low), "the timer is not spread"


def test_the_marking_claim_comes_at_once_when_enough_rows_wait_for_it(
        env: Env, running: Callable[[Relay], threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """``MARK_LIMIT`` rows waiting bring the claim before ``MARK_AFTER``: at 100 completions/s the claim otherwise came
    only when a notice fell outside the event window, with a burst of quiet rows."""
    monkeypatch.setattr(relay_module, "MARK_LIMIT", 2)
    relay, _, claims, audit = _idle_with_deferred_marks(env, running, monkeypatch, 60.0)
    add_tasks(env, "first", 1)
    [first] = _unpublished(env)
    assert audit.collect({first}, timeout=10) == {first}
    assert claims == []
    add_tasks(env, "second", 1)
    wait_for(lambda: claims == [2], 10, what="the claim at the second row")
    assert not _unpublished(env)
    assert relay.metrics.value("pollbridge_relay_notified_published_total") == 2
