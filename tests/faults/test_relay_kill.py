"""SIGKILL of the relay process mid-batch, then a restart: every outbox row is on the bus at least once,
and a row published twice carries the same event id both times."""

from __future__ import annotations

import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.bus import open_bus
from bridge.db.engine import create_engine, read_only
from bridge.db.schema import outbox
from tests.support import start_relay, wait_for


def _relay(cwd: Path, db_url: str, bus_url: str) -> subprocess.Popen[bytes]:
    return start_relay(cwd, db_url, bus_url)


@pytest.mark.parametrize("backend", [
    "sqlite-embedded",
    pytest.param("postgresql-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
])
def test_relay_killed_mid_batch_loses_nothing(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    db, bus_kind = backend.split("-")
    db_url = request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url")
    namespace = request.getfixturevalue("redis_namespace") if bus_kind == "redis" else "pollbridge"
    bus_url = request.getfixturevalue("redis_server") if bus_kind == "redis" else "embedded"
    (tmp_path / "pollbridge.toml").write_text(
        f'[bus]\nnamespace = "{namespace}"\npartitions = 4\n[relay]\nbatch_size = 100\n')
    engine = create_engine(db_url)
    total = 6000 if db == "sqlite" else 30000
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES ('k', 'orders')"))
        conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key, depends_on) VALUES ('k', :key, '[]')"),
                     [{"key": f"t{i}"} for i in range(total)])

    # Read-only polling: on SQLite a write-locking poll every few milliseconds can starve the relay.
    reader = read_only(engine)

    def published() -> int:
        with reader.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).where(outbox.c.published_at.is_not(None))).scalar_one())

    kills = 0
    proc: subprocess.Popen[bytes] | None = None
    try:
        for _ in range(3):  # kill it three times while it is busy, restart each time
            proc = _relay(tmp_path, db_url, bus_url)
            before = published()
            wait_for(lambda b=before: published() > b, 90, interval=0.01, what="the relay to publish")
            if published() >= total:
                proc.kill()
                proc.wait(10)
                break
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
            kills += 1
        proc = _relay(tmp_path, db_url, bus_url)
        wait_for(lambda: published() == total, 60, what="every outbox row published after the restarts")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
    assert kills >= 1, "the relay finished before it could be killed: make the workload larger"

    with engine.connect() as conn:
        rows = {r.id: r.event_id for r in conn.execute(sa.select(outbox.c.id, outbox.c.event_id))}
    assert len(rows) == total
    bus = open_bus(bus_url, engine=engine, partitions=4, namespace=namespace)
    try:
        bus.ensure_group("audit")
        by_version: dict[int, set[str]] = defaultdict(set)
        deadline = time.monotonic() + 60
        while len(by_version) < total and time.monotonic() < deadline:
            batch = bus.read("audit", "auditor", list(range(4)), 2000, 0.2)
            bus.ack("audit", batch)
            for d in batch:
                assert d.event is not None, d.error
                by_version[int(d.event.data["version"])].add(d.event.id)
    finally:
        bus.close()
        engine.dispose()
    assert set(by_version) == set(rows), "an outbox row never reached the bus"
    for version, ids in by_version.items():
        assert ids == {rows[version]}, f"outbox row {version} was republished under another event id"
