"""Event path vs. poller, end to end on PostgreSQL + Redis: ready → dispatch latency and throughput.

    python -m bench.scheduler [--rate 500] [--seconds 20] [--poll-interval 1.0] [--schedulers 2] [--quick]
                              [--wake adaptive] [--skip-poller] [--skip-throughput] [--profile DIR] [--json F]
    python -m bench.scheduler --soak-minutes 60 [--soak-rate 200] [--schedulers 1] [--json F]

Processes: ``pollbridge relay run`` and ``--schedulers`` x ``pollbridge scheduler run`` (phase cutover),
or ``pollbridge poller run`` for the comparison, each its own process; they die with the bench (SIGTERM
on exit, on Ctrl-C, on SIGTERM/SIGHUP of the bench, and through ``PR_SET_PDEATHSIG`` even when the bench
is killed with SIGKILL). The bench process plays the workers: it completes dispatched tasks (queued →
completed) of chain workflows, so each completion makes the next task of the chain ready.

Latency is computed in SQL from the dispatch log (``dispatched_at - ready_at``, both from the database
clock) over the tasks that *became ready inside the measured window* (the seeding burst that dispatches
the chains' first tasks is not measured); after the window the bench waits until every task that became
ready was dispatched (a task still ready and not dispatched after 30 s is reported as ``stranded``).

1. *Latency*: completions paced at ``--rate`` per second for ``--seconds``; also per second of the
   window (``per_second`` in the JSON), so a stall shows.
2. *Throughput*: completions as fast as the completer can go for ``--seconds``; task transitions/s
   counts the dispatches (pending → queued) and completions (queued → completed) inside the window;
   "sustained" is twice the dispatch rate (the closed loop's steady state: completions can run ahead
   for a while by draining the tasks queued before the window).
3. *Memory*: the schedulers' resident set size at the start and the end of the run.

``--profile DIR`` records each scheduler with py-spy during the latency phase (collapsed stacks,
``DIR/schedulerN.txt``). ``--soak-minutes N`` runs only a soak: completions at ``--soak-rate``/s with
new chains seeded every second, sampling each scheduler's RSS and the minute's latency every minute
(with ``VACUUM (ANALYZE)`` every minute when the server runs without autovacuum).

The seeded tables are analyzed before measuring (as autovacuum would do shortly after a bulk load);
each phase reports the load average before and after and the CPU seconds per second of every process.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import sqlalchemy as sa

from bench.common import (
    REDIS_URL,
    WORKER_QUEUE_INDEX,
    delete_namespace,
    latency_summary,
    machine,
    scratch_database,
    write_json,
)
from bridge.app import install
from bridge.bus import open_bus
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import BusSettings, CaptureSettings
from bridge.db.engine import create_engine
from event_scheduler.leases import lease_snapshot

COMPLETE_BATCH = """
UPDATE tasks SET status = 'completed', completed_at = clock_timestamp(), updated_at = clock_timestamp()
WHERE id IN (SELECT id FROM tasks WHERE status = 'queued' AND instance_id LIKE :p || '%'
             ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED)
"""

#: Chain tasks that are ready (pending, predecessor completed) but not dispatched.
READY_NOT_DISPATCHED = """
SELECT count(*) FROM tasks t JOIN tasks d ON d.instance_id = t.instance_id AND d.task_key = t.depends_on ->> 0
WHERE t.status = 'pending' AND d.status = 'completed' AND t.instance_id LIKE :p || '%'
"""

LATENCY_SQL = """
SELECT extract(epoch FROM dispatched_at - ready_at) * 1000 FROM pollbridge_dispatch_log
WHERE path = :path AND instance_id LIKE :p || '%' AND ready_at >= :t0 AND ready_at < :t1
"""

PER_SECOND_SQL = """
SELECT floor(extract(epoch FROM ready_at - :t0))::int AS s, count(*),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM dispatched_at - ready_at) * 1000),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM dispatched_at - ready_at) * 1000),
       max(extract(epoch FROM dispatched_at - ready_at) * 1000)
