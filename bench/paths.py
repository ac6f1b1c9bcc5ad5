"""The two paths side by side: one workload through the poller (10 s and 1 s) and the event path.

    python -m bench.paths [--instances 10000] [--tasks 10] [--arrival-rate 120] [--arrivals steady]
                          [--min-duration 0.01] [--max-duration 0.05] [--paths poller-10s,poller-1s,events]
                          [--embedded-instances 500] [--no-embedded] [--json F] [--png F] [--quick]
    python -m bench.paths --scale ...      # the scale curve: same as python -m bench.scale ...

``--quick`` (CI): 200 instances x 5 tasks at 200/s, ``poller-1s`` and ``events`` (one scheduler) only, no
embedded runs.

**Workload.** ``--instances`` workflow instances of ``--tasks`` tasks, shapes chain / fan-out / diamond in
turn (``bridge.reference.workload.make_shape``: about 20 % of the tasks also carry a due time 0.1-2 s after the
instance arrives), arriving at ``--arrival-rate`` instances/s (``steady``, ``poisson`` or all at once,
``burst``), the same instances and arrival times (``--seed``) for every path. The bench process inserts
them (instances and tasks of a 20 ms tick in one transaction; a task's ``updated_at``, its readiness
start when it has no dependency, is the database clock of its insert). The workers are the bench
fleet (``python -m bench._paths_common fleet``, its own process): it claims every dispatched task
(``queued`` → ``running``) and completes each after its run time (uniform in ``--min-duration`` …
``--max-duration``, fixed per task), with unlimited concurrency, so the workers are never what is
measured. Autovacuum is off on this server: the bench runs ``ANALYZE`` on the task tables 3 s into the
arrivals and every 15 s after, as autovacuum's analyze would, the same for every path.

**Paths**, each in a scratch database of its own, each component its own process:

* ``poller-10s``, ``poller-1s``: ``pollbridge poller run --interval N`` (flags: every type ``polling``),
  no capture trigger, no relay: the legacy setup before pollbridge.
* ``events``: capture triggers (``[capture] wake = adaptive``), ``pollbridge relay run`` and
  ``--schedulers`` x ``pollbridge scheduler run --phase cutover`` on Redis Streams.
* The embedded default (SQLite + the embedded bus, same processes) for ``poller-1s`` and ``events``,
  at ``--embedded-instances`` instances.

**Per path**: ready → dispatch latency p50/p90/p99/max over every dispatch, computed in SQL from
``pollbridge_dispatch_log`` (``dispatched_at - ready_at``, both from the database clock; nearest-rank,
ranked by the database); throughput (tasks / (last completion - first arrival)), and how long the
path needed after the last arrival; statements per dispatched task, counted two ways: *statements*
(client side: every statement the path's processes executed, pool pre-pings included, counted by a
``sitecustomize`` in each child, exact per process) and *transactions* (server side: the path
database's ``pg_stat_database`` ``xact_commit + xact_rollback`` delta, minus the fleet's and the
bench's own transactions, which they count); the same per idle second, over ``--idle-seconds`` with the
path's processes running, nothing arriving and no worker started yet, before the workload; CPU
seconds per process over the workload and over the idle window, peak RSS (``VmHWM``) per process, and
the CPU of the path database's backends. ``pg_stat_statements`` is not loaded on this server. The
invariants are checked afterwards with ``bridge.reference.oracle``: no task lost, none dispatched twice, none
early. With every figure: the load average and how much CPU other processes on the machine used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from bench import _paths_common as pc
from bench.common import REDIS_URL, delete_namespace, scratch_database, write_json
from bridge.app import install
from bridge.bus import open_bus
from bridge.capture.triggers import remove_capture
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import BusSettings, CaptureSettings
from bridge.db.clock import as_utc
from bridge.db.engine import create_engine
from bridge.reference.oracle import verify
from bridge.reference.workload import SHAPES, WorkflowSpec, make_shape
from bridge.tasktable.tables import reflect_tables
from event_scheduler.leases import lease_snapshot

TYPES = {"chain": "orders", "fanout": "reports", "diamond": "etl"}
TICK = 0.02
ANALYZE_FIRST, ANALYZE_EVERY = 3.0, 15.0


@dataclass(frozen=True)
class PathSpec:
    label: str
    kind: str            # "poller" or "events"
    backend: str         # "postgresql" or "sqlite"
    interval: float = 0.0


@dataclass(frozen=True)
class Workload:
    specs: list[WorkflowSpec]
    offsets: list[float]  # arrival time of each instance, seconds from the start

    @property
    def tasks(self) -> int:
        return sum(len(s.tasks) for s in self.specs)


def build_workload(instances: int, tasks: int, rate: float, arrivals: str, seed: int,
                   shapes: tuple[str, ...] = SHAPES, prefix: str = "w") -> Workload:
    rng = random.Random(seed)
    specs = [WorkflowSpec(f"{prefix}{n:06d}", TYPES[shapes[n % len(shapes)]],
                          make_shape(shapes[n % len(shapes)], tasks, rng)) for n in range(instances)]
    if arrivals == "burst":
        offsets = [0.0] * instances
    elif arrivals == "poisson":
        t, offsets = 0.0, []
        for _ in range(instances):
            offsets.append(t)
            t += rng.expovariate(rate)
    else:
        offsets = [n / rate for n in range(instances)]
    return Workload(specs, offsets)


# --- inserting the workload ---------------------------------------------------------------------------
def _rows(specs: list[WorkflowSpec]) -> tuple[list[str], list[str], list[str], list[float | None]]:
    inst, keys, deps, due = [], [], [], []
    for s in specs:
        for t in s.tasks:
            inst.append(s.instance_id)
            keys.append(t.key)
            deps.append(json.dumps(list(t.depends_on)))
            due.append(t.due_in)
    return inst, keys, deps, due


class Inserter:
    """The bench process's own database work (arrivals, ANALYZE, progress checks), counted."""

    def __init__(self, url: str, backend: str) -> None:
        self.backend = backend
        self.statements = 0
        self.transactions = 0
        self.pg: pc.CountingConnection | None = None
        self.lite: sqlite3.Connection | None = None
        if backend == "postgresql":
            self.pg = pc.CountingConnection(url)
        else:
            self.lite = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, timeout=30)
            self.lite.execute("PRAGMA busy_timeout=30000")

    def insert(self, specs: list[WorkflowSpec]) -> None:
        inst, keys, deps, due = _rows(specs)
        if self.pg is not None:
            with self.pg.transaction():
                self.pg.execute("INSERT INTO workflow_instances (id, workflow_type) "
                                "SELECT * FROM unnest(%s::text[], %s::text[])",
                                ([s.instance_id for s in specs], [s.workflow_type for s in specs]))
                self.pg.execute(
                    "INSERT INTO tasks (instance_id, task_key, depends_on, due_at) "
                    "SELECT i, k, d::json, CASE WHEN s IS NULL THEN NULL "
                    "ELSE clock_timestamp() + s * interval '1 second' END "
                    "FROM unnest(%s::text[], %s::text[], %s::text[], %s::float8[]) AS r(i, k, d, s)",
                    (inst, keys, deps, due))
            return
        assert self.lite is not None
        self.lite.execute("BEGIN IMMEDIATE")
        self.lite.executemany("INSERT INTO workflow_instances (id, workflow_type) VALUES (?, ?)",
                              [(s.instance_id, s.workflow_type) for s in specs])
        self.lite.executemany(
            f"INSERT INTO tasks (instance_id, task_key, status, depends_on, due_at, updated_at) "
            f"VALUES (?, ?, 'pending', ?, CASE WHEN ? IS NULL THEN NULL "
            f"ELSE strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || ? || ' seconds') END, {pc.SQLITE_NOW})",
            [(i, k, d, s, s) for i, k, d, s in zip(inst, keys, deps, due, strict=True)])
        self.lite.execute("COMMIT")
        self.statements += 2 + len(specs) + len(inst)
        self.transactions += 1

    def analyze(self) -> None:
        if self.pg is not None:
            self.pg.execute("ANALYZE tasks, workflow_instances, pollbridge_dispatch_log")

    def not_completed(self) -> int:
        query = "SELECT count(*) FROM tasks WHERE status IN ('pending', 'queued', 'running')"
        if self.pg is not None:
            return int(self.pg.scalar(query))
        assert self.lite is not None
        self.statements += 1
        self.transactions += 1
        return int(self.lite.execute(query).fetchone()[0])

    def now(self) -> Any:
        if self.pg is not None:
            return self.pg.scalar("SELECT clock_timestamp()")
        assert self.lite is not None
        self.statements += 1
        self.transactions += 1
        return self.lite.execute(f"SELECT {pc.SQLITE_NOW}").fetchone()[0]

    def counts(self) -> tuple[int, int]:
        if self.pg is not None:
            return self.pg.statements, self.pg.transactions
        return self.statements, self.transactions

    def close(self) -> None:
        if self.pg is not None:
            self.pg.close()
        if self.lite is not None:
            self.lite.close()


