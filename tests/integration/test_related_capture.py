"""A second engine's shapes, attached by configuration alone (issue 17, item 1's general case), on SQLite and
PostgreSQL: not Airflow, not the reference schema.

The "stages" engine keeps a workflow's steps in ``st_steps`` (dependencies as a JSON array of step names in
``needs``), but a step's state lives in the job row it points at (``st_jobs.state``, with ``finished_at`` and
``attempt``), and the run's pipeline (the workflow type) in ``st_runs``. pollbridge is attached with a
mapping, a view the user owns (``install_sql``) that joins the three, and ``[[mapping.related]]`` that
captures ``st_jobs`` too: capture sits on ``st_steps`` (a step row inserted) and on ``st_jobs`` (a change of
``state`` or ``finished_at`` is a status change of the steps pointing at the job). The engine itself is plain
SQL here, in ``dual_write`` with ``[legacy] kind = "foreign"``.

Proves: a job's state change reaches the event scheduler as its step's status change; the shadow decisions
are the engine's readiness (the fan-out after ``a``, the join after ``b`` and ``c``); the engine's
dispatches are the legacy evidence, one per attempt; a heartbeat on the job row captures nothing; nothing
is written to the engine's tables; doctor's capture check covers both tables and ``uninstall`` removes
every trigger and function. On PostgreSQL with ``track_commit_timestamp``, a ``finished_at`` stamped
before the commit (here: backdated) does not make the dependent look ready before the commit
(``committed_at`` floors the ready time).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.app import install
from bridge.bus import open_bus
from bridge.capture import wal
from bridge.capture.relay import Relay
from bridge.capture.triggers import capture_status, installed_triggers
from bridge.capture.wal import WalCapture, capture_state, slot_state
from bridge.core.errors import MappingMismatch
from bridge.core.mapping import TaskTableMapping
from bridge.core.phases import FixedRouter
from bridge.core.settings import CaptureSettings, RelaySettings, SchedulerSettings
from bridge.db.clock import db_clock
from bridge.db.engine import create_engine
from bridge.db.schema import decisions, dispatch_log, outbox
from bridge.tasktable.dispatch import write_blocker
from bridge.tasktable.tables import reflect_tables
from event_scheduler.scheduler import EventScheduler
from tests.support import drain
from tests.support.wal import wal_available

SCHEMA = {
    "sqlite": [
        "CREATE TABLE st_runs (id TEXT PRIMARY KEY, pipeline TEXT NOT NULL)",
        "CREATE TABLE st_jobs (id INTEGER PRIMARY KEY, state TEXT NOT NULL DEFAULT 'waiting', attempt INTEGER "
        "NOT NULL DEFAULT 0, finished_at TIMESTAMP, heartbeat_at TIMESTAMP)",
        "CREATE TABLE st_steps (id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, name TEXT NOT NULL, needs TEXT NOT NULL "
        "DEFAULT '[]', job_id INTEGER NOT NULL REFERENCES st_jobs (id))",
    ],
    "postgresql": [
        "CREATE TABLE st_runs (id text PRIMARY KEY, pipeline text NOT NULL)",
        "CREATE TABLE st_jobs (id serial PRIMARY KEY, state text NOT NULL DEFAULT 'waiting', attempt integer "
        "NOT NULL DEFAULT 0, finished_at timestamptz, heartbeat_at timestamptz)",
        "CREATE TABLE st_steps (id serial PRIMARY KEY, run_id text NOT NULL, name text NOT NULL, needs text NOT NULL "
        "DEFAULT '[]', job_id integer NOT NULL REFERENCES st_jobs (id))",
        "CREATE INDEX st_steps_job ON st_steps (job_id)",
    ],
}

#: The user's own SQL: the view pollbridge reads. On PostgreSQL it also says when the job row's latest change
#: committed (NULL unless track_commit_timestamp is on), which floors the ready time.
VIEW = {
    "sqlite": """-- name: install
CREATE VIEW IF NOT EXISTS pollbridge_st_tasks AS
SELECT s.id, s.run_id, s.name, s.needs, s.job_id, j.state, j.attempt, j.finished_at, r.pipeline,
       'run:' || s.run_id AS run_key
FROM st_steps s JOIN st_jobs j ON j.id = s.job_id JOIN st_runs r ON r.id = s.run_id;

