"""The event scheduler's commands through the real CLI: ``dlq list|replay|purge`` round trips,
``signal`` and its errors, ``scheduler run`` stopping on SIGTERM, and ``--help``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.bus import EventBus, open_bus
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent, new_event_id
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import SchedulerSettings
from bridge.db.engine import create_engine, db_now
from bridge.db.schema import bus_log, dispatch_log, outbox, scheduler_leases, scheduler_members, signals
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler.leases import lease_snapshot
from tests.support import Run, wait_for

GROUP = SchedulerSettings().group
PARTITIONS = 4


def _no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr


def _one_line_error(result: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    """Exit ``code`` with exactly one ``pollbridge: error:`` line on stderr naming ``fragments``."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    _no_traceback(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pollbridge: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


class SchedulerProcess:
    """``pollbridge scheduler run`` in the background; its stderr goes to a file (a full pipe could block it)."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        exe = shutil.which("pollbridge")
        assert exe, "pollbridge is not installed"
        self.log = cwd / "scheduler.log"
        full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
                    "POLLBRIDGE_SCHEDULER_PHASE": "cutover", **env}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([exe, "scheduler", "run"], cwd=cwd, env=full_env,
                                         stdout=subprocess.DEVNULL, stderr=out)
        wait_for(lambda: "scheduler " in self.stderr() or self.proc.poll() is not None, 60,
                 what="the scheduler to start")
        assert self.proc.poll() is None, self.stderr()

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def started() -> Iterator[list[SchedulerProcess]]:
    """Scheduler processes a test started; killed at the end if the test did not stop them."""
    procs: list[SchedulerProcess] = []
    yield procs
    for p in procs:
        p.kill()


def _write_config(cwd: Path, namespace: str) -> None:
    (cwd / "pollbridge.toml").write_text(
        f'[bus]\nnamespace = "{namespace}"\npartitions = {PARTITIONS}\nvisibility_timeout = 1\n'
        "[scheduler]\nlease_ttl = 3\nclaim_interval = 0.5\nblock = 0.2\n")


def _all_partitions_held(engine: Engine, bus: EventBus | None = None) -> bool:
    """Every partition leased, wherever the leases are (beside a Redis bus, else in the database)."""
    leases = lease_snapshot(engine, bus).leases
    return all(leases.get(p, (None, None))[0] for p in range(PARTITIONS))


def _dispatch_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(dispatch_log.c.task_id, dispatch_log.c.attempt, dispatch_log.c.path)))


def _task_id(engine: Engine, tables: TaskTable, instance_id: str, key: str) -> Any:
    t = tables.tasks
    with engine.connect() as conn:
        return conn.execute(sa.select(t.c.id).where(t.c.instance_id == instance_id, t.c.task_key == key)).scalar_one()


def _write_raw_entry(bus: EventBus, engine: Engine, partition: int, entry_key: str, payload: str) -> None:
    """An entry that is not a CloudEvent, written straight into the backend's storage."""
    if hasattr(bus, "client"):
        bus.client.xadd(bus.keys.stream(partition), {"id": entry_key, "payload": payload})  # type: ignore[attr-defined]
    else:
        with engine.begin() as conn:
            conn.execute(bus_log.insert().values(partition=partition, event_id=entry_key, payload=payload,
                                                 created_at=db_now(engine.dialect.name)))


