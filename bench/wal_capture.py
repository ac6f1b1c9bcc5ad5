"""Write-ahead-log capture against trigger capture: the scheduler's write path, and what the relay costs per change.

    python -m bench.wal_capture [--phases write,cost,cpu] [--rounds 3] [--seconds 10] [--rows 100000] [--configs A,B]
                                [--clients 1,8] [--json F] [--quick]

Needs ``wal_level = logical`` (``.ci/run`` sets it). One scratch database with the reference schema and
``--rows`` tasks; Redis for the relay's bus (a namespace of its own, deleted at the end).

1. **Write path.** pgbench runs random single-row status UPDATEs (each one changes the status, so each is a
   captured change) for ``--seconds`` with 1 and 8 clients (``--clients``), in each configuration, the
   configurations in an order that alternates from round to round (forward, then backward), so drift and other
   load fall on all:

   * ``baseline``: no capture at all;
   * ``trigger``: the capture triggers (wake = poll), no relay: the trigger's own cost;
   * ``wal``: the publication and the slot, nothing reading: what logical decoding adds to the writes;
   * ``trigger + relay``: the triggers and ``pollbridge relay run`` (wake = adaptive) draining to Redis;
   * ``wal + relay``: ``pollbridge relay run`` with ``[capture] mode = "wal"`` streaming the slot to Redis;
   * ``wal full`` and ``wal full + relay``: the same with the task table's ``REPLICA IDENTITY FULL`` (every
     update logs the whole old row: what pollbridge would cost if it asked for the old status from the log
     instead of remembering the values it saw; pollbridge itself never alters the scheduler's table).

   Before every run: the outbox emptied, ``VACUUM ANALYZE``, ``CHECKPOINT``. Reported per configuration and
   client count: tps of every round, the median, and the change of the median against the baseline's.
2. **Cost per change.** For each relay mode, a writer updates one task's status at 2, 20 and 500 changes/s
   (issue 19's rates) for ``--rate-seconds``; the scratch database's ``pg_stat_database`` transactions over the
   window, minus the writer's own (one per change), divided by the changes: what capture and the relay cost the
   database per change (the idle transactions of the window included: at 2 changes/s they are most of it). First, the
   transactions per second with nothing written (idle).
3. **Where WAL capture's CPU goes** (``--phases cpu``, not by default): with the relay streaming, 8 pgbench
   clients for ``--seconds`` and the relay's catch-up, ``--rounds`` times; CPU-seconds per 1,000 changes of the
   walsender, the relay process, the relay's database backends, Redis and the whole machine (:func:`cpu_split`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
import redis
import sqlalchemy as sa

from bench._paths_common import CLK_TCK, cpu_totals
from bench.capture import _cpu_seconds, _libpq, _maintenance, _scalar, relay_process, run_pgbench, seed
from bench.capture import _xacts as capture_xacts
from bench.common import REDIS_URL, delete_namespace, machine, scratch_database, write_json
from bridge.app import install
from bridge.capture import wal
from bridge.capture.triggers import remove_capture
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import CaptureSettings
from bridge.db.engine import create_engine

CONFIGS = ("baseline", "trigger", "wal", "wal full", "trigger + relay", "wal + relay", "wal full + relay")
#: Seconds for the statistics to settle around a measuring window (see cost_per_change).
SETTLE = 8.0


def _set_capture(url: str, config: str) -> None:
    engine = create_engine(url)
    try:
        if not config.startswith("wal"):
            # Out of a wal configuration the bench drops the slot as it is (its changes are of no interest): a
            # switch back to the triggers would first stream the unread share to its end.
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                wal.remove_wal(conn, end_stream=True)
        if config == "baseline":
            with engine.begin() as conn:
                remove_capture(conn)
        elif config.startswith("wal"):
            install.init(engine, mapping=TaskTableMapping(), capture=CaptureSettings(mode="wal"))
        else:
            install.init(engine, mapping=TaskTableMapping(),
                         capture=CaptureSettings(wake="adaptive" if "relay" in config else "poll"))
        with engine.begin() as conn:  # the bench's own table: pollbridge never alters the scheduler's
            identity = "FULL" if "full" in config else "DEFAULT"
            conn.execute(sa.text(f"ALTER TABLE tasks REPLICA IDENTITY {identity}"))
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE pollbridge_relay_state SET armed = false, holder = NULL"))
    finally:
        engine.dispose()


def _relay(url: str, mode: str, namespace: str) -> contextlib.AbstractContextManager[Any]:
    """``pollbridge relay run`` in ``mode`` (wake = adaptive); entered once it leads and, for wal, streams."""
    return relay_process(url, "adaptive", namespace, mode)


def _drained(url: str, mode: str, timeout: float = 120.0) -> None:
    """Until the relay caught up: no unpublished outbox row, and for wal the slot confirmed up to now."""
    target = _scalar(url, "SELECT pg_current_wal_lsn()::text")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mode == "wal":
            if _scalar(url, f"SELECT bool_and(confirmed_flush_lsn >= '{target}'::pg_lsn) FROM pg_replication_slots "
                            "WHERE database = current_database()"):
                return
        elif int(_scalar(url, "SELECT count(*) FROM pollbridge_outbox WHERE published_at IS NULL")) == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the {mode} relay did not catch up within {timeout:g} s")


def _xacts(url: str) -> int:
    """The scratch database's committed + rolled-back transactions, read from the admin database (the read itself
    is not one of them)."""
    return capture_xacts(str(sa.engine.make_url(url).database))


def _settled_xacts(url: str, limit: float = 60.0) -> int:
    """The transaction count once it has not moved for two 2 s looks in a row (at most ``limit`` s), called after
    the :data:`SETTLE` seconds: a backend reports its transactions when it next goes idle, and an idle one only
    after 10 s (PostgreSQL 15), so a start-up reported late fell into the idle window (measured: 36 start-up
    transactions in a 30 s window after an 8 s settle, counted as 1.2 a second of a relay that then made none).
    8 s and at least 4 s of quiet are past those 10 s; a relay that probes every 5 s leaves such a gap between
    its probes."""
    deadline = time.monotonic() + limit
    last, quiet = _xacts(url), 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(2.0)
        now = _xacts(url)
        quiet = quiet + 1 if now == last else 0
        last = now
    return last


def write_path(url: str, script: str, rounds: int, seconds: int, namespace: str,
               configs: tuple[str, ...] = CONFIGS, clients_list: tuple[int, ...] = (1, 8)) -> dict[str, Any]:
    tps: dict[str, dict[int, list[float]]] = {c: {n: [] for n in clients_list} for c in configs}
    for round_no in range(rounds):
        order = configs if round_no % 2 == 0 else tuple(reversed(configs))
        for config in order:
            _set_capture(url, config)
            mode = "wal" if config.startswith("wal") else "trigger"
            for clients in clients_list:
                _maintenance(url, truncate_outbox=True)
                relay = _relay(url, mode, namespace) if "relay" in config else contextlib.nullcontext()
                with relay:
                    result = run_pgbench(url, script, clients, seconds)
                    if "relay" in config:
                        _drained(url, mode)
                tps[config][clients].append(result["tps"])
                print(f"round {round_no + 1} {config:16s} {clients} client(s): {result['tps']:9.1f} tps", flush=True)
    out: dict[str, Any] = {}
    for config in configs:
        out[config] = {}
        for clients in clients_list:
            median = statistics.median(tps[config][clients])
            base = statistics.median(tps["baseline"][clients]) if "baseline" in tps else None
            out[config][str(clients)] = {"tps": tps[config][clients], "median": round(median, 1),
                                         "change_pct": round(100.0 * (median - base) / base, 1) if base else None}
    return out


def _server_cpu(url: str, backend_type: str) -> dict[int, float]:
    """CPU seconds so far of each server process of ``backend_type`` on this database (pgbench's clients and this
    look aside)."""
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        pids = [int(r[0]) for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND backend_type = %s "
            "AND pid <> pg_backend_pid() AND coalesce(application_name, '') <> 'pgbench'", (backend_type,)).fetchall()]
    return {pid: _cpu_seconds([pid]) for pid in pids}


def _used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU used between two readings: a process that appeared in between counts from 0, one that is gone is not
    counted (its last seconds are lost)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


def _redis_pid() -> int | None:
    with contextlib.suppress(Exception):
        return int(redis.Redis.from_url(REDIS_URL).info("server")["process_id"])
    return None


def cpu_split(url: str, script: str, rounds: int, seconds: int, namespace: str) -> dict[str, Any]:
    """Where WAL capture's CPU goes, per 1,000 captured changes, while 8 pgbench clients write: the walsender
    (decoding the log), the relay process (decoding the stream, Python), the relay's database backends (its
    batch inserts and looks) and Redis; and the whole machine's busy CPU. Each window is the pgbench run and the
    relay's catch-up after it, the relay streaming from before; the changes are pgbench's committed transactions
    (each one a captured change). A CPU figure per change is steadier than the writers' throughput on a 2-core
    machine whose throughput swings from run to run."""
    redis_pid = _redis_pid()
    config = "wal + relay"
    out: dict[str, list[dict[str, float]]] = {config: []}
    for round_no in range(rounds):
        _set_capture(url, "wal")
        _maintenance(url, truncate_outbox=True)
        with _relay(url, "wal", namespace) as proc:
            local = {"relay": [proc.pid], "redis": [redis_pid] if redis_pid else []}
            before = {k: _cpu_seconds(v) for k, v in local.items()}
            server = {kind: _server_cpu(url, kind) for kind in ("walsender", "client backend")}
            busy0 = cpu_totals()[0]
            result = run_pgbench(url, script, 8, seconds)
            _drained(url, "wal")
            machine_busy = (cpu_totals()[0] - busy0) / CLK_TCK
            used = {k: _cpu_seconds(v) - before[k] for k, v in local.items()}
            used["walsender"] = _used(server["walsender"], _server_cpu(url, "walsender"))
            used["relay backends"] = _used(server["client backend"], _server_cpu(url, "client backend"))
        changes = result["transactions"] or result["tps"] * seconds
        row = {k: round(1000 * used[k] / changes, 4) for k in ("walsender", "relay", "relay backends", "redis")}
        row["machine busy"] = round(1000 * machine_busy / changes, 4)
        row["tps"] = result["tps"]
        out[config].append(row)
        print(f"round {round_no + 1} {config:16s} CPU-s per 1,000 changes: "
              + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return {c: {"runs": rows, "median": {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}}
            for c, rows in out.items() if rows}


def cost_per_change(url: str, rates: list[float], rate_seconds: float, idle_seconds: float,
                    namespace: str, settle: float = SETTLE, settle_limit: float = 60.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    task = int(_scalar(url, "SELECT min(id) FROM tasks"))
    for mode in ("trigger", "wal"):
        _set_capture(url, "wal + relay" if mode == "wal" else "trigger + relay")
        out[mode] = {}
        with _relay(url, mode, namespace), psycopg.connect(_libpq(url), autocommit=True) as writer:
            # A backend reports its transactions to the statistics when it next goes idle, not at once: the
            # relay's start-up must be reported before the first window opens (measured: a 1 s settle
            # counted about 9 start-up transactions a second into a 10 s idle window; 8 s, none).
            time.sleep(settle)
            before = _settled_xacts(url, settle_limit)
            time.sleep(idle_seconds)
            out[mode]["idle_per_s"] = round((_xacts(url) - before) / idle_seconds, 2)
            for rate in rates:
                changes = int(rate * rate_seconds)
                before = _xacts(url)
                started = time.monotonic()
                for n in range(changes):
                    status = "queued" if n % 2 == 0 else "pending"
                    writer.execute("UPDATE tasks SET status = %s WHERE id = %s", (status, task))
                    wait = started + (n + 1) / rate - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                # No look at the relay's progress inside the window (each would be a transaction of its own):
                # it keeps up at these rates; checked after the window is read.
                time.sleep(settle)
                spent = _xacts(url) - before - changes
                _drained(url, mode)
                out[mode][f"{rate:g}/s"] = round(spent / changes, 2)
                print(f"{mode:8s} at {rate:g} changes/s: {spent / changes:.2f} transactions per change", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wal_capture", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rates", default="2,20,500", help="changes per second for the cost per change")
    parser.add_argument("--rate-seconds", type=float, default=10.0)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 3 s at 8 clients, 10k rows, short rate runs, 1 s settles (CI smoke)")
    parser.add_argument("--phases", default="write,cost",
                        help="which phases, comma-separated: write, cost, cpu (where the capture's CPU goes)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"write-path configurations, comma-separated (default all: {', '.join(CONFIGS)})")
    parser.add_argument("--clients", default="1,8", help="write-path client counts, comma-separated")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    configs = tuple(c.strip() for c in args.configs.split(","))
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; expected some of: {', '.join(CONFIGS)}")
    if args.quick:
        # CI keeps the script working; its figures mean nothing. One client count and 1 s settles, not the
        # statistics' 8 s: the quick run took 210 s of a 35-minute CI beside a CPU hog with both and 8 s.
        args.rounds, args.seconds, args.rows, args.rate_seconds, args.idle_seconds = 1, 3, 10_000, 3.0, 3.0
        args.clients = "8"
    namespace = f"pb_bench_wal_{os.getpid()}"
    with scratch_database("pollbridge_bench_wal") as url:
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                problems = wal.settings_problems(conn)
        finally:
            engine.dispose()
        if problems:
            print(f"bench.wal_capture: {problems[0]}", file=sys.stderr)
            return 1
        lo, hi = seed(url, args.rows)
        script = Path(tempfile.mkdtemp(prefix="pbbench-wal-")) / "update.sql"
        script.write_text(f"\\set id random({lo}, {hi})\n"
                          "UPDATE tasks SET status = CASE status WHEN 'pending' THEN 'queued' ELSE 'pending' END "
                          "WHERE id = :id;\n")
        try:
            phases = set(args.phases.split(","))
            results: dict[str, Any] = {}
            if "write" in phases:
                results["write_path"] = write_path(url, str(script), args.rounds, args.seconds, namespace, configs,
                                                  tuple(int(n) for n in args.clients.split(",")))
            if "cpu" in phases:
                results["cpu_split"] = cpu_split(url, str(script), args.rounds, args.seconds, namespace)
            if "cost" in phases:
                # --quick (CI) bounds the wait for settled statistics: its figures are not the ones to quote.
                results["cost_per_change"] = cost_per_change(url, [float(r) for r in args.rates.split(",")],
                                                             args.rate_seconds, args.idle_seconds, namespace,
                                                             settle=1.0 if args.quick else SETTLE,
                                                             settle_limit=2.0 if args.quick else 60.0)
        finally:
            _set_capture(url, "baseline")  # the slot goes before the database does
            delete_namespace(namespace)
    print(json.dumps(results, indent=2))
    write_json(args.json_path, {"bench": "wal_capture", "machine": machine(), "args": vars(args), **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