-- name: uninstall
DROP VIEW IF EXISTS pollbridge_st_tasks;
""",
    "postgresql": """-- name: install
CREATE OR REPLACE VIEW pollbridge_st_tasks AS
SELECT s.id, s.run_id, s.name, s.needs, s.job_id, j.state, j.attempt, j.finished_at, r.pipeline,
       'run:' || s.run_id AS run_key,
       CASE WHEN current_setting('track_commit_timestamp') = 'on'
            THEN pg_xact_commit_timestamp(j.xmin) END AS committed_at
FROM st_steps s JOIN st_jobs j ON j.id = s.job_id JOIN st_runs r ON r.id = s.run_id;

-- name: uninstall
DROP VIEW IF EXISTS pollbridge_st_tasks;
""",
}


#: The PostgreSQL view made writable by the user's own INSTEAD OF trigger: a step's state written through the view
#: lands on its job row (what pollbridge's dispatch needs in selective and cutover).
WRITABLE = VIEW["postgresql"].replace("""
-- name: uninstall
DROP VIEW IF EXISTS pollbridge_st_tasks;
""", """
CREATE FUNCTION pollbridge_st_tasks_write() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  UPDATE st_jobs SET state = NEW.state, attempt = NEW.attempt, finished_at = NEW.finished_at WHERE id = OLD.job_id;
  RETURN NEW;
END
$f$;
CREATE TRIGGER pollbridge_st_tasks_write INSTEAD OF UPDATE ON pollbridge_st_tasks
FOR EACH ROW EXECUTE FUNCTION pollbridge_st_tasks_write();

