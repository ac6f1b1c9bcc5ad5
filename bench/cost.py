"""What the database pays per completion, at every rate: the event path (both capture modes), the embedded
default and the reference poller, alternating in one run (issue 20, point 5).

    python -m bench.cost [--rates 0,2,20,100,500] [--seconds 20] [--configs trigger,wal,embedded,poller-10s,poller-1s]
                         [--settle 11] [--json F] [--png F] [--quick]

``--quick`` (CI): rates 0 and 20, 5 s windows, ``trigger``, ``embedded`` and ``poller-1s`` only, a 1 s settle
(its transaction counts can include start-up transactions: it keeps the script working, its figures are not
the ones to quote).

**Workload.** Two-task chains (``t0`` → ``t1``, workflow type ``bench``), enough for every window of the run
(rate x seconds x 1.25, plus 10, summed over the rates), seeded into each configuration's database before its
first window with ``t0`` already dispatched (``queued``) and ``t1`` ``pending`` (the first window's start-up
consumes their captured inserts): the task table is the same size in every window. In each window the bench
process, *the completer*, completes queued ``t0`` tasks, oldest first, at the rate for ``--seconds``
(``bench.scheduler.complete``, one transaction a batch); each completion makes one ``t1`` ready, which the
configuration must dispatch. Rate 0 is idle: nothing is completed, the window measures what the processes
cost per second. Before each window: ``VACUUM (ANALYZE)`` of the busy tables (autovacuum is off here).

**Configurations**, each in a scratch database of its own (and a Redis namespace of its own), each component
a ``pollbridge`` subprocess (``bench.paths.start_processes``), started afresh for every window:

* ``trigger``: PostgreSQL + Redis, the capture triggers (``[capture] wake = "adaptive"``, the default),
  ``pollbridge relay run`` and one ``pollbridge scheduler run``, every type in ``cutover``;
* ``wal``: the same with ``[capture] mode = "wal"`` (a publication and a logical slot the relay streams);
* ``embedded``: the embedded default: a SQLite file and the embedded bus, the same two processes;
* ``poller-10s``, ``poller-1s``: ``pollbridge poller run --interval 10`` / ``1``, every type in ``polling``,
  no capture (the legacy setup before pollbridge), on PostgreSQL.

The windows alternate: for each rate, every configuration, in an order that reverses from one rate to the
next, so that drift and other load on the machine fall on all of them.

**Per configuration and rate:**

* *transactions per completion* (PostgreSQL): the scratch database's ``pg_stat_database`` ``xact_commit +
  xact_rollback`` from the start of the window until the configuration's processes have stopped after it,
  minus the bench's own transactions (the completer's batches and pool pings, counted with SQLAlchemy
  events, and its clock and drain queries, counted by ``CountingConnection``), divided by the completions.
  A backend reports its transactions when it next goes idle, at most once a second, and an idle backend
  with unreported ones only after 10 s (PostgreSQL 15): so the window opens ``--settle`` seconds after the
  processes' start-up and the bench's set-up (11 s), and only once the count has grown by no more than the
  processes' statements (plus 2) in two 2 s looks in a row (a start-up or catch-up burst reported late is
  not counted), and closes after the processes exited (a backend reports at exit). The processes' shutdown
  (a lease released) is counted. ``rollbacks`` counts the rolled-back ones apart.
* *statements per completion*: every statement each process executed (``psycopg`` on PostgreSQL,
  SQLAlchemy on SQLite), counted by the ``sitecustomize`` of ``bench._paths_common``; per process, and
  per statement text per second over the window (``by_text``: what a time-driven loop shows up in).
  On SQLite (no ``pg_stat_database``) the statements are the figure; ``write_transactions`` counts the
  ``BEGIN IMMEDIATE`` (every write transaction on SQLite takes the database's one write lock).
* *transactions/s* and *statements/s* over the window and its drain;
* *ready → dispatch* p50/p99: ``dispatched_at - ready_at`` of the ``t1`` dispatches whose ``ready_at`` (the
  ``t0``'s ``completed_at``) falls in the window, from the dispatch log, nearest rank, ranked in SQL;
* *where it went* (``stages``): ready → dispatch split where the completer's ``COMMIT`` returned (its batches'
  times, recorded by the bench): ``completer_commit``, the client's own commit, and ``commit_to_dispatch``, what
  the configuration took after it (see ``_stages``);
* *CPU seconds per 1,000 completions* of the configuration's processes (``/proc``; idle: % of a core), the
  CPU of the scratch database's backends, and how busy the rest of the machine was;
* *stranded* (a ``t1`` whose ``t0`` completed in the window and that was still not dispatched
  ``max(30 s, --seconds)``, plus the poll interval, after it: lost, or a configuration that cannot keep up),
  *doubled* and *early* dispatches (``bridge.reference.oracle.verify``).

What the transaction count can and cannot see: a transaction without a client statement is counted (a
LISTENing backend reads each notification that reaches it while idle in a transaction of its own, so the
``adaptive`` wake-up's NOTIFYs show up here and in no statement count); the window start can miss the last
burst a periodic process made less than a second before it (a poller's scan: reported up to 10 s later, and
then counted in the window), a few transactions at most.

Exit status 1 when something broke (a process died, a task stranded, dispatched twice or early), else 0:
the figures are reported, not held against targets.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import math
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from bench import _paths_common as pc
from bench.common import (
    PG_ADMIN_URL,
    REDIS_URL,
    command,
    delete_namespace,
    latency_summary,
    scratch_database,
    write_json,
)
from bench.paths import Inserter, PathSpec, start_processes
from bench.scheduler import complete
from bench.wal_capture import _drained
from bridge.app import install
from bridge.bus import open_bus
from bridge.capture import wal
from bridge.capture.triggers import remove_capture
from bridge.core.errors import MappingMismatch
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import BusSettings, CaptureSettings, SchedulerSettings
from bridge.db.changes import JOURNAL_SUFFIX
from bridge.db.engine import create_engine
from bridge.reference.oracle import verify
from bridge.reference.workload import TaskSpec, WorkflowSpec
from bridge.tasktable.tables import reflect_tables

RATES = (0.0, 2.0, 20.0, 100.0, 500.0)
CHAIN = (TaskSpec("t0"), TaskSpec("t1", depends_on=("t0",)))
#: The completer's queue: the chains' first tasks that are queued, oldest first (the workers' own index, as
#: ``bench.common.WORKER_QUEUE_INDEX`` is for the other benches; the dispatched ``t1`` tasks stay queued,
#: nobody completes them, and would otherwise lie in the completer's way).
T0_QUEUE_INDEX = ("CREATE INDEX IF NOT EXISTS bench_cost_t0_queued ON tasks (id) "
                  "WHERE status = 'queued' AND task_key = 't0'")
COMPLETE_T0 = {
    "postgresql": "UPDATE tasks SET status = 'completed', completed_at = clock_timestamp(), "
                  "updated_at = clock_timestamp() WHERE id = ANY(ARRAY(SELECT id FROM tasks "
                  "WHERE status = 'queued' AND task_key = 't0' ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED))",
    "sqlite": f"UPDATE tasks SET status = 'completed', completed_at = {pc.SQLITE_NOW}, updated_at = {pc.SQLITE_NOW} "
              "WHERE id IN (SELECT id FROM tasks WHERE status = 'queued' AND task_key = 't0' ORDER BY id LIMIT :n)",
}
#: Chains whose first task completed and whose second is still not dispatched.
READY_NOT_DISPATCHED = ("SELECT count(*) FROM tasks t JOIN tasks d ON d.instance_id = t.instance_id "
                        "AND d.task_key = 't0' WHERE t.task_key = 't1' AND t.status = 'pending' "
                        "AND d.status = 'completed'")
DRAIN_TIMEOUT = 30.0


@dataclass(frozen=True)
class Config:
    path: PathSpec
    capture: str  # "trigger", "wal", or "none" (the poller's legacy setup)

    @property
    def name(self) -> str:
        return self.path.label

    @property
    def pg(self) -> bool:
        return self.path.backend == "postgresql"


CONFIGS = {
    "trigger": Config(PathSpec("trigger", "events", "postgresql"), "trigger"),
    "wal": Config(PathSpec("wal", "events", "postgresql"), "wal"),
    "embedded": Config(PathSpec("embedded", "events", "sqlite"), "trigger"),
    "poller-10s": Config(PathSpec("poller-10s", "poller", "postgresql", 10.0), "none"),
    "poller-1s": Config(PathSpec("poller-1s", "poller", "postgresql", 1.0), "none"),
}


@dataclass
class Setup:
    """A configuration's scratch database, bus namespace and folder, kept for the whole run."""

    config: Config
    url: str
    bus_url: str
    namespace: str
    workdir: Path
    seeded: int = 0

    @property
    def dbname(self) -> str:
        return self.url.rsplit("/", 1)[1] if self.config.pg else ""