# --- (a) dead letters ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [
    "sqlite-embedded",
    pytest.param("postgresql-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
])
def test_dead_letter_round_trip(backend: str, request: pytest.FixtureRequest, pollbridge: Run, tmp_path: Path,
                                started: list[SchedulerProcess]) -> None:
    db, bus_kind = backend.split("-")
    db_url = str(request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url"))
    bus_url = str(request.getfixturevalue("redis_server")) if bus_kind == "redis" else "embedded"
    namespace = str(request.getfixturevalue("redis_namespace")) if bus_kind == "redis" else "pollbridge"
    _write_config(tmp_path, namespace)
    env = {"POLLBRIDGE_DATABASE_URL": db_url, "POLLBRIDGE_BUS_URL": bus_url}
    engine = create_engine(db_url)
    tables = reflect_tables(engine, TaskTableMapping())
    bus = open_bus(bus_url, engine=engine, partitions=PARTITIONS, namespace=namespace)
    try:
        # A task that awaits an approval. No relay runs: the scheduler learns of it only through the bus.
        with engine.begin() as conn:
            seed(conn, tables, [WorkflowSpec("dlq-1", "orders", (TaskSpec("approve", awaits_signal="manager"),))])
        task_id = _task_id(engine, tables, "dlq-1", "approve")

        # A valid event about it whose handling failed: delivered to the scheduler's group, dead-lettered.
        event = CloudEvent(id=new_event_id(), type=TASK_STATUS_CHANGED, subject=str(task_id), partitionkey="dlq-1",
                           time=datetime.now(UTC), data={
                               "task_id": str(task_id), "instance_id": "dlq-1", "workflow_type": "orders",
                               "task_key": "approve", "old_status": None, "new_status": "pending",
                               "change": "insert"})
        bus.ensure_group(GROUP)
        bus.publish([event])
        got = bus.read(GROUP, "a-consumer-that-failed", list(range(PARTITIONS)), 10, 2.0)
        assert [d.event.id for d in got if d.event is not None] == [event.id]
        bus.dead_letter(GROUP, got[0], "handling failed on 5 deliveries (simulated outage)")
        assert bus.pending_count(GROUP) == 0

        sched = SchedulerProcess(tmp_path, env)
        started.append(sched)
        wait_for(lambda: _all_partitions_held(engine, bus), 30, what="the scheduler to hold every partition")

        # Two poison entries: not JSON at all, and valid JSON that is not a CloudEvent (no partitionkey).
        # Both are dead-lettered at once, with the reason.
        poison = {"specversion": "1.0", "id": "poison-1", "source": "test", "type": TASK_STATUS_CHANGED,
                  "subject": str(task_id), "time": datetime.now(UTC).isoformat(), "data": {}}
        _write_raw_entry(bus, engine, 1, "poison-1", json.dumps(poison))
        _write_raw_entry(bus, engine, 2, "poison-2", "this is not json")
        wait_for(lambda: len(bus.dead_letters()) == 3, 30, what="the poison entries in the dead-letter store")

        listed = pollbridge("dlq", "list", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        letters = json.loads(listed.stdout)
        assert len(letters) == 3
        [bad] = [x for x in letters if "partitionkey" in x["reason"]]
        [garbage] = [x for x in letters if x["payload"] == "this is not json"]
        [fixable] = [x for x in letters if "simulated outage" in x["reason"]]
        assert bad["reason"].startswith("unparseable entry") and "missing CloudEvents attribute" in bad["reason"]
        assert garbage["reason"].startswith("unparseable entry") and "not JSON" in garbage["reason"]
        assert bad["group"].endswith(GROUP) and bad["partition"] == 1 and garbage["partition"] == 2
        assert json.loads(bad["payload"]) == poison
        assert json.loads(fixable["payload"])["id"] == event.id
        table = pollbridge("dlq", "list", env=env)
        assert table.returncode == 0 and "3 dead letter(s)" in table.stdout, table.stdout

        # Malformed entries cannot be replayed: exit 1, one line naming them, and they stay in the store.
        refused = pollbridge("dlq", "replay", bad["id"], garbage["id"], env=env)
        _one_line_error(refused, 1, "cannot replay entries that are still malformed", bad["id"], garbage["id"])
        assert {x.id for x in bus.dead_letters()} == {bad["id"], garbage["id"], fixable["id"]}
        unknown = pollbridge("dlq", "replay", "no-such-id", env=env)
        _one_line_error(unknown, 2, "no dead letter with id no-such-id")
        usage = pollbridge("dlq", "replay", env=env)
        assert usage.returncode == 2 and "--all" in usage.stderr
        _no_traceback(usage)
        # ... they are purged instead (after a confirmation; declining removes nothing).
        declined = pollbridge("dlq", "purge", bad["id"], garbage["id"], env=env, input="n\n")
        _no_traceback(declined)
        assert declined.returncode == 1 and "nothing purged" in declined.stderr, declined.stderr
        assert len(bus.dead_letters()) == 3
        purged = pollbridge("dlq", "purge", bad["id"], garbage["id"], "--yes", env=env)
        assert purged.returncode == 0, purged.stderr
        assert "purged 2 dead letter(s)" in purged.stdout
        assert [x.id for x in bus.dead_letters()] == [fixable["id"]]

        # Fix the cause (the approval arrives; no relay, so no event announces it), then replay.
        approved = pollbridge("signal", str(task_id), "--kind", "approval", env=env)
        assert approved.returncode == 0, approved.stderr
        time.sleep(1.5)
        assert _dispatch_rows(engine) == [], "the scheduler dispatched without an event"
        replayed = pollbridge("dlq", "replay", fixable["id"], env=env)
        assert replayed.returncode == 0, replayed.stderr
        assert "replayed 1 dead letter(s)" in replayed.stdout
        wait_for(lambda: len(_dispatch_rows(engine)) >= 1, 30, what="the replayed event to dispatch the task")
        assert json.loads(pollbridge("dlq", "list", "--json", env=env).stdout) == []
        again = pollbridge("dlq", "replay", fixable["id"], env=env)
        _one_line_error(again, 2, "no dead letter with id")
        wait_for(lambda: bus.pending_count(GROUP) == 0, 15, what="the replayed entry to be acknowledged")
        time.sleep(1.0)  # anything handled twice would show now
        assert [tuple(r) for r in _dispatch_rows(engine)] == [(str(task_id), 1, "events")]
        t = tables.tasks
        with engine.connect() as conn:
            assert conn.execute(sa.select(t.c.status).where(t.c.id == task_id)).scalar_one() == "queued"
        assert sched.terminate() == 0, sched.stderr()
    finally:
        bus.close()
        engine.dispose()


# --- (b) signal -----------------------------------------------------------------------------------------------
def _snapshot(engine: Engine, tables: TaskTable) -> tuple[list[Any], list[Any], int]:
    with engine.connect() as conn:
        tasks = [tuple(r) for r in conn.execute(sa.select(tables.tasks).order_by(tables.tasks.c.id))]
        recorded = [tuple(r) for r in conn.execute(sa.select(signals).order_by(signals.c.id))]
        changes = int(conn.execute(sa.select(sa.func.count()).select_from(outbox)).scalar_one())
    return tasks, recorded, changes


def test_signal_happy_path_and_errors(pollbridge: Run, sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    tables = reflect_tables(engine, TaskTableMapping())
    t = tables.tasks
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec("sig", "orders", (
            TaskSpec("approve_me", awaits_signal="manager"), TaskSpec("reject_me", awaits_signal="manager"),
            TaskSpec("call_me", awaits_signal="webhook"), TaskSpec("finished", awaits_signal="manager"),
            TaskSpec("plain")))])
        ids = {k: str(i) for k, i in conn.execute(sa.select(t.c.task_key, t.c.id))}
        conn.execute(t.update().where(t.c.task_key == "finished").values(status="completed"))
    env = {"POLLBRIDGE_DATABASE_URL": sqlite_url}
    try:
        before = _snapshot(engine, tables)
        rejected = [
            (("999999", "--kind", "approval"), "no task '999999'"),
            (("abc", "--kind", "approval"), "is not a valid int"),
            ((ids["plain"], "--kind", "approval"), "awaits no signal"),
            ((ids["approve_me"], "--kind", "approval", "--payload", "{nope"), "not valid JSON"),
            ((ids["finished"], "--kind", "approval"), "not pending"),
        ]
        for args, message in rejected:
            result = pollbridge("signal", *args, env=env)
            _one_line_error(result, 2, message)
            assert result.stdout == ""
        for args in ((ids["approve_me"], "--kind", "maybe"), (ids["approve_me"],)):
            usage = pollbridge("signal", *args, env=env)
            assert usage.returncode == 2 and "--kind" in usage.stderr, usage.stderr
            _no_traceback(usage)
        assert _snapshot(engine, tables) == before, "a rejected signal changed the database"

        ok = pollbridge("signal", ids["approve_me"], "--kind", "approval", "--payload", '{"by": "ann"}',
                        "--actor", "ann", env=env)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.strip() == f"task {ids['approve_me']}: approval recorded (status pending)"
        by_env = pollbridge("signal", ids["call_me"], env={**env, "POLLBRIDGE_SIGNAL_KIND": "callback",
                                                              "POLLBRIDGE_ACTOR": "hook"})
        assert by_env.returncode == 0, by_env.stderr
        no = pollbridge("signal", ids["reject_me"], "--kind", "rejection", env=env)
        assert no.returncode == 0, no.stderr
        assert no.stdout.strip() == f"task {ids['reject_me']}: rejection recorded (status failed)"
        with engine.connect() as conn:
            rows = {str(r.id): r for r in conn.execute(sa.select(t))}
            recorded = conn.execute(sa.select(signals.c.task_id, signals.c.kind, signals.c.actor, signals.c.payload)
                                    .order_by(signals.c.id)).all()
        assert rows[ids["approve_me"]].status == "pending" and rows[ids["approve_me"]].signal_received_at
        assert rows[ids["call_me"]].signal_received_at is not None
        rejected_row = rows[ids["reject_me"]]
        assert rejected_row.status == "failed" and rejected_row.attempts == rejected_row.max_attempts
        assert [(r.task_id, r.kind, r.payload) for r in recorded] == [
            (ids["approve_me"], "approval", '{"by": "ann"}'),
            (ids["call_me"], "callback", None),
            (ids["reject_me"], "rejection", None),
        ]
        assert [r.actor for r in recorded[:2]] == ["ann", "hook"] and recorded[2].actor  # default: the OS user

        after = _snapshot(engine, tables)
        twice = pollbridge("signal", ids["approve_me"], "--kind", "callback", env=env)
        _one_line_error(twice, 2, "already received")
        failed = pollbridge("signal", ids["reject_me"], "--kind", "approval", env=env)
        _one_line_error(failed, 2)
        assert _snapshot(engine, tables) == after
    finally:
        engine.dispose()


# --- (c) scheduler run -----------------------------------------------------------------------------------------
def test_scheduler_run_dispatches_and_stops_cleanly_on_sigterm(sqlite_url: str, tmp_path: Path,
                                                               started: list[SchedulerProcess]) -> None:
    _write_config(tmp_path, "pollbridge")
    engine = create_engine(sqlite_url)
    tables = reflect_tables(engine, TaskTableMapping())
    try:
        with engine.begin() as conn:  # ready before the scheduler starts: the start-up catch-up finds them
            seed(conn, tables, [WorkflowSpec("run-1", "orders", (TaskSpec("a"), TaskSpec("b", ("a",)))),
                                WorkflowSpec("run-2", "reports", (TaskSpec("c"),))])
        sched = SchedulerProcess(tmp_path, {"POLLBRIDGE_DATABASE_URL": sqlite_url})
        started.append(sched)
        wait_for(lambda: len(_dispatch_rows(engine)) == 2, 30, what="the two root tasks to be dispatched")
        assert _all_partitions_held(engine)
        # SIGUSR1: every thread's stack on stderr (for a process that looks stuck), and it goes on running.
        sched.proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: "Current thread" in sched.stderr() and "event_scheduler/scheduler.py" in sched.stderr(),
                 30, what="the stack dump")
        dump = sched.stderr()
        assert "Thread 0x" in dump and "event_scheduler/timers.py" in dump, dump  # the other threads too
        assert sched.proc.poll() is None, dump
        assert sched.terminate() == 0, sched.stderr()
        err = sched.stderr()
        assert "Traceback" not in err, err
        assert "scheduler stopped: 2 dispatched" in err, err
        # A clean stop gives the partitions back at once (on a SQLite file: its lock files, nothing in the tables).
        snap = lease_snapshot(engine, None)
        assert snap.locks and snap.members == {} and len(snap.leases) == PARTITIONS, snap
        assert [h for h, _ in snap.leases.values()] == [None] * PARTITIONS, snap
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(scheduler_members)).scalar_one() == 0
            assert conn.execute(sa.select(scheduler_leases.c.holder)).scalars().all() == []
        assert sorted(r.path for r in _dispatch_rows(engine)) == ["events", "events"]
    finally:
        engine.dispose()


