"""Liveness by lock files beside a SQLite database (bridge.db.filelock): the kernel releases a dead process's
lock at once, two holders in one process exclude each other, a removed file is a lost lock, and a relay
leads its partition by one without a statement."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import sqlalchemy as sa

from bridge.app import install
from bridge.bus import open_bus
from bridge.capture.leadership import FileLockLeadership, ensure_state_row, leadership_for, relay_lock_name
from bridge.capture.relay import Relay
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import RelaySettings
from bridge.db.engine import create_engine
from bridge.db.filelock import LOCK_INFIX, FileLock, holder_of, lock_path, remove_locks
from bridge.db.schema import relay_state
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from event_scheduler.leases import lease_snapshot, lease_store
from tests.support import wait_for


def _name(path: Path) -> str | None:
    holder = holder_of(path)
    return None if holder is None else holder.name


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
        assert _name(path) == "child:1:abc"
        mine = FileLock(path)
        assert not mine.acquire("parent")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert holder_of(path) is None  # no timeout to wait out: the kernel released it with the process
        assert mine.acquire("parent") and _name(path) == "parent"
        mine.release()
        assert holder_of(path) is None
    finally:
        child.kill()
        child.wait()


def test_two_holders_in_one_process_exclude_each_other(tmp_path: Path) -> None:
    path = tmp_path / "x"
    one, two = FileLock(path), FileLock(path)
    assert one.acquire("one") and one.acquire("one")  # held: taking it again is a no-op
    assert not two.acquire("two") and _name(path) == "one"
    one.release()
    assert two.acquire("two") and not one.acquire("one") and _name(path) == "two"
    two.release()


def test_a_lock_whose_file_was_removed_is_lost(tmp_path: Path) -> None:
    """``uninstall`` beside a running holder: a second holder could lock a new file of the same name, so the
    first must see that it no longer holds the name's lock."""
    path = tmp_path / "x"
    one, two = FileLock(path), FileLock(path)
    assert one.acquire("one")
    path.unlink()
    assert two.acquire("two")
    assert not one.held() and _name(path) == "two"
    two.release()


def test_a_relay_on_a_sqlite_file_leads_by_its_lock_file(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        path = lock_path(engine, relay_lock_name(0))
        ensure_state_row(engine, 0)
        first, second = leadership_for(engine, 0, 5.0), leadership_for(engine, 0, 5.0)
        assert isinstance(first, FileLockLeadership) and path is not None
        assert first.try_acquire() and not second.try_acquire()
        assert _name(path) == first.holder
        with engine.connect() as conn:  # who holds it, for status: written when taken
            assert conn.execute(sa.select(relay_state.c.holder)).scalar_one() == first.holder
        statements: list[str] = []
        sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        assert all(first.try_acquire() for _ in range(50))  # still held: asked of the file, not the database
        assert statements == []
        first.release()
        assert second.try_acquire() and _name(path) == second.holder
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


def test_a_dropped_lock_is_released_when_collected(tmp_path: Path) -> None:
    path = tmp_path / "x"
    lock = FileLock(path)
    assert lock.acquire("gone") and _name(path) == "gone"
    del lock
    gc.collect()
    assert holder_of(path) is None and FileLock(path).acquire("next")


def test_a_lock_file_takes_the_databases_permissions(tmp_path: Path) -> None:
    """A database a group shares (0660) stays usable by each of its users: SQLite gives its -wal and -shm the
    database's mode, and so do the lock files, whatever the umask (before: 0644, and the group's other user
    could not open the file the first one made)."""
    database = tmp_path / "shared.db"
    database.touch()
    database.chmod(0o660)
    old = os.umask(0o022)
    try:
        lock = FileLock(Path(f"{database}{LOCK_INFIX}relay_0"))
        assert lock.acquire("one")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(lock.path).st_mode) == 0o660
    lock.release()


def test_names_with_glob_characters_are_names(tmp_path: Path) -> None:
    """``data[1].db``: its lock files are found (members counted, removed by uninstall), and another database's
    files in the same folder are not."""
    url = f"sqlite:///{tmp_path / 'data[1].db'}"
    other = create_engine(f"sqlite:///{tmp_path / 'data1.db'}")
    engine = create_engine(url)
    try:
        install.init(engine, demo_schema=True, mapping=TaskTableMapping())
        bus = open_bus("embedded", engine=engine, partitions=4)
        a, b = (lease_store(engine, bus, h, ttl=10.0) for h in ("a", "b"))
        a.refresh()
        b.refresh()
        a.refresh()
        b.refresh()
        assert (a.owned, b.owned) == ({0, 1}, {2, 3})
        assert sorted(lease_snapshot(engine, bus).members) == ["a", "b"]
        theirs = lock_path(other, relay_lock_name(0))
        assert theirs is not None and FileLock(theirs).acquire("other")
        a.release_all()
        b.release_all()
        removed = remove_locks(engine)
        assert len(removed) == 2 + 4 and theirs.exists() and theirs not in removed
    finally:
        engine.dispose()
        other.dispose()


def test_a_holder_that_stopped_touching_its_lock_is_stuck(sqlite_url: str) -> None:
    """A stalled process keeps its locks (nobody can take them): the checks tell it from a working one by the
    lock file's time, which the relay touches at each leadership check and a scheduler at each round."""
    from bridge.app.components import Components
    from bridge.core.settings import Settings

    engine = create_engine(sqlite_url)
    bus = open_bus("embedded", engine=engine, partitions=8)
    try:
        ensure_state_row(engine, 0)
        tables = reflect_tables(engine, TaskTableMapping())
        with engine.begin() as conn:  # a known workflow type
            seed(conn, tables, [WorkflowSpec("k", "orders", (TaskSpec("a"),))])
        relay = leadership_for(engine, 0, 5.0)
        leases = lease_store(engine, bus, "sched:1:abc", ttl=10.0)
        assert relay.try_acquire() and leases.refresh()[0] == set(range(8))
        settings = dataclasses.replace(Settings(), database_url=sqlite_url)

        def check(name: str) -> tuple[bool, str]:
            result = Components(settings).preflight(engine, "orders", "cutover").result(name)
            assert result is not None
            return result.passed, result.detail

        assert check("relay_alive")[0] and check("scheduler_alive")[0]
        long_ago = time.time() - 60
        for path in Path(sqlite_url.removeprefix("sqlite:///")).parent.glob(f"*{LOCK_INFIX}*"):
            os.utime(path, (long_ago, long_ago))
        passed, detail = check("relay_alive")
        assert not passed and "the relay is stuck" in detail and "older than 10 s" in detail, detail
        passed, detail = check("scheduler_alive")
        assert not passed and "no scheduler process heartbeat within 20 s" in detail, detail
        assert relay.try_acquire() and leases.refresh() == (set(), set())  # working again: they touch the files
        assert check("relay_alive")[0] and check("scheduler_alive")[0]
        relay.release()
        leases.release_all()
    finally:
        bus.close()
        engine.dispose()
