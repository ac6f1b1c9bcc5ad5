"""Capture cost on the legacy write path, and the relay's wake-up modes.

    python -m bench.capture [--quick] [--json FILE] [--seconds N] [--rows N]

1. *Write path*: on a scratch database with the reference schema and ``--rows`` tasks, pgbench runs
   random single-row status UPDATEs (each one changes the status, so the capture trigger writes one
   outbox row per transaction) for ``--seconds`` with 1 and 8 clients, in each configuration:

   * ``baseline``: no capture trigger, no relay;
   * ``poll``, ``notify``, ``adaptive``: the capture trigger installed with that wake mode and
     ``pollbridge relay run`` with the same ``[capture] wake``, draining into Redis;
   * ``trigger only``: the trigger (wake = poll) and no relay, so the outbox only grows: the trigger's
     own cost;
   * ``trigger only (adaptive)``: the same with wake = adaptive: the trigger also reads the relay's
     flag on every change (never set without a relay, as under load);
   * ``baseline (repeat)``: the baseline again at the end, to see drift (not with ``--quick``, which
     also leaves out ``trigger only (adaptive)`` and the 4/s latency run).

   Before every pgbench run the outbox is emptied (``TRUNCATE``, after the relay drained it),
   ``VACUUM ANALYZE`` and ``CHECKPOINT`` run, so every run starts from the same table. Reported: tps,
   the change against the baseline with the same number of clients (the less disturbed baseline run), the
   outbox rows written (checked against the transactions pgbench committed), the relay's backlog when
   pgbench stopped, how long it took to drain it, the CPU the relay used, and the CPU that processes
   outside the benchmark used meanwhile (others' tests on a shared machine: read it before a figure).
   A run during which that exceeded ``--max-other-load`` is done again while ``--budget`` allows; the
   least disturbed attempt is reported and every attempt is in the JSON.
2. *Idle cost*: with the relay drained and no writer, the database transactions per second of the
   scratch database (``pg_stat_database.xact_commit + xact_rollback`` deltas over ``--idle-seconds``,
   read from another database; every statement the relay sends runs in its own transaction, so this
   counts its statements, connection pre-pings included).
3. *Alternating comparisons* (``--paired-rounds``, ``--paired-seconds``): small differences drown in the
   load of a shared machine, so ``trigger only (adaptive)`` is also compared with ``trigger only`` (the
   cost of the flag read) in short alternating runs with 8 clients (a b, b a, a b), and with
   ``--paired-relays`` the ``adaptive`` relay with the ``poll`` relay. Reported: the change b/a of
   every round.
4. *Latency*: commit → event readable on the bus per wake mode, with ``bench.relay.latency`` at a
   modest rate (200/s) and at a trickle (4/s: the outbox empties between changes, so an adaptive relay
   arms and is woken by NOTIFY).

``--relay-custom-plans`` sets ``plan_cache_mode = force_custom_plan`` as the scratch database's default
(pgbench gets ``auto`` back through ``PGOPTIONS``), so the relay's sessions never run a cached generic
plan: a workaround for the relay's claim statement, whose generic plan, made while the outbox was
empty, re-runs its ``LIMIT … FOR UPDATE SKIP LOCKED`` subquery for every outbox row (quadratic, and
claims more than ``batch_size`` rows). It shows what the relay costs without that problem.

Uses a scratch database on the local PostgreSQL and namespaces of its own on the local Redis (deleted
at the end). The relay runs as its own process with the settings of a ``pollbridge.toml`` in a
temporary directory; everything else uses the defaults of ``RelaySettings``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import bench.relay
from bench._paths_common import cpu_totals
from bench.common import PG_ADMIN_URL, REDIS_URL, db_url, delete_namespace, machine, scratch_database, write_json
from bench.relay import latency
from bridge.app import install
from bridge.capture.triggers import remove_capture
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import CaptureSettings, RelaySettings, WakeMode
from bridge.db.engine import create_engine

DATABASE = "pollbridge_bench_capture"
CLIENTS = (1, 8)
IDLE_METHOD = "pg_stat_database.xact_commit + xact_rollback delta"


@dataclass(frozen=True)
class Config:
    name: str
    trigger: WakeMode | None  # None: no capture trigger
    relay: bool


CONFIGS = (
    Config("baseline", None, False),
    Config("poll", "poll", True),
    Config("notify", "notify", True),
    Config("adaptive", "adaptive", True),
    Config("trigger only", "poll", False),
    Config("trigger only (adaptive)", "adaptive", False),
)
REPEAT = Config("baseline (repeat)", None, False)


# --- database helpers -------------------------------------------------------------------------------
def _maintenance(url: str, *, truncate_outbox: bool) -> None:
    """Same starting point for every run: empty outbox, vacuumed tables, fresh checkpoint."""
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        if truncate_outbox:
            conn.execute("TRUNCATE pollbridge_outbox")
        conn.execute("VACUUM ANALYZE tasks")
        conn.execute("VACUUM ANALYZE pollbridge_outbox")
        conn.execute("VACUUM ANALYZE pollbridge_relay_state")
        conn.execute("CHECKPOINT")


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _scalar(url: str, query: str) -> Any:
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        row = conn.execute(query).fetchone()
    return None if row is None else row[0]


def _backlog(url: str) -> int:
    return int(_scalar(url, "SELECT count(*) FROM pollbridge_outbox WHERE published_at IS NULL"))


def _wait_drained(url: str, timeout: float) -> float | None:
    """Seconds until the outbox has no unpublished row; None if it did not drain within ``timeout``."""
    started = time.perf_counter()
    while _backlog(url):
        if time.perf_counter() - started > timeout:
            return None
        time.sleep(0.05)
    return round(time.perf_counter() - started, 2)


def _xacts(dbname: str) -> int:
    """Committed + rolled back transactions of ``dbname``, read from the admin database (not counted)."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                           (dbname,)).fetchone()
    assert row is not None
    return int(row[0])