def prepare(config: Config, stack: contextlib.ExitStack, run_id: str, chains: int) -> Setup:
    """The configuration's database: the reference schema, its capture (none for the poller), the completer's
    index and ``chains`` chains for the whole run; cleaned up when ``stack`` closes."""
    namespace = f"pbcost{run_id}{config.name.replace('-', '')}"
    workdir = Path(tempfile.mkdtemp(prefix=f"pbcost-{config.name}-"))
    if config.pg:
        url = stack.enter_context(scratch_database(f"pollbridge_bench_cost_{config.name.replace('-', '_')}"))
        bus_url = REDIS_URL
        stack.callback(delete_namespace, namespace)
    else:
        url = f"sqlite:///{workdir / 'pollbridge.db'}"
        bus_url = "embedded"
        stack.callback(_remove_sqlite, workdir / "pollbridge.db")
    engine = create_engine(url)
    try:
        if config.capture == "wal":
            stack.callback(_drop_slot, url)  # before the database goes (a slot keeps it)
        install.init(engine, demo_schema=True, mapping=TaskTableMapping(),
                     capture=CaptureSettings(mode="wal" if config.capture == "wal" else "trigger"))
        with engine.begin() as conn:
            if config.capture == "none":
                remove_capture(conn)
            conn.execute(sa.text(T0_QUEUE_INDEX))
    finally:
        engine.dispose()
    setup = Setup(config, url, bus_url, namespace, workdir)
    ins = Inserter(url, config.path.backend)
    try:
        seed(setup, ins, chains)
    finally:
        ins.close()
    return setup