-- name: uninstall
DROP VIEW IF EXISTS pollbridge_st_tasks;
DROP FUNCTION IF EXISTS pollbridge_st_tasks_write();
""")


def _mapping(dialect: str, sql_file: Path, instance_id: str = "run_id") -> TaskTableMapping:
    columns: dict[str, Any] = {
        "id": "id", "instance_id": instance_id, "task_key": "name", "status": "state", "depends_on": "needs",
        "workflow_type": "pipeline", "completed_at": "finished_at", "attempts": "attempt",
        "due_at": "", "awaits_signal": "", "signal_received_at": "", "dispatched_at": "", "updated_at": "",
        "max_attempts": "",
    }
    if dialect == "postgresql":
        columns["committed_at"] = "committed_at"
    return TaskTableMapping.from_dict({
        "table": "st_steps", "read_table": "pollbridge_st_tasks", "install_sql": str(sql_file), "instances": False,
        "columns": columns,
        "statuses": {"pending": "waiting", "dispatched": "queued", "running": "running", "completed": "done",
                     "failed": "error", "review": ""},
        "dispatch": {"attempt_moves": "dispatch", "set": {"attempt": "increment"}},
        "related": [{"table": "st_jobs", "match": {"job_id": "id"}, "watch": ["state", "finished_at"],
                     "columns": {"state": "state", "attempt": "attempt"}}],
    })


class Stages:
    """The engine (plain SQL) with pollbridge attached in dual_write: relay (foreign evidence) and scheduler.
    ``mode``: the capture, triggers or (PostgreSQL) the write-ahead log, streamed by :meth:`capture`."""

    def __init__(self, url: str, tmp_path: Path, *, phase: str = "dual_write", writable: bool = False,
                 instance_id: str = "run_id", mode: str = "trigger") -> None:
        self.engine = create_engine(url)
        self.dialect = self.engine.dialect.name
        self.mode = mode
        if mode == "wal":
            if self.dialect != "postgresql":
                self.engine.dispose()
                pytest.skip("write-ahead-log capture is PostgreSQL's")
            wal_available(url)
        with self.engine.begin() as conn:
            for statement in SCHEMA[self.dialect]:
                conn.exec_driver_sql(statement)
        sql_file = tmp_path / "stages.sql"
        sql_file.write_text(WRITABLE if writable else VIEW[self.dialect])
        self.mapping = _mapping(self.dialect, sql_file, instance_id)
        install.init(self.engine, mapping=self.mapping, capture=CaptureSettings(mode=mode))
        self.tables = reflect_tables(self.engine, self.mapping)
        self.bus = open_bus("embedded", engine=self.engine, partitions=2)
        self.streamer = WalCapture(self.engine, self.tables, self.bus, foreign=self.mapping) if mode == "wal" \
            else None
        self.relay = Relay(self.engine, self.bus, RelaySettings(batch_size=100, purge_interval=3600),
                           statuses=self.mapping.statuses, foreign=self.mapping)
        self.sched = EventScheduler(self.engine, self.tables, self.bus,
                                    SchedulerSettings(group="stages", block=0.05, lease_ttl=30.0),
                                    FixedRouter(phase), visibility_timeout=30.0, registry=CollectorRegistry(),
                                    pollbridge_retries=False)
        self.sched.refresh_leases()
        self.uninstalled = False

    def close(self) -> None:
        if not self.uninstalled:
            self.sched.leases.release_all()
        self.bus.close()
        self.engine.dispose()

    # --- the engine ------------------------------------------------------------------------------------------
    def start_run(self, run_id: str, steps: dict[str, list[str]]) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO st_runs (id, pipeline) VALUES (:r, 'etl')"), {"r": run_id})
            for name, needs in steps.items():
                job = conn.execute(sa.text("INSERT INTO st_jobs (state) VALUES ('waiting') RETURNING id")).scalar_one()
                conn.execute(sa.text("INSERT INTO st_steps (run_id, name, needs, job_id) VALUES (:r, :n, :d, :j)"),
                             {"r": run_id, "n": name, "d": "[" + ", ".join(f'"{n}"' for n in needs) + "]", "j": job})

    def job(self, run_id: str, name: str, assignments: str, **params: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE st_jobs SET {assignments} WHERE id = (SELECT job_id FROM st_steps "
                                 "WHERE run_id = :r AND name = :n)"), {"r": run_id, "n": name, **params})

    def run_step(self, run_id: str, name: str) -> None:
        """The engine dispatches the step (its attempt rises at dispatch), runs it, finishes it."""
        self.job(run_id, name, "state = 'queued', attempt = attempt + 1")
        self.job(run_id, name, "state = 'running'")
        self.job(run_id, name, "state = 'done', finished_at = CURRENT_TIMESTAMP")

    # --- pollbridge -------------------------------------------------------------------------------------------
    def capture(self) -> int:
        """Write what the capture has not written yet (the triggers write as the engine writes; the log's
        changes are streamed now). How many outbox rows."""
        return self.streamer.catch_up() if self.streamer is not None else 0

    def drain(self) -> None:
        if self.streamer is None:
            drain(self.relay, self.sched)
            return
        for _ in range(10):  # the log's rows are written published: stream, then let the scheduler handle them
            moved = self.capture()
            while self.sched.poll_once(block=0.0):
                moved += 1
            if not moved:
                return

    def decided(self) -> list[tuple[str, int]]:
        with self.engine.connect() as conn:
            return sorted((str(r.task_key), int(r.attempt)) for r in conn.execute(
                sa.select(decisions.c.task_key, decisions.c.attempt)))

    def evidence(self) -> list[tuple[str, str, int]]:
        with self.engine.connect() as conn:
            return sorted((str(r.task_key), str(r.path), int(r.attempt)) for r in conn.execute(
                sa.select(dispatch_log.c.task_key, dispatch_log.c.path, dispatch_log.c.attempt)))

    def engine_rows(self) -> dict[str, list[tuple[Any, ...]]]:
        with self.engine.connect() as conn:
            return {t: [tuple(r) for r in conn.execute(sa.text(f"SELECT * FROM {t} ORDER BY id"))]
                    for t in ("st_runs", "st_jobs", "st_steps")}


@pytest.fixture(params=["trigger", "wal"])
def mode(request: pytest.FixtureRequest) -> str:
    """The capture: triggers, or the write-ahead log (PostgreSQL only: skipped on SQLite)."""
    return str(request.param)


@pytest.fixture
def stages(empty_db_url: str, tmp_path: Path, mode: str) -> Iterator[Stages]:
    s = Stages(empty_db_url, tmp_path, mode=mode)
    yield s
    s.close()


DIAMOND = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}


def test_a_job_state_change_is_captured_as_its_steps_status_change(stages: Stages) -> None:
    stages.start_run("r1", DIAMOND)
    stages.capture()
    with stages.engine.begin() as conn:
        conn.execute(outbox.delete())
    stages.job("r1", "a", "state = 'queued', attempt = attempt + 1")
    stages.job("r1", "a", "heartbeat_at = CURRENT_TIMESTAMP")  # not watched: nothing captured
    stages.capture()
    with stages.engine.connect() as conn:
        rows = conn.execute(sa.select(outbox.c.task_key, outbox.c.instance_id, outbox.c.workflow_type,
                                      outbox.c.change, outbox.c.old_status, outbox.c.new_status,
                                      outbox.c.attempt)).all()
    assert [tuple(r) for r in rows] == [("a", "r1", "etl", "status", None, "queued", 1)]


def test_steps_inserted_are_captured_with_the_status_read_through_the_view(stages: Stages) -> None:
    stages.start_run("r1", {"a": []})
    stages.capture()
    with stages.engine.connect() as conn:
        rows = conn.execute(sa.select(outbox.c.task_key, outbox.c.change, outbox.c.new_status)
                            .where(outbox.c.change == "insert")).all()
    assert [tuple(r) for r in rows] == [("a", "insert", "waiting")]


def test_shadow_decisions_follow_the_engine_and_its_dispatches_are_the_evidence(stages: Stages) -> None:
    stages.start_run("r1", DIAMOND)
    stages.drain()
    assert stages.decided() == [("a", 1)]  # only the root is ready
    before = stages.engine_rows()

    stages.run_step("r1", "a")
    stages.drain()
    assert stages.decided() == [("a", 1), ("b", 1), ("c", 1)]  # the fan-out, once a's job is done
    stages.run_step("r1", "b")
    stages.drain()
    assert stages.decided() == [("a", 1), ("b", 1), ("c", 1)]  # the join waits for c
    stages.run_step("r1", "c")
    stages.drain()
    assert stages.decided() == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    assert stages.evidence() == [("a", "poller", 1), ("b", "poller", 1), ("c", "poller", 1)]

    after = stages.engine_rows()
    assert after["st_steps"] == before["st_steps"]  # pollbridge wrote nothing to the engine's tables
    assert len(after["st_jobs"]) == len(before["st_jobs"])
    assert [r[1] for r in after["st_jobs"]] == ["done", "done", "done", "waiting"]  # the engine's own writes


def test_doctor_covers_both_tables_and_uninstall_removes_everything(stages: Stages) -> None:
    if stages.mode == "wal":
        _doctor_and_uninstall_wal(stages)
        return
    with stages.engine.connect() as conn:
        ok, line = capture_status(conn, stages.tables)
        assert ok, line
        assert "'st_steps'" in line and "'st_jobs'" in line
        on = sorted(installed_triggers(conn))
    assert [name for name, _ in on] == ["pollbridge_capture_insert", "pollbridge_capture_r1_insert",
                                        "pollbridge_capture_r1_update", "pollbridge_capture_update"]
    with stages.engine.begin() as conn:
        on_table = " ON st_jobs" if stages.dialect == "postgresql" else ""
        conn.exec_driver_sql(f"DROP TRIGGER pollbridge_capture_r1_update{on_table}")
    with stages.engine.connect() as conn:
        ok, line = capture_status(conn, stages.tables)
    assert not ok and "missing on 'st_jobs'" in line and "pollbridge_capture_r1_update" in line

    stages.sched.leases.release_all()
    stages.uninstalled = True
    install.uninstall_all(stages.engine, stages.bus, stages.mapping)
    with stages.engine.connect() as conn:
        assert installed_triggers(conn) == []
        if stages.dialect == "postgresql":
            functions = conn.exec_driver_sql(
                "SELECT proname FROM pg_proc WHERE proname LIKE 'pollbridge%%'").scalars().all()
            assert functions == []
        assert not sa.inspect(conn).has_table("pollbridge_outbox")
        assert "pollbridge_st_tasks" not in sa.inspect(conn).get_view_names()
        assert sa.inspect(conn).has_table("st_jobs")  # the engine's tables stay


def _doctor_and_uninstall_wal(stages: Stages) -> None:
    """The log's capture: the publication carries both tables (doctor says so when one is missing), no trigger or
    function anywhere; uninstall drops the publication and the slot."""
    with stages.engine.connect() as conn:
        ok, line = capture_state(conn, stages.tables, "wal")
        assert ok, line
        assert installed_triggers(conn) == []
        published = sorted(conn.exec_driver_sql(
            "SELECT tablename FROM pg_publication_tables WHERE pubname = 'pollbridge_publication'").scalars())
        assert published == ["st_jobs", "st_steps"]
    with stages.engine.begin() as conn:
        conn.exec_driver_sql("ALTER PUBLICATION pollbridge_publication DROP TABLE st_jobs")
    with stages.engine.connect() as conn:
        ok, line = capture_state(conn, stages.tables, "wal")
    assert not ok and "'st_jobs'" in line and "pollbridge init" in line, line

    stages.sched.leases.release_all()
    stages.uninstalled = True
    install.uninstall_all(stages.engine, stages.bus, stages.mapping)
    with stages.engine.connect() as conn:
        assert not wal.publication_exists(conn)
        assert not slot_state(conn).exists
        assert "pollbridge_st_tasks" not in sa.inspect(conn).get_view_names()


def _engine_tables_only(url: str, tmp_path: Path, *, without_key: bool = False) -> tuple[Engine, Path]:
    """PostgreSQL with the engine's tables (``without_key``: st_jobs without a primary key) and the view's SQL
    file, nothing of pollbridge's installed; skipped elsewhere or where the log cannot be read."""
    if not url.startswith("postgresql"):
        pytest.skip("write-ahead-log capture is PostgreSQL's")
    wal_available(url)
    engine = create_engine(url)
    with engine.begin() as conn:
        for statement in SCHEMA["postgresql"]:
            if without_key:
                statement = statement.replace("st_jobs (id serial PRIMARY KEY", "st_jobs (id serial") \
                    .replace(" REFERENCES st_jobs (id)", "")
            conn.exec_driver_sql(statement)
    sql_file = tmp_path / "stages.sql"
    sql_file.write_text(VIEW["postgresql"])
    return engine, sql_file