def _backend_pids(dbname: str) -> list[int]:
    """Server processes of the client connections to ``dbname`` (read from the admin database)."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
                            (dbname,)).fetchall()
    return [int(r[0]) for r in rows]


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the given processes so far (same host, from /proc; gone ones count 0)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used by the relay process and its database backends between ``start`` and ``stop``, in % of one core.

    The backends are the scratch database's connections when ``start`` runs, which must be the relay's
    only (call it before any writer connects)."""

    def __init__(self, dbname: str, relay_pid: int | None) -> None:
        self.dbname = dbname
        self.relay_pid = relay_pid
        self.pids: list[int] = []
        self.t0 = self.relay0 = self.backends0 = 0.0

    def start(self) -> None:
        self.pids = _backend_pids(self.dbname)
        self.t0 = time.perf_counter()
        self.relay0 = _cpu_seconds([self.relay_pid]) if self.relay_pid else 0.0
        self.backends0 = _cpu_seconds(self.pids)

    def stop(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.t0
        relay = (_cpu_seconds([self.relay_pid]) if self.relay_pid else 0.0) - self.relay0
        backends = _cpu_seconds(self.pids) - self.backends0
        return {"relay_process_cpu_pct": round(100 * relay / elapsed, 1),
                "relay_backends_cpu_pct": round(100 * backends / elapsed, 1)}


def idle_cost(url: str, settle: float, window: float, relay_pid: int | None) -> dict[str, Any]:
    """Transactions per second the scratch database runs with no writer (the relay's idle cost), and CPU."""
    dbname = make_url(url).database
    assert dbname is not None
    # Backends flush their statistics at most once a second (an idle one up to 10 s later): settle first,
    # so what the relay did while it was still busy is not counted in the window.
    time.sleep(settle)
    cpu = CpuMeter(dbname, relay_pid)
    cpu.start()
    before, t0 = _xacts(dbname), time.perf_counter()
    time.sleep(window)
    after, t1 = _xacts(dbname), time.perf_counter()
    used = cpu.stop()
    armed = _scalar(url, "SELECT armed FROM pollbridge_relay_state WHERE relay_partition = 0")
    return {"xacts_per_s": round((after - before) / (t1 - t0), 1), "window_s": round(t1 - t0, 1), **used,
            "armed_at_end": armed, "method": IDLE_METHOD}


def install_config(url: str, wake: WakeMode | None) -> None:
    engine = create_engine(url)
    try:
        if wake is None:
            with engine.begin() as conn:
                remove_capture(conn)
        else:
            install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings(wake=wake))
        with engine.begin() as conn:  # a clean relay state: not armed, nobody holding it
            conn.execute(sa.text("UPDATE pollbridge_relay_state SET armed = false, holder = NULL"))
    finally:
        engine.dispose()