def run_arrivals(ins: Inserter, work: Workload, deadline_s: float) -> float:
    """Insert each instance at its arrival time (a tick's worth per transaction); returns the seconds it took."""
    started = time.perf_counter()
    next_analyze = ANALYZE_FIRST
    i = 0
    n = len(work.specs)
    while i < n:
        elapsed = time.perf_counter() - started
        if elapsed > deadline_s:
            raise RuntimeError(f"arrivals did not keep up: {i} of {n} instances inserted in {elapsed:.0f} s")
        j = i
        while j < n and work.offsets[j] <= elapsed and j - i < 2000:
            j += 1
        if j > i:
            ins.insert(work.specs[i:j])
            i = j
        if elapsed >= next_analyze:
            ins.analyze()
            next_analyze += ANALYZE_EVERY
        if i < n:
            time.sleep(max(0.0, min(TICK, work.offsets[i] - (time.perf_counter() - started))))
    return time.perf_counter() - started


# --- one path ------------------------------------------------------------------------------------------
def _toml(namespace: str) -> str:
    return f'[bus]\nnamespace = "{namespace}"\n'


def _wait_for(check: Any, timeout: float, what: str, children: pc.Children) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children.check_alive()
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not happen within {timeout:.0f} s")


def _scalar(url: str, backend: str, query: str) -> Any:
    if backend == "postgresql":
        with psycopg.connect(pc.libpq(url), autocommit=True) as conn:
            row = conn.execute(query).fetchone()
    else:
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"), timeout=30)) as lite:
            row = lite.execute(query).fetchone()
    return None if row is None else row[0]


