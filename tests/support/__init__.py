"""Helpers shared by tests, imported as ``tests.support`` (the chaos engine is :mod:`tests.support.chaos`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.bus import open_bus
from bridge.bus.base import Delivery, EventBus
from bridge.db.filelock import remove_locks
from bridge.reference.oracle import Verdict, verify
from bridge.tasktable.tables import TaskTable
from legacy_poller.poller import LegacyPoller


@dataclass
class Env:
    """A database with pollbridge installed plus a way to open buses on it (see the ``env`` fixture)."""

    engine: Engine
    tables: TaskTable
    open_bus: Callable[[], EventBus]
    kind: str
    namespace: str | None = None
    url: str = ""
    #: The Redis (server or cluster node) URL of the bus, or None for the embedded bus.
    bus_url: str | None = None


@dataclass
class StackContext:
    """What outlives one state-machine example: the database, how to open a bus on it, and an example counter.

    Subclasses set ``partitions`` (of the buses :meth:`open_bus` opens) and ``reset_tables`` (emptied by
    :meth:`reset` in this order, after the task table and the instances).
    """

    env: Env
    redis_url: str | None
    examples: int = 0
    partitions: ClassVar[int] = 4
    reset_tables: ClassVar[tuple[sa.Table, ...]] = ()

    def open_bus(self) -> EventBus:
        if self.redis_url is None:
            return open_bus("embedded", engine=self.env.engine, partitions=self.partitions)
        return open_bus(self.redis_url, partitions=self.partitions, namespace=self.env.namespace or "pollbridge")

    def reset(self) -> None:
        """An empty task table, ``reset_tables`` and Redis namespace (on Redis) for the next example."""
        tt = self.env.tables
        with self.env.engine.begin() as conn:
            conn.execute(tt.tasks.delete())
            if tt.instances is not None:
                conn.execute(tt.instances.delete())
            for table in self.reset_tables:
                conn.execute(table.delete())
        # SQLite: the liveness lock files beside the database too. A lock an earlier example's scheduler still
        # holds is then on a removed file: that scheduler sees it lost it, and the next example's takes a new one.
        remove_locks(self.env.engine)
        if self.redis_url is not None and self.env.namespace is not None:
            clear_redis_namespace(self.redis_url, self.env.namespace)


#: ``@pytest.fixture(params=SHARED_DB_PARAMS)`` on an ``engine`` override returning ``shared_engine(request)``
#: gives a module one database per dialect (the ``sqlite_shared``/``pg_shared`` fixtures of tests/integration),
#: emptied before each test instead of cloned for it (cloning one per test costs seconds).
SHARED_DB_PARAMS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
#: Where the scheduler's partition leases can live: the database (SQLite, PostgreSQL), or Redis beside the bus
#: (with PostgreSQL as the database).
LEASE_STORE_PARAMS = [*SHARED_DB_PARAMS, pytest.param("redis", marks=[pytest.mark.postgres, pytest.mark.redis])]
#: What ``shared_engine`` empties, the outbox last: deleting tasks fires the capture trigger.
SHARED_DB_RESET = ("tasks", "workflow_instances", "pollbridge_dispatch_log", "pollbridge_decisions",
                   "pollbridge_flags", "pollbridge_flag_audit", "pollbridge_holds", "pollbridge_review",
                   "pollbridge_outbox", "pollbridge_capture_gaps")


def reset_shared(engine: Engine) -> Engine:
    """Empty the tables the shared-database tests write (and undo a rename a failed test may have left)."""
    with engine.begin() as conn:
        if "pollbridge_flags_away" in sa.inspect(conn).get_table_names():
            conn.execute(sa.text("ALTER TABLE pollbridge_flags_away RENAME TO pollbridge_flags"))
        for name in SHARED_DB_RESET:
            conn.execute(sa.text(f"DELETE FROM {name}"))
    remove_locks(engine)  # SQLite: the lock files beside it (see StackContext.reset)
    return engine


def shared_engine(request: pytest.FixtureRequest) -> Engine:
    """The module's shared database for the dialect in ``request.param`` (see ``SHARED_DB_PARAMS``), emptied."""
    return reset_shared(request.getfixturevalue(f"{request.param.replace('postgresql', 'pg')}_shared"))


#: Runs the installed ``pollbridge`` script: ``run(*args, env=..., timeout=..., cwd=..., input=...)``.
Run = Callable[..., subprocess.CompletedProcess[str]]


def when_waiting(monkeypatch: Any, signal: Any) -> threading.Event:
    """An event set each time ``signal.wait(seen, timeout)`` is called (a wake-up generation a test's reader or
    relay blocks on): the test then knows the waiter has looked and is about to block, without sleeping."""
    waiting = threading.Event()
    inner = signal.wait

    def wait(seen: int, timeout: float) -> int:
        waiting.set()
        return int(inner(seen, timeout))

    monkeypatch.setattr(signal, "wait", wait)
    return waiting


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    """Deadline-bounded wait: return as soon as ``condition()`` holds, fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def drive_until_settled(
    engine: Engine,
    tables: TaskTable,
    pollers: Sequence[LegacyPoller],
    instance_ids: Sequence[str],
    timeout: float = 60.0,
) -> Verdict:
    """Scan with every poller in turn (workers run elsewhere) until the instances settle; return the verdict."""
    deadline = time.monotonic() + timeout
    while True:
        for poller in pollers:
            poller.scan_once()
        with engine.connect() as conn:
            verdict = verify(conn, tables, instance_ids)
        if verdict.unsettled == 0:
            return verdict
        if time.monotonic() > deadline:
            raise AssertionError(f"workload not settled after {timeout} s: {verdict}")
        time.sleep(0.02)


def clear_redis_namespace(redis_url: str, namespace: str) -> int:
    """Delete every key of one test's bus namespace (and nothing else); how many there were."""
    from bridge.bus.redis_streams import connect, delete_namespace

    client, _ = connect(redis_url)  # a server or a cluster
    try:
        return delete_namespace(client, namespace)
    finally:
        client.close()


