"""``pollbridge serve`` as a user runs it: the installed script in a subprocess, a real HTTP client."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import sqlalchemy as sa

from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.db.schema import signals
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.serve.auth import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from bridge.tasktable.tables import reflect_tables
from tests.support import Run, stop_processes

SECRET = "acceptance-secret-0123456789"


def _installed(pollbridge: Run, url: str) -> dict[str, str]:
    init = pollbridge("--database-url", url, "init", "--demo-schema")
    assert init.returncode == 0, init.stderr
    engine = create_engine(url)
    try:
        tables = reflect_tables(engine, TaskTableMapping())
        with engine.begin() as conn:
            seed(conn, tables, [WorkflowSpec("web-1", "orders", (TaskSpec("approve", awaits_signal="manager"),
                                                                   TaskSpec("ship", ("approve",))))])
            rows = conn.execute(sa.select(tables.col("task_key"), tables.col("id"))).all()
    finally:
        engine.dispose()
    return {str(k): str(i) for k, i in rows}


@contextmanager
def _serve(url: str, cwd: Path, *args: str, **env: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    exe = shutil.which("pollbridge")
    assert exe
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
            "POLLBRIDGE_DATABASE_URL": url, "POLLBRIDGE_SERVE_PORT": "0", **env}
    proc = subprocess.Popen([exe, "serve", *args], cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        match = re.match(r"serving on (http://127\.0\.0\.1:\d+) ", first)
        assert match, first + (proc.stderr.read() if proc.poll() is not None else "")
        yield proc, match.group(1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def test_serve_help_shows_every_environment_variable(pollbridge: Run) -> None:
    result = pollbridge("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for name in ("POLLBRIDGE_SERVE_HOST", "POLLBRIDGE_SERVE_PORT", "POLLBRIDGE_SIGNAL_SECRET"):
        assert name in text, name
    assert "127.0.0.1" in text and "Last-Event-ID" in text


def test_serve_on_localhost_takes_a_signed_signal_streams_it_and_stops_on_sigterm(
        pollbridge: Run, empty_db_url: str, tmp_path: Path) -> None:
    ids = _installed(pollbridge, empty_db_url)
    with _serve(empty_db_url, tmp_path, POLLBRIDGE_SIGNAL_SECRET=SECRET) as (proc, base), \
            httpx.Client(base_url=base, timeout=30) as http:
        deadline = time.monotonic() + 30
        while (health := http.get("/healthz")).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.1)
        assert health.json()["signals"] == "enabled"
        with http.stream("GET", "/instances/web-1/events") as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith("retry:") and next(lines).startswith("id: ")
            body = json.dumps({"task_id": ids["approve"], "kind": "approval", "actor": "ann"}).encode()
            ts = str(int(time.time()))
            signed = {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: sign(SECRET, ts, body)}
            r = http.post(f"/signals/{ids['approve']}", content=body, headers=signed)
            assert r.status_code == 202, r.text
            event_id = r.json()["event_id"]
            assert event_id
            assert http.post(f"/signals/{ids['approve']}", content=body, headers=signed).status_code == 401
            # The capture trigger wrote the change; `relay run` is not running here, so publish it through the
            # embedded relay once and see it arrive on the stream.
            relay = subprocess.Popen([shutil.which("pollbridge") or "pollbridge", "--database-url", empty_db_url,
                                      "relay", "run"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env={k: v for k, v in os.environ.items()
                                                                     if not k.startswith("POLLBRIDGE_")})
            try:
                seen = []
                for line in lines:
                    if line.startswith("data: "):
                        seen.append(json.loads(line[6:])["id"])
                        if event_id in seen:
                            break
            finally:
                relay.send_signal(signal.SIGTERM)
                relay.wait(30)
        metrics = http.get("/metrics").text
        assert 'pollbridge_serve_signals_total{outcome="accepted"} 1.0' in metrics
        assert "pollbridge_status_up 1.0" in metrics and "pollbridge_serve_bus_reader_up 1.0" in metrics
        assert http.get(f"/tasks/{ids['approve']}").json()["signal_received_at"]
        [(out, err)] = stop_processes([proc])
    assert proc.returncode == 0, err
    assert "server stopped" in err and "Traceback" not in err
    assert SECRET not in out + err
    engine = create_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.select(signals.c.kind, signals.c.actor)).all() == [("approval", "ann")]
    finally:
        engine.dispose()


def test_serve_binds_127_0_0_1_by_default_only(pollbridge: Run, sqlite_url: str, tmp_path: Path) -> None:
    with _serve(sqlite_url, tmp_path) as (proc, base):
        port = int(base.rsplit(":", 1)[1])
        with httpx.Client(base_url=base, timeout=10) as http:
            health = http.get("/healthz").json()
            assert health["signals"] == "disabled (no secret)"
        # Not reachable on another address of this host (when it has one besides loopback).
        other = _non_loopback_address()
        if other is not None:
            with socket.socket() as sock:
                sock.settimeout(3)
                assert sock.connect_ex((other, port)) != 0
        stop_processes([proc])
        assert proc.returncode == 0


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            address = str(probe.getsockname()[0])
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_serve_errors_are_one_line(pollbridge: Run, sqlite_url: str, tmp_path: Path) -> None:
    short = pollbridge("--database-url", sqlite_url, "serve", env={"POLLBRIDGE_SIGNAL_SECRET": "short"})
    assert short.returncode == 2 and "Traceback" not in short.stderr
    assert short.stderr.strip().splitlines() == ["pollbridge: error: POLLBRIDGE_SIGNAL_SECRET must be at least 16 "
                                                 "characters"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        taken = pollbridge("--database-url", sqlite_url, "serve", "--port", str(port))
    assert taken.returncode == 1, taken.stderr
    lines = taken.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pollbridge: error: cannot listen on 127.0.0.1:{port}"), lines
    bad_config = tmp_path / "bad.toml"
    bad_config.write_text('[serve]\nsse_buffer = 0\n')
    bad = pollbridge("--config", str(bad_config), "--database-url", sqlite_url, "serve")
    assert bad.returncode == 2 and "serve.sse_buffer must be a positive integer" in bad.stderr