def start_fleet(url: str, children: pc.Children, args: argparse.Namespace) -> pc.Child:
    fleet = children.spawn("fleet", [sys.executable, "-m", "bench._paths_common", "fleet", "--url", url,
                                     "--min-duration", str(args.min_duration), "--max-duration",
                                     str(args.max_duration)], count="self")
    _wait_for(lambda: pc.read_count(fleet.stmt_file) > 0, 60, "the worker fleet's first claim", children)
    return fleet


def start_processes(path: PathSpec, url: str, bus_url: str, namespace: str, children: pc.Children,
                    args: argparse.Namespace) -> list[str]:
    """Start the path's processes; wait until they are ready. Returns their names."""
    exe = shutil.which("pollbridge") or sys.exit("pollbridge is not installed (pip install -e .)")
    if path.kind == "poller":
        poller = children.spawn("poller", [exe, "--log-level", "INFO", "poller", "run", "--interval",
                                           str(path.interval)])

        def scanned() -> bool:  # the first scan runs as soon as the poller is up
            texts = pc.read_counts(poller.stmt_file).get("texts", {})
            return any("pb_pending" in t for t in texts)

        _wait_for(scanned, 60, "the poller's first scan", children)
        return ["poller"]
    children.spawn("relay", [exe, "--log-level", "INFO", "relay", "run"])
    names = ["relay"]
    for n in range(args.schedulers):
        children.spawn(f"scheduler{n + 1}", [exe, "--log-level", "INFO", "scheduler", "run", "--phase", "cutover"])
        names.append(f"scheduler{n + 1}")

    engine = create_engine(url)
    bus = open_bus(bus_url, engine=engine, partitions=BusSettings().partitions, namespace=namespace)

    def settled() -> bool:
        relay = _scalar(url, path.backend, "SELECT count(*) FROM pollbridge_relay_state WHERE holder IS NOT NULL")
        return bool(relay) and lease_snapshot(engine, bus).settled(args.schedulers, bus.partitions)

    try:
        _wait_for(settled, 60, "the schedulers settling their partition leases and the relay taking its partition",
                  children)
    finally:
        bus.close()
        engine.dispose()
    return names


