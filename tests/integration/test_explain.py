"""``explain``: each situation a task can be in gets its own answer, over SQLite and PostgreSQL.

Workloads are seeded through the mapping and driven by the real paths, synchronously: the legacy poller
(:class:`LegacyPoller`), the relay (:meth:`Relay.publish_batch`), the event scheduler
(:class:`EventScheduler` following the flags through a :class:`FlagRouter`) and the demo workers. Each
test asserts the answer's code and the words of its sentence, and the facts behind it (dispatch paths,
phases at the time, trace ids, deliveries), so a wrong explanation fails. Delivery states are checked on
every stack (SQLite + embedded bus, PostgreSQL + embedded bus, PostgreSQL + Redis).
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.bus import open_bus
from bridge.bus.base import EventBus, partition_for
from bridge.capture.relay import Relay
from bridge.core.settings import RelaySettings, SchedulerSettings, TypeSettings, WorkerSettings
from bridge.db.schema import dispatch_log, holds
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from bridge.reconcile.classify import PhaseSpan
from bridge.reconcile.explain import ANSWER_CODES, DELIVERY_STATES, Explanation, UnknownTask, explain_task, phase_at
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.review import Parking, decide, park
from bridge.tasktable.tables import TaskTable
from event_scheduler.scheduler import EventScheduler
from event_scheduler.signals import record_signal
from legacy_poller.poller import LegacyPoller
from legacy_poller.workers import WorkerPool
from tests.support import Env

GROUP = "explain-test"
SCHED = SchedulerSettings(group=GROUP, batch_size=50, block=0.05, lease_ttl=30.0, claim_interval=0.2,
                          defaults=TypeSettings(retry_base=30.0, retry_max=60.0))
RELAY = RelaySettings(batch_size=100, purge_interval=3600)
OK = WorkerSettings(concurrency=1, min_duration=0.0, max_duration=0.0, failure_rate=0.0)
FAIL = replace(OK, failure_rate=1.0)
TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC"
MS = r"[\d,.]+ ms"


# --- helpers ---------------------------------------------------------------------------------------------
def _seed(engine: Engine, tables: TaskTable, instance_id: str, workflow_type: str,
          *tasks: TaskSpec) -> dict[str, str]:
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec(instance_id, workflow_type, tasks)])
        rows = conn.execute(sa.select(tables.col("task_key"), tables.col("id"))
                            .where(tables.col("instance_id") == instance_id)).all()
    return {str(k): str(i) for k, i in rows}


def _explain(engine: Engine, tables: TaskTable, task_id: str, **kwargs: Any) -> Explanation:
    story = explain_task(engine, tables, task_id, group=GROUP, **kwargs)
    assert story.answer.code in ANSWER_CODES
    return story


def _set(engine: Engine, workflow_type: str, phase: str, **kwargs: Any) -> None:
    FlagStore(engine).change(workflow_type, phase, actor="test", reason="test set-up", **kwargs)


def _poller(engine: Engine, tables: TaskTable) -> LegacyPoller:
    router = FlagRouter(FlagStore(engine), refresh_interval=0.0, registry=CollectorRegistry())
    router.refresh()
    return LegacyPoller(engine, tables, router=router, registry=CollectorRegistry())


def _scheduler(engine: Engine, tables: TaskTable, bus: EventBus) -> EventScheduler:
    router = FlagRouter(FlagStore(engine), refresh_interval=3600, registry=CollectorRegistry())
    router.refresh()
    sched = EventScheduler(engine, tables, bus, SCHED, router, visibility_timeout=30.0,
                           registry=CollectorRegistry(), holder="explain-test")
    sched.refresh_leases()  # catch-up of an empty table: later dispatches come from events
    return sched


def _stamp(engine: Engine, value: datetime) -> Any:
    return value.replace(tzinfo=None) if engine.dialect.name == "sqlite" else value


def _db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        value = conn.execute(sa.select(sa.func.current_timestamp())).scalar()
    parsed = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def _update(engine: Engine, tables: TaskTable, task_id: str, **values: Any) -> None:
    cols = {getattr(tables.mapping.columns, k): v for k, v in values.items()}
    with engine.begin() as conn:
        conn.execute(tables.tasks.update().where(tables.col("id") == int(task_id)).values(cols))


# --- not ready yet ---------------------------------------------------------------------------------------
def test_waiting_for_a_dependency_then_ready_for_the_poller(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "w1", "orders", TaskSpec("a"), TaskSpec("b", ("a",)))
    poller = _poller(engine, tables)
    story = _explain(engine, tables, ids["b"])
    assert story.answer.code == "waiting_dependency"
    assert story.answer.sentence.endswith("is not triggered yet: waiting for dependency a (status pending).")
    assert [(d.key, d.task_id, d.status, d.met) for d in story.readiness.dependencies] == [
        ("a", ids["a"], "pending", False)]
    assert story.readiness.ready_now is False and story.dispatches == ()

    poller.scan_once()
    story = _explain(engine, tables, ids["b"])
    assert "waiting for dependency a (status queued)" in story.answer.sentence

    assert WorkerPool(engine, tables, OK).work_one()
    story = _explain(engine, tables, ids["b"])
    assert story.answer.code == "ready_not_dispatched"
    assert re.search(rf"is ready since {TIME} \([\d.]+ s ago\) but not dispatched: the type is in phase polling, "
                     r"so the legacy poller should dispatch it at its next scan\.$", story.answer.sentence), \
        story.answer.sentence
    dep = story.readiness.dependencies[0]
    assert dep.status == "completed" and dep.met and dep.completed_at is not None
    assert story.readiness.ready_now and story.readiness.ready_since is not None
    assert story.readiness.ready_since >= dep.completed_at - timedelta(milliseconds=1)


def test_a_future_due_time(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "d1", "orders", TaskSpec("c", due_in=3600))
    story = _explain(engine, tables, ids["c"])
    assert story.answer.code == "not_due"
    assert re.search(rf"is not triggered yet: due at {TIME} \(in (59\.\d|60\.0) min\)\.$", story.answer.sentence), \
        story.answer.sentence
    assert story.readiness.due is False and story.readiness.due_at is not None
    assert story.readiness.due_at > story.readiness.checked_at + timedelta(minutes=59)


def test_awaiting_a_signal_then_the_signal_is_on_record(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "s1", "orders", TaskSpec("d", awaits_signal="approval"))
    story = _explain(engine, tables, ids["d"])
    assert story.answer.code == "awaiting_signal"
    assert story.answer.sentence.endswith("is not triggered yet: awaiting signal 'approval'.")
    assert story.readiness.awaits_signal == "approval" and story.readiness.signal_received_at is None

    record_signal(engine, tables, ids["d"], "approval", actor="alice", payload='{"ok": true}')
    story = _explain(engine, tables, ids["d"])
    assert story.answer.code == "ready_not_dispatched"
    assert story.readiness.signal_received_at is not None
    [signal] = story.readiness.signals
    assert (signal.kind, signal.actor, signal.payload) == ("approval", "alice", '{"ok": true}')
    assert signal.received_at is not None
    assert [e.change for e in story.events] == ["insert", "signal"]


def test_every_blocker_is_named_and_a_missing_dependency_blocks(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "m1", "orders", TaskSpec("a"),
                TaskSpec("z", ("a",), due_in=600, awaits_signal="callback"))
    story = _explain(engine, tables, ids["z"])
    assert story.answer.code == "waiting_dependency"
    assert re.search(r"waiting for dependency a \(status pending\); due at .* \(in \d+\.\d min\); "
                     r"awaiting signal 'callback'\.$", story.answer.sentence), story.answer.sentence

    cols = tables.mapping.columns
    with engine.begin() as conn:
        conn.execute(tables.tasks.insert().values({cols.instance_id: "m1", cols.task_key: "orphan",
                                                   cols.status: "pending", cols.depends_on: ["ghost", "a"]}))
        orphan = str(conn.execute(sa.select(tables.col("id")).where(tables.col("task_key") == "orphan")).scalar())
    story = _explain(engine, tables, orphan)
    assert "waiting for dependencies ghost (missing: no such task in the instance), a (status pending)" \
        in story.answer.sentence
    assert [(d.key, d.task_id, d.met) for d in story.readiness.dependencies] == [
        ("ghost", None, False), ("a", ids["a"], False)]


# --- dispatched, by which path, in which phase -----------------------------------------------------------
def test_dispatched_by_the_poller_then_completed(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "p1", "orders", TaskSpec("a"))
    _poller(engine, tables).scan_once()
    story = _explain(engine, tables, ids["a"])
    assert story.answer.code == "dispatched"
    assert re.search(rf"was dispatched by the legacy poller at {TIME}, {MS} after it became ready, while the type "
                     r"was in phase polling; it is now waiting for a worker \(status queued\)\.$",
                     story.answer.sentence), story.answer.sentence
    [d] = story.dispatches
    assert (d.path, d.attempt, d.phase, d.trace_id) == ("poller", 1, "polling", None)
    assert d.latency_ms is not None and d.latency_ms >= 0
    assert d.dispatched_at is not None and d.ready_at is not None
    assert abs(d.latency_ms - (d.dispatched_at - d.ready_at) / timedelta(milliseconds=1)) < 0.01

    assert WorkerPool(engine, tables, OK).work_one()
    story = _explain(engine, tables, ids["a"])
    assert story.answer.code == "completed"
    assert re.search(rf"completed at {TIME}; dispatched by the legacy poller at {TIME}, {MS} after it became "
                     r"ready, while the type was in phase polling\.$", story.answer.sentence), story.answer.sentence
    assert story.completed_at is not None and story.attempts == 1


def test_the_phase_of_each_dispatch_is_the_phase_at_that_time(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "h1", "orders", TaskSpec("a"))
    poller = _poller(engine, tables)
    poller.scan_once()  # attempt 1, polling
    assert WorkerPool(engine, tables, FAIL).work_one()
    story = _explain(engine, tables, ids["a"])
    assert story.answer.code == "failed_retrying"
    assert story.answer.sentence.endswith("failed on attempt 1 of 3 and waits for its retry: the legacy poller "
                                          "re-pends it at its next scan (type in phase polling).")
    _set(engine, "orders", "dual_write")
    poller.scan_once()  # re-pended and dispatched again: attempt 2, dual_write
    story = _explain(engine, tables, ids["a"])
    assert [(d.attempt, d.path, d.phase) for d in story.dispatches] == [(1, "poller", "polling"),
                                                                        (2, "poller", "dual_write")]
    assert story.answer.code == "dispatched"
    assert "while the type was in phase dual_write (dispatch 2 of the task)" in story.answer.sentence
    assert [s.phase for s in story.phases] == ["polling", "dual_write"]
    assert story.phases[0].until == story.phases[1].since and story.phases[1].until is None
    assert (story.flag.phase, story.flag.source) == ("dual_write", "flag")


def test_phase_at_follows_the_spans() -> None:
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    spans = [PhaseSpan("x", "polling", None, t0), PhaseSpan("x", "cutover", t0, None)]
    assert phase_at(spans, t0 - timedelta(seconds=1)) == "polling"
    assert phase_at(spans, t0) == "cutover"
    assert phase_at([], t0) == "polling"


def test_an_early_dispatch_is_called_out(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "e1", "orders", TaskSpec("a"))
    now = _db_now(engine)
    _update(engine, tables, ids["a"], status="queued")
    with engine.begin() as conn:
        conn.execute(dispatch_log.insert().values(
            task_id=ids["a"], instance_id="e1", workflow_type="orders", task_key="a", attempt=1, path="poller",
            ready_at=_stamp(engine, now + timedelta(seconds=2)), dispatched_at=_stamp(engine, now)))
    story = _explain(engine, tables, ids["a"])
    assert re.search(r", 2,000 ms BEFORE it became ready \(an early dispatch: a safety violation\)",
                     story.answer.sentence), story.answer.sentence


# --- ready but not dispatched: who should act ------------------------------------------------------------
def test_ready_in_cutover_the_event_path_should_have_and_the_sweep_catches_it(engine: Engine,
                                                                              tables: TaskTable) -> None:
    _set(engine, "orders", "cutover", grace_seconds=30)
    ids = _seed(engine, tables, "c1", "orders", TaskSpec("a"))
    story = _explain(engine, tables, ids["a"])
    assert story.answer.code == "ready_not_dispatched"
    assert story.answer.sentence.endswith(
        "but not dispatched: the type is in phase cutover, so the event path should have dispatched it (its latest "
        "event is still unpublished in the outbox: is the relay running?); the safety sweep will catch it after "
        "the grace period (30 s).")
    assert (story.flag.event_route, story.flag.poller_route) == ("dispatch", "sweep")
    poller = _poller(engine, tables)
    assert poller.scan_once().dispatched == 0  # the scan leaves cutover types out
    # Ready for longer than the grace period (its ready time moved back, instead of waiting 30 s).
    _update(engine, tables, ids["a"], updated_at=datetime.now(UTC) - timedelta(seconds=60))
    story = _explain(engine, tables, ids["a"])
    assert "it has been ready longer than the grace period (30 s), so the next safety sweep dispatches it " \
           "(an event-path miss)" in story.answer.sentence
    assert poller.sweep_once().fallback == 1
    story = _explain(engine, tables, ids["a"])
    assert re.search(rf"was dispatched by the safety sweep \(an event-path miss\) at {TIME}, {MS} after it became "
                     r"ready, while the type was in phase cutover", story.answer.sentence), story.answer.sentence
    assert [(d.path, d.phase) for d in story.dispatches] == [("fallback", "cutover")]


def test_ready_in_selective_inside_and_outside_the_share(engine: Engine, tables: TaskTable) -> None:
    # A grace period no machine outlasts while seeding and explaining (0.3 s was outlasted beside a CPU hog in CI).
    _set(engine, "orders", "selective", grace_seconds=600)
    ids = _seed(engine, tables, "s1", "orders", TaskSpec("a"))
    story = _explain(engine, tables, ids["a"])
    assert "the type is in phase selective and its instance is in the event path's share, so the event path " \
           "should have dispatched it" in story.answer.sentence
    assert "the poller's fallback dispatches it once it has been ready for the grace period (600 s)" \
        in story.answer.sentence
    _set(engine, "orders", "selective", grace_seconds=0.3)
    time.sleep(0.4)  # past the grace period: time that must pass, not a wait for another thread
    poller = _poller(engine, tables)
    assert poller.scan_once().fallback == 1
    story = _explain(engine, tables, ids["a"])
    assert "was dispatched by the poller's fallback (an event-path miss)" in story.answer.sentence
    assert "while the type was in phase selective" in story.answer.sentence

    _set(engine, "reports", "selective", percent=0.0)
    ids = _seed(engine, tables, "s2", "reports", TaskSpec("a"))
    story = _explain(engine, tables, ids["a"])
    assert story.answer.sentence.endswith(
        "the type is in phase selective 0% and its instance is outside the event path's share, so the legacy "
        "poller should dispatch it at its next scan.")


def test_dual_write_shows_the_shadow_decision(env: Env) -> None:
    engine, tables = env.engine, env.tables
    _set(engine, "orders", "dual_write")
    bus = env.open_bus()
    sched = _scheduler(engine, tables, bus)
    ids = _seed(engine, tables, "dw1", "orders", TaskSpec("a"))
    story = _explain(engine, tables, ids["a"], bus=bus)
    assert story.answer.sentence.endswith("(the event path has recorded no shadow decision for it yet).")
    Relay(engine, bus, RELAY, statuses=tables.mapping.statuses).publish_batch()
    assert sched.poll_once(block=0.0) >= 1
    story = _explain(engine, tables, ids["a"], bus=bus)
    assert story.answer.code == "ready_not_dispatched"
    assert re.search(rf"phase dual_write, so the legacy poller should dispatch it at its next scan \(the event path "
                     rf"recorded its shadow decision at {TIME}\)\.$", story.answer.sentence), story.answer.sentence
    [decision] = story.decisions
    [event] = story.events
    assert (decision.attempt, decision.phase, decision.trace_id) == (1, "dual_write", event.trace_id)
    assert decision.trace_event is not None and decision.trace_event.event_id == event.event_id
    assert decision.latency_ms is not None and decision.latency_ms >= 0
    assert event.delivery.state == "acknowledged"

    _poller(engine, tables).scan_once()
    story = _explain(engine, tables, ids["a"], bus=bus)
    assert "dispatched by the legacy poller" in story.answer.sentence
    assert "while the type was in phase dual_write" in story.answer.sentence


def test_dispatched_by_the_event_path_with_the_event_trace(env: Env) -> None:
    engine, tables = env.engine, env.tables
    _set(engine, "orders", "cutover")
    bus = env.open_bus()
    sched = _scheduler(engine, tables, bus)
    ids = _seed(engine, tables, "ev1", "orders", TaskSpec("a"), TaskSpec("b", ("a",)))
    Relay(engine, bus, RELAY, statuses=tables.mapping.statuses).publish_batch()
    assert sched.poll_once(block=0.0) >= 1
    story = _explain(engine, tables, ids["a"], bus=bus)
    assert story.answer.code == "dispatched"
    assert re.search(rf"was dispatched by the event path at {TIME}, {MS} after it became ready, while the type was "
                     r"in phase cutover; it is now waiting for a worker", story.answer.sentence), story.answer.sentence
    [d] = story.dispatches
    assert d.path == "events" and d.phase == "cutover"
    insert = story.events[0]
    assert insert.change == "insert" and d.trace_id is not None
    # The scheduler handles one instance's events as a batch: the trace is that of one of them (a's or b's insert).
    b_events = _explain(engine, tables, ids["b"]).events
    assert d.trace_id in {e.trace_id for e in (*story.events, *b_events)}
    assert d.trace_event is not None
    assert (d.trace_event.task_key, d.trace_event.change) in {("a", "insert"), ("b", "insert")}
    assert d.trace_event.event_id in {e.event_id for e in (*story.events, *b_events) if e.trace_id == d.trace_id}
    assert insert.delivery.state == "acknowledged"
    assert insert.delivery.partition == partition_for("ev1", bus.partitions)
    # The dispatch itself is captured: its event is in the outbox, not yet published.
    assert [(e.change, e.old_status, e.new_status, e.delivery.state) for e in story.events[1:]] == [
        ("status", "pending", "queued", "unpublished")]


# --- failed, rejected, review ----------------------------------------------------------------------------
def test_failed_terminally_retrying_in_cutover_and_rejected(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "f1", "orders", TaskSpec("a"), TaskSpec("r", awaits_signal="approval"))
    _poller(engine, tables).scan_once()
    assert WorkerPool(engine, tables, FAIL).work_one()
    _set(engine, "orders", "cutover")
    story = _explain(engine, tables, ids["a"])
    assert story.answer.sentence.endswith("failed on attempt 1 of 3 and waits for its retry: the event path "
                                          "re-pends it after its backoff (type in phase cutover).")
    _update(engine, tables, ids["a"], max_attempts=1)
    story = _explain(engine, tables, ids["a"])
    assert story.answer.code == "failed_terminal"
    assert re.search(rf"failed terminally at {TIME} after 1 of 1 attempts; no path will dispatch it again\.$",
                     story.answer.sentence), story.answer.sentence

    record_signal(engine, tables, ids["r"], "rejection", actor="bob")
    story = _explain(engine, tables, ids["r"])
    assert story.answer.code == "rejected"
    assert re.search(rf"was rejected by bob at {TIME} and failed for good; no path will dispatch it\.$",
                     story.answer.sentence), story.answer.sentence
    assert story.dispatches == ()


def test_in_the_review_status_by_hand(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "rv1", "orders", TaskSpec("a"))
    _update(engine, tables, ids["a"], status="review")
    story = _explain(engine, tables, ids["a"])
    assert story.answer.code == "held_for_review"
    assert "not in pollbridge's review queue" in story.answer.sentence


def test_parked_then_rejected_in_the_review_queue(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "rv2", "orders", TaskSpec("a"))
    stop = Parking(ids["a"], "rv2", "orders", "a", 1, "depth", 7, 3)
    with engine.begin() as conn:
        assert park(conn, tables, [stop], "sched-x") == [stop]
    story = _explain(engine, tables, ids["a"])
    assert story.answer.code == "held_for_review" and story.status == "review"
    assert "causation depth 7 > max_depth 3" in story.answer.sentence
    assert f"pollbridge review release {ids['a']}" in story.answer.sentence
    with engine.begin() as conn:
        decide(conn, tables, [str(ids["a"])], "rejected", actor="alice", reason="runaway agent")
    story = _explain(engine, tables, ids["a"])
    assert story.answer.code == "rejected" and "rejected by alice" in story.answer.sentence
    assert "runaway agent" in story.answer.sentence
    assert [e["decision"] for e in story.to_json()["review"]] == ["rejected"]


def test_held_back_by_backpressure(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "hb1", "orders", TaskSpec("a"))
    FlagStore(engine).change("orders", "cutover", actor="t", reason="t")
    with engine.begin() as conn:
        conn.execute(holds.insert().values(task_id=str(ids["a"]), instance_id="hb1", workflow_type="orders",
                                           task_key="a", attempt=1, reason="in_flight", held_at=datetime.now(UTC),
                                           until=datetime.now(UTC) + timedelta(seconds=1), holder="sched-y"))
    story = _explain(engine, tables, ids["a"])
    assert story.answer.code == "held_back", story.answer.sentence
    assert "in-flight cap" in story.answer.sentence and "not an event-path miss" in story.answer.sentence
    assert story.to_json()["hold"]["legitimate"] is True
    with engine.begin() as conn:  # its holder died: the hold is stale, the usual answer comes back
        conn.execute(holds.update().values(until=datetime.now(UTC) - timedelta(seconds=60)))
    assert _explain(engine, tables, ids["a"]).answer.code == "ready_not_dispatched"


def test_an_unknown_task_id_is_a_usage_error(engine: Engine, tables: TaskTable) -> None:
    with pytest.raises(UnknownTask, match=r"no task '424242' in tasks") as caught:
        _explain(engine, tables, "424242")
    assert caught.value.exit_code == 2
    with pytest.raises(UnknownTask, match=r"no task 'not-a-number' in tasks: 'id' holds int values"):
        _explain(engine, tables, "not-a-number")


# --- delivery, on every bus ------------------------------------------------------------------------------
def test_delivery_states_on_every_bus(env: Env) -> None:
    engine, tables = env.engine, env.tables
    bus = env.open_bus()
    bus.ensure_group(GROUP)
    ids = _seed(engine, tables, "dl1", "orders", TaskSpec("a"))

    def delivery() -> Any:
        return _explain(engine, tables, ids["a"], bus=bus).events[-1].delivery

    assert delivery().state == "unpublished"
    relay = Relay(engine, bus, RELAY, statuses=tables.mapping.statuses)
    relay.publish_batch()
    got = delivery()
    assert (got.state, got.partition) == ("undelivered", partition_for("dl1", bus.partitions))
    assert got.entry_id is not None
    entries = bus.read(GROUP, "probe", list(range(bus.partitions)), 10, 0.0)
    assert [e.entry_id for e in entries] == [got.entry_id]
    pending = delivery()
    assert (pending.state, pending.consumer, pending.deliveries) == ("pending", "probe", 1)
    bus.ack(GROUP, entries)
    assert delivery().state == "acknowledged"

    _poller(engine, tables).scan_once()  # a second event: pending -> queued
    relay.publish_batch()
    [second] = bus.read(GROUP, "probe", list(range(bus.partitions)), 10, 0.0)
    bus.dead_letter(GROUP, second, "poison for the test")
    story = _explain(engine, tables, ids["a"], bus=bus)
    assert [e.delivery.state for e in story.events] == ["acknowledged", "dead_lettered"]
    assert {e.delivery.state for e in story.events} <= set(DELIVERY_STATES)

    unknown = _explain(engine, tables, ids["a"], bus=None, bus_error="bus redis://x could not be opened")
    assert {(e.delivery.state, e.delivery.detail) for e in unknown.events} == {
        ("unknown", "bus redis://x could not be opened")}


def test_an_unreachable_bus_makes_delivery_unknown(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "u1", "orders", TaskSpec("a"))
    bus = open_bus("embedded", engine=engine)
    Relay(engine, bus, RELAY, statuses=tables.mapping.statuses).publish_batch()
    dead = open_bus("redis://127.0.0.1:1/0", socket_timeout=1.0)
    try:
        story = _explain(engine, tables, ids["a"], bus=dead)
    finally:
        dead.close()
    [event] = story.events
    assert event.delivery.state == "unknown" and event.delivery.detail.startswith("bus unreachable: ")
    assert story.answer.code == "ready_not_dispatched"  # everything else still comes from the database


# --- JSON ------------------------------------------------------------------------------------------------
def test_json_has_the_documented_keys(engine: Engine, tables: TaskTable) -> None:
    ids = _seed(engine, tables, "j1", "orders", TaskSpec("a"), TaskSpec("b", ("a",), due_in=5, awaits_signal="cb"))
    _poller(engine, tables).scan_once()
    record_signal(engine, tables, ids["b"], "callback")
    doc = _explain(engine, tables, ids["b"]).to_json()
    assert set(doc) == {"task_id", "task", "readiness", "events", "events_truncated", "decisions", "dispatches",
                        "flag", "phases", "review", "hold", "answer"}
    assert set(doc["task"]) == {"id", "instance_id", "task_key", "workflow_type", "status", "logical_status",
                                "attempts", "max_attempts", "dispatched_at", "completed_at", "updated_at"}
    assert set(doc["readiness"]) == {"ready_now", "ready_since", "checked_at", "dependencies", "due_at", "due",
                                     "awaits_signal", "signal_received_at", "signals"}
    assert set(doc["readiness"]["dependencies"][0]) == {"key", "task_id", "status", "logical_status",
                                                        "completed_at", "met"}
    assert set(doc["readiness"]["signals"][0]) == {"kind", "actor", "received_at", "payload"}
    assert set(doc["events"][0]) == {"event_id", "change", "old_status", "new_status", "trace_id", "created_at",
                                     "published_at", "relay_partition", "delivery"}
    assert set(doc["events"][0]["delivery"]) == {"state", "partition", "entry_id", "deliveries", "consumer",
                                                 "detail"}
    assert set(doc["flag"]) == {"phase", "percent", "grace_seconds", "event_route", "poller_route", "source",
                                "detail"}
    assert set(doc["answer"]) == {"code", "sentence"}
    assert doc["answer"]["code"] == "waiting_dependency"
    assert doc["task"]["workflow_type"] == "orders" and doc["task"]["id"] == ids["b"]

    a = _explain(engine, tables, ids["a"]).to_json()
    assert set(a["dispatches"][0]) == {"attempt", "path", "ready_at", "dispatched_at", "latency_ms", "trace_id",
                                       "phase", "trace_event"}
    datetime.fromisoformat(a["dispatches"][0]["dispatched_at"])