def test_wal_refuses_a_related_table_it_would_make_postgresql_refuse_updates_of(
        empty_db_url: str, tmp_path: Path) -> None:
    """A related table without a primary key (no replica identity) in the publication would make PostgreSQL refuse
    every UPDATE of it: init refuses the mode in one line, creates no publication and no slot, and the engine's
    updates go on."""
    engine, sql_file = _engine_tables_only(empty_db_url, tmp_path, without_key=True)
    try:
        with pytest.raises(MappingMismatch) as refused:
            install.init(engine, mapping=_mapping("postgresql", sql_file), capture=CaptureSettings(mode="wal"))
        assert "'st_jobs'" in str(refused.value) and "primary key" in str(refused.value)
        assert "\n" not in str(refused.value)
        with engine.begin() as conn:
            assert not wal.publication_exists(conn)
            assert not slot_state(conn).exists
            conn.exec_driver_sql("INSERT INTO st_jobs (state) VALUES ('waiting')")
            conn.exec_driver_sql("UPDATE st_jobs SET state = 'done'")  # the engine's writes are untouched
    finally:
        engine.dispose()


def test_a_completion_stamped_before_its_commit_is_floored_at_the_commit(stages: Stages) -> None:
    if stages.dialect != "postgresql":
        pytest.skip("commit timestamps are PostgreSQL's (track_commit_timestamp)")
    with stages.engine.connect() as conn:
        tracked = conn.exec_driver_sql("SHOW track_commit_timestamp").scalar() == "on"
    if not tracked:
        message = ("PostgreSQL's track_commit_timestamp is off; enable it: psql -c 'ALTER SYSTEM SET "
                   "track_commit_timestamp = on' and restart the server (.ci/run does)")
        if os.environ.get("POLLBRIDGE_REQUIRE_SERVICES") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    stages.start_run("r1", {"a": [], "b": ["a"]})
    stages.job("r1", "a", "state = 'queued', attempt = attempt + 1")
    before_commit = db_clock(stages.engine)
    # The engine stamps finished_at long before it commits (here: a minute before the statement runs).
    stages.job("r1", "a", "state = 'done', finished_at = CURRENT_TIMESTAMP - interval '60 seconds'")
    stages.drain()
    with stages.engine.connect() as conn:
        ready_at = conn.execute(sa.select(decisions.c.ready_at).where(decisions.c.task_key == "b")).scalar_one()
    assert ready_at >= before_commit, (ready_at, before_commit)
    assert ready_at - before_commit < timedelta(seconds=30)