def measure_path(path: PathSpec, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    print(f"[{path.label}] {len(work.specs):,} instances, {work.tasks:,} tasks on {path.backend} ...", flush=True)
    clock = time.perf_counter()
    namespace = f"pbpaths{uuid.uuid4().hex[:6]}"
    dbname = f"pollbridge_bench_paths_{path.label.replace('-', '_').replace(' ', '_')}"
    workdir = Path(tempfile.mkdtemp(prefix=f"pbpaths-{path.label.replace(' ', '-')}-"))
    with contextlib.ExitStack() as stack:
        if path.backend == "postgresql":
            url = stack.enter_context(scratch_database(dbname, keep=args.keep))
            bus_url = REDIS_URL
            stack.callback(delete_namespace, namespace)
        else:
            url = f"sqlite:///{workdir / 'pollbridge.db'}"
            bus_url = "embedded"
        engine = create_engine(url)
        install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings())
        if path.kind == "poller":
            with engine.begin() as conn:  # the legacy setup: no capture
                remove_capture(conn)
        engine.dispose()
        (workdir / "pollbridge.toml").write_text(_toml(namespace))
        children = pc.Children(workdir, {**os.environ, "POLLBRIDGE_DATABASE_URL": url, "POLLBRIDGE_BUS_URL": bus_url})
        stack.callback(children.stop_all)
        names = start_processes(path, url, bus_url, namespace, children, args)
        print(f"[{path.label}] processes ready after {time.perf_counter() - clock:.1f} s", flush=True)
        pg = path.backend == "postgresql"

        # Idle: the path's processes running, nothing arriving, no worker yet.
        time.sleep(min(2.0, args.idle_seconds / 2))  # backends flush their statistics at most once a second
        load = pc.MachineLoad([dbname] if pg else [])
        load.start([c.proc.pid for c in children.items])
        cpu0, st0, texts0 = children.cpu(), children.statements(), children.statement_texts()
        x0 = pc.db_xacts(dbname) if pg else None
        backends = pc.BackendCpu(dbname if pg else None)
        backends.start()
        t0 = time.perf_counter()
        time.sleep(args.idle_seconds)
        idle_s = time.perf_counter() - t0
        cpu1, st1, texts1 = children.cpu(), children.statements(), children.statement_texts()
        x1 = pc.db_xacts(dbname) if pg else None
        idle = {"seconds": round(idle_s, 1),
                "statements_per_s": {n: round((st1.get(n, 0) - st0.get(n, 0)) / idle_s, 2) for n in names},
                "cpu_pct": {n: round(100 * (cpu1.get(n, 0) - cpu0.get(n, 0)) / idle_s, 2) for n in names},
                "backends_cpu_pct": _pct(backends.stop(), idle_s), **load.stop(),
                "statements_per_s_by_text": {n: pc.text_deltas(texts0.get(n, {}), texts1.get(n, {}), idle_s)
                                             for n in names}}
        idle["path_statements_per_s"] = round(sum(idle["statements_per_s"].values()), 2)
        idle["path_transactions_per_s"] = None if x0 is None or x1 is None else round((x1 - x0) / idle_s, 2)
        start_fleet(url, children, args)

        # The workload.
        ins = Inserter(url, path.backend)
        try:
            load = pc.MachineLoad([dbname] if pg else [])
            load.start([c.proc.pid for c in children.items])
            cpu0, st0 = children.cpu(), children.statements()
            x0 = pc.db_xacts(dbname) if pg else None
            backends = pc.BackendCpu(dbname if pg else None)
            backends.start()
            started_at = ins.now()
            t0 = time.perf_counter()
            arrival_s = run_arrivals(ins, work, deadline_s=work.offsets[-1] + 120)
            timeout = args.drain_timeout
            left = ins.not_completed()
            while left and time.perf_counter() - t0 - arrival_s < timeout:
                children.check_alive()
                time.sleep(0.25)
                left = ins.not_completed()
            wall = time.perf_counter() - t0
            cpu1, st1 = children.cpu(), children.statements()
            backend_cpu = backends.stop()
            machine_load = load.stop()
            bench_counts = ins.counts()
        finally:
            ins.close()  # disconnecting flushes its statistics before the final count
        children.stop_all()
        st_final = children.statements()
        time.sleep(0.5 if pg else 0.0)
        x1 = pc.db_xacts(dbname) if pg else None
        result = collect(path, url, work, children, names, started_at, wall, arrival_s, left)
        per_process: dict[str, Any] = {}
        for c in children.items:
            per_process[c.name] = {
                "cpu_s": round((c.cpu_end if c.cpu_end is not None else cpu1.get(c.name, 0)) - cpu0.get(c.name, 0), 2),
                "peak_rss_mb": c.peak_rss_mb,
                "statements": st_final.get(c.name, 0) - st0.get(c.name, 0),
            }
        fleet_statements = per_process["fleet"]["statements"]
        path_statements = sum(per_process[n]["statements"] for n in names)
        dispatched = result["dispatched"] or 1
        result.update({
            "label": path.label, "backend": path.backend, "kind": path.kind,
            "interval_s": path.interval or None, "processes": per_process, "path_processes": names,
            "backends_cpu_s": backend_cpu,
            "path_cpu_s": round(sum(per_process[n]["cpu_s"] for n in names), 2),
            "statements_per_dispatch": round(path_statements / dispatched, 2),
            "path_statements": path_statements,
            "idle": idle, "load": machine_load, "bench_statements": bench_counts[0],
            "logs": str(workdir),
        })
        if x0 is not None and x1 is not None:
            path_xacts = (x1 - x0) - fleet_statements - bench_counts[1]
            result["path_transactions"] = path_xacts
            result["transactions_per_dispatch"] = round(path_xacts / dispatched, 2)
        print(f"[{path.label}] workload {wall:.0f} s, all {time.perf_counter() - clock:.0f} s: "
              f"p50 {result['latency']['p50_ms']} ms, "
              f"p99 {result['latency']['p99_ms']} ms, {result['tasks_per_s']} tasks/s, "
              f"load {machine_load['load_after']}", flush=True)
        return result


