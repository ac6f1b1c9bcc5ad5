"""SIGKILL of one of two scheduler processes while it is dispatching, then a restart.

Two ``pollbridge scheduler run`` processes split the bus partitions, a ``pollbridge relay run`` feeds
them and a ``pollbridge workers run`` executes what they dispatch. A workload of a few hundred tasks
(DAGs, and due times spread over several seconds so dispatching goes on for a while) is seeded; one
scheduler holding partitions is SIGKILLed mid-run. The survivor takes its partitions over when the
leases expire (claiming the entries the dead one had read and not acknowledged, and catching up from
the database), the killed one is restarted and gets its share back. At the end every task is
completed, nothing was dispatched twice or early (:func:`bridge.reference.oracle.verify`), and only the event
path dispatched.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.bus import EventBus, open_bus
from bridge.bus.base import partition_for
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import SchedulerSettings
from bridge.db.engine import create_engine, db_now, read_only
from bridge.db.schema import dispatch_log, outbox
from bridge.reference.oracle import load_tasks, verify
from bridge.reference.workload import SHAPES, WorkflowSpec, make_shape, seed
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler.leases import lease_snapshot
from tests.support import wait_for

PARTITIONS = 4


class Processes:
    """The ``pollbridge`` subprocesses of one test; stderr of each goes to a file (a full pipe could block it)."""

    def __init__(self, cwd: Path, db_url: str, bus_url: str) -> None:
        exe = shutil.which("pollbridge")
        assert exe, "pollbridge is not installed"
        self.exe = exe
        self.cwd = cwd
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
                    "POLLBRIDGE_DATABASE_URL": db_url, "POLLBRIDGE_BUS_URL": bus_url,
                    "POLLBRIDGE_LOG_LEVEL": "INFO",
                    # Every type event-driven without going through the gates: this test is about crashes.
                    "POLLBRIDGE_SCHEDULER_PHASE": "cutover"}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.count = 0

    def start(self, *args: str, ready: str) -> subprocess.Popen[bytes]:
        """Start ``pollbridge ARGS`` and wait until its stderr shows ``ready`` (its start-up line)."""
        self.count += 1
        log = self.cwd / f"{args[0]}-{self.count}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([self.exe, *args], cwd=self.cwd, env=self.env, stdout=subprocess.DEVNULL,
                                    stderr=out)
        self.procs.append(proc)
        wait_for(lambda: ready in log.read_text(errors="replace") or proc.poll() is not None, 60,
                 what=f"`pollbridge {' '.join(args)}` to start")
        assert proc.poll() is None, f"`pollbridge {' '.join(args)}` exited: {log.read_text(errors='replace')}"
        return proc

    def scheduler(self) -> subprocess.Popen[bytes]:
        return self.start("scheduler", "run", ready="scheduler ")

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted(self.cwd.glob("*.log")))

    def dump_stacks(self) -> None:
        """Ask every live process for its threads' stacks (SIGUSR1, see bridge.core.runtime) and wait for them."""
        logs = sorted(self.cwd.glob("*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        live = [log for proc, log in zip(self.procs, logs, strict=False) if proc.poll() is None]
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
        try:
            wait_for(lambda: all("most recent call first" in log.read_text(errors="replace") for log in live), 10,
                     what="the stack dumps")
        except AssertionError as exc:
            print(exc)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _workload(prefix: str, rng: random.Random) -> list[WorkflowSpec]:
    """About 300 tasks in 50 instances: chains, fan-out/fan-in and diamonds; half the tasks have a due
    time up to 9 s away, so dispatches keep happening long enough to kill a scheduler in the middle."""
    specs = []
    for n in range(50):
        shape = SHAPES[n % len(SHAPES)]
        tasks = make_shape(shape, 6, rng, due_fraction=0.5, max_due=9.0)
        specs.append(WorkflowSpec(f"{prefix}-{n:03d}", ("orders", "reports", "etl")[n % 3], tasks))
    return specs


def _dispatches(engine: Engine, instances: list[str] | None = None) -> int:
    q = sa.select(sa.func.count()).select_from(dispatch_log)
    if instances is not None:
        q = q.where(dispatch_log.c.instance_id.in_(instances))
    with read_only(engine).connect() as conn:  # no write lock on SQLite: the test must not slow the writers
        return int(conn.execute(q).scalar_one())


def _holders(engine: Engine, bus: EventBus) -> dict[int, str | None]:
    """Each partition's lease holder, wherever the schedulers keep their leases (beside a Redis bus)."""
    return {p: h for p, (h, _) in lease_snapshot(engine, bus).leases.items()}


def _partitions_of(engine: Engine, bus: EventBus, pid: int) -> set[int]:
    """Partitions whose lease names process ``pid`` (holder names are ``host:pid:random``)."""
    return {p for p, h in _holders(engine, bus).items() if h is not None and h.split(":")[-2] == str(pid)}


def _unfinished(engine: Engine, bus: EventBus, tables: TaskTable, ids: list[str]) -> str:
    """What a timed-out wait needs to be diagnosed: the outbox and bus backlogs, each task not completed."""
    group = SchedulerSettings().group
    with read_only(engine).connect() as conn:
        tasks = [t for t in load_tasks(conn, tables, ids) if t.status != tables.statuses.completed]
        logged = Counter(r.task_id for r in conn.execute(sa.select(dispatch_log.c.task_id)))
        unpublished = conn.execute(sa.select(sa.func.count()).select_from(outbox)
                                   .where(outbox.c.published_at.is_(None))).scalar_one()
        clock = conn.execute(sa.select(db_now(engine.dialect.name))).scalar_one()
    lines = [f"database clock {clock}; outbox rows unpublished: {unpublished}; bus lag {bus.lag(group)}, "
             f"pending {bus.pending_count(group)}",
             f"{len(tasks)} task(s) not completed:"]
    for t in tasks[:40]:
        lines.append(f"  {t.instance_id}/{t.key} id={t.id} status={t.status} due={t.due_at} deps={t.depends_on} "
                     f"partition={partition_for(t.instance_id, PARTITIONS)} dispatched={logged.get(str(t.id), 0)}")
    return "\n".join(lines)


def _run_kill_scenario(tmp_path: Path, db_url: str, bus_url: str, namespace: str) -> None:
    (tmp_path / "pollbridge.toml").write_text(
        f'[bus]\nnamespace = "{namespace}"\npartitions = {PARTITIONS}\nvisibility_timeout = 2\n'
        "[scheduler]\nlease_ttl = 3\nclaim_interval = 1\n"
        "[workers]\nconcurrency = 4\nmin_duration = 0.005\nmax_duration = 0.02\n")
    engine = create_engine(db_url)
    bus = open_bus(bus_url, engine=engine, partitions=PARTITIONS, namespace=namespace)
    tables = reflect_tables(engine, TaskTableMapping())
    specs = _workload("kill", random.Random(11))
    ids = [s.instance_id for s in specs]
    procs = Processes(tmp_path, db_url, bus_url)
    try:
        procs.start("relay", "run", ready="relay partition")
        procs.start("workers", "run", ready="workers on")
        a = procs.scheduler()
        b = procs.scheduler()
        # Both members share the partitions before any work arrives (b joined, a gives back the excess).
        wait_for(lambda: bool(_partitions_of(engine, bus, a.pid)) and bool(_partitions_of(engine, bus, b.pid))
                 and len(_partitions_of(engine, bus, a.pid) | _partitions_of(engine, bus, b.pid)) == PARTITIONS, 30,
                 what="the two schedulers to split the partitions")
        with engine.begin() as conn:
            total = seed(conn, tables, specs)
        assert 250 <= total <= 400

        # Kill a scheduler that holds partitions while dispatches are happening. Usually that is either; under
        # load one can miss a renewal, lose its leases to the other for a moment and hold none.
        wait_for(lambda: _dispatches(engine) >= total // 5, 60, what="a fifth of the workload to be dispatched")
        chosen: dict[str, tuple[subprocess.Popen[bytes], set[int]]] = {}

        def choose() -> bool:
            for proc in (a, b):
                held = _partitions_of(engine, bus, proc.pid)
                if held:
                    chosen["victim"] = (proc, held)
                    return True
            return False
        wait_for(choose, 30, what="a scheduler to hold partitions")
        victim, victim_partitions = chosen["victim"]
        survivor = b if victim is a else a
        orphaned = [i for i in ids if partition_for(i, PARTITIONS) in victim_partitions]
        orphaned_tasks = sum(len(s.tasks) for s in specs if s.instance_id in orphaned)
        at_kill = _dispatches(engine)
        orphaned_at_kill = _dispatches(engine, orphaned)
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(10) == -signal.SIGKILL
        assert at_kill < total and orphaned_at_kill < orphaned_tasks, \
            "the workload finished before the kill: spread the due times further"

        # The survivor takes the dead one's partitions over once their leases expired ...
        wait_for(lambda: _partitions_of(engine, bus, survivor.pid) == set(range(PARTITIONS)), 30,
                 what="the survivor to take over every partition")
        # ... and a restarted scheduler gets its share back.
        a2 = procs.scheduler()
        wait_for(lambda: bool(_partitions_of(engine, bus, a2.pid)), 30,
                 what="the restarted scheduler to acquire partitions")

        def settled() -> bool:
            with read_only(engine).connect() as conn:
                v = verify(conn, tables, ids)
            return v.completed == v.tasks
        wait_for(settled, 120, interval=0.2, what="every task to be completed after the kill")
        assert a2.poll() is None and survivor.poll() is None, procs.logs()
        after_kill = _dispatches(engine) - at_kill
    except BaseException:
        try:  # the diagnosis must not replace the failure it is for
            procs.dump_stacks()
            print(f"leases: {_holders(engine, bus)}\n{_unfinished(engine, bus, tables, ids)}")
        except Exception as exc:
            print(f"(diagnostics failed: {type(exc).__name__}: {exc})")
        print(procs.logs(tail=20_000))
        raise
    finally:
        procs.stop_all()
        bus.close()

    for proc in procs.procs:
        if proc is not victim:
            assert proc.returncode == 0, procs.logs()  # the survivors stop cleanly on SIGTERM
    assert after_kill > 0
    with engine.connect() as conn:
        verdict = verify(conn, tables, ids)
        paths: dict[str, int] = dict(conn.execute(
            sa.select(dispatch_log.c.path, sa.func.count()).group_by(dispatch_log.c.path)).all())
        per_task = conn.execute(sa.select(dispatch_log.c.task_id, sa.func.count()).group_by(dispatch_log.c.task_id)
                                .having(sa.func.count() > 1)).all()
    # The dead scheduler's instances were finished by the others (takeover, claim, catch-up).
    assert _dispatches(engine, orphaned) == orphaned_tasks > orphaned_at_kill
    engine.dispose()
    assert verdict.completed == verdict.tasks == total, verdict
    assert verdict.lost == 0, verdict
    assert verdict.double_dispatched == 0, verdict.problems
    assert verdict.early == 0, verdict.problems
    assert verdict.dispatches == total, "a task was dispatched more than once (workers never fail here)"
    assert per_task == []
    assert paths == {"events": total}


@pytest.mark.postgres
@pytest.mark.redis
def test_scheduler_killed_mid_run_on_postgresql_and_redis(tmp_path: Path, pg_url: str, redis_server: str,
                                                          redis_namespace: str) -> None:
    _run_kill_scenario(tmp_path, pg_url, redis_server, redis_namespace)


def test_scheduler_killed_mid_run_on_sqlite_embedded(tmp_path: Path, sqlite_url: str) -> None:
    _run_kill_scenario(tmp_path, sqlite_url, "embedded", "pollbridge")