def _drop_slot(url: str) -> None:
    engine = create_engine(url)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            wal.remove_wal(conn, end_stream=True)
    finally:
        engine.dispose()


def _remove_sqlite(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", JOURNAL_SUFFIX):
        with contextlib.suppress(OSError):
            Path(f"{path}{suffix}").unlink()


def _toml(setup: Setup) -> str:
    mode = "wal" if setup.config.capture == "wal" else "trigger"
    return f'[bus]\nnamespace = "{setup.namespace}"\n[capture]\nmode = "{mode}"\nwake = "adaptive"\n'


# --- the bench's own database work -------------------------------------------------------------------
def _sql(ins: Inserter, query: str, params: tuple[Any, ...] = ()) -> list[Any]:
    """A statement on the bench's counted connection (``%s`` placeholders on both backends)."""
    if ins.pg is not None:
        cur = ins.pg.execute(query, params)
        return cur.fetchall() if cur.description else []
    assert ins.lite is not None
    ins.statements += 1
    ins.transactions += 1
    return ins.lite.execute(query.replace("%s", "?"), params).fetchall()


def seed(setup: Setup, ins: Inserter, chains: int) -> None:
    """``chains`` two-task chains, ``t0`` queued (dispatched before the run), ``t1`` pending."""
    specs = [WorkflowSpec(f"c{n:07d}", "bench", CHAIN) for n in range(chains)]
    for start in range(0, len(specs), 2000):
        ins.insert(specs[start:start + 2000])
    setup.seeded = chains
    now = "clock_timestamp()" if setup.config.pg else pc.SQLITE_NOW
    _sql(ins, f"UPDATE tasks SET status = 'queued', updated_at = {now} WHERE task_key = 't0' AND status = 'pending'")


def maintain(setup: Setup, ins: Inserter) -> None:
    """The statistics and the dead rows of the previous windows, as autovacuum would have them (it is off on
    this server)."""
    if setup.config.pg:
        _sql(ins, "VACUUM (ANALYZE) tasks, workflow_instances, pollbridge_outbox, pollbridge_dispatch_log")
    else:
        _sql(ins, "ANALYZE")


class CompleterCount:
    """The completer's transactions on PostgreSQL: one per batch (``conn.begin()``), one per pool checkout (the
    pre-ping, in autocommit)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.n = 0
        sa.event.listen(engine, "begin", self._bump)
        sa.event.listen(engine.pool, "checkout", self._bump)

    def _bump(self, *_args: Any) -> None:
        self.n += 1


def wait_caught_up(setup: Setup, children: pc.Children, timeout: float = 600.0) -> None:
    """Until the captured changes of the seeding are published and consumed (the event path), so that the
    window does not open on the start-up's backlog."""
    if setup.config.path.kind != "events":
        return
    if setup.config.pg:
        _drained(setup.url, setup.config.capture, timeout)
    engine = create_engine(setup.url)
    bus = open_bus(setup.bus_url, engine=engine, partitions=BusSettings().partitions, namespace=setup.namespace)
    group = SchedulerSettings().group
    deadline = time.monotonic() + timeout
    try:
        while True:
            children.check_alive()
            with engine.connect() as conn:
                backlog = conn.execute(sa.text("SELECT count(*) FROM pollbridge_outbox "
                                               "WHERE published_at IS NULL")).scalar_one()
            if not backlog and sum(bus.lag(group).values()) == 0 and bus.pending_count(group) == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{setup.config.name}: the start-up backlog was not consumed within {timeout:g} s")
            time.sleep(0.2)
    finally:
        bus.close()
        engine.dispose()


def _wal_streaming(url: str, children: pc.Children) -> None:
    """Until the relay streams the slot (the changes before it are in the log, read once it streams)."""
    engine = create_engine(url)
    deadline = time.monotonic() + 60
    try:
        while True:
            children.check_alive()
            with engine.connect() as conn:
                if conn.execute(sa.text("SELECT coalesce(bool_or(active), false) FROM pg_replication_slots "
                                        "WHERE database = current_database()")).scalar_one():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("the wal relay did not stream its slot within 60 s")
            time.sleep(0.1)
    finally:
        engine.dispose()


def _rollbacks(dbname: str) -> int:
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        row = conn.execute("SELECT xact_rollback FROM pg_stat_database WHERE datname = %s", (dbname,)).fetchone()
    return int(row[0]) if row else 0


def settle_statistics(setup: Setup, children: pc.Children, settle: float, limit: float = 60.0) -> float:
    """Sleep ``settle`` seconds, then (PostgreSQL) until the database's transaction count has, for two 2 s
    looks in a row, grown by no more than the processes' statements (plus 2): transactions reported late (a
    start-up or catch-up burst, reported up to 10 s after it) must not fall into the window. Returns the
    seconds it waited."""
    started = time.perf_counter()
    time.sleep(settle)
    children.check_alive()
    if not setup.config.pg:
        return round(time.perf_counter() - started, 1)
    quiet = 0
    x, n = pc.db_xacts(setup.dbname), sum(children.statements().values())
    while quiet < 2 and time.perf_counter() - started < settle + limit:
        time.sleep(2.0)
        children.check_alive()
        x1, n1 = pc.db_xacts(setup.dbname), sum(children.statements().values())
        quiet = quiet + 1 if x1 - x <= n1 - n + 2 else 0
        x, n = x1, n1
    return round(time.perf_counter() - started, 1)


# --- one window ----------------------------------------------------------------------------------------
def window(setup: Setup, rate: float, seconds: float, settle: float) -> dict[str, Any]:
    """Start the configuration's processes, let them and the statistics settle, complete at ``rate`` for
    ``seconds``, drain, stop them; every figure of the window."""
    config = setup.config
    pg = config.pg
    workdir = setup.workdir / f"rate-{rate:g}"
    workdir.mkdir(exist_ok=True)
    (workdir / "pollbridge.toml").write_text(_toml(setup))
    ins = Inserter(setup.url, config.path.backend)
    engine = create_engine(setup.url, pool_size=1)
    completer = CompleterCount(engine)
    children = pc.Children(workdir, {**os.environ, "POLLBRIDGE_DATABASE_URL": setup.url,
                                     "POLLBRIDGE_BUS_URL": setup.bus_url})
    try:
        maintain(setup, ins)
        names = start_processes(config.path, setup.url, setup.bus_url, setup.namespace, children,
                                argparse.Namespace(schedulers=1))
        if config.capture == "wal":
            _wal_streaming(setup.url, children)
        wait_caught_up(setup, children)
        with engine.connect() as conn:  # the completer's connection made (and counted) before the window
            conn.execute(sa.text("SELECT 1"))
        settled = settle_statistics(setup, children, settle)

        load = pc.MachineLoad([setup.dbname] if pg else [])
        load.start([c.proc.pid for c in children.items])
        backends = pc.BackendCpu(setup.dbname if pg else None)
        backends.start()
        x0 = pc.db_xacts(setup.dbname) if pg else None
        r0 = _rollbacks(setup.dbname) if pg else None
        own0, completer0 = ins.counts()[1], completer.n
        cpu0, texts0 = children.cpu(), children.statement_texts()
        t0 = ins.now()
        started = time.perf_counter()
        commits: list[tuple[float, float]] = []
        if rate:
            completed = complete(engine, "", rate, seconds, statement=COMPLETE_T0[config.path.backend],
                                 commits=commits)
        else:
            completed = 0
            time.sleep(seconds)
        elapsed = time.perf_counter() - started
        t1 = ins.now()
        texts1 = children.statement_texts()
        children.check_alive()

        drain_started = time.perf_counter()
        drain_limit = max(DRAIN_TIMEOUT, seconds) + config.path.interval
        while (left := int(_sql(ins, READY_NOT_DISPATCHED)[0][0])) \
                and time.perf_counter() - drain_started < drain_limit:
            children.check_alive()
            time.sleep(0.05)
        drained = time.perf_counter() - drain_started
        span = time.perf_counter() - started
        backend_cpu = backends.stop()
        machine_load = load.stop()
        own = ins.counts()[1] - own0 + completer.n - completer0
        children.stop_all()
        texts_end = children.statement_texts()
    finally:
        children.stop_all()
        ins.close()
        engine.dispose()  # every connection of the bench's closed: its last transactions reported
    x1 = r1 = None
    if pg:
        time.sleep(1.0)  # the exited backends' statistics
        x1 = pc.db_xacts(setup.dbname)
        r1 = _rollbacks(setup.dbname)

    processes: dict[str, Any] = {}
    for c in children.items:
        if c.name not in names:
            continue
        statements = int(texts_end.get(c.name, {}).get("n", 0)) - int(texts0.get(c.name, {}).get("n", 0))
        cpu = (c.cpu_end or 0.0) - cpu0.get(c.name, 0.0)
        processes[c.name] = {
            "statements": statements,
            "statements_per_s": round(statements / span, 2),
            "statements_per_completion": round(statements / completed, 2) if completed else None,
            "cpu_s": round(cpu, 3),
            "by_text_per_s": pc.text_deltas(texts0.get(c.name, {}), texts1.get(c.name, {}), elapsed, top=20),
            "write_transactions": None if pg else _begins(texts0.get(c.name, {}), texts_end.get(c.name, {})),
            "peak_rss_mb": c.peak_rss_mb,
        }
    statements = sum(p["statements"] for p in processes.values())
    cpu_s = sum(p["cpu_s"] for p in processes.values())
    result: dict[str, Any] = {
        "config": config.name, "rate": rate, "seconds": round(elapsed, 2), "span_s": round(span, 2),
        "drain_s": round(drained, 2), "settle_s": settled, "completions": completed,
        "completions_per_s": round(completed / elapsed, 2),
        "statements": statements, "statements_per_s": round(statements / span, 2),
        "statements_per_completion": round(statements / completed, 2) if completed else None,
        "cpu_s": round(cpu_s, 3), "cpu_pct": round(100 * cpu_s / span, 2),
        "cpu_s_per_1000": round(1000 * cpu_s / completed, 3) if completed else None,
        "db_backends_cpu_s": backend_cpu, "processes": processes, "load": machine_load,
        "stranded": left, "logs": str(workdir),
    }
    if not pg:
        writes = sum(p["write_transactions"] or 0 for p in processes.values())
        result["write_transactions"] = writes
        result["write_transactions_per_completion"] = round(writes / completed, 2) if completed else None
    if x0 is not None and x1 is not None:
        transactions = x1 - x0 - own
        result.update({"transactions": transactions, "bench_transactions": own,
                       # rolled back, bench's included: logical decoding reads the catalogs of each decoded
                       # transaction in a transaction it rolls back
                       "rollbacks": None if r0 is None or r1 is None else r1 - r0,
                       "transactions_per_s": round(transactions / span, 2),
                       "transactions_per_completion": round(transactions / completed, 2) if completed else None})
    result.update(check(setup, t0, t1, commits))
    return result


def _begins(before: dict[str, Any], after: dict[str, Any]) -> int:
    old = before.get("texts", {})
    return sum(n - old.get(t, 0) for t, n in after.get("texts", {}).items() if t.startswith("BEGIN IMMEDIATE"))


def check(setup: Setup, t0: Any, t1: Any, commits: list[tuple[float, float]] | None = None) -> dict[str, Any]:
    """Latency of the ``t1`` dispatches made ready in the window (split at the completer's commit, given its
    batches' ``commits``), and the oracle's doubled / early."""
    dialect = setup.config.path.backend
    if dialect == "postgresql":
        window_sql = "ready_at >= :t0 AND ready_at < :t1"
        completed_sql = "completed_at >= :t0 AND completed_at < :t1"
        apart_ms = "abs(extract(epoch FROM l.ready_at - p.completed_at)) * 1000"
    else:
        window_sql = "julianday(ready_at) >= julianday(:t0) AND julianday(ready_at) < julianday(:t1)"
        completed_sql = "julianday(completed_at) >= julianday(:t0) AND julianday(completed_at) < julianday(:t1)"
        apart_ms = "abs(julianday(l.ready_at) - julianday(p.completed_at)) * 86400000.0"
    engine = create_engine(setup.url)
    try:
        tables = reflect_tables(engine, TaskTableMapping())
        with engine.connect() as conn:
            def execute(query: str, params: Any) -> Any:
                return conn.execute(sa.text(query), params).all()

            params = {"t0": t0, "t1": t1}
            n, values = pc.latency_from_sql(execute, dialect, f"task_key = 't1' AND {window_sql}", params)
            instances = [str(r[0]) for r in execute(f"SELECT instance_id FROM tasks WHERE task_key = 't0' "
                                                    f"AND {completed_sql}", params)]
            verdict = verify(conn, tables, instances)
            if dialect == "postgresql":
                # Statistics of now, not of the seed: with the seed's, the planner joined the outbox to the tasks
                # by nested loops (85 s after a 20 s window at 500/s, auto_explain, 2026-12-07).
                conn.exec_driver_sql("ANALYZE pollbridge_outbox, tasks, pollbridge_dispatch_log")
            stages = _stages(execute, dialect, window_sql, params, commits or [])
            # The ready time the dispatch log records is the upstream's completion (checked, not assumed).
            mismatched = execute(f"SELECT count(*) FROM pollbridge_dispatch_log l JOIN tasks p ON p.instance_id = "
                                 f"l.instance_id AND p.task_key = 't0' WHERE l.task_key = 't1' AND "
                                 f"{window_sql.replace('ready_at', 'l.ready_at')} AND {apart_ms} > 1", params)[0][0]
    finally:
        engine.dispose()
    lat = pc.summary(n, values)
    return {"latency": lat, "p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"], "stages": stages,
            "chains_completed": len(instances),
            "ready_at_not_completion": int(mismatched),
            "doubled": verdict.double_dispatched, "early": verdict.early, "problems": list(verdict.problems[:5])}


