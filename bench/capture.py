"""Capture cost on the legacy write path, and the relay's wake-up modes.

    python -m bench.capture [--quick] [--json FILE] [--seconds N] [--rows N]

1. *Write path*: on a scratch database with the reference schema and ``--rows`` tasks, pgbench runs
   random single-row status UPDATEs (each one changes the status, so the capture trigger writes one
   outbox row per transaction) for ``--seconds`` with 1 and 8 clients, in each configuration:

   ========================  =================  ==========================================
   configuration             capture trigger    relay
   ========================  =================  ==========================================
   ``baseline``              none               none
   ``poll``                  wake = poll        ``pollbridge relay run``, wake = poll
   ``notify``                wake = notify      ``pollbridge relay run``, wake = notify
   ``adaptive``              wake = adaptive    ``pollbridge relay run``, wake = adaptive
   ``trigger only``          wake = poll        none (the outbox only grows)
   ``baseline (repeat)``     none               none (drift check; not with ``--quick``)
   ========================  =================  ==========================================

   Before every pgbench run the outbox is emptied (``TRUNCATE``, after the relay drained it),
   ``VACUUM ANALYZE`` and ``CHECKPOINT`` run, so every run starts from the same table. Reported: tps,
   the change against the baseline with the same number of clients, the outbox rows written (checked
   against the transactions pgbench committed), the relay's backlog when pgbench stopped and how long
   it took to drain it.
2. *Idle cost*: with the relay drained and no writer, the database transactions per second of the
   scratch database (``pg_stat_database.xact_commit + xact_rollback`` deltas over ``--idle-seconds``,
   read from another database; every statement the relay sends runs in its own transaction, so this
   counts its statements, connection pre-pings included).
3. *Latency*: commit → event readable on the bus per wake mode, with ``bench.relay.latency`` at a
   modest rate (200/s) and at a trickle (4/s: the outbox empties between changes, so an adaptive relay
   arms and is woken by NOTIFY).

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
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from bench.common import PG_ADMIN_URL, REDIS_URL, machine, scratch_database, write_json
from bench.relay import latency
from bridge import install
from bridge.capture import WakeMode, remove_capture
from bridge.db import create_engine
from bridge.mapping import TaskTableMapping
from bridge.settings import CaptureSettings, RelaySettings

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


# --- pgbench ----------------------------------------------------------------------------------------
PGBENCH_SCRIPT = """\\set id random({lo}, {hi})
UPDATE tasks SET status = CASE WHEN status = 'pending' THEN 'queued' ELSE 'pending' END WHERE id = :id;
"""


def pgbench_command(url: str, script: str, clients: int, seconds: int) -> list[str]:
    u = make_url(url)
    return ["pgbench", "-n", "-f", script, "-c", str(clients), "-j", str(clients), "-T", str(seconds),
            "-M", "prepared", "-h", u.host or "127.0.0.1", "-p", str(u.port or 5432), "-U", u.username or "postgres",
            u.database or "postgres"]


def run_pgbench(url: str, script: str, clients: int, seconds: int) -> dict[str, Any]:
    env = dict(os.environ)
    password = make_url(url).password
    if password:
        env["PGPASSWORD"] = str(password)
    proc = subprocess.run(pgbench_command(url, script, clients, seconds), capture_output=True, text=True, env=env,
                          timeout=seconds + 120)
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
            "transactions": int(done) if done else None, "failed": int(failed) if failed else 0}


# --- the relay as its own process -------------------------------------------------------------------
@contextmanager
def relay_process(url: str, wake: WakeMode, namespace: str) -> Iterator[subprocess.Popen[bytes]]:
    """``pollbridge relay run`` with ``[capture] wake`` and ``[bus] namespace``; yields once it leads."""
    workdir = tempfile.mkdtemp(prefix="pbbench-relay-")
    Path(workdir, "pollbridge.toml").write_text(f'[bus]\nnamespace = "{namespace}"\n[capture]\nwake = "{wake}"\n')
    env = {**os.environ, "POLLBRIDGE_DATABASE_URL": url, "POLLBRIDGE_BUS_URL": REDIS_URL}
    exe = shutil.which("pollbridge") or sys.exit("pollbridge is not installed")
    log_path = Path(workdir, "relay.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([exe, "relay", "run"], cwd=workdir, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while _scalar(url, "SELECT holder FROM pollbridge_relay_state WHERE relay_partition = 0") is None:
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


def delete_namespace(namespace: str) -> int:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            client.delete(*keys)
        return len(keys)
    finally:
        client.close()


# --- the runs ---------------------------------------------------------------------------------------
def run_config(cfg: Config, url: str, script: str, seconds: int, idle: tuple[float, float], namespace: str,
               baseline: dict[int, float]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    install_config(url, cfg.trigger)
    _maintenance(url, truncate_outbox=True)
    dbname = make_url(url).database
    assert dbname is not None
    rows: list[dict[str, Any]] = []
    idle_result: dict[str, Any] | None = None
    relay_pid: int | None = None

    def one(clients: int) -> None:
        cpu = CpuMeter(dbname, relay_pid) if relay_pid else None
        if cpu:
            cpu.start()
        result = run_pgbench(url, script, clients, seconds)
        if cpu:
            result.update(cpu.stop())
        backlog = _backlog(url) if cfg.trigger else None
        drain = _wait_drained(url, 120) if cfg.relay else None
        written = int(_scalar(url, "SELECT count(*) FROM pollbridge_outbox")) if cfg.trigger else None
        base = baseline.get(clients)
        if cfg.name == "baseline":
            baseline[clients] = result["tps"]
            base = result["tps"]
        change = None if not base else round(100.0 * (result["tps"] - base) / base, 1)
        rows.append({"config": cfg.name, "trigger_wake": cfg.trigger, "relay": cfg.relay, "clients": clients,
                     **result, "change_pct": change, "outbox_rows": written, "backlog_at_end": backlog,
                     "drain_s": drain})
        _maintenance(url, truncate_outbox=cfg.trigger is not None)

    settle, window = idle
    if cfg.relay:
        assert cfg.trigger is not None
        with relay_process(url, cfg.trigger, namespace) as proc:
            relay_pid = proc.pid
            time.sleep(1.0)  # let an adaptive relay settle (arm) before the writer starts, like a quiet system
            for clients in CLIENTS:
                one(clients)
            idle_result = {"config": cfg.name, **idle_cost(url, settle, window, relay_pid)}
        delete_namespace(namespace)
    else:
        for clients in CLIENTS:
            one(clients)
        if cfg.name == "baseline":  # the floor: nothing but the benchmark's own idle connections
            idle_result = {"config": "no relay", **idle_cost(url, 0.5, window, None)}
    return rows, idle_result


def latency_runs(url: str, rates: list[tuple[float, float]], namespace: str) -> list[dict[str, Any]]:
    """``bench.relay.latency`` per wake mode and rate; it seeds ``lat-`` rows, which are removed after each run."""
    results = []
    for rate, seconds in rates:
        for wake in ("poll", "notify", "adaptive"):
            install_config(url, wake)  # type: ignore[arg-type]
            _maintenance(url, truncate_outbox=True)
            ns = f"{namespace}_lat_{wake}_{int(rate)}"
            try:
                results.append(latency(url, rate, seconds, wake, ns))
            finally:
                delete_namespace(ns)
                with psycopg.connect(_libpq(url), autocommit=True) as conn:
                    conn.execute("DELETE FROM tasks WHERE instance_id LIKE 'lat-%'")
                    conn.execute("DELETE FROM workflow_instances WHERE id LIKE 'lat-%'")
    return results


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
            "drain s", "relay CPU %"]
    body = []
    for r in results["write_path"]:
        cpu = None
        if r.get("relay_process_cpu_pct") is not None:
            cpu = round(r["relay_process_cpu_pct"] + r["relay_backends_cpu_pct"], 1)
        body.append([r["config"], str(r["clients"]), _fmt(r["tps"]), _fmt(r["change_pct"], "%"),
                     _fmt(r["latency_avg_ms"]), _fmt(r["outbox_rows"]), _fmt(r["backlog_at_end"]),
                     _fmt(r["drain_s"]), _fmt(cpu)])
    idle_head = ["relay", "xacts/s", "relay process CPU %", "its backends CPU %", "armed at end"]
    idle_body = [[i["config"], _fmt(i["xacts_per_s"]), _fmt(i["relay_process_cpu_pct"]),
                  _fmt(i["relay_backends_cpu_pct"]), _fmt(i["armed_at_end"])] for i in results["idle"]]
    lat_head = ["wake", "rate/s", "received", "p50 ms", "p90 ms", "p99 ms", "max ms"]
    lat_body = [[lat["wake"], _fmt(lat["rate_per_s"]), f"{lat['received']}/{lat['updates']}", _fmt(lat["p50_ms"]),
                 _fmt(lat["p90_ms"]), _fmt(lat["p99_ms"]), _fmt(lat["max_ms"])] for lat in results["latency"]]
    return [
        (f"Write path: pgbench status UPDATEs, {st['rows']:,} rows, {st['seconds']} s per run; "
         "relay CPU = relay process + its backends, % of one core", head, body),
        (f"Relay idle cost over {st['idle_seconds']} s (xact_commit + xact_rollback)", idle_head, idle_body),
        ("Commit -> event readable on the bus (bench.relay.latency)", lat_head, lat_body),
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
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="window of the idle-cost measurement")
    parser.add_argument("--idle-settle", type=float, default=3.0, help="wait after the drain before the idle window")
    parser.add_argument("--latency-rate", type=float, default=200.0, help="updates per second of the latency run")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--no-trickle", action="store_true", help="skip the 4/s latency run")
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI (< 1 minute)")
    parser.add_argument("--json", dest="json_path", help="also write the results to this file")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.seconds, args.idle_seconds, args.idle_settle, args.latency_seconds = 10_000, 2, 1.5, 1.5, 1.0
        args.no_trickle = True
    rates = [(args.latency_rate, args.latency_seconds)]
    if not args.no_trickle:
        rates.append((4.0, 2.0 if args.quick else 10.0))
    configs = list(CONFIGS) if args.quick else [*CONFIGS, REPEAT]
    namespace = f"pbbenchcap{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    results: dict[str, Any] = {
        "machine": machine(),
        "command": " ".join(["python -m bench.capture", *sys.argv[1:]]),
        "settings": {"rows": args.rows, "seconds": args.seconds, "clients": list(CLIENTS),
                     "idle_seconds": args.idle_seconds, "latency_rates": [{"rate": r, "seconds": s} for r, s in rates],
                     "relay": {k: getattr(RelaySettings(), k) for k in
                               ("batch_size", "poll_interval", "arm_after", "fallback_interval")},
                     "pgbench": " ".join(pgbench_command("postgresql://root@127.0.0.1:5432/" + DATABASE,
                                                         "update_status.sql", 8, args.seconds))},
        "write_path": [], "idle": [], "latency": [],
    }
    workdir = tempfile.mkdtemp(prefix="pbbench-capture-")
    try:
        with scratch_database(DATABASE) as url:
            lo, hi = seed(url, args.rows)
            script = str(Path(workdir, "update_status.sql"))
            Path(script).write_text(PGBENCH_SCRIPT.format(lo=lo, hi=hi))
            results["pgbench_script"] = Path(script).read_text()
            baseline: dict[int, float] = {}
            # Warm-up (not recorded): caches, hint bits and the table's first round of dead rows.
            run_pgbench(url, script, max(CLIENTS), 1 if args.quick else 5)
            for cfg in configs:
                print(f"[{time.perf_counter() - started:5.0f} s] {cfg.name}", file=sys.stderr, flush=True)
                rows, idle = run_config(cfg, url, script, args.seconds, (args.idle_settle, args.idle_seconds),
                                        f"{namespace}_{cfg.trigger}", baseline)
                results["write_path"].extend(rows)
                if idle:
                    results["idle"].append(idle)
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
