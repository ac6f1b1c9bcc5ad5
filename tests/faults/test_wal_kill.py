"""SIGKILL of the relay while it streams the write-ahead log (``[capture] mode = "wal"``), then restarts: every
committed change reaches the bus, and a change streamed again (it was written but not yet confirmed when the
relay died) carries the same event id as before; its connections cut by the server, the same."""

from __future__ import annotations

import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.app import install
from bridge.bus import open_bus
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import CaptureSettings
from bridge.db.engine import create_engine
from bridge.db.schema import outbox
from tests.support import start_relay, wait_for
from tests.support.wal import wal_available

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def _relay(cwd: Path, db_url: str, bus_url: str) -> subprocess.Popen[bytes]:
    return start_relay(cwd, db_url, bus_url, ready=b"streaming the write-ahead log")


def test_relay_killed_while_streaming_loses_nothing_and_repeats_ids(pg_empty_url: str, redis_server: str,
                                                                    redis_namespace: str, tmp_path: Path) -> None:
    wal_available(pg_empty_url)
    engine = create_engine(pg_empty_url)
    (tmp_path / "pollbridge.toml").write_text(
        f'[bus]\nnamespace = "{redis_namespace}"\npartitions = 4\n[capture]\nmode = "wal"\n')
    install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings(mode="wal"))
    total, per_txn = 20000, 50
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES ('k', 'orders')"))
    for start in range(0, total, per_txn):  # many transactions, so the relay confirms as it goes
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key, depends_on) VALUES ('k', :key, '[]')"),
                         [{"key": f"t{i}"} for i in range(start, start + per_txn)])

    def captured() -> int:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count(sa.distinct(outbox.c.task_id)))).scalar_one())

    kills = 0
    proc: subprocess.Popen[bytes] | None = None
    try:
        for _ in range(3):  # kill it three times while it streams, restart each time
            proc = _relay(tmp_path, pg_empty_url, redis_server)
            before = captured()
            wait_for(lambda b=before: captured() > b, 90, interval=0.01, what="the relay to capture")
            if captured() >= total:
                break
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
            kills += 1
        if proc is None or proc.poll() is not None:
            proc = _relay(tmp_path, pg_empty_url, redis_server)
        # The server cuts the relay's connections too (a failover, an administrator): it reconnects and resumes.
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                                 "current_database() AND pid <> pg_backend_pid()"))
            conn.commit()
        wait_for(lambda: captured() == total, 120, what="every change captured after the restarts")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
    assert kills >= 1, "the relay finished before it could be killed: make the workload larger"

    with engine.connect() as conn:
        rows = conn.execute(sa.select(outbox.c.task_id, outbox.c.event_id, outbox.c.published_at)).all()
    ids_of: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        assert r.published_at is not None
        ids_of[r.task_id].add(r.event_id)
    assert len(ids_of) == total
    assert all(len(ids) == 1 for ids in ids_of.values()), "a change streamed again got another event id"
    bus = open_bus(redis_server, partitions=4, namespace=redis_namespace)
    try:
        bus.ensure_group("audit")
        seen: set[str] = set()
        deadline = time.monotonic() + 60
        while len(seen) < total and time.monotonic() < deadline:
            batch = bus.read("audit", "auditor", list(range(4)), 2000, 0.2)
            bus.ack("audit", batch)
            for d in batch:
                assert d.event is not None, d.error
                assert d.event.id in ids_of[str(d.event.data["task_id"])]
                seen.add(str(d.event.data["task_id"]))
    finally:
        bus.close()
    assert len(seen) == total, "a captured change never reached the bus"
    install.uninstall(engine, TaskTableMapping())  # the slot goes before the database does
    engine.dispose()