#: A timestamp as Unix seconds, per dialect.
_EPOCH = {"postgresql": "extract(epoch FROM {})", "sqlite": "(julianday({}) - 2440587.5) * 86400.0"}


def _stages(execute: Any, dialect: str, window_sql: str, params: dict[str, Any],
            commits: list[tuple[float, float]]) -> dict[str, Any]:
    """Where the window's ``t1`` dispatches' latency went, split at the completer's commit (n, p50, p90, p99, max
    in ms): ``completer_commit``, from the upstream's ``completed_at`` (set by the completer's ``UPDATE``) until
    the completer's ``COMMIT`` returned, the client's own write (its WAL flush; the capture trigger's work
    included), which ready → dispatch counts and nothing downstream can shorten; ``commit_to_dispatch``, from
    then to ``dispatched_at``: what the configuration took (capture's notification, the relay, the bus, the
    scheduler). A dispatch whose completion falls in no recorded batch is left out. Measured apart because
    on this machine a one-row commit now and then takes 5 to 100 ms (one 104 ms ``COMMIT`` in PostgreSQL's
    log, 2026-12-07): a window's p99 at 2 completions/s is its second slowest dispatch."""
    epoch = _EPOCH[dialect]
    rows = execute(f"SELECT {epoch.format('p.completed_at')}, {epoch.format('l.dispatched_at')} "
                   f"FROM pollbridge_dispatch_log l JOIN tasks p ON p.instance_id = l.instance_id "
                   f"AND p.task_key = 't0' WHERE l.task_key = 't1' AND "
                   f"{window_sql.replace('ready_at', 'l.ready_at')}", params)
    starts = [b for b, _ in commits]
    # SQLite stamps completed_at to the millisecond, rounded down: it may read up to 1 ms before its batch began.
    # (Both clocks are this host's: the bench and the database run on one machine.)
    slack = 0.001 if dialect == "sqlite" else 0.0
    waits, after = [], []
    for completed, dispatched in rows:
        i = bisect.bisect_right(starts, float(completed) + slack) - 1
        if i < 0 or float(completed) > commits[i][1]:
            continue
        end = commits[i][1]
        waits.append((end - float(completed)) * 1000)
        after.append((float(dispatched) - end) * 1000)
    return {"completer_commit": latency_summary(waits), "commit_to_dispatch": latency_summary(after)}