def seed(url: str, rows: int) -> tuple[int, int]:
    """The reference schema without capture, ``rows`` tasks (10 per instance); returns the id range."""
    engine = create_engine(url)
    try:
        install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings(wake="poll"))
        with engine.begin() as conn:
            remove_capture(conn)
            conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) "
                                 "SELECT 'i' || (g / 10), 'bench' FROM generate_series(0, :n - 1) g "
                                 "WHERE g % 10 = 0"), {"n": rows})
            conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key, depends_on) "
                                 "SELECT 'i' || (g / 10), 't' || g, '[]' FROM generate_series(0, :n - 1) g"),
                         {"n": rows})
            lo, hi = conn.execute(sa.text("SELECT min(id), max(id) FROM tasks")).one()
    finally:
        engine.dispose()
    return int(lo), int(hi)


# --- load from outside the benchmark ---------------------------------------------------------------
class OtherLoad:
    """CPU used during a run by processes that are not part of the benchmark (others' tests on a shared machine).

    Samples ``/proc`` every ``interval`` s. Ours: this process and its children (pgbench, the relay), and
    the PostgreSQL backends of the scratch database (their process title names it). Shared, not counted:
    PostgreSQL's and Redis's server processes and kernel threads. Everything else is *other*: a process
    born during the run counts from its start; one that ends between samples loses its last interval."""

    def __init__(self, dbname: str, interval: float = 0.5) -> None:
        self.dbname = dbname
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], int] = {}
        self._kind: dict[tuple[int, int], str] = {}
        self._t0 = 0.0
        self._boot_ticks0 = 0
        self._busy0 = self._total0 = 0
        self.hz = os.sysconf("SC_CLK_TCK")

    def _classify(self, pid: int, comm: str, ppid: int) -> str:
        if pid == os.getpid() or ppid == os.getpid():
            return "ours"
        if comm in ("redis-server", "kthreadd") or ppid == 2 or pid == 2:
            return "shared"
        if comm == "postgres":
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                return "shared"
            if f" {self.dbname} " in title:
                return "ours"
            # a client backend's title is "postgres: <cluster>: <user> <database> <host> <state>"
            return "other" if re.match(r"postgres: \S+: \S+ \S+ \S+", title) else "shared"
        return "other"

    def _sample(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                raw = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1:raw.rindex(")")]
            fields = raw.rsplit(")", 1)[1].split()
            pid, ppid, cpu, start = int(entry.name), int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])
            key = (pid, start)
            if key not in self._kind:
                self._kind[key] = self._classify(pid, comm, ppid)
                # born during the run: all of its CPU counts; otherwise from the first sample on
                self._first[key] = 0 if start >= self._boot_ticks0 else cpu
            self._last[key] = cpu

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> None:
        self._t0 = time.perf_counter()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        self._boot_ticks0 = int(uptime * self.hz)
        self._busy0, self._total0 = cpu_totals()
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        elapsed = time.perf_counter() - self._t0
        other = sum(self._last[k] - self._first[k] for k, kind in self._kind.items() if kind == "other")
        busy, total = cpu_totals()
        cpus = os.cpu_count() or 1
        return {"other_cpu_pct": round(100 * other / self.hz / elapsed, 1),
                "machine_busy_pct": round(100 * cpus * (busy - self._busy0) / max(1, total - self._total0), 1)}


# --- pgbench ----------------------------------------------------------------------------------------
PGBENCH_SCRIPT = """\\set id random({lo}, {hi})
UPDATE tasks SET status = CASE WHEN status = 'pending' THEN 'queued' ELSE 'pending' END WHERE id = :id;
"""


def pgbench_command(url: str, script: str, clients: int, seconds: int) -> list[str]:
    u = make_url(url)
    return ["pgbench", "-n", "-f", script, "-c", str(clients), "-j", str(clients), "-T", str(seconds),
            "-M", "prepared", "-h", u.host or "127.0.0.1", "-p", str(u.port or 5432), "-U", u.username or "postgres",
            u.database or "postgres"]