def _pct(seconds: float | None, window: float) -> float | None:
    return None if seconds is None else round(100 * seconds / window, 2)


def collect(path: PathSpec, url: str, work: Workload, children: pc.Children, names: list[str], started_at: Any,
            wall: float, arrival_s: float, left: int) -> dict[str, Any]:
    """Latency, throughput and the invariants, read from the path's database after its processes stopped."""
    engine = create_engine(url)
    try:
        tt = reflect_tables(engine, TaskTableMapping())
        where = "path = :path"
        with engine.connect() as conn:
            def execute(query: str, params: Any) -> Any:
                return conn.execute(sa.text(query), params).all()

            n, values = pc.latency_from_sql(execute, path.backend, where, {"path": "poller" if path.kind == "poller"
                                                                           else "events"},
                                            [0.5, 0.9, 0.99, *pc.CDF_QUANTILES])
            other: dict[str, int] = {str(k): int(v) for k, v in conn.execute(
                sa.text("SELECT path, count(*) FROM pollbridge_dispatch_log GROUP BY path")).all()}
            span = conn.execute(sa.text("SELECT (SELECT min(created_at) FROM workflow_instances), "
                                        "(SELECT max(completed_at) FROM tasks)")).one()
            completed = int(conn.execute(sa.text("SELECT count(*) FROM tasks WHERE status = 'completed'")).scalar_one())
            verdict = verify(conn, tt, [s.instance_id for s in work.specs])
        first, last = _utc(span[0]), _utc(span[1])
        makespan = (last - first).total_seconds() if first and last else wall
        return {
            "latency": pc.summary(n, values), "cdf": pc.cdf_points(n, values),
            "dispatches_by_path": {str(k): int(v) for k, v in other.items()},
            "dispatched": sum(int(v) for v in other.values()),
            "tasks": work.tasks, "completed": completed, "not_completed_at_end": left,
            "arrival_s": round(arrival_s, 1), "makespan_s": round(makespan, 1),
            "after_last_arrival_s": round(makespan - arrival_s, 1),
            "tasks_per_s": round(completed / makespan, 1) if makespan > 0 else None,
            "invariants": {"lost": verdict.lost, "double_dispatched": verdict.double_dispatched,
                           "early": verdict.early, "problems": list(verdict.problems[:5])},
        }
    finally:
        engine.dispose()