def age_scheduler_member(engine: Engine, bus: EventBus | None, holder: str | None, seconds: float,
                         store: Any = None) -> None:
    """A scheduler process stalled or died: ``holder``'s (every member's if None) heartbeat and leases
    are ``seconds`` old, wherever the leases are kept (beside a Redis bus, else in the database). Lock files
    (``store``, a :class:`~event_scheduler.leases.FileLockPartitionLeases`) keep no age: a process's death
    is its locks' release, which closing their descriptors is (what the kernel does when it dies)."""
    from datetime import UTC, datetime, timedelta

    from bridge.db.schema import scheduler_leases, scheduler_members
    from event_scheduler.leases import FileLockPartitionLeases

    if isinstance(store, FileLockPartitionLeases):
        store.release_all()
        return

    # Where the scheduler keeps its leases is the bus's answer (a wrapping test bus delegates it): the
    # Redis backend keeps them beside its streams, every other backend leaves them to the database.
    if bus is not None and bus.leases() is not None:
        client, keys = bus.client, bus.keys  # type: ignore[attr-defined]
        secs, micros = client.time()
        past = int(secs) * 1000 + int(micros) // 1000 - int(seconds * 1000)
        for m in client.zrange(keys.scheduler_members, 0, -1):
            if holder is None or m.decode() == holder:
                client.zadd(keys.scheduler_members, {m: past})
        for p, v in client.hgetall(keys.scheduler_leases).items():
            owner = v.decode().split(" ", 1)[1]
            if holder is None or owner == holder:
                client.hset(keys.scheduler_leases, p, f"{past} {owner}")
        return
    at = datetime.now(UTC) - timedelta(seconds=seconds)
    if engine.dialect.name == "sqlite":
        at = at.replace(tzinfo=None)
    lc, mc = scheduler_leases.c, scheduler_members.c
    with engine.begin() as conn:
        conn.execute(scheduler_members.update().where(sa.true() if holder is None else mc.holder == holder)
                     .values(heartbeat_at=at))
        conn.execute(scheduler_leases.update().where(sa.true() if holder is None else lc.holder == holder)
                     .values(expires_at=at))


def start_relay(cwd: Path, db_url: str, bus_url: str, ready: bytes = b"relay partition") -> subprocess.Popen[bytes]:
    """``pollbridge relay run`` as its own process in ``cwd`` (its ``pollbridge.toml``), started once its log
    says ``ready`` (its signal handlers are installed before the first line). Its stderr goes to a file, not
    a pipe: a pipe nobody drains fills up and blocks the relay's logging."""
    exe = shutil.which("pollbridge")
    assert exe, "pollbridge is not installed"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
           "POLLBRIDGE_DATABASE_URL": db_url, "POLLBRIDGE_BUS_URL": bus_url}
    log = cwd / f"relay-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([exe, "relay", "run"], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=out)
    wait_for(lambda: ready in log.read_bytes() or proc.poll() is not None, 60, what="the relay to start")
    assert proc.poll() is None, log.read_text()
    return proc


def drain(relay: Any, scheduler: Any, rounds: int = 10) -> None:
    """Publish every captured change and let the scheduler handle every event, until neither moves (a
    scheduler's own write is captured again: a few rounds)."""
    for _ in range(rounds):
        moved = 0
        while relay.publish_batch():
            moved += 1
        while scheduler.poll_once(block=0.0):
            moved += 1
        if not moved:
            return


class Audit:
    """A consumer group of its own that collects every event id the bus delivers."""

    def __init__(self, bus: EventBus, group: str = "audit") -> None:
        self.bus, self.group = bus, group
        bus.ensure_group(group)
        self.seen: list[Delivery] = []

    def collect(self, expected: set[str], timeout: float = 20.0) -> set[str]:
        deadline = time.monotonic() + timeout
        while True:
            batch = self.bus.read(self.group, "auditor", list(range(self.bus.partitions)), 500, 0.05)
            if batch:
                self.bus.ack(self.group, batch)
                self.seen.extend(batch)
            ids = self.ids()
            if expected <= ids or time.monotonic() > deadline:
                return ids

    def ids(self) -> set[str]:
        return {d.event.id for d in self.seen if d.event is not None}


def stop_processes(procs: list[subprocess.Popen[str]], grace: float = 30.0) -> list[tuple[str, str]]:
    """SIGTERM each process and collect its output; one that has not exited within ``grace`` seconds is asked
    for every thread's stack (SIGUSR1: bridge.core.runtime's faulthandler), killed, and the test fails with
    that stack, so a stop that hangs says where it hangs."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    outputs: list[tuple[str, str]] = []
    hung: list[str] = []
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.communicate(timeout=3)  # the dump is written at once; this reads it meanwhile
            p.kill()
            out, err = p.communicate()
            outputs.append((out, err))
            args = p.args if isinstance(p.args, list) else [p.args]
            name = " ".join(map(str, args[1:3]))
            hung.append(f"{name} (pid {p.pid}) did not stop within {grace} s of SIGTERM:\n{err[-20000:]}")
    assert not hung, "\n\n".join(hung)
    return outputs