# --- the run -------------------------------------------------------------------------------------------
def run(configs: list[Config], rates: list[float], seconds: float, settle: float) -> dict[str, Any]:
    # Every window's chains seeded at once, before the first window (its start-up consumes their captured
    # inserts): the task table is the same size in every window of a configuration.
    chains = sum(math.ceil(rate * seconds * 1.25) + 10 for rate in rates if rate)
    results: dict[str, Any] = {"windows": [], "skipped": {}, "chains": chains}
    run_id = uuid.uuid4().hex[:6]
    with contextlib.ExitStack() as stack:
        setups: dict[str, Setup] = {}
        for config in configs:
            try:
                setups[config.name] = prepare(config, stack, run_id, chains)
            except MappingMismatch as exc:  # e.g. wal_level is not logical
                results["skipped"][config.name] = str(exc)
                print(f"[{config.name}] skipped: {exc}", file=sys.stderr, flush=True)
        for i, rate in enumerate(rates):
            order = [c for c in configs if c.name in setups]
            for config in order if i % 2 == 0 else order[::-1]:
                print(f"[{config.name}] {rate:g} completions/s for {seconds:g} s ...", flush=True)
                try:
                    r = window(setups[config.name], rate, seconds, settle)
                except RuntimeError as exc:
                    print(f"[{config.name}] at {rate:g}/s broke: {exc}", file=sys.stderr, flush=True)
                    results["windows"].append({"config": config.name, "rate": rate, "error": str(exc)})
                    continue
                results["windows"].append(r)
                commit, after = r["stages"]["completer_commit"], r["stages"]["commit_to_dispatch"]
                print(f"[{config.name}] {r['completions_per_s']:g} completions/s: "
                      f"{_or(r.get('transactions_per_completion'))} transactions and "
                      f"{_or(r['statements_per_completion'])} statements per completion, "
                      f"{_or(r.get('transactions_per_s'))} transactions/s, {r['statements_per_s']} statements/s, "
                      f"p50 {_or(r['p50_ms'])} ms p99 {_or(r['p99_ms'])} ms (n={r['latency']['n']}; "
                      f"the completer's commit p50 {_or(commit['p50_ms'])} max {_or(commit['max_ms'])} ms; "
                      f"from it to the dispatch p50 {_or(after['p50_ms'])} p99 {_or(after['p99_ms'])} ms), "
                      f"stranded {r['stranded']}, others {r['load']['other_cpu_pct']}% of a core", flush=True)
    return results