FROM pollbridge_dispatch_log
WHERE path = :path AND instance_id LIKE :p || '%' AND ready_at >= :t0 AND ready_at < :t1
GROUP BY 1 ORDER BY 1
"""

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the bench dies, however it dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (and its waited-for children), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def postgres_cpu() -> float:
    """CPU time of every PostgreSQL process (this bench's backends are most of it)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if Path(entry, "comm").read_text().strip() in ("postgres", "postmaster"):
                    total += cpu_seconds(int(entry.name))
    return total


def cpu_snapshot(procs: Processes) -> dict[str, float]:
    snap = {name: cpu_seconds(proc.pid) for name, proc in procs.procs if not name.startswith("py-spy")}
    snap["postgres"] = postgres_cpu()
    snap["bench"] = time.process_time()
    return snap


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Processes:
    def __init__(self, url: str, namespace: str, wake: str = "adaptive") -> None:
        self.workdir = tempfile.mkdtemp(prefix="pbbench-")
        # The relay's defaults, spelled out: while busy it polls the outbox every 2 ms; after 200 ms idle
        # it arms the capture trigger's NOTIFY and waits for it (1 s fallback probe).
        Path(self.workdir, "pollbridge.toml").write_text(
            f'[bus]\nnamespace = "{namespace}"\n[capture]\nwake = "{wake}"\n'
            '[relay]\npoll_interval = 0.002\narm_after = 0.2\nfallback_interval = 1.0\n'
            '[scheduler]\nphase = "cutover"\nbatch_size = 1000\n')
        self.env = {**os.environ, "POLLBRIDGE_DATABASE_URL": url, "POLLBRIDGE_BUS_URL": REDIS_URL}
        self.exe = shutil.which("pollbridge") or sys.exit("pollbridge is not installed")
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.namespace = namespace
        atexit.register(self.stop)

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        return self.spawn(name, [self.exe, "--log-level", "INFO", *args])

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(Path(self.workdir, f"{name}.log"), "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, cwd=self.workdir, env=self.env, stderr=log, stdout=log,
                                    stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.procs.append((name, proc))
        return proc

    def caught_up(self) -> bool:
        """The schedulers have read and acknowledged everything on the bus."""
        bus = open_bus(REDIS_URL, namespace=self.namespace)
        try:
            return sum(bus.lag("pollbridge-scheduler").values()) == 0 and bus.pending_count("pollbridge-scheduler") == 0
        finally:
            bus.close()

    def stop(self, names: tuple[str, ...] | None = None) -> None:
        """SIGTERM (then SIGKILL after 15 s) the processes, all or those named."""
        chosen = [(n, p) for n, p in self.procs if names is None or n in names]
        for _, proc in chosen:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.send_signal(signal.SIGTERM)
        for _, proc in chosen:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = [(n, p) for n, p in self.procs if (n, p) not in chosen]


def seed_chains(engine: sa.Engine, prefix: str, first: int, count: int, length: int) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) "
                             "SELECT :p || g, 'bench' FROM generate_series(CAST(:a AS int), CAST(:b AS int)) g"),
                     {"p": prefix, "a": first, "b": first + count - 1})
        conn.execute(sa.text(
            "INSERT INTO tasks (instance_id, task_key, depends_on) "
            "SELECT :p || g, 't' || k, CASE WHEN k = 0 THEN '[]' ELSE json_build_array('t' || (k - 1)) END "
            "FROM generate_series(CAST(:a AS int), CAST(:b AS int)) g, generate_series(0, :len - 1) k"),
            {"p": prefix, "a": first, "b": first + count - 1, "len": length})