def _utc(value: Any) -> datetime | None:
    """A timestamp as aware UTC (SQLite returns text for an untyped aggregate)."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return as_utc(value)


# --- report --------------------------------------------------------------------------------------------
def print_report(results: dict[str, Any]) -> None:
    paths = results["paths"]
    head = ["path", "tasks", "p50 ms", "p90 ms", "p99 ms", "max ms", "tasks/s", "after last s",
            "stmts/dispatch", "xacts/dispatch", "idle stmts/s", "idle xacts/s", "path CPU s", "db CPU s",
            "lost/dup/early", "other load %"]
    rows = []
    for r in paths:
        lat, inv = r["latency"], r["invariants"]
        rows.append([f"{r['label']} ({'pg+redis' if r['backend'] == 'postgresql' else 'sqlite+embedded'})",
                     r["tasks"], lat["p50_ms"], lat["p90_ms"], lat["p99_ms"], lat["max_ms"], r["tasks_per_s"],
                     r["after_last_arrival_s"], r["statements_per_dispatch"], r.get("transactions_per_dispatch"),
                     r["idle"]["path_statements_per_s"], r["idle"]["path_transactions_per_s"], r["path_cpu_s"],
                     r["backends_cpu_s"], f"{inv['lost']}/{inv['double_dispatched']}/{inv['early']}",
                     r["load"]["other_cpu_pct"]])
    print()
    print(pc.table(head, rows))
    print()
    head = ["path", "process", "CPU s (workload)", "idle CPU %", "peak RSS MB", "statements", "idle stmts/s"]
    rows = []
    for r in paths:
        for name, p in r["processes"].items():
            rows.append([r["label"], name, p["cpu_s"], r["idle"]["cpu_pct"].get(name), p["peak_rss_mb"],
                         p["statements"], r["idle"]["statements_per_s"].get(name)])
    print(pc.table(head, rows))
    print()
    for r in paths:
        print(f"{r['label']:>22}: load average {r['load']['load_before']} -> {r['load']['load_after']}, "
              f"machine busy {r['load']['machine_busy_pct']}% of a core, others {r['load']['other_cpu_pct']}%; "
              f"idle window: others {r['idle']['other_cpu_pct']}%; logs {r['logs']}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--scale" in argv:
        from bench import scale

        argv.remove("--scale")
        return scale.main(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.paths", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--tasks", type=int, default=10, help="tasks per instance")
    parser.add_argument("--arrival-rate", type=float, default=120.0, help="instances per second")
    parser.add_argument("--arrivals", choices=["steady", "poisson", "burst"], default="steady")
    parser.add_argument("--min-duration", type=float, default=0.01, help="task run time, seconds")
    parser.add_argument("--max-duration", type=float, default=0.05, help="task run time, seconds")
    parser.add_argument("--paths", default="poller-10s,poller-1s,events",
                        help="comma-separated: poller-<N>s and/or events (PostgreSQL + Redis)")
    parser.add_argument("--schedulers", type=int, default=2)
    parser.add_argument("--embedded-instances", type=int, default=500)
    parser.add_argument("--embedded-arrival-rate", type=float, default=40.0)
    parser.add_argument("--no-embedded", action="store_true", help="skip the SQLite + embedded bus runs")
    parser.add_argument("--idle-seconds", type=float, default=8.0)
    parser.add_argument("--drain-timeout", type=float, default=180.0,
                        help="seconds after the last arrival before unfinished tasks are reported")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small and short, for CI (< 1 minute)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch databases")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--png", dest="png_path")
    args = parser.parse_args(argv)
    if args.quick:  # CI keeps the script working; its figures mean little
        args.instances, args.tasks, args.arrival_rate, args.paths = 200, 5, 200.0, "poller-1s,events"
        args.idle_seconds, args.drain_timeout, args.no_embedded, args.schedulers = 2.0, 60.0, True, 1
    pc.exit_on_signals()
    wanted: list[PathSpec] = []
    for name in [p.strip() for p in args.paths.split(",") if p.strip()]:
        if name == "events":
            wanted.append(PathSpec("events", "events", "postgresql"))
        elif name.startswith("poller-") and name.endswith("s"):
            wanted.append(PathSpec(name, "poller", "postgresql", float(name[7:-1])))
        else:
            parser.error(f"unknown path {name!r}")
    shapes = SHAPES
    work = build_workload(args.instances, args.tasks, args.arrival_rate, args.arrivals, args.seed, shapes)
    results: dict[str, Any] = {
        "command": " ".join(["python -m bench.paths", *argv]), "machine": pc.machine_info(),
        "workload": {"instances": args.instances, "tasks_per_instance": args.tasks, "tasks": work.tasks,
                     "arrival_rate": args.arrival_rate, "arrivals": args.arrivals, "shapes": list(shapes),
                     "task_duration_s": [args.min_duration, args.max_duration], "seed": args.seed,
                     "offered_tasks_per_s": round(work.tasks / max(work.offsets[-1], 1e-9), 1)},
        "paths": [],
    }
    started = time.perf_counter()
    for path in wanted:
        results["paths"].append(measure_path(path, work, args))
    if not args.no_embedded:
        small = build_workload(args.embedded_instances, args.tasks, args.embedded_arrival_rate, args.arrivals,
                               args.seed, shapes)
        results["embedded_workload"] = {"instances": args.embedded_instances, "tasks": small.tasks,
                                        "arrival_rate": args.embedded_arrival_rate}
        for path in (PathSpec("embedded poller-1s", "poller", "sqlite", 1.0),
                     PathSpec("embedded events", "events", "sqlite")):
            results["paths"].append(measure_path(path, small, args))
    results["seconds"] = round(time.perf_counter() - started, 1)
    print_report(results)
    write_json(args.json_path, results)
    message = pc.plot(args.png_path, f"ready -> dispatch latency, {args.instances:,} instances x {args.tasks} tasks "
                                     f"at {args.arrival_rate:g} instances/s (embedded: {args.embedded_instances:,})",
                      "ready -> dispatch latency, ms (log)", "fraction of dispatches",
                      {f"{r['label']} (p50 {r['latency']['p50_ms']} ms)": r["cdf"] for r in results["paths"]},
                      logx=True, step=True)
    if message:
        print(message)
    bad = [r["label"] for r in results["paths"]
           if r["invariants"]["lost"] or r["invariants"]["double_dispatched"] or r["invariants"]["early"]]
    if bad:
        print(f"error: invariants broken on {', '.join(bad)}", file=sys.stderr)
    print(f"total {results['seconds']} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
