"""The reference poller on the reference schema and on a differently named one, through the mapping only."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.app import install
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import WorkerSettings
from bridge.db.engine import create_engine
from bridge.db.schema import dispatch_log
from bridge.reference.workload import TaskSpec, WorkflowSpec, demo_workload, seed
from bridge.tasktable.tables import TaskTable, reflect_tables
from legacy_poller.poller import LegacyPoller
from legacy_poller.runner import PollerRunner
from legacy_poller.workers import WorkerPool
from tests.support import drive_until_settled, wait_for

FAST_WORKERS = WorkerSettings(concurrency=3, min_duration=0.0, max_duration=0.005, idle_sleep=0.01)


@pytest.fixture
def workers(engine: Engine, tables: TaskTable) -> Iterator[WorkerPool]:
    pool = WorkerPool(engine, tables, FAST_WORKERS, seed=1)
    pool.start()
    yield pool
    pool.stop()


def test_workload_settles_with_no_lost_double_or_early(engine: Engine, tables: TaskTable,
                                                      workers: WorkerPool) -> None:
    specs = demo_workload(9, 7, prefix="w")
    with engine.begin() as conn:
        total = seed(conn, tables, specs)
    verdict = drive_until_settled(engine, tables, [LegacyPoller(engine, tables)], [s.instance_id for s in specs])
    assert verdict.tasks == total
    assert verdict.completed == total
    assert verdict.dispatches == total
    assert (verdict.lost, verdict.double_dispatched, verdict.early) == (0, 0, 0), verdict.problems


def test_two_pollers_racing_never_double_dispatch(engine: Engine, tables: TaskTable, workers: WorkerPool) -> None:
    specs = demo_workload(12, 6, prefix="race")
    with engine.begin() as conn:
        total = seed(conn, tables, specs)
    a, b = LegacyPoller(engine, tables, batch_size=3), LegacyPoller(engine, tables, batch_size=3)
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            b.scan_once()

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        verdict = drive_until_settled(engine, tables, [a], [s.instance_id for s in specs])
    finally:
        stop.set()
        thread.join(30)
    assert verdict.dispatches == total
    assert verdict.double_dispatched == 0 and verdict.early == 0


def test_due_time_and_signal_gate_dispatch(engine: Engine, tables: TaskTable) -> None:
    spec = WorkflowSpec("gated", "orders", (TaskSpec("timer", due_in=1.5), TaskSpec("approval", awaits_signal="ok")))
    with engine.begin() as conn:
        seed(conn, tables, [spec])
    poller = LegacyPoller(engine, tables)
    assert poller.scan_once().dispatched == 0

    def dispatched_keys() -> set[str]:
        with engine.connect() as conn:
            return set(conn.execute(sa.select(dispatch_log.c.task_key)).scalars())

    wait_for(lambda: poller.scan_once().dispatched == 1 or bool(dispatched_keys()), 10, what="timer task dispatch")
    assert dispatched_keys() == {"timer"}
    with engine.begin() as conn:
        now = sa.func.clock_timestamp() if engine.dialect.name == "postgresql" else sa.func.datetime("now")
        conn.execute(tables.tasks.update().where(tables.tasks.c.task_key == "approval")
                     .values(signal_received_at=now))
    assert poller.scan_once().dispatched == 1
    assert dispatched_keys() == {"timer", "approval"}


def test_scan_metrics_count_examined_and_empty_scans(engine: Engine, tables: TaskTable) -> None:
    specs = [WorkflowSpec("m", "orders", (TaskSpec("a"), TaskSpec("b", ("a",)), TaskSpec("c", ("b",))))]
    with engine.begin() as conn:
        seed(conn, tables, specs)
    registry = CollectorRegistry()
    poller = LegacyPoller(engine, tables, registry=registry)
    first = poller.scan_once()
    assert (first.examined, first.ready, first.dispatched) == (3, 1, 1)
    second = poller.scan_once()
    assert (second.examined, second.dispatched) == (2, 0)
    assert registry.get_sample_value("pollbridge_poller_scans_total") == 2
    assert registry.get_sample_value("pollbridge_poller_empty_scans_total") == 1
    assert registry.get_sample_value("pollbridge_poller_rows_examined_total") == 5


def test_failed_task_with_attempts_left_is_retried(engine: Engine, tables: TaskTable) -> None:
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec("retry", "orders", (TaskSpec("a"),))])
    poller = LegacyPoller(engine, tables)
    assert poller.scan_once().dispatched == 1
    t = tables.tasks
    with engine.begin() as conn:  # a worker ran it and it failed on attempt 1 of 3
        conn.execute(t.update().where(t.c.instance_id == "retry").values(status="failed", attempts=1))
    result = poller.scan_once()
    assert (result.repended, result.dispatched) == (1, 1)
    with engine.begin() as conn:  # the last attempt fails: no more retries
        conn.execute(t.update().where(t.c.instance_id == "retry").values(status="failed", attempts=3))
    assert poller.scan_once().repended == 0
    with engine.connect() as conn:
        attempts = sorted(conn.execute(sa.select(dispatch_log.c.attempt)).scalars())
    assert attempts == [1, 2]


def test_runner_scans_on_its_interval_and_stops_cleanly(engine: Engine, tables: TaskTable) -> None:
    poller = LegacyPoller(engine, tables)
    runner = PollerRunner(poller, interval=0.05)
    runner.start()
    try:
        wait_for(lambda: poller.metrics.value("pollbridge_poller_scans_total") >= 3, 10, what="three scans")
    finally:
        runner.stop()
    after_stop = poller.metrics.value("pollbridge_poller_scans_total")
    threading.Event().wait(0.2)
    assert poller.metrics.value("pollbridge_poller_scans_total") == after_stop
    assert runner.errors == 0


# --- a second, differently named schema, reached only through the mapping -------------------------

ALT_MAPPING = {
    "table": "jobs",
    "columns": {
        "id": "job_id", "instance_id": "run_ref", "task_key": "step", "status": "state",
        "workflow_type": "kind", "depends_on": "", "due_at": "not_before",
        "awaits_signal": "wait_for", "signal_received_at": "signal_at",
        "dispatched_at": "sent_at", "completed_at": "finished_at",
        "updated_at": "", "attempts": "", "max_attempts": "",
    },
    "statuses": {"pending": "NEW", "dispatched": "SENT", "running": "BUSY", "completed": "DONE", "failed": "ERR"},
    "dependencies": {"mode": "edges", "table": "job_needs", "task_id": "job", "depends_on_id": "needs_job"},
}


def _create_alt_schema(engine: Engine) -> None:
    md = sa.MetaData()
    sa.Table("jobs", md,
             sa.Column("job_id", sa.Integer, primary_key=True, autoincrement=True),
             sa.Column("run_ref", sa.String(64), nullable=False),
             sa.Column("step", sa.String(64), nullable=False),
             sa.Column("kind", sa.String(64), nullable=False),
             sa.Column("state", sa.String(8), nullable=False),
             sa.Column("not_before", sa.DateTime(timezone=True)),
             sa.Column("wait_for", sa.String(64)),
             sa.Column("signal_at", sa.DateTime(timezone=True)),
             sa.Column("sent_at", sa.DateTime(timezone=True)),
             sa.Column("finished_at", sa.DateTime(timezone=True)))
    sa.Table("job_needs", md,
             sa.Column("job", sa.Integer, nullable=False),
             sa.Column("needs_job", sa.Integer, nullable=False))
    md.create_all(engine)


def test_alternative_schema_through_the_mapping_alone(empty_db_url: str) -> None:
    engine = create_engine(empty_db_url)
    try:
        _create_alt_schema(engine)
        mapping = TaskTableMapping.from_dict(ALT_MAPPING)
        install.init(engine, mapping=mapping)
        tables = reflect_tables(engine, mapping)
        specs = demo_workload(6, 5, prefix="alt")
        with engine.begin() as conn:
            total = seed(conn, tables, specs)
            assert conn.execute(sa.text("SELECT count(*) FROM job_needs")).scalar_one() > 0
            assert set(conn.execute(sa.text("SELECT DISTINCT state FROM jobs")).scalars()) == {"NEW"}
        pool = WorkerPool(engine, tables, FAST_WORKERS, seed=2)
        pool.start()
        try:
            verdict = drive_until_settled(engine, tables, [LegacyPoller(engine, tables)],
                                          [s.instance_id for s in specs])
        finally:
            pool.stop()
        assert verdict.completed == verdict.dispatches == total
        assert (verdict.double_dispatched, verdict.early) == (0, 0), verdict.problems
        with engine.connect() as conn:
            assert set(conn.execute(sa.text("SELECT DISTINCT state FROM jobs")).scalars()) == {"DONE"}
            types = set(conn.execute(sa.select(dispatch_log.c.workflow_type)).scalars())
        assert types == {"orders", "reports", "etl"}
    finally:
        engine.dispose()


def test_idle_workers_take_no_write_lock_on_sqlite(sqlite_url: str) -> None:
    """SQLite has one write lock; idle workers look for a dispatched task without it (PostgreSQL has no
    such lock: its workers claim with SKIP LOCKED), and on a database file they do not even look while
    nothing commits: they wait for a commit (bridge.db.changes; they looked every idle_sleep, 80 looks a
    second for four workers). A task dispatched by another process (a connection that is not pollbridge's:
    only the file watcher can see its commit) is picked up long before their 5 s fallback look."""
    engine = create_engine(sqlite_url)
    tables = reflect_tables(engine, TaskTableMapping())
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec("idle", "orders", (TaskSpec("a"),))])
    workers = WorkerPool(engine, tables, FAST_WORKERS, seed=1)
    statements: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *rest: object) -> None:
        statements.append(statement)

    workers.start()
    try:
        threading.Event().wait(0.3)  # each worker's first look
        sa.event.listen(engine, "before_cursor_execute", seen)
        try:
            threading.Event().wait(1.0)
        finally:
            sa.event.remove(engine, "before_cursor_execute", seen)
        assert not [s for s in statements if s.upper().startswith("BEGIN IMMEDIATE")], statements[:5]
        assert len(statements) <= 2 * FAST_WORKERS.concurrency, statements  # at most a look each (was ~300)
        other = sqlite3.connect(engine.url.database or "", isolation_level=None)
        try:
            other.execute("UPDATE tasks SET status = ?", (tables.statuses.dispatched,))
        finally:
            other.close()
        wait_for(lambda: workers.stats().completed == 1, 2.5, what="the dispatched task worked before the fallback")
    finally:
        workers.stop()
        engine.dispose()