def test_writes_through_a_join_view_need_the_users_instead_of_trigger(empty_db_url: str, tmp_path: Path) -> None:
    """The dispatching phases write the step's status through the read view: preflight's dispatch_writable says
    whether that can work; with the user's INSTEAD OF trigger it does, and the job row takes the dispatch."""
    plain = Stages(empty_db_url, tmp_path)
    try:
        with plain.engine.connect() as conn:
            blocker = write_blocker(conn, plain.tables)
        if plain.dialect == "sqlite":
            assert blocker is not None and "SQLite does not report the rows" in blocker
            return
        assert blocker is not None and "'state', 'attempt', 'finished_at'" in blocker and "INSTEAD OF UPDATE" in blocker
        install.uninstall_all(plain.engine, plain.bus, plain.mapping)
        plain.uninstalled = True
    finally:
        plain.close()
    with create_engine(empty_db_url).begin() as conn:
        for table in ("st_steps", "st_jobs", "st_runs"):
            conn.exec_driver_sql(f"DROP TABLE {table}")

    stages = Stages(empty_db_url, tmp_path, phase="cutover", writable=True)
    try:
        with stages.engine.connect() as conn:
            assert write_blocker(conn, stages.tables) is None
        stages.start_run("r1", {"a": [], "b": ["a"]})
        stages.drain()
        with stages.engine.connect() as conn:
            states = dict(conn.execute(sa.text(
                "SELECT s.name, j.state FROM st_steps s JOIN st_jobs j ON j.id = s.job_id")).all())
        assert states == {"a": "queued", "b": "waiting"}  # pollbridge dispatched a, through the view
        assert stages.evidence() == [("a", "events", 1)]
    finally:
        stages.close()


