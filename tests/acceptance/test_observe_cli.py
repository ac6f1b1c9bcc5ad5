"""``pollbridge explain``, ``status`` and ``metrics serve`` as a user runs them: the installed script, a subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from tests.support import Run, stop_processes

METRIC_NAMES = ("pollbridge_phase", "pollbridge_dispatches_window", "pollbridge_outbox_backlog",
                "pollbridge_outbox_oldest_age_seconds", "pollbridge_bus_lag", "pollbridge_bus_pending",
                "pollbridge_dead_letters", "pollbridge_guardian_demotions", "pollbridge_flag_store_up")


def _no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr


def _installed(pollbridge: Run, url: str) -> dict[str, str]:
    """Install pollbridge and the reference schema in ``url`` and seed one instance; task ids by key."""
    init = pollbridge("--database-url", url, "init", "--demo-schema")
    assert init.returncode == 0, init.stderr
    engine = create_engine(url)
    try:
        tables = reflect_tables(engine, TaskTableMapping())
        with engine.begin() as conn:
            seed(conn, tables, [WorkflowSpec("cli-1", "orders", (TaskSpec("a"), TaskSpec("b", ("a",))))])
            rows = conn.execute(sa.select(tables.col("task_key"), tables.col("id"))).all()
    finally:
        engine.dispose()
    return {str(k): str(i) for k, i in rows}


def test_explain_a_task_as_text_and_json(pollbridge: Run, empty_db_url: str) -> None:
    ids = _installed(pollbridge, empty_db_url)
    env = {"POLLBRIDGE_DATABASE_URL": empty_db_url}
    text = pollbridge("explain", ids["b"], env=env)
    assert text.returncode == 0, text.stderr
    first = text.stdout.splitlines()[0]
    assert first == f"Task {ids['b']} (b of instance cli-1, type orders) is not triggered yet: waiting for " \
                    "dependency a (status pending)."
    assert "outbox events" in text.stdout and "dispatches" in text.stdout

    as_json = pollbridge("explain", ids["a"], "--json", env=env)
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["answer"]["code"] == "ready_not_dispatched"
    assert "the legacy poller should dispatch it at its next scan" in doc["answer"]["sentence"]
    assert [e["delivery"]["state"] for e in doc["events"]] == ["unpublished"]
    assert doc["task"]["status"] == "pending" and doc["flag"]["phase"] == "polling"


def test_explain_an_unknown_task_exits_2_on_one_line(pollbridge: Run, empty_db_url: str) -> None:
    _installed(pollbridge, empty_db_url)
    for bad in ("424242", "no-such-id"):
        result = pollbridge("--database-url", empty_db_url, "explain", bad, "--json")
        assert result.returncode == 2, (result.stdout, result.stderr)
        _no_traceback(result)
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"pollbridge: error: no task '{bad}' in tasks"), lines


def test_status_json_parses_and_an_unreachable_bus_is_unknown_and_exit_1(pollbridge: Run, empty_db_url: str) -> None:
    _installed(pollbridge, empty_db_url)
    result = pollbridge("--database-url", empty_db_url, "status", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["outbox"]["backlog"] == 2 and doc["bus"]["state"] == "ok" and doc["flag_store"]["up"] is True
    assert doc["window_seconds"] == 300

    bus = "redis://carol:pa55word@127.0.0.1:1/0"
    down = pollbridge("--database-url", empty_db_url, "--bus-url", bus, "status", "--json", "--window", "60",
                      timeout=60)
    assert down.returncode == 1, down.stderr  # everything else is shown; the unread part fails the command
    _no_traceback(down)
    assert len(down.stderr.strip().splitlines()) == 1 and "status incomplete: the bus" in down.stderr
    doc = json.loads(down.stdout)
    assert doc["bus"]["state"] == "unknown" and "unreachable" in doc["bus"]["reason"]
    assert doc["bus"]["lag"] is None and doc["window_seconds"] == 60
    assert "pa55word" not in down.stdout + down.stderr and "carol:***@" in down.stdout

    table = pollbridge("--database-url", empty_db_url, "--bus-url", bus, "status", timeout=60)
    assert table.returncode == 1, table.stderr
    assert "lag, pending and dead letters unknown" in table.stdout
    assert "pa55word" not in table.stdout + table.stderr


def test_status_against_an_unreachable_database_is_one_masked_line(pollbridge: Run) -> None:
    result = pollbridge("--database-url", "postgresql://bob:hunter22@127.0.0.1:1/x", "status")
    assert result.returncode == 1
    _no_traceback(result)
    assert "hunter22" not in result.stderr and "***" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_metrics_serve_answers_a_scrape_on_localhost_and_stops_on_sigterm(
        pollbridge: Run, empty_db_url: str, tmp_path: Path) -> None:
    _installed(pollbridge, empty_db_url)
    exe = shutil.which("pollbridge")
    assert exe
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
           "POLLBRIDGE_DATABASE_URL": empty_db_url, "POLLBRIDGE_METRICS_SERVE_PORT": "0"}
    proc = subprocess.Popen([exe, "metrics", "serve"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        match = re.match(r"metrics on http://127\.0\.0\.1:(\d+)/metrics ", first)
        assert match, first
        port = int(match.group(1))
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                    body = response.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "the metrics endpoint never answered"
                time.sleep(0.1)
        for name in METRIC_NAMES:
            assert f"# TYPE {name} gauge" in body, name
        assert "pollbridge_status_up 1.0" in body
        assert "pollbridge_outbox_backlog 2.0" in body
        assert "pollbridge_flag_store_up 1.0" in body
    finally:
        [(out, err)] = stop_processes([proc])
    assert proc.returncode == 0, err
    _no_traceback(subprocess.CompletedProcess([], proc.returncode, out, err))
    assert "metrics server stopped" in err


def test_metrics_serve_on_a_port_in_use_is_one_line(pollbridge: Run, empty_db_url: str) -> None:
    import socket

    _installed(pollbridge, empty_db_url)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = pollbridge("--database-url", empty_db_url, "metrics", "serve", "--port", str(port), timeout=60)
    assert result.returncode == 1
    _no_traceback(result)
    assert result.stderr.strip().splitlines()[-1].startswith(f"pollbridge: error: cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize(("command", "variables"), [
    (("explain", "--help"), ("POLLBRIDGE_JSON",)),
    (("status", "--help"), ("POLLBRIDGE_JSON", "POLLBRIDGE_STATUS_WINDOW")),
    (("metrics", "serve", "--help"), ("POLLBRIDGE_METRICS_SERVE_HOST", "POLLBRIDGE_METRICS_SERVE_PORT",
                                      "POLLBRIDGE_STATUS_WINDOW")),
])
def test_help_shows_environment_variables(pollbridge: Run, command: tuple[str, ...],
                                          variables: tuple[str, ...]) -> None:
    result = pollbridge(*command)
    assert result.returncode == 0, result.stderr
    for variable in variables:
        assert variable in result.stdout, (variable, result.stdout)
    if command[0] == "metrics":
        assert "127.0.0.1" in result.stdout and "9464" in result.stdout
