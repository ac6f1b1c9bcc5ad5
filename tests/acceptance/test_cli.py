"""The real CLI as a subprocess: the demo, init + doctor, and bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.db.engine import create_engine
from tests.support import Run, stop_processes


def _no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr


@pytest.mark.postgres
def test_demo_on_postgresql_as_a_table(pollbridge: Run, pg_empty_url: str) -> None:
    """The demo on PostgreSQL with the embedded bus, in its human format (the JSON format and the other
    stacks are covered by tests/acceptance/test_runall_demo.py)."""
    result = pollbridge("demo", "--instances", "9", "--poll-interval", "0.2",
                        env={"POLLBRIDGE_DATABASE_URL": pg_empty_url})
    assert result.returncode == 0, result.stderr
    assert "stage by stage" in result.stdout and "ready→dispatch: p50" in result.stdout
    assert "reconciler over dual_write" in result.stdout
    overall = re.search(r"overall: (\d+) tasks, (\d+) dispatches, lost 0, ", result.stdout)
    assert overall and overall.group(1) == overall.group(2) != "0", result.stdout


def test_init_then_doctor_pass(pollbridge: Run, empty_db_url: str) -> None:
    init = pollbridge("--database-url", empty_db_url, "init", "--demo-schema")
    assert init.returncode == 0, init.stderr
    assert "created demo tables" in init.stdout
    again = pollbridge("--database-url", empty_db_url, "init", "--demo-schema")
    assert again.returncode == 0 and "already at" in again.stdout
    doctor = pollbridge("--database-url", empty_db_url, "doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert doctor.stdout.count("[ok]") == 6


def test_doctor_fails_before_init(pollbridge: Run, empty_db_url: str) -> None:
    result = pollbridge("--database-url", empty_db_url, "doctor", "--json")
    assert result.returncode == 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["database"]["ok"] is True
    assert checks["mapping"]["ok"] is False and "'tasks'" in checks["mapping"]["detail"]
    assert checks["migrations"]["ok"] is False


def test_unreachable_database_is_one_line_with_masked_password(pollbridge: Run) -> None:
    result = pollbridge("--database-url", "postgresql://bob:hunter22@127.0.0.1:1/x", "init")
    assert result.returncode == 1
    _no_traceback(result)
    assert "hunter22" not in result.stderr and "***" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", ['tasks"; DROP TABLE tasks; --', "tasks table", "1tasks", "t'x"])
def test_injection_through_a_mapped_name_is_rejected(pollbridge: Run, tmp_path: Path, bad: str) -> None:
    (tmp_path / "pollbridge.toml").write_text(f"[mapping]\ntable = {json.dumps(bad)}\n")
    result = pollbridge("init")
    assert result.returncode == 2
    _no_traceback(result)
    assert "mapping.table" in result.stderr
    assert not (tmp_path / "pollbridge.db").exists(), "a rejected command must change nothing"


def test_status_mapped_twice_is_rejected(pollbridge: Run, tmp_path: Path) -> None:
    (tmp_path / "pollbridge.toml").write_text('[mapping.statuses]\npending = "x"\nrunning = "x"\n')
    result = pollbridge("doctor")
    assert result.returncode == 2
    _no_traceback(result)
    assert "mapped twice" in result.stderr


def test_cyclic_workload_is_rejected_before_anything_is_written(pollbridge: Run, tmp_path: Path) -> None:
    workload = [{"workflow_type": "w", "tasks": [{"key": "a", "depends_on": ["b"]}, {"key": "b", "depends_on": ["a"]}]}]
    (tmp_path / "w.json").write_text(json.dumps(workload))
    result = pollbridge("demo", "--workload", "w.json")
    assert result.returncode == 2
    _no_traceback(result)
    assert "cycle" in result.stderr
    assert not (tmp_path / "pollbridge.db").exists()


def test_usage_errors_exit_2(pollbridge: Run) -> None:
    assert pollbridge("no-such-command").returncode == 2
    assert pollbridge("demo", "--instances", "0").returncode == 2
    assert pollbridge("--config", "missing.toml", "doctor").returncode == 2


def test_help_shows_environment_variables(pollbridge: Run) -> None:
    top = pollbridge("--help").stdout
    assert "POLLBRIDGE_DATABASE_URL" in top and "POLLBRIDGE_BUS_URL" in top and "POLLBRIDGE_CONFIG" in top
    assert "POLLBRIDGE_POLL_INTERVAL" in pollbridge("poller", "run", "--help").stdout
    assert "POLLBRIDGE_WORKERS_CONCURRENCY" in pollbridge("workers", "run", "--help").stdout


def test_uninstall_keeps_the_scheduler_tables(pollbridge: Run, empty_db_url: str) -> None:
    assert pollbridge("--database-url", empty_db_url, "init", "--demo-schema").returncode == 0
    result = pollbridge("--database-url", empty_db_url, "uninstall", "--yes")
    assert result.returncode == 0, result.stderr
    assert "pollbridge_dispatch_log" in result.stdout
    engine = create_engine(empty_db_url)
    try:
        names = set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"tasks", "workflow_instances"} <= names
    assert not any(n.startswith("pollbridge_") for n in names)


def test_poller_and_workers_processes_finish_a_workload_and_stop_on_sigterm(
        pollbridge: Run, db_url: str, tmp_path: Path) -> None:
    from bridge.core.mapping import TaskTableMapping
    from bridge.reference.oracle import verify
    from bridge.reference.workload import demo_workload, seed
    from bridge.tasktable.tables import reflect_tables

    engine = create_engine(db_url)
    try:
        tables = reflect_tables(engine, TaskTableMapping())
        specs = demo_workload(6, 5, prefix="proc")
        with engine.begin() as conn:
            seed(conn, tables, specs)
        exe = shutil.which("pollbridge")
        assert exe
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
               "POLLBRIDGE_DATABASE_URL": db_url}
        procs = [
            subprocess.Popen([exe, "poller", "run", "--interval", "0.1"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            subprocess.Popen([exe, "workers", "run", "--concurrency", "2"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        ]
        try:
            deadline = time.monotonic() + 90
            while True:
                with engine.connect() as conn:
                    verdict = verify(conn, tables, [s.instance_id for s in specs])
                if verdict.unsettled == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            outputs = stop_processes(procs)
        assert verdict.unsettled == 0, verdict
        assert (verdict.double_dispatched, verdict.early) == (0, 0)
        assert [p.returncode for p in procs] == [0, 0], outputs
        assert "poller stopped" in outputs[0][1] and "workers stopped" in outputs[1][1]
    finally:
        engine.dispose()
