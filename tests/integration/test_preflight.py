"""``pollbridge preflight``: every check passes, and fails for a real reason, on SQLite and PostgreSQL (the bus
embedded, and Redis where the bus matters); the JSON output's keys; exit codes 0, 1 and 2.

Real reasons: a database that cannot be reached, a schema not installed, capture triggers removed, a bus on a
closed port, a relay stopped, a scheduler's heartbeat gone stale or partitions without a consumer, an old
unpublished outbox row, undelivered events, dead letters, missing or unsafe reconciler evidence, a step
skipped, no rollback on record or an old one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Engine

from bridge.app.components import Components
from bridge.bus import EventBus
from bridge.capture.relay import Relay
from bridge.capture.triggers import remove_capture
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent, new_event_id
from bridge.core.mapping import TaskTableMapping
from bridge.core.phases import FixedRouter
from bridge.core.settings import (
    BusSettings,
    GateSettings,
    PreflightSettings,
    RelaySettings,
    SchedulerSettings,
    Settings,
)
from bridge.db.engine import create_engine, db_now
from bridge.db.schema import decisions, flag_audit, outbox, outbox_dead, relay_state
from bridge.flags.store import FlagStore
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.rollout.preflight import CHECKS, PreflightReport, checks_for
from bridge.rollout.promotion import rollback
from bridge.tasktable.dispatch import ReadyTask, dispatch_many
from bridge.tasktable.readiness import ready_predicate, ready_since
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler.leases import lease_store
from event_scheduler.scheduler import EventScheduler
from tests.support import LEASE_STORE_PARAMS, age_scheduler_member, wait_for

PARTITIONS = 4
GROUP = SchedulerSettings().group
EVENT_PATH = [c.name for c in checks_for("cutover")]
KNOWN = TaskSpec("wait", awaits_signal="never")
PLAIN = TaskSpec("a")


@dataclass
class Stack:
    url: str
    engine: Engine
    tables: TaskTable
    settings: Settings
    kind: str

    def open_bus(self) -> EventBus:
        return Components(self.settings).bus(self.engine)

    def run(self, phase: str, workflow_type: str = "orders", **kwargs: Any) -> PreflightReport:
        settings = kwargs.pop("settings", self.settings)
        return run_preflight(self.engine, settings, workflow_type, phase, **kwargs)

    def check(self, phase: str, name: str, **kwargs: Any) -> tuple[bool, str]:
        result = self.run(phase, **kwargs).result(name)
        assert result is not None, f"{name} did not run for {phase}"
        return result.passed, result.detail


def run_preflight(engine: Engine, settings: Settings, workflow_type: str, phase: str, **kwargs: Any
                  ) -> PreflightReport:
    """Preflight as the CLI runs it: the flag store and the bus from the composition root."""
    return Components(settings).preflight(engine, workflow_type, phase, **kwargs)


def _settings(url: str, bus_url: str = "embedded", namespace: str = "pollbridge") -> Settings:
    return Settings(database_url=url, bus_url=bus_url, bus=BusSettings(partitions=PARTITIONS, namespace=namespace),
                    relay=RelaySettings(lease_timeout=1.0),
                    scheduler=SchedulerSettings(lease_ttl=2.0),
                    gates=GateSettings(min_tasks=5, miss_budget=0.5, tolerance=1.0),
                    preflight=PreflightSettings(max_backlog_age=5.0, max_lag=2, heartbeat_timeouts=2.0))


def _seed(engine: Engine, tables: TaskTable, ids: list[str], workflow_type: str = "orders",
          task: TaskSpec = PLAIN) -> None:
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec(i, workflow_type, (task,)) for i in ids])


@pytest.fixture
def stack(db_url: str) -> Iterator[Stack]:
    """SQLite or PostgreSQL with pollbridge installed (capture included) and the embedded bus; one
    ``orders`` instance so the type is known (its task awaits a signal: it is never ready, so it is no evidence)."""
    engine = create_engine(db_url)
    tables = reflect_tables(engine, TaskTableMapping())
    _seed(engine, tables, ["known-0"], task=KNOWN)
    yield Stack(db_url, engine, tables, _settings(db_url), db_url.split(":")[0])
    engine.dispose()


@pytest.fixture
def redis_stack(pg_url: str, redis_server: str, redis_namespace: str) -> Iterator[Stack]:
    engine = create_engine(pg_url)
    tables = reflect_tables(engine, TaskTableMapping())
    _seed(engine, tables, ["known-0"], task=KNOWN)
    yield Stack(pg_url, engine, tables, _settings(pg_url, redis_server, redis_namespace), "postgresql-redis")
    engine.dispose()


# --- the registry and the report ------------------------------------------------------------------------

def test_polling_runs_only_the_database_check(stack: Stack) -> None:
    report = stack.run("polling")
    assert [r.name for r in report.results] == ["database"]
    assert report.passed
    assert list(report.not_applicable) == [c.name for c in CHECKS if c.name != "database"]


def test_the_checks_of_each_phase_run_in_registry_order(stack: Stack) -> None:
    for phase in ("dual_write", "selective", "cutover"):
        report = stack.run(phase)
        assert [r.name for r in report.results] == [c.name for c in checks_for(phase)]
        assert all(r.description for r in report.results)


# --- database ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dialect", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_database_fails_when_unreachable_and_nothing_else_is_checked(dialect: str, tmp_path: Any,
                                                                       request: pytest.FixtureRequest) -> None:
    if dialect == "sqlite":
        url = f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}"
    else:
        request.getfixturevalue("pg_server")
        url = "postgresql://root:secret@127.0.0.1:1/nowhere"  # a closed port
    engine = create_engine(url)
    try:
        report = run_preflight(engine, _settings(url), "orders", "cutover")
    finally:
        engine.dispose()
    database = report.result("database")
    assert database is not None and not database.passed
    assert "cannot connect" in database.detail and "secret" not in database.detail
    assert report.current_phase is None
    for name in ("migrations", "relay_alive", "scheduler_alive", "outbox_backlog", "reconciler_gate",
                 "rollback_rehearsed", "capture_installed"):
        r = report.result(name)
        assert r is not None and not r.passed and r.detail.startswith("not checked: database failed"), (name, r)
    polling = run_preflight(create_engine(url), _settings(url), "orders", "polling")
    assert not polling.passed and [r.name for r in polling.results] == ["database"]


def test_database_passes_with_the_url_masked(stack: Stack) -> None:
    passed, detail = stack.check("polling", "database")
    assert passed and detail.startswith("connected to ")


# --- migrations -----------------------------------------------------------------------------------------

def test_migrations_fail_on_a_database_without_pollbridge(empty_db_url: str) -> None:
    engine = create_engine(empty_db_url)
    try:
        report = run_preflight(engine, _settings(empty_db_url), "orders", "dual_write")
    finally:
        engine.dispose()
    migrations = report.result("migrations")
    assert migrations is not None and not migrations.passed
    assert "not installed" in migrations.detail and "pollbridge init" in migrations.detail
    relay = report.result("relay_alive")
    assert relay is not None and relay.detail.startswith("not checked: migrations failed")


def test_migrations_pass_at_head(stack: Stack) -> None:
    passed, detail = stack.check("dual_write", "migrations")
    assert passed and detail.startswith("at head")


# --- capture_installed ----------------------------------------------------------------------------------

def test_capture_installed_passes_then_fails_once_the_triggers_are_removed(stack: Stack) -> None:
    assert stack.check("dual_write", "capture_installed")[0]
    with stack.engine.begin() as conn:
        remove_capture(conn)
    passed, detail = stack.check("dual_write", "capture_installed")
    assert not passed and "pollbridge_capture_insert" in detail and "pollbridge init" in detail


# --- bus ------------------------------------------------------------------------------------------------

def test_bus_passes_when_reachable(stack: Stack) -> None:
    passed, detail = stack.check("dual_write", "bus")
    assert passed and "reachable" in detail


@pytest.mark.redis
def test_bus_passes_on_redis(redis_stack: Stack) -> None:
    passed, detail = redis_stack.check("dual_write", "bus")
    assert passed and detail.startswith("redis://")


def test_bus_fails_on_a_closed_port_and_its_dependants_are_not_checked(stack: Stack) -> None:
    settings = replace(stack.settings, bus_url="redis://:hunter2@127.0.0.1:1/0")
    report = stack.run("cutover", settings=settings)
    bus = report.result("bus")
    assert bus is not None and not bus.passed and "hunter2" not in bus.detail
    for name in ("consumer_lag", "dead_letters"):
        r = report.result(name)
        assert r is not None and not r.passed and r.detail.startswith("not checked: bus failed"), r
    assert report.result("relay_alive") is not None  # the database checks still ran


# --- relay_alive ----------------------------------------------------------------------------------------

class RelayThread:
    def __init__(self, stack: Stack) -> None:
        self.bus = stack.open_bus()
        self.relay = Relay(stack.engine, self.bus, stack.settings.relay, statuses=stack.tables.statuses)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.relay.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def halt(self) -> None:
        self.stop.set()
        self.thread.join(15)
        self.relay.leadership.release()
        self.bus.close()


def test_relay_alive_follows_a_real_relay(stack: Stack) -> None:
    passed, detail = stack.check("dual_write", "relay_alive")
    assert not passed and "no relay holds" in detail
    relay = RelayThread(stack)
    try:
        wait_for(lambda: stack.check("dual_write", "relay_alive")[0], 20, interval=0.1, what="the relay to be alive")
        passed, detail = stack.check("dual_write", "relay_alive")
        assert detail.startswith("partition 0 held by ") and relay.relay.leadership.holder in detail
    finally:
        relay.halt()
    passed, detail = stack.check("dual_write", "relay_alive")
    assert not passed and "partition 0" in detail


def test_relay_alive_on_sqlite_is_the_lock_file_not_the_row(sqlite_url: str) -> None:
    """A relay that died leaves its row behind, heartbeat fresh: on a SQLite file the check asks the partition's
    lock file, which the kernel released with the process (before: a fresh row passed for 10 s)."""
    engine = create_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            conn.execute(relay_state.insert().values(
                relay_partition=0, armed=False, holder="gone:1:abc",
                heartbeat_at=datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=1)))
        tables = reflect_tables(engine, TaskTableMapping())
        _seed(engine, tables, ["k"])
        result = run_preflight(engine, _settings(sqlite_url), "orders", "dual_write").result("relay_alive")
    finally:
        engine.dispose()
    assert result is not None and not result.passed
    assert "no relay holds its lock file (last holder gone:1:abc)" in result.detail, result.detail


def test_relay_alive_needs_every_relay_partition(stack: Stack) -> None:
    relay = RelayThread(stack)
    try:
        wait_for(lambda: stack.check("dual_write", "relay_alive")[0], 20, interval=0.1, what="the relay to be alive")
        two = replace(stack.settings, capture=replace(stack.settings.capture, relay_partitions=2))
        passed, detail = stack.check("dual_write", "relay_alive", settings=two)
        assert not passed and "partition 1" in detail and "partition 0" not in detail
    finally:
        relay.halt()


# --- scheduler_alive ------------------------------------------------------------------------------------

@pytest.fixture(params=LEASE_STORE_PARAMS)
def any_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """SQLite or PostgreSQL with the embedded bus (leases in the database), or PostgreSQL with Redis
    (leases beside the bus)."""
    kind = str(request.param)
    url = str(request.getfixturevalue("sqlite_url" if kind == "sqlite" else "pg_url"))
    engine = create_engine(url)
    tables = reflect_tables(engine, TaskTableMapping())
    _seed(engine, tables, ["known-0"], task=KNOWN)
    settings = _settings(url) if kind != "redis" else _settings(
        url, str(request.getfixturevalue("redis_server")), str(request.getfixturevalue("redis_namespace")))
    yield Stack(url, engine, tables, settings, kind)
    engine.dispose()


def test_scheduler_alive_follows_the_members_and_their_leases(any_stack: Stack) -> None:
    stack = any_stack
    passed, detail = stack.check("dual_write", "scheduler_alive")
    nobody = "no scheduler process holds a member lock file" if stack.kind == "sqlite" else \
        "no scheduler process is registered"
    assert not passed and nobody in detail, detail

    bus = stack.open_bus()
    leases = lease_store(stack.engine, bus, "host:1:aaa", ttl=2.0)
    leases.refresh()
    passed, detail = stack.check("dual_write", "scheduler_alive")
    assert passed and f"holding all {PARTITIONS} bus partitions" in detail, detail

    # A member that holds only some of the partitions (the bus has more): the others have no consumer.
    more = replace(stack.settings, bus=replace(stack.settings.bus, partitions=PARTITIONS + 2))
    passed, detail = stack.check("dual_write", "scheduler_alive", settings=more)
    assert not passed and f"{PARTITIONS}, {PARTITIONS + 1} of {PARTITIONS + 2}" in detail, detail

    # Its heartbeat goes stale (a crashed process leaves its record behind); on a SQLite file its lock files
    # are released with the process, and nothing is left behind.
    age_scheduler_member(stack.engine, bus, "host:1:aaa", 30, store=leases)
    bus.close()
    passed, detail = stack.check("dual_write", "scheduler_alive")
    if stack.kind == "sqlite":
        assert not passed and "no scheduler process holds a member lock file" in detail, detail
    else:
        assert not passed and "no scheduler process heartbeat within 4 s" in detail and "30." in detail, detail


# --- outbox_backlog -------------------------------------------------------------------------------------

def test_outbox_backlog_fails_on_an_old_unpublished_row(stack: Stack) -> None:
    with stack.engine.begin() as conn:
        conn.execute(outbox.update().values(published_at=db_now(stack.engine.dialect.name)))
    passed, detail = stack.check("dual_write", "outbox_backlog")
    assert passed and detail.startswith("0 unpublished"), detail
    _seed(stack.engine, stack.tables, ["backlog-1", "backlog-2"])  # the capture trigger writes the outbox
    assert stack.check("dual_write", "outbox_backlog")[0]
    old = datetime.now(UTC) - timedelta(seconds=60)
    with stack.engine.begin() as conn:
        conn.execute(outbox.update().where(outbox.c.published_at.is_(None))
                     .values(created_at=old.replace(tzinfo=None) if stack.kind == "sqlite" else old))
    passed, detail = stack.check("dual_write", "outbox_backlog")
    assert not passed and "2 unpublished" in detail and "above max_backlog_age 5 s" in detail, detail


# --- consumer_lag and dead_letters ----------------------------------------------------------------------

def _event(instance: str) -> CloudEvent:
    return CloudEvent(id=new_event_id(), type=TASK_STATUS_CHANGED, subject=instance, partitionkey=instance,
                      time=datetime.now(UTC), data={"task_id": instance, "instance_id": instance,
                                                    "workflow_type": "orders", "task_key": "a", "old_status": None,
                                                    "new_status": "pending", "change": "insert"})


def _lag_and_dead_letters(stack: Stack) -> None:
    bus = stack.open_bus()
    try:
        bus.ensure_group(GROUP)
        assert stack.check("selective", "consumer_lag")[0]
        bus.publish([_event(f"lag-{n}") for n in range(3)])
        passed, detail = stack.check("selective", "consumer_lag")
        assert not passed and "3 entries not yet delivered" in detail and "above max_lag 2" in detail, detail
        got = bus.read(GROUP, "test-consumer", list(range(PARTITIONS)), 10, 1.0)
        assert len(got) == 3
        bus.ack(GROUP, got[1:])
        assert stack.check("selective", "consumer_lag")[0]

        assert stack.check("selective", "dead_letters")[0]
        bus.dead_letter(GROUP, got[0], "handling failed on 5 deliveries (test)")
        passed, detail = stack.check("selective", "dead_letters")
        assert not passed and detail.startswith("1 dead letter(s) on the bus, 0 set aside") and "dlq" in detail
        bus.remove_dead_letters([d.id for d in bus.dead_letters()])
        assert stack.check("selective", "dead_letters")[0]
    finally:
        bus.close()
    with stack.engine.begin() as conn:
        conn.execute(outbox_dead.insert().values(outbox_id=1, reason="unknown status", payload="{}",
                                                 created_at=db_now(stack.engine.dialect.name)))
    passed, detail = stack.check("selective", "dead_letters")
    assert not passed and "1 set aside by the relay" in detail and "pollbridge_outbox_dead" in detail


def test_consumer_lag_and_dead_letters_on_the_embedded_bus(stack: Stack) -> None:
    _lag_and_dead_letters(stack)


@pytest.mark.redis
def test_consumer_lag_and_dead_letters_on_redis(redis_stack: Stack) -> None:
    _lag_and_dead_letters(redis_stack)


def test_dead_letters_gate_only_the_dispatching_phases() -> None:
    assert "dead_letters" not in [c.name for c in checks_for("dual_write")]
    assert "dead_letters" in EVENT_PATH


# --- reconciler_gate ------------------------------------------------------------------------------------

def _ready(stack: Stack, ids: list[str]) -> list[ReadyTask]:
    tt, t = stack.tables, stack.tables.tasks
    src, workflow_type = tt.workflow_type_source(t)
    q = (sa.select(tt.col("id"), tt.col("instance_id"), tt.col("task_key"), workflow_type,
                   tt.col("attempts") + 1, ready_since(tt, t))
         .select_from(src).where(ready_predicate(tt, t), tt.col("instance_id").in_(ids)))
    with stack.engine.connect() as conn:
        return [ReadyTask(*row) for row in conn.execute(q).all()]


def _shadowed(stack: Stack, ids: list[str], *, decide: bool = True) -> None:
    """dual_write evidence: the event path decided (or did not), the poller dispatched."""
    _seed(stack.engine, stack.tables, ids)
    tasks = _ready(stack, ids)
    with stack.engine.begin() as conn:
        if decide:
            for task in tasks:
                conn.execute(decisions.insert().values(
                    task_id=str(task.task_id), instance_id=task.instance_id, workflow_type=task.workflow_type,
                    task_key=task.task_key, attempt=task.attempt, ready_at=task.ready_at,
                    decided_at=db_now(stack.engine.dialect.name)))
        assert len(dispatch_many(conn, stack.tables, tasks, "poller")) == len(ids)


def test_reconciler_gate_for_dual_write_is_the_capture_check(stack: Stack) -> None:
    passed, detail = stack.check("dual_write", "reconciler_gate")
    assert passed and "polling -> dual_write" in detail and "capture_installed ok" in detail
    with stack.engine.begin() as conn:
        remove_capture(conn)
    passed, detail = stack.check("dual_write", "reconciler_gate")
    assert not passed and "capture_installed FAILED" in detail


def test_reconciler_gate_for_selective_counts_the_evidence_of_dual_write(stack: Stack) -> None:
    store = FlagStore(stack.engine)
    store.change("orders", "dual_write", actor="op", reason="test")
    time.sleep(0.01)
    passed, detail = stack.check("selective", "reconciler_gate")
    assert not passed and "min_tasks FAILED (0 compared" in detail, detail

    _shadowed(stack, [f"clean-{n}" for n in range(6)])
    time.sleep(0.01)
    passed, detail = stack.check("selective", "reconciler_gate")
    assert passed and "dual_write -> selective" in detail and "min_tasks ok (6 compared" in detail, detail
    assert stack.check("selective", "reconciler_gate", percent=10.0)[1].startswith("gate dual_write -> selective 10%")

    # Misses (the poller dispatched, the event path recorded nothing) past the budget fail it.
    _shadowed(stack, [f"miss-{n}" for n in range(6)], decide=False)
    time.sleep(0.01)
    passed, detail = stack.check("selective", "reconciler_gate")
    assert not passed and "miss_rate FAILED (6 miss(es) in 12" in detail, detail


def test_reconciler_gate_refuses_a_skipped_step_and_passes_a_demotion(stack: Stack) -> None:
    passed, detail = stack.check("cutover", "reconciler_gate")
    assert not passed and "skips a step" in detail and "next: dual_write" in detail
    FlagStore(stack.engine).change("orders", "selective", actor="op", reason="test", percent=50.0)
    passed, detail = stack.check("dual_write", "reconciler_gate")
    assert passed and "not a promotion" in detail
    passed, detail = stack.check("selective", "reconciler_gate", percent=25.0)
    assert passed and "selective 50% -> selective 25%" in detail
    passed, detail = stack.check("selective", "reconciler_gate", percent=75.0)
    assert not passed and "min_tasks FAILED" in detail


# --- rollback_rehearsed ---------------------------------------------------------------------------------

def test_rollback_rehearsed_needs_a_recent_rollback_of_the_type(stack: Stack) -> None:
    passed, detail = stack.check("selective", "rollback_rehearsed")
    assert not passed and "no rollback of orders was ever recorded" in detail
    store = FlagStore(stack.engine)
    store.change("orders", "dual_write", actor="op", reason="test")
    store.change("orders", "polling", actor="guardian", reason="lag", action="guardian")
    assert not stack.check("selective", "rollback_rehearsed")[0], "a guardian demotion is no rehearsal"
    rollback(store, ["reports"], reason="another type's rehearsal")
    assert not stack.check("selective", "rollback_rehearsed")[0]

    rollback(store, ["orders"], reason="rehearsal")
    passed, detail = stack.check("selective", "rollback_rehearsed")
    assert passed and "within rollback_rehearsal_days 7" in detail, detail

    old = datetime.now(UTC) - timedelta(days=8)
    with stack.engine.begin() as conn:
        conn.execute(flag_audit.update().where(flag_audit.c.action == "rollback").values(
            changed_at=old.replace(tzinfo=None) if stack.kind == "sqlite" else old))
    passed, detail = stack.check("selective", "rollback_rehearsed")
    assert not passed and "older than rollback_rehearsal_days 7" in detail and "8.0 day(s) ago" in detail, detail


# --- everything at once, bad input, the CLI -------------------------------------------------------------

def test_bad_input_is_refused_before_anything_is_read(stack: Stack) -> None:
    from bridge.core.errors import FlagError

    for args in (("orders", "nowhere", None), ("bad name!", "selective", None), ("orders", "selective", 101.0),
                 ("orders", "cutover", 50.0), ("orders", "selective", 12.345)):
        with pytest.raises(FlagError):
            run_preflight(stack.engine, stack.settings, args[0], args[1], percent=args[2])
    with pytest.raises(FlagError, match="unknown workflow type"):
        stack.run("dual_write", workflow_type="no-such-type")
    assert stack.run("polling", workflow_type="no-such-type").passed  # the way back never asks


def _cli(stack: Stack, *args: str) -> tuple[int, str]:
    from bridge.cli.main import cli

    result = CliRunner().invoke(cli, ["--database-url", stack.url, "--bus-url", "embedded", "preflight", *args],
                                env={"POLLBRIDGE_CONFIG": None, "POLLBRIDGE_JSON": None})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout + result.stderr


def test_cli_json_keys_and_exit_codes(stack: Stack) -> None:
    code, out = _cli(stack, "dual_write", "--type", "orders", "--json")
    assert code == 1  # no relay, no scheduler
    data = json.loads(out)
    assert set(data) == {"workflow_type", "phase", "percent", "current_phase", "current_percent", "passed",
                         "failed", "checks", "not_applicable"}
    assert (data["workflow_type"], data["phase"], data["percent"], data["current_phase"], data["passed"]) == \
        ("orders", "dual_write", None, "polling", False)
    assert [c["name"] for c in data["checks"]] == [c.name for c in checks_for("dual_write")]
    assert all(set(c) == {"name", "passed", "detail", "description"} for c in data["checks"])
    assert set(data["failed"]) == {"relay_alive", "scheduler_alive"}
    assert data["not_applicable"] == ["dead_letters", "rollback_rehearsed", "dispatch_writable"]

    code, out = _cli(stack, "polling", "--type", "orders")
    assert code == 0
    assert out.splitlines()[0] == "preflight orders: polling -> polling"
    assert out.splitlines()[1].startswith("[pass] database: connected to ")
    assert out.splitlines()[-1] == "ready: 1 of 1 checks passed"

    code, out = _cli(stack, "selective", "--type", "orders", "--percent", "50")
    assert code == 1 and out.splitlines()[0] == "preflight orders: polling -> selective 50%"
    assert "[FAIL] reconciler_gate: polling -> selective 50% skips a step" in out
    assert out.splitlines()[-1].startswith("not ready: ")

    for args in (("bogus", "--type", "orders"), ("cutover", "--type", "bad name!"), ("dual_write", "--type", "nope"),
                 ("cutover", "--type", "orders", "--percent", "5"), ("cutover",)):
        code, out = _cli(stack, *args)
        assert code == 2, (args, out)
        assert "Traceback" not in out


def test_every_check_passes_with_the_event_path_running(stack: Stack) -> None:
    """The whole checklist green, on real components: a relay thread, a scheduler's leases, evidence, a rollback."""
    store = FlagStore(stack.engine)
    rollback(store, ["orders"], reason="rehearsal")
    store.change("orders", "dual_write", actor="op", reason="test")
    time.sleep(0.01)
    _shadowed(stack, [f"ok-{n}" for n in range(6)])
    time.sleep(0.01)
    relay = RelayThread(stack)
    bus = stack.open_bus()
    scheduler = EventScheduler(stack.engine, stack.tables, bus, stack.settings.scheduler, FixedRouter("polling"))
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)
    thread.start()
    try:
        def green() -> bool:
            report = stack.run("selective")
            failed[:] = [f"{r.name}: {r.detail}" for r in report.failed]
            return report.passed
        failed: list[str] = []
        try:
            wait_for(green, 20, interval=0.2, what="every check to pass")
        except AssertionError:
            raise AssertionError(f"still failing: {failed}") from None
    finally:
        relay.halt()
        stop.set()
        thread.join(15)
        bus.close()
    report = stack.run("cutover")  # skipping selective, and the relay and the scheduler are gone
    assert {r.name for r in report.failed} == {"relay_alive", "scheduler_alive", "reconciler_gate"}