def analyze(engine: sa.Engine) -> None:
    """Statistics for the freshly seeded tables, as autovacuum would have them within a minute or so. With
    the statistics of an empty table PostgreSQL may plan the dispatch compare-and-set (``id = ANY(...) AND
    status = 'pending' AND ...``) with a bitmap of the status index, which reads every pending task."""
    with engine.connect() as conn:
        conn.execute(sa.text(WORKER_QUEUE_INDEX))
        conn.execute(sa.text("ANALYZE tasks, workflow_instances"))
        conn.commit()


def db_clock(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        value: datetime = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    return value


def complete(engine: sa.Engine, prefix: str, rate: float | None, seconds: float,
             each_second: Any = None, statement: str = COMPLETE_BATCH,
             commits: list[tuple[float, float]] | None = None) -> int:
    """Complete dispatched tasks, paced at ``rate`` per second (None: as fast as possible), each batch one
    transaction of ``statement`` (bind parameters ``:n``, the batch size, and ``:p``, the prefix). ``commits``:
    each batch's (start, end of its commit) in Unix seconds is appended to it."""
    done = 0
    started = time.perf_counter()
    tick = 0
    with engine.connect() as conn:
        while (elapsed := time.perf_counter() - started) < seconds:
            if each_second is not None and elapsed >= tick:
                each_second(tick)
                tick += 1
            if rate:
                due = int(elapsed * rate) - done
                if due <= 0:
                    time.sleep(0.001)
                    continue
                n = min(due, 200)
            else:
                n = 500
            begun = time.time()
            with conn.begin():
                done += conn.execute(sa.text(statement), {"n": n, "p": prefix}).rowcount
            if commits is not None:
                commits.append((begun, time.time()))
    return done


def drain(engine: sa.Engine, prefix: str, timeout: float = 30.0) -> tuple[int, float]:
    """Wait until every ready task of ``prefix`` was dispatched; (still ready, seconds waited)."""
    started = time.monotonic()
    while True:
        with engine.connect() as conn:
            left = int(conn.execute(sa.text(READY_NOT_DISPATCHED), {"p": prefix}).scalar_one())
        waited = time.monotonic() - started
        if left == 0 or waited > timeout:
            return left, round(waited, 2)
        time.sleep(0.05)


def measure(engine: sa.Engine, path: str, prefix: str, t0: datetime, t1: datetime) -> dict[str, Any]:
    params = {"path": path, "p": prefix, "t0": t0, "t1": t1}
    with engine.connect() as conn:
        rows = conn.execute(sa.text(LATENCY_SQL), params).scalars().all()
        seconds = conn.execute(sa.text(PER_SECOND_SQL), params).all()
    out: dict[str, Any] = dict(latency_summary([float(r) for r in rows]))
    out["per_second"] = [{"s": int(s), "n": int(n), "p50_ms": round(float(p50), 1), "p99_ms": round(float(p99), 1),
                          "max_ms": round(float(mx), 1)} for s, n, p50, p99, mx in seconds]
    return out


def wait_for_roots(engine: sa.Engine, procs: Processes, prefix: str, instances: int, path: str) -> None:
    """Let the seeded chains' first tasks be dispatched, the outbox be published and the bus drained before
    the clock starts: seeding N chains of 10 writes 10 N outbox rows at once, and a window that opened on
    the tail of that backlog would measure the set-up burst, not the paced workload."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            queued = conn.execute(sa.text("SELECT count(*) FROM tasks WHERE status = 'queued' "
                                          "AND instance_id LIKE :p || '%'"), {"p": prefix}).scalar_one()
            backlog = (conn.execute(sa.text("SELECT count(*) FROM pollbridge_outbox WHERE published_at IS NULL"))
                       .scalar_one() if path == "events" else 0)
        if queued >= instances and backlog == 0 and (path != "events" or procs.caught_up()):
            return
        time.sleep(0.2)
    print("warning: the seeded chains' first tasks were not all dispatched (or the outbox not published) "
          "within 120 s; the window opens anyway", file=sys.stderr)


def wait_for_schedulers(url: str, namespace: str, count: int, timeout: float = 60.0) -> None:
    """Until ``count`` schedulers are members and every partition is leased (the start-up rebalancing is
    over), so the measured phases do not include a start-up catch-up."""
    engine = create_engine(url)
    bus = open_bus(REDIS_URL, engine=engine, partitions=BusSettings().partitions, namespace=namespace)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if lease_snapshot(engine, bus).settled(count, bus.partitions):
                time.sleep(1.0)
                return
            time.sleep(0.2)
    finally:
        bus.close()
        engine.dispose()
    print(f"warning: the {count} scheduler(s) did not settle their leases within {timeout:.0f} s", file=sys.stderr)


def run_phase(url: str, procs: Processes, label: str, rate: float | None, seconds: float,
              instances: int, length: int, path: str, profile: Path | None = None) -> dict[str, Any]:
    engine = create_engine(url, pool_size=4)
    prefix = f"{label}-"
    spies: list[subprocess.Popen[bytes]] = []
    try:
        seed_chains(engine, prefix, 1, instances, length)
        analyze(engine)
        wait_for_roots(engine, procs, prefix, instances, path)
        time.sleep(0.5)
        if profile is not None:
            spies = start_profilers(procs, profile, seconds)
        load = load_average()
        cpu0 = cpu_snapshot(procs)
        t0 = db_clock(engine)
        started = time.perf_counter()
        completed = complete(engine, prefix, rate, seconds)
        elapsed = time.perf_counter() - started
        t1 = db_clock(engine)
        cpu1 = cpu_snapshot(procs)
        stranded, drained = drain(engine, prefix)
        with engine.connect() as conn:
            dispatched = int(conn.execute(sa.text(
                "SELECT count(*) FROM pollbridge_dispatch_log WHERE instance_id LIKE :p || '%' "
                "AND dispatched_at >= :t0 AND dispatched_at < :t1"), {"p": prefix, "t0": t0, "t1": t1}).scalar_one())
        result = {"completions": completed, "seconds": round(elapsed, 2),
                  "completions_per_s": round(completed / elapsed, 1),
                  "dispatches_per_s": round(dispatched / elapsed, 1),
                  "transitions_per_s": round((completed + dispatched) / elapsed, 1),
                  # Closed loop: in a steady state every dispatch is followed by a completion, so twice the
                  # dispatch rate is what the pipeline sustains (completions can run ahead for a while by
                  # draining the tasks queued before the window).
                  "sustained_transitions_per_s": round(2 * dispatched / elapsed, 1),
                  "load_before": load, "load_after": load_average(),
                  "drain_s": drained, "stranded": stranded,
                  # CPU seconds per second of the window, per process (postgres: all its processes)
                  "cpu_per_s": {k: round((cpu1[k] - v) / elapsed, 3) for k, v in cpu0.items() if k in cpu1},
                  "latency": measure(engine, path, prefix, t0, t1)}
    finally:
        for spy in spies:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(30)
        engine.dispose()
    return result


def start_profilers(procs: Processes, directory: Path, seconds: float) -> list[subprocess.Popen[bytes]]:
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy not found (pip install py-spy): not profiling", file=sys.stderr)
        return []
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, proc in list(procs.procs):
        if name.startswith("scheduler") or name == "relay":
            out.append(procs.spawn(f"py-spy-{name}", [
                spy, "record", "--format", "raw", "--rate", "250", "--duration", str(int(seconds)),
                "--pid", str(proc.pid), "--output", str(directory / f"{name}.txt")]))
    return out


class Maintenance:
    """``VACUUM (ANALYZE)`` of the busy tables every ``interval`` seconds on a thread, standing in for
    autovacuum when the server runs without it (this machine's PostgreSQL has ``autovacuum = off``): without
    it an hour of steady load piles up dead rows and stale statistics, and every query slows down."""

    TABLES = "tasks, workflow_instances, pollbridge_outbox, pollbridge_dispatch_log"

    def __init__(self, url: str, interval: float = 60.0) -> None:
        self.url, self.interval = url, interval
        self.stop = threading.Event()
        self.runs: list[float] = []
        self.thread = threading.Thread(target=self._run, name="bench-maintenance", daemon=True)

    def _run(self) -> None:
        engine = create_engine(self.url)
        try:
            while not self.stop.wait(self.interval):
                started = time.monotonic()
                with engine.connect() as conn:
                    conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                        sa.text(f"VACUUM (ANALYZE) {self.TABLES}"))
                self.runs.append(round(time.monotonic() - started, 2))
        finally:
            engine.dispose()

    def __enter__(self) -> Maintenance:
        if not autovacuum_on(self.url):
            self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(120)


def autovacuum_on(url: str) -> bool:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return str(conn.execute(sa.text("SHOW autovacuum")).scalar_one()) == "on"
    finally:
        engine.dispose()


def soak(url: str, procs: Processes, schedulers: list[subprocess.Popen[bytes]], minutes: float, rate: float,
         length: int) -> dict[str, Any]:
    """Steady load for ``minutes``: RSS and latency sampled every minute."""
    engine = create_engine(url, pool_size=4)
    prefix = "soak-"
    per_second = max(1, round(rate / length))
    seeded = max(200, int(rate * 10 / length))
    samples: list[dict[str, Any]] = []
    maintenance = Maintenance(url)
    try:
        maintenance.__enter__()
        seed_chains(engine, prefix, 1, seeded, length)
        analyze(engine)
        wait_for_roots(engine, procs, prefix, seeded, "events")
        samples.append({"minute": 0, "rss_mb": [rss_mb(p.pid) for p in schedulers], "load": load_average()})
        print(f"soak minute 0: RSS {samples[-1]['rss_mb']} MB, load {samples[-1]['load']}", flush=True)
        for minute in range(1, int(minutes) + 1):
            t0 = db_clock(engine)

            def seed(_tick: int) -> None:
                nonlocal seeded
                seed_chains(engine, prefix, seeded + 1, per_second, length)
                seeded += per_second

            completed = complete(engine, prefix, rate, 60.0, seed)
            t1 = db_clock(engine)
            lat = latency_summary(_latencies(engine, prefix, t0, t1))
            sample = {"minute": minute, "rss_mb": [rss_mb(p.pid) for p in schedulers], "load": load_average(),
                      "completions_per_s": round(completed / 60, 1), "p50_ms": lat["p50_ms"],
                      "p99_ms": lat["p99_ms"], "max_ms": lat["max_ms"], "n": lat["n"]}
            samples.append(sample)
            print(f"soak minute {minute}: RSS {sample['rss_mb']} MB, {sample['completions_per_s']} completions/s, "
                  f"p50 {sample['p50_ms']} ms p99 {sample['p99_ms']} ms max {sample['max_ms']} ms, "
                  f"load {sample['load']}", flush=True)
        stranded, _ = drain(engine, prefix)
    finally:
        maintenance.__exit__()
        engine.dispose()
    return {"minutes": int(minutes), "rate": rate, "instances": seeded, "stranded": stranded, "samples": samples,
            "vacuum_analyze_s": maintenance.runs}


def _latencies(engine: sa.Engine, prefix: str, t0: datetime, t1: datetime) -> list[float]:
    time.sleep(0.5)  # the window's last ready tasks get dispatched
    with engine.connect() as conn:
        return [float(r) for r in conn.execute(sa.text(LATENCY_SQL), {"path": "events", "p": prefix, "t0": t0,
                                                                      "t1": t1}).scalars()]


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: children stopped, database dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=500)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--wake", choices=("poll", "notify", "adaptive"), default="adaptive",
                        help="capture wake-up mode of the event path (pollbridge's default: adaptive)")
    parser.add_argument("--schedulers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small and short, for CI (< 1 minute)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database for inspection")
    parser.add_argument("--skip-poller", action="store_true", help="measure the event path only")
    parser.add_argument("--skip-throughput", action="store_true", help="measure the latency phase only")
    parser.add_argument("--profile", type=Path, help="py-spy the schedulers and the relay during the latency phase")
    parser.add_argument("--soak-minutes", type=float, help="run only a memory soak of this many minutes")
    parser.add_argument("--soak-rate", type=float, default=200, help="completions/s during the soak")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 4
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    length = 10
    instances = max(200, int(args.rate * args.seconds * 2 / length) + 1)
    namespace = f"pbbench{uuid.uuid4().hex[:6]}"
    results: dict[str, Any] = {"machine": machine(), "command": " ".join(["python -m bench.scheduler", *sys.argv[1:]]),
                               "load_at_start": load_average()}
    procs: Processes | None = None
    try:
        database = "pollbridge_bench_soak" if args.soak_minutes else "pollbridge_bench_scheduler"
        with scratch_database(database, keep=args.keep) as url:
            engine = create_engine(url)
            install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings(wake=args.wake))
            engine.dispose()
            procs = Processes(url, namespace, args.wake)
            try:
                procs.start("relay", "relay", "run")
                schedulers = [procs.start(f"scheduler{i}", "scheduler", "run", "--phase", "cutover")
                              for i in range(args.schedulers)]
                wait_for_schedulers(url, namespace, args.schedulers)
                rss_start = [rss_mb(p.pid) for p in schedulers]
                if args.soak_minutes:
                    results["soak"] = soak(url, procs, schedulers, args.soak_minutes, args.soak_rate, length)
                else:
                    results["events_latency"] = run_phase(url, procs, "lat", args.rate, args.seconds, instances,
                                                          length, "events", args.profile)
                    if not args.skip_throughput:
                        results["events_throughput"] = run_phase(url, procs, "tp", None, args.seconds,
                                                                 instances * 3, length, "events")
                results["scheduler_rss_mb"] = {"start": rss_start, "end": [rss_mb(p.pid) for p in schedulers]}
                procs.stop()
                if not args.skip_poller and not args.soak_minutes:
                    procs.start("poller", "poller", "run", "--interval", str(args.poll_interval))
                    time.sleep(1.0)
                    results["poller_latency"] = run_phase(url, procs, "pol", args.rate, args.seconds, instances,
                                                          length, "poller")
                    results["poller_latency"]["interval_s"] = args.poll_interval
            finally:
                procs.stop()
    finally:
        delete_namespace(namespace)
    for name in ("events_latency", "events_throughput", "poller_latency"):
        if name not in results:
            continue
        r = results[name]
        lat = r["latency"]
        worst = max(lat["per_second"], key=lambda s: s["p99_ms"], default=None)
        print(f"{name:18} {r['completions_per_s']:>8} completions/s {r['dispatches_per_s']:>8} dispatches/s "
              f"{r['transitions_per_s']:>8} transitions/s ({r['sustained_transitions_per_s']} sustained)  "
              f"ready->dispatch p50 {lat['p50_ms']} ms p90 {lat['p90_ms']} ms p99 {lat['p99_ms']} ms "
              f"max {lat['max_ms']} ms (n={lat['n']}, stranded {r['stranded']}); worst second "
              f"{worst and worst['s']}: p99 {worst and worst['p99_ms']} ms; "
              f"load {r['load_before']} -> {r['load_after']}")
        print(f"{'':18} CPU s/s: " + ", ".join(f"{k} {v}" for k, v in r["cpu_per_s"].items()))
    if procs is not None:
        print(f"process logs in {procs.workdir}")
    print(f"scheduler RSS MB start {results['scheduler_rss_mb']['start']} end {results['scheduler_rss_mb']['end']}")
    write_json(args.json_path, results)


if __name__ == "__main__":
    main()