def test_scheduler_run_rejects_a_bad_phase(pollbridge: Run, sqlite_url: str) -> None:
    result = pollbridge("scheduler", "run", "--phase", "sideways", env={"POLLBRIDGE_DATABASE_URL": sqlite_url},
                        timeout=60)
    assert result.returncode == 2 and "sideways" in result.stderr, result.stderr
    _no_traceback(result)


@pytest.mark.parametrize(("command", "variables"), [
    (("--help",), ("POLLBRIDGE_CONFIG", "POLLBRIDGE_DATABASE_URL", "POLLBRIDGE_BUS_URL", "POLLBRIDGE_LOG_LEVEL")),
    (("scheduler", "run", "--help"), ("POLLBRIDGE_METRICS_PORT",)),  # --phase: test-only, hidden
    (("signal", "--help"), ("POLLBRIDGE_SIGNAL_KIND", "POLLBRIDGE_SIGNAL_PAYLOAD", "POLLBRIDGE_ACTOR")),
    (("dlq", "list", "--help"), ("POLLBRIDGE_DLQ_LIMIT", "POLLBRIDGE_JSON")),
    (("dlq", "replay", "--help"), ("POLLBRIDGE_JSON",)),  # --all: command line only
    (("dlq", "purge", "--help"), ("POLLBRIDGE_JSON",)),  # --all, --yes: command line only
])
def test_help_shows_environment_variables(pollbridge: Run, command: tuple[str, ...],
                                          variables: tuple[str, ...]) -> None:
    result = pollbridge(*command, timeout=60)
    assert result.returncode == 0, result.stderr
    for variable in variables:
        assert variable in result.stdout, (variable, result.stdout)