def test_a_key_the_view_computes_is_captured_as_the_view_computes_it(empty_db_url: str, tmp_path: Path,
                                                                    mode: str) -> None:
    """instance_id is an expression of the user's view ('run:' || run_id), not a column of either captured table:
    the step's insert and its job's change both carry it, and the shadow decision is made for that instance."""
    stages = Stages(empty_db_url, tmp_path, instance_id="run_key", mode=mode)
    try:
        stages.start_run("r1", {"a": [], "b": ["a"]})
        stages.job("r1", "a", "state = 'queued', attempt = attempt + 1")
        stages.capture()
        with stages.engine.connect() as conn:
            captured = {(str(r.change), str(r.instance_id)) for r in conn.execute(
                sa.select(outbox.c.change, outbox.c.instance_id))}
        assert captured == {("insert", "run:r1"), ("status", "run:r1")}
        stages.drain()
        stages.job("r1", "a", "state = 'done', finished_at = CURRENT_TIMESTAMP")
        stages.drain()
        with stages.engine.connect() as conn:
            decided = sorted((str(r.instance_id), str(r.task_key)) for r in conn.execute(
                sa.select(decisions.c.instance_id, decisions.c.task_key)))
        assert decided == [("run:r1", "a"), ("run:r1", "b")]
    finally:
        stages.close()


def test_wal_needs_the_status_from_the_change_itself(empty_db_url: str, tmp_path: Path) -> None:
    """The view takes the status from st_jobs: read after the commit, a dispatch followed at once by the start would
    be read as running and the engine's dispatch missed as evidence. Without mapping.related.columns naming it the
    mode is refused in one line, and nothing is created."""
    engine, sql_file = _engine_tables_only(empty_db_url, tmp_path)
    try:
        mapping = _mapping("postgresql", sql_file)
        mapping = dataclasses.replace(mapping, related=tuple(dataclasses.replace(r, columns=())
                                                             for r in mapping.related))
        with pytest.raises(MappingMismatch) as refused:
            install.init(engine, mapping=mapping, capture=CaptureSettings(mode="wal"))
        assert "columns = {state = " in str(refused.value) and "\n" not in str(refused.value)
        with engine.connect() as conn:
            assert not wal.publication_exists(conn)
            assert not slot_state(conn).exists
    finally:
        engine.dispose()