def _or(value: Any) -> Any:
    return "-" if value is None else value


def print_report(results: dict[str, Any]) -> None:
    head = ["config", "rate/s", "done/s", "tx/completion", "stmts/completion", "tx/s", "stmts/s", "p50 ms",
            "p99 ms", "CPU s/1k", "CPU %", "stranded", "doubled/early", "others %"]
    rows = []
    windows = sorted((w for w in results["windows"] if "error" not in w), key=lambda w: (w["config"], w["rate"]))
    for w in windows:
        rows.append([w["config"], w["rate"], w["completions_per_s"], w.get("transactions_per_completion"),
                     w["statements_per_completion"], w.get("transactions_per_s"), w["statements_per_s"],
                     w["p50_ms"], w["p99_ms"], w["cpu_s_per_1000"], w["cpu_pct"], w["stranded"],
                     f"{w['doubled']}/{w['early']}", w["load"]["other_cpu_pct"]])
    print()
    print(pc.table(head, rows))
    print()
    head = ["config", "rate/s", "process", "stmts/s", "stmts/completion", "CPU s", "top statements/s in the window"]
    rows = []
    for w in windows:
        for name, p in w["processes"].items():
            top = "; ".join(f"{n:g}/s {t[:60]}" for t, n in list(p["by_text_per_s"].items())[:2])
            rows.append([w["config"], w["rate"], name, p["statements_per_s"], p["statements_per_completion"],
                         p["cpu_s"], top])
    print(pc.table(head, rows))
    for name, reason in results["skipped"].items():
        print(f"{name}: skipped ({reason})")
    for w in results["windows"]:
        if "error" in w:
            print(f"{w['config']} at {w['rate']:g}/s: broke: {w['error'][:300]}")


