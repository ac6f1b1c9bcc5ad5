"""``pollbridge demo`` walks the whole migration; ``pollbridge run-all`` runs every component in one process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from tests.support import Run, clear_redis_namespace, wait_for

PHASES = ["polling", "dual_write", "selective", "cutover", "rollback"]


def test_demo_walks_every_phase_and_compares_the_paths(pollbridge: Run, tmp_path: Path) -> None:
    """The zero-setup default (SQLite and the embedded bus in ./pollbridge.db), as JSON."""
    result = pollbridge("demo", "--json", "--instances", "15", "--poll-interval", "0.3", timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "pollbridge.db").exists()
    summary = json.loads(result.stdout)
    assert summary["paths"]["poller"]["p50_ms"] is not None
    assert summary["poller"]["scans"] >= 1
    # The foundation's fields are kept ...
    for key in ("tasks", "dispatches", "lost", "double_dispatched", "early", "paths", "poller"):
        assert key in summary
    assert summary["dispatches"] == summary["tasks"] > 0
    assert (summary["lost"], summary["double_dispatched"], summary["early"]) == (0, 0, 0)
    # ... and one object per phase, in the order of the migration.
    phases = summary["phases"]
    assert [p["phase"] for p in phases] == PHASES
    by_phase = {p["phase"]: p for p in phases}
    assert set(by_phase["polling"]["paths"]) == {"poller"}  # the event path is off
    assert set(by_phase["dual_write"]["paths"]) == {"poller"}  # shadow only: it never dispatches
    assert "events" in by_phase["cutover"]["paths"] and "poller" not in by_phase["cutover"]["paths"]
    assert set(by_phase["rollback"]["paths"]) == {"poller"}  # the way back works
    assert by_phase["selective"]["percent"] == 50.0
    assert by_phase["dual_write"]["reconcile"]["types"], "the reconciler's report of dual_write is missing"
    for p in phases:
        assert (p["lost"], p["double_dispatched"], p["early"]) == (0, 0, 0), p
        assert set(p["statements_per_dispatch"]) == {"poller", "events"}
        assert set(p["idle_statements_per_s"]) == {"poller", "events"}
    assert by_phase["dual_write"]["gate"] and by_phase["cutover"]["gate"]
    # The keys the README documents ...
    for stats in summary["paths"].values():
        assert set(stats) >= {"p50_ms", "p90_ms", "p99_ms", "max_ms"}
    assert set(summary["poller"]) >= {"scans", "empty_scan_ratio", "rows_examined", "statements_per_dispatch"}
    # ... and what says how to read them: the verdict, the backend, the gates' settings, statements by table.
    assert len(summary["verdict"]) == 3 and summary["verdict"][0].startswith("ready→dispatch: p50 ")
    assert (summary["backend"]["database"], summary["backend"]["bus"]) == ("sqlite", "embedded")
    assert summary["gate_settings"]["production_defaults"]["min_tasks"] == 1000
    assert set(by_phase["cutover"]["statements_per_dispatch_by_table"]["events"]) == {
        "task_table", "bus", "pollbridge", "other"}
    # Every stage says what it does as it starts, on stderr; 15 instances are too few for the demo's gates,
    # and the refusal says why before the gate is forced.
    for label in PHASES:
        assert f"\n{label}" in "\n" + result.stderr, (label, result.stderr)
    assert "gate into cutover: refused, forced to go on (audited as forced): etl: min_tasks: " in result.stderr
    assert "cutover (FORCED: refused on min_tasks" in summary["verdict"][2]


def test_run_all_dispatches_both_paths_and_stops_on_sigterm(sqlite_url: str, tmp_path: Path) -> None:
    engine = create_engine(sqlite_url)
    tables = reflect_tables(engine, TaskTableMapping())
    chain = (TaskSpec("a"), TaskSpec("b", ("a",)))
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec(f"r{i}", "orders" if i % 2 else "reports", chain) for i in range(10)])
    exe = shutil.which("pollbridge")
    assert exe is not None
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
           "POLLBRIDGE_DATABASE_URL": sqlite_url}
    flags = subprocess.run([exe, "flags", "set", "orders", "cutover", "--force", "--reason", "test"], env=env,
                           capture_output=True, text=True, cwd=tmp_path)
    assert flags.returncode == 0, flags.stderr
    log = (tmp_path / "run-all.log").open("w")
    proc = subprocess.Popen([exe, "run-all", "--demo-workers", "--poll-interval", "0.3"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        t = tables.tasks

        def done() -> bool:
            with engine.connect() as conn:
                return conn.execute(sa.select(sa.func.count()).where(t.c.status != "completed")).scalar_one() == 0

        wait_for(done, timeout=60, what="every task completed under run-all")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    with engine.connect() as conn:
        paths = dict(conn.execute(sa.text(
            "SELECT workflow_type, group_concat(DISTINCT path) FROM pollbridge_dispatch_log GROUP BY 1")).all())
    assert paths == {"orders": "events", "reports": "poller"}
    assert "run-all stopped" in (tmp_path / "run-all.log").read_text()
    engine.dispose()


def test_run_all_help_shows_env_vars(pollbridge: Run) -> None:
    result = pollbridge("run-all", "--help")
    for var in ("POLLBRIDGE_DEMO_WORKERS", "POLLBRIDGE_POLL_INTERVAL", "POLLBRIDGE_METRICS_PORT"):
        assert var in result.stdout


@pytest.mark.postgres
@pytest.mark.redis
def test_demo_on_postgresql_and_redis(pollbridge: Run, pg_empty_url: str, redis_server: str,
                                      redis_namespace: str, tmp_path: Path) -> None:
    (tmp_path / "pollbridge.toml").write_text(f'[bus]\nnamespace = "{redis_namespace}"\n')
    result = pollbridge("demo", "--json", "--instances", "10", "--poll-interval", "0.3", timeout=300,
                        env={"POLLBRIDGE_DATABASE_URL": pg_empty_url, "POLLBRIDGE_BUS_URL": redis_server})
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert [p["phase"] for p in summary["phases"]] == PHASES
    assert (summary["lost"], summary["double_dispatched"], summary["early"]) == (0, 0, 0)
    assert (summary["backend"]["database"], summary["backend"]["bus"]) == ("postgresql", "redis")
    assert not summary["backend"]["bus_statements_counted"]  # Redis's commands are no database statements
    for p in summary["phases"]:
        assert p["idle_statements_per_s_by_table"]["events"]["bus"] == 0, p


@pytest.mark.postgres
@pytest.mark.redis
def test_demo_on_postgresql_and_a_redis_cluster(pollbridge: Run, pg_empty_url: str, redis_cluster: str,
                                                tmp_path: Path) -> None:
    """The whole walk polling → dual_write → selective → cutover with the bus on a 3+3 Redis Cluster (the URL of
    one node: pollbridge finds the others)."""
    namespace = f"pbtest-{uuid.uuid4().hex[:10]}"
    (tmp_path / "pollbridge.toml").write_text(f'[bus]\nnamespace = "{namespace}"\n')
    try:
        result = pollbridge("demo", "--json", "--instances", "10", "--poll-interval", "0.3", timeout=300,
                            env={"POLLBRIDGE_DATABASE_URL": pg_empty_url, "POLLBRIDGE_BUS_URL": redis_cluster})
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert [p["phase"] for p in summary["phases"]] == PHASES
        assert (summary["lost"], summary["double_dispatched"], summary["early"]) == (0, 0, 0)
        assert summary["backend"]["bus"] == "redis"
    finally:
        clear_redis_namespace(redis_cluster, namespace)


@pytest.mark.postgres
@pytest.mark.rabbitmq
def test_demo_on_postgresql_and_rabbitmq(pollbridge: Run, pg_empty_url: str, tmp_path: Path) -> None:
    """The whole walk polling → dual_write → selective → cutover with the bus on RabbitMQ (a namespace of its own on
    the test server, deleted afterwards): nothing lost, doubled or early in any phase."""
    from tests.support.rabbitmq import delete_namespace, new_namespace, reachable_rabbitmq

    url = reachable_rabbitmq()
    namespace = new_namespace()
    (tmp_path / "pollbridge.toml").write_text(f'[bus]\nnamespace = "{namespace}"\n')
    try:
        result = pollbridge("demo", "--json", "--instances", "10", "--poll-interval", "0.3", timeout=300,
                            env={"POLLBRIDGE_DATABASE_URL": pg_empty_url, "POLLBRIDGE_BUS_URL": url})
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert [p["phase"] for p in summary["phases"]] == PHASES
        assert (summary["lost"], summary["double_dispatched"], summary["early"]) == (0, 0, 0)
        assert summary["dispatches"] == summary["tasks"] > 0
        for p in summary["phases"]:
            assert (p["lost"], p["double_dispatched"], p["early"]) == (0, 0, 0), p
        by_phase = {p["phase"]: p for p in summary["phases"]}
        assert "events" in by_phase["cutover"]["paths"] and "poller" not in by_phase["cutover"]["paths"]
        # The bus is the server's, not the embedded log. (bridge/app/demo.py names every server bus "redis".)
        assert summary["backend"]["bus"] != "embedded" and not summary["backend"]["bus_statements_counted"]
    finally:
        delete_namespace(url, namespace, 8)
