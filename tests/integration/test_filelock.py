"""Liveness by lock files beside a SQLite database (bridge.db.filelock): the kernel releases a dead process's
lock at once, two holders in one process exclude each other, a removed file is a lost lock, and a relay
leads its partition by one without a statement."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import sqlalchemy as sa

from bridge.app import install
from bridge.bus import open_bus
from bridge.capture.leadership import FileLockLeadership, ensure_state_row, leadership_for, relay_lock_name
from bridge.capture.relay import Relay
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import RelaySettings
from bridge.db.engine import create_engine
from bridge.db.filelock import LOCK_INFIX, FileLock, holder_of, lock_path
from bridge.db.schema import relay_state
from tests.support import wait_for

HOLD = """
import sys, time
from pathlib import Path
from bridge.db.filelock import FileLock
lock = FileLock(Path(sys.argv[1]))
assert lock.acquire("child:1:abc")
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_holders_lock_is_free_at_once(tmp_path: Path) -> None:
    path = tmp_path / f"db{LOCK_INFIX}relay_0"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert holder_of(path) == "child:1:abc"
        mine = FileLock(path)
        assert not mine.acquire("parent")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert holder_of(path) is None  # no timeout to wait out: the kernel released it with the process
        assert mine.acquire("parent") and holder_of(path) == "parent"
        mine.release()
        assert holder_of(path) is None
    finally:
        child.kill()
        child.wait()


def test_two_holders_in_one_process_exclude_each_other(tmp_path: Path) -> None:
    path = tmp_path / "x"
    one, two = FileLock(path), FileLock(path)
    assert one.acquire("one") and one.acquire("one")  # held: taking it again is a no-op
    assert not two.acquire("two") and holder_of(path) == "one"
    one.release()
    assert two.acquire("two") and not one.acquire("one") and holder_of(path) == "two"
    two.release()


def test_a_lock_whose_file_was_removed_is_lost(tmp_path: Path) -> None:
    """``uninstall`` beside a running holder: a second holder could lock a new file of the same name, so the
    first must see that it no longer holds the name's lock."""
    path = tmp_path / "x"
    one, two = FileLock(path), FileLock(path)
    assert one.acquire("one")
    path.unlink()
    assert two.acquire("two")
    assert not one.held() and holder_of(path) == "two"
    two.release()


def test_a_relay_on_a_sqlite_file_leads_by_its_lock_file(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        path = lock_path(engine, relay_lock_name(0))
        ensure_state_row(engine, 0)
        first, second = leadership_for(engine, 0, 5.0), leadership_for(engine, 0, 5.0)
        assert isinstance(first, FileLockLeadership) and path is not None
        assert first.try_acquire() and not second.try_acquire()
        assert holder_of(path) == first.holder
        with engine.connect() as conn:  # who holds it, for status: written when taken
            assert conn.execute(sa.select(relay_state.c.holder)).scalar_one() == first.holder
        statements: list[str] = []
        sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        assert all(first.try_acquire() for _ in range(50))  # still held: asked of the file, not the database
        assert statements == []
        first.release()
        assert second.try_acquire() and holder_of(path) == second.holder
        second.release()
        install.uninstall(engine, TaskTableMapping())
        assert not list(path.parent.glob(f"*{LOCK_INFIX}*"))  # uninstall removes the lock files
    finally:
        engine.dispose()


def test_a_standby_relay_takes_over_when_the_holder_stops(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    fast = RelaySettings(poll_interval=0.01, lease_timeout=0.3, idle_probe_interval=0.5)
    relays = [Relay(engine, open_bus("embedded", engine=engine, partitions=1), fast) for _ in range(2)]
    stops = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=r.run, args=(s,), daemon=True) for r, s in zip(relays, stops, strict=True)]
    try:
        threads[0].start()
        wait_for(lambda: relays[0].metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 1, 10,
                 what="the first relay to lead")
        threads[1].start()
        stops[0].set()
        threads[0].join(10)
        wait_for(lambda: relays[1].metrics.value("pollbridge_relay_leader", {"partition": "0"}) == 1, 10,
                 what="the standby to take over")
    finally:
        for s in stops:
            s.set()
        for t in threads:
            t.join(10)
        engine.dispose()