def plot(png: str | None, results: dict[str, Any]) -> str | None:
    """Two panels against the rate: transactions per completion (statements for SQLite) and latency."""
    if not png:
        return None
    plt = pc.pyplot()
    if plt is None:
        return f"matplotlib is not installed (pip install 'pollbridge[bench]'): {png} not drawn"
    fig, (cost_ax, lat_ax) = plt.subplots(1, 2, figsize=(12, 5), dpi=110)
    windows = [w for w in results["windows"] if "error" not in w and w["rate"] > 0]
    for name in dict.fromkeys(w["config"] for w in windows):
        mine = sorted((w for w in windows if w["config"] == name), key=lambda w: w["rate"])
        key = "transactions_per_completion" if any("transactions_per_completion" in w for w in mine) \
            else "statements_per_completion"
        pts = [(w["rate"], w[key]) for w in mine if w.get(key)]
        label = name if key.startswith("transactions") else f"{name} (SQLite: statements)"
        line = cost_ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)[0]
        for q, style in (("p50_ms", "-"), ("p99_ms", "--")):
            pts = [(w["rate"], w[q]) for w in mine if w.get(q)]
            lat_ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o" if q == "p50_ms" else "v",
                        color=line.get_color(), label=f"{name} {q[:3]}")
    xlabel = "completions per second (log)"
    pc.style(cost_ax, "database transactions per completion", xlabel, "transactions per completion (log)",
             logx=True, logy=True, legend_size=7)
    pc.style(lat_ax, "ready -> dispatch latency (solid p50, dashed p99)", xlabel, "ms (log)",
             logx=True, logy=True, legend_size=7)
    pc.save(plt, fig, png)
    return None