def run_pgbench(url: str, script: str, clients: int, seconds: int, pgoptions: str | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if pgoptions:
        env["PGOPTIONS"] = pgoptions
    password = make_url(url).password
    if password:
        env["PGPASSWORD"] = str(password)
    load = OtherLoad(make_url(url).database or "")
    load.start()
    try:
        proc = subprocess.run(pgbench_command(url, script, clients, seconds), capture_output=True, text=True,
                              env=env, timeout=seconds + 120)
    finally:
        other = load.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out = proc.stdout

    def find(pattern: str) -> str | None:
        m = re.search(pattern, out, re.MULTILINE)
        return m.group(1) if m else None

    tps = find(r"^tps = ([\d.]+) \(without initial connection time\)")
    if tps is None:
        raise RuntimeError(f"cannot read tps from pgbench output:\n{out}")
    lat = find(r"^latency average = ([\d.]+) ms")
    done = find(r"^number of transactions actually processed: (\d+)")
    failed = find(r"^number of failed transactions: (\d+)")
    return {"tps": round(float(tps), 1), "latency_avg_ms": float(lat) if lat else None,
            "transactions": int(done) if done else None, "failed": int(failed) if failed else 0, **other}


# --- the relay as its own process -------------------------------------------------------------------
@contextmanager
def relay_process(url: str, wake: WakeMode, namespace: str, mode: str = "trigger") -> Iterator[subprocess.Popen[bytes]]:
    """``pollbridge relay run`` with ``[capture] wake`` and ``mode`` and ``[bus] namespace``; yields once it leads
    (and, capturing from the write-ahead log, streams its slot)."""
    workdir = tempfile.mkdtemp(prefix="pbbench-relay-")
    Path(workdir, "pollbridge.toml").write_text(
        f'[bus]\nnamespace = "{namespace}"\n[capture]\nwake = "{wake}"\nmode = "{mode}"\n')
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
           "POLLBRIDGE_DATABASE_URL": url, "POLLBRIDGE_BUS_URL": REDIS_URL}
    exe = shutil.which("pollbridge") or sys.exit("pollbridge is not installed")
    log_path = Path(workdir, "relay.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([exe, "relay", "run"], cwd=workdir, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        def up() -> bool:
            leads = _scalar(url, "SELECT holder FROM pollbridge_relay_state WHERE relay_partition = 0") is not None
            return leads and (mode != "wal" or bool(_scalar(
                url, "SELECT bool_or(active) FROM pg_replication_slots WHERE database = current_database()")))

        while not up():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"relay ({wake}) did not take its partition:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        yield proc
        if proc.poll() is not None:
            raise RuntimeError(f"relay ({wake}) exited early:\n{log_path.read_text()[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# --- the runs ---------------------------------------------------------------------------------------
@dataclass
class Plan:
    """What every run shares, and the time budget that decides whether a run disturbed by other load is redone."""

    url: str
    script: str
    seconds: int
    idle_settle: float
    idle_window: float
    pgoptions: str | None
    max_other_cpu: float  # % of one core; above it a run is redone while the budget allows
    deadline: float  # perf_counter() by which everything must be done
    runs_left: int  # pgbench runs still to do (for the estimate)
    tail_s: float  # estimated time of what follows the write-path runs (latency)
    retries: int = 0
    run_times: list[float] = field(default_factory=list)  # seconds each attempt took, maintenance included

    @property
    def dbname(self) -> str:
        return make_url(self.url).database or ""

    def may_retry(self) -> bool:
        """Whether one more attempt and everything still to do fit before the deadline (a cautious guess)."""
        per_run = max(self.seconds + 12.0, sum(self.run_times) / len(self.run_times) if self.run_times else 0.0)
        needed = (self.runs_left + 1) * per_run + 3 * (self.idle_settle + self.idle_window + 3) + self.tail_s
        return time.perf_counter() + needed < self.deadline


def run_config(cfg: Config, plan: Plan, namespace: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    install_config(plan.url, cfg.trigger)
    _maintenance(plan.url, truncate_outbox=True)
    url = plan.url
    rows: list[dict[str, Any]] = []
    idle_result: dict[str, Any] | None = None
    relay_pid: int | None = None

    def attempt(clients: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return measure(clients)
        finally:
            plan.run_times.append(time.perf_counter() - t0)

    def measure(clients: int) -> dict[str, Any]:
        cpu = CpuMeter(plan.dbname, relay_pid) if relay_pid else None
        if cpu:
            cpu.start()
        result = run_pgbench(url, plan.script, clients, plan.seconds, plan.pgoptions)
        if cpu:
            result.update(cpu.stop())
        backlog = _backlog(url) if cfg.trigger else None
        drain = _wait_drained(url, 60) if cfg.relay else None
        written = int(_scalar(url, "SELECT count(*) FROM pollbridge_outbox")) if cfg.trigger else None
        captured = None if written is None else written == result["transactions"]
        _maintenance(url, truncate_outbox=cfg.trigger is not None)
        return {"config": cfg.name, "trigger_wake": cfg.trigger, "relay": cfg.relay, "clients": clients,
                **result, "outbox_rows": written, "one_row_per_transaction": captured,
                "backlog_at_end": backlog, "drain_s": drain}

    def one(clients: int) -> None:
        plan.runs_left -= 1
        attempts = [attempt(clients)]
        while attempts[-1]["other_cpu_pct"] > plan.max_other_cpu and plan.may_retry():
            print(f"    {cfg.name}, {clients} client(s): other load used {attempts[-1]['other_cpu_pct']}% of a core; "
                  "again", file=sys.stderr, flush=True)
            plan.retries += 1
            attempts.append(attempt(clients))
        best = min(attempts, key=lambda a: a["other_cpu_pct"])
        best["attempts"] = [{k: a[k] for k in ("tps", "other_cpu_pct")} for a in attempts]
        rows.append(best)

    if cfg.relay:
        assert cfg.trigger is not None
        with relay_process(url, cfg.trigger, namespace) as proc:
            relay_pid = proc.pid
            time.sleep(0.5)  # let an adaptive relay arm (after arm_after = 0.2 s) before the writer starts
            for clients in CLIENTS:
                one(clients)
            idle_result = {"config": cfg.name, **idle_cost(url, plan.idle_settle, plan.idle_window, relay_pid)}
        delete_namespace(namespace)
    else:
        for clients in CLIENTS:
            one(clients)
        if cfg.name == "baseline":  # the floor: nothing but the benchmark's own idle connections
            idle_result = {"config": "no relay", **idle_cost(url, 0.5, plan.idle_window, None)}
    return rows, idle_result


@contextmanager
def relay_start_awaited(url: str) -> Iterator[None]:
    """Make ``bench.relay.latency`` start its writer only once its relay holds the partition.

    ``latency`` starts ``pollbridge relay run`` and sleeps a fixed second before its writer starts; on this
    2-core machine the relay takes 1.2-1.4 s to take its partition when the machine is busy, so the first
    commits waited for the relay to *start* (p99 > 1 s in any wake mode). This swaps the ``subprocess``
    module ``bench.relay`` sees for one whose ``Popen`` returns only once ``pollbridge_relay_state.holder``
    is set (``install_config`` clears it before every run)."""
    module = vars(bench.relay)
    real = module["subprocess"]

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = real.Popen(*args, **kwargs)
        deadline = time.monotonic() + 30
        while _scalar(url, "SELECT holder FROM pollbridge_relay_state WHERE relay_partition = 0") is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                break  # latency() will notice: nothing is received
            time.sleep(0.02)
        return proc

    shim = types.SimpleNamespace(**{name: getattr(real, name) for name in dir(real) if not name.startswith("__")})
    shim.Popen = popen
    module["subprocess"] = shim
    try:
        yield
    finally:
        module["subprocess"] = real


PAIRS = (
    (Config("trigger only", "poll", False), Config("trigger only (adaptive)", "adaptive", False)),
    (Config("poll", "poll", True), Config("adaptive", "adaptive", True)),
)


def paired(plan: Plan, a: Config, b: Config, rounds: int, seconds: int, namespace: str) -> dict[str, Any]:
    """``b`` against ``a`` in alternating short runs (a b, b a, a b, ...) with 8 clients, so that load from outside
    the benchmark, which comes and goes over minutes, falls on both sides alike: the per-round ratio b/a."""
    clients = max(CLIENTS)
    runs: dict[str, list[dict[str, Any]]] = {a.name: [], b.name: []}
    for r in range(rounds):
        for cfg in (a, b) if r % 2 == 0 else (b, a):
            install_config(plan.url, cfg.trigger)
            _maintenance(plan.url, truncate_outbox=True)
            if cfg.relay:
                assert cfg.trigger is not None
                ns = f"{namespace}_pair{r}_{cfg.trigger}"
                with relay_process(plan.url, cfg.trigger, ns):
                    time.sleep(0.5)
                    result = run_pgbench(plan.url, plan.script, clients, seconds, plan.pgoptions)
                    result["backlog_at_end"] = _backlog(plan.url)
                    result["drain_s"] = _wait_drained(plan.url, 60)
                delete_namespace(ns)
            else:
                result = run_pgbench(plan.url, plan.script, clients, seconds, plan.pgoptions)
            runs[cfg.name].append({k: v for k, v in result.items() if k not in ("latency_avg_ms", "failed")})
    ratios = sorted(round(100.0 * (y["tps"] - x["tps"]) / x["tps"], 1) for x, y in zip(runs[a.name], runs[b.name],
                                                                                        strict=True))
    return {"a": a.name, "b": b.name, "clients": clients, "seconds": seconds, "rounds": rounds, "runs": runs,
            "b_vs_a_pct": ratios, "median_b_vs_a_pct": ratios[len(ratios) // 2]}


def latency_runs(url: str, rates: list[tuple[float, float]], namespace: str) -> list[dict[str, Any]]:
    """``bench.relay.latency`` per wake mode and rate; it seeds ``lat-`` rows, which are removed after each run."""
    results = []
    for rate, seconds in rates:
        for wake in ("poll", "notify", "adaptive"):
            install_config(url, wake)
            _maintenance(url, truncate_outbox=True)
            ns = f"{namespace}_lat_{wake}_{int(rate)}"
            load = OtherLoad(make_url(url).database or "")
            try:
                with relay_start_awaited(url):
                    load.start()
                    try:
                        result = latency(url, rate, seconds, wake, ns)
                    finally:
                        other = load.stop()
                results.append({**result, **other})
            finally:
                delete_namespace(ns)
                with psycopg.connect(_libpq(url), autocommit=True) as conn:
                    conn.execute("DELETE FROM tasks WHERE instance_id LIKE 'lat-%'")
                    conn.execute("DELETE FROM workflow_instances WHERE id LIKE 'lat-%'")
    return results


def add_changes(results: dict[str, Any]) -> None:
    """``change_pct`` of every run against the baseline with the same clients: of the baseline runs (the first
    and, without ``--quick``, the repeat at the end) the one that other load disturbed least."""
    baseline: dict[int, float] = {}
    for clients in CLIENTS:
        runs = [r for r in results["write_path"] if r["trigger_wake"] is None and r["clients"] == clients]
        baseline[clients] = min(runs, key=lambda r: r["other_cpu_pct"])["tps"]
    results["baseline_tps"] = {str(k): v for k, v in baseline.items()}
    for r in results["write_path"]:
        base = baseline[r["clients"]]
        r["change_pct"] = round(100.0 * (r["tps"] - base) / base, 1)


# --- output -----------------------------------------------------------------------------------------
def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and suffix == "%":
        return f"{value:+.1f}%"
    if isinstance(value, float):
        return f"{value:,.1f}{suffix}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}{suffix}"
    return f"{value}{suffix}"


def _tables(results: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    st = results["settings"]
    head = ["configuration", "clients", "tps", "vs baseline", "lat. avg ms", "outbox rows", "backlog at end",
            "drain s", "relay CPU %", "other load CPU %"]
    body = []
    for r in results["write_path"]:
        cpu = None
        if r.get("relay_process_cpu_pct") is not None:
            cpu = round(r["relay_process_cpu_pct"] + r["relay_backends_cpu_pct"], 1)
        body.append([r["config"], str(r["clients"]), _fmt(r["tps"]), _fmt(r["change_pct"], "%"),
                     _fmt(r["latency_avg_ms"]), _fmt(r["outbox_rows"]), _fmt(r["backlog_at_end"]),
                     _fmt(r["drain_s"]), _fmt(cpu), _fmt(r["other_cpu_pct"])])
    idle_head = ["relay", "xacts/s", "relay process CPU %", "its backends CPU %", "armed at end"]
    idle_body = [[i["config"], _fmt(i["xacts_per_s"]), _fmt(i["relay_process_cpu_pct"]),
                  _fmt(i["relay_backends_cpu_pct"]), _fmt(i["armed_at_end"])] for i in results["idle"]]
    lat_head = ["wake", "rate/s", "received", "p50 ms", "p90 ms", "p99 ms", "max ms", "other load CPU %"]
    lat_body = [[lat["wake"], _fmt(lat["rate_per_s"]), f"{lat['received']}/{lat['updates']}", _fmt(lat["p50_ms"]),
                 _fmt(lat["p90_ms"]), _fmt(lat["p99_ms"]), _fmt(lat["max_ms"]), _fmt(lat["other_cpu_pct"])]
                for lat in results["latency"]]
    pair_head = ["b vs a, alternating runs", "a tps", "b tps", "b vs a per round", "median"]
    pair_body = [[f"{pr['b']} vs {pr['a']} ({pr['clients']} clients, {pr['seconds']} s)",
                  " ".join(f"{x['tps']:,.0f}" for x in pr["runs"][pr["a"]]),
                  " ".join(f"{x['tps']:,.0f}" for x in pr["runs"][pr["b"]]),
                  " ".join(f"{c:+.1f}%" for c in pr["b_vs_a_pct"]), f"{pr['median_b_vs_a_pct']:+.1f}%"]
                 for pr in results.get("paired", [])]
    return [
        (f"Write path: pgbench status UPDATEs, {st['rows']:,} rows, {st['seconds']} s per run; baseline = least "
         f"disturbed baseline run {results['baseline_tps']}; CPU in % of one core", head, body),
        (f"Relay idle cost over {st['idle_seconds']} s (xact_commit + xact_rollback)", idle_head, idle_body),
        ("Commit -> event readable on the bus (bench.relay.latency)", lat_head, lat_body),
        *([("Alternating comparisons (other load falls on both sides alike)", pair_head, pair_body)] if pair_body
          else []),
    ]


def print_tables(results: dict[str, Any]) -> None:
    tables = _tables(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        for title, head, body in tables:
            print(title)
            widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
            for line in [head, *body]:
                print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
            print()
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    for title, head, body in tables:
        table = Table(title=title)
        for i, column in enumerate(head):
            table.add_column(column, justify="left" if i == 0 else "right")
        for line in body:
            table.add_row(*line)
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="tasks in the table")
    parser.add_argument("--seconds", type=int, default=20, help="duration of each pgbench run")
    parser.add_argument("--idle-seconds", type=float, default=6.0, help="window of the idle-cost measurement")
    parser.add_argument("--idle-settle", type=float, default=3.0, help="wait after the drain before the idle window")
    parser.add_argument("--latency-rate", type=float, default=200.0, help="updates per second of the latency run")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--no-trickle", action="store_true", help="skip the 4/s latency run")
    parser.add_argument("--relay-custom-plans", action="store_true",
                        help="workaround: plan_cache_mode = force_custom_plan for the relay's sessions (not pgbench's)")
    parser.add_argument("--max-other-load", type=float, default=25.0,
                        help="redo a run when processes outside the benchmark used more than this %% of one core")
    parser.add_argument("--paired-rounds", type=int, default=3,
                        help="rounds of the alternating comparisons (trigger's flag read; poll vs adaptive relay)")
    parser.add_argument("--paired-seconds", type=int, default=4, help="duration of each run of those comparisons")
    parser.add_argument("--paired-relays", action="store_true",
                        help="also compare the adaptive relay with the poll relay in alternating runs (about 2 min)")
    parser.add_argument("--budget", type=float, default=500.0,
                        help="seconds the whole benchmark may take; redone runs only fit within it")
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI (< 1 minute)")
    parser.add_argument("--json", dest="json_path", help="also write the results to this file")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.seconds, args.idle_seconds, args.idle_settle, args.latency_seconds = 10_000, 1, 1.0, 0.5, 0.5
        args.no_trickle, args.budget, args.paired_rounds = True, 0.0, 0
    rates = [(args.latency_rate, args.latency_seconds)]
    if not args.no_trickle:
        rates.append((4.0, 8.0))
    configs = [c for c in CONFIGS if c.name != "trigger only (adaptive)"] if args.quick else [*CONFIGS, REPEAT]
    namespace = f"pbbenchcap{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    results: dict[str, Any] = {
        "machine": machine(),
        "command": " ".join(["python -m bench.capture", *sys.argv[1:]]),
        "settings": {"relay_custom_plans": args.relay_custom_plans, "rows": args.rows, "seconds": args.seconds,
                     "clients": list(CLIENTS),
                     "idle_seconds": args.idle_seconds, "idle_settle": args.idle_settle,
                     "max_other_load_pct": args.max_other_load, "budget_s": args.budget,
                     "latency_rates": [{"rate": r, "seconds": s} for r, s in rates],
                     "relay": {k: getattr(RelaySettings(), k) for k in
                               ("batch_size", "poll_interval", "arm_after", "fallback_interval")},
                     "pgbench": " ".join(pgbench_command(db_url(DATABASE),
                                                         "update_status.sql", 8, args.seconds))},
        "write_path": [], "idle": [], "latency": [], "paired": [],
    }
    workdir = tempfile.mkdtemp(prefix="pbbench-capture-")
    try:
        with scratch_database(DATABASE) as url:
            lo, hi = seed(url, args.rows)
            pgoptions = None
            if args.relay_custom_plans:
                # Every new session of the scratch database plans each execution afresh, except pgbench's,
                # which PGOPTIONS puts back to the default (the relay's engine sets libpq `options` itself,
                # which is why the database default is the way to reach it).
                with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
                    conn.execute(f'ALTER DATABASE "{DATABASE}" SET plan_cache_mode = force_custom_plan')
                pgoptions = "-c plan_cache_mode=auto"
            script = str(Path(workdir, "update_status.sql"))
            Path(script).write_text(PGBENCH_SCRIPT.format(lo=lo, hi=hi))
            results["pgbench_script"] = Path(script).read_text()
            # Warm-up (not recorded): caches, hint bits and the table's first round of dead rows.
            run_pgbench(url, script, max(CLIENTS), 1 if args.quick else 5, pgoptions)
            plan = Plan(url, script, args.seconds, args.idle_settle, args.idle_seconds, pgoptions,
                        max_other_cpu=args.max_other_load, deadline=started + args.budget,
                        runs_left=len(configs) * len(CLIENTS),
                        tail_s=sum(3 * (s + 6) for _, s in rates)
                        + args.paired_rounds * 2 * (args.paired_seconds + 4)
                        + (args.paired_rounds * 2 * (args.paired_seconds + 20) if args.paired_relays else 0))
            for cfg in configs:
                print(f"[{time.perf_counter() - started:5.0f} s] {cfg.name}", file=sys.stderr, flush=True)
                rows, idle = run_config(cfg, plan, f"{namespace}_{cfg.trigger}")
                results["write_path"].extend(rows)
                if idle:
                    results["idle"].append(idle)
            add_changes(results)
            results["redone_runs"] = plan.retries
            results["paired"] = []
            pairs = PAIRS if args.paired_relays else PAIRS[:1]
            for a, b in pairs if args.paired_rounds > 0 else ():
                print(f"[{time.perf_counter() - started:5.0f} s] {b.name} vs {a.name}, alternating", file=sys.stderr,
                      flush=True)
                results["paired"].append(paired(plan, a, b, args.paired_rounds, args.paired_seconds, namespace))
            print(f"[{time.perf_counter() - started:5.0f} s] latency", file=sys.stderr, flush=True)
            results["latency"] = latency_runs(url, rates, namespace)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{namespace}*:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
    results["total_s"] = round(time.perf_counter() - started, 1)
    print_tables(results)
    print(f"total {results['total_s']} s", file=sys.stderr)
    write_json(args.json_path, results)


if __name__ == "__main__":
    main()