def git_state() -> dict[str, Any]:
    """The commit measured, and what was changed beside it (the children run the working tree)."""
    status = command("git", "-C", str(pc.REPO), "status", "--porcelain", timeout=10)
    return {"commit": command("git", "-C", str(pc.REPO), "rev-parse", "--short", "HEAD", timeout=10).strip(),
            "dirty": [line[3:] for line in status.splitlines() if len(line) > 3]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="completions per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="each window")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--settle", type=float, default=11.0,
                        help="seconds between the start-up and the window (PostgreSQL reports an idle backend's "
                             "transactions after 10 s)")
    parser.add_argument("--quick", action="store_true", help="rates 0 and 20, 5 s windows, three configurations (CI)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--png", dest="png_path")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.seconds, args.configs, args.settle = "0,20", 5.0, "trigger,embedded,poller-1s", 1.0
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or any(r < 0 for r in rates):
        parser.error(f"unknown configuration(s) {', '.join(unknown)}" if unknown else "a rate below 0")
    pc.exit_on_signals()
    started = time.perf_counter()
    results: dict[str, Any] = {"command": " ".join(["python -m bench.cost", *(sys.argv[1:] if argv is None else argv)]),
                               "machine": pc.machine_info(), "git": git_state(), "rates": rates,
                               "seconds": args.seconds, "settle_s": args.settle, "configs": names}
    results.update(run([CONFIGS[n] for n in names], rates, args.seconds, args.settle))
    results["total_s"] = round(time.perf_counter() - started, 1)
    print_report(results)
    write_json(args.json_path, results)
    message = plot(args.png_path, results)
    if message:
        print(message)
    broken = [w for w in results["windows"]
              if "error" in w or w["stranded"] or w["doubled"] or w["early"]]
    for w in broken:
        print(f"error: {w['config']} at {w['rate']:g}/s: " + (w.get("error", "")[:200] or
              f"{w['stranded']} stranded, {w['doubled']} dispatched twice, {w['early']} early"), file=sys.stderr)
    print(f"total {results['total_s']} s")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
