"""What the server's walsender spends per captured change with pgoutput's text tuples and with its ``binary`` ones,
on a wide table shaped like Airflow 3's ``task_instance`` (binary tuples were measured here and not adopted:
docs/capture.md).

    python -m bench.wal_tuples [--rounds 3] [--seconds 8] [--rows 100000] [--quick] [--json F]

A scratch database with a ``task_instance`` table of 37 columns (uuids, timestamps, a float, JSON, a pickled
executor config as bytes) and ``--rows`` rows, a publication of it and a logical replication slot on ``pgoutput``.
For each round, in an order that alternates, ``pg_recvlogical`` streams the slot with text tuples, then with
``binary`` (or the reverse), while 8 pgbench clients run single-row UPDATEs of the status and ``updated_at`` (what
a scheduler's write looks like) for ``--seconds``; then until the reader has confirmed everything. Reported per
round: the writers' tps, and CPU-seconds per 1,000 changes of the walsender and of ``pg_recvlogical`` (from
``/proc``). ``pg_recvlogical`` only writes the stream to ``/dev/null``, so the figure is the server's decoding
and output alone, without pollbridge's relay (``python -m bench.wal_capture --phases cpu`` measures the relay).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from bench._paths_common import cpu_seconds
from bench.capture import _libpq, run_pgbench
from bench.common import machine, scratch_database, write_json

SLOT = "pb_bench_wal_tuples"
PUBLICATION = "pb_bench_wal_tuples"
TABLE = """CREATE TABLE task_instance (
  id uuid PRIMARY KEY DEFAULT gen_random_uuid(), task_id varchar(250), dag_id varchar(250), run_id varchar(250),
  map_index int DEFAULT -1, start_date timestamptz, end_date timestamptz, duration float8, state varchar(20),
  try_number int, max_tries int, hostname varchar(1000), unixname varchar(1000), pool varchar(256), pool_slots int,
  queue varchar(256), priority_weight int, operator varchar(1000), custom_operator_name varchar(1000),
  queued_dttm timestamptz, scheduled_dttm timestamptz, queued_by_job_id int, last_heartbeat_at timestamptz, pid int,
  executor varchar(1000), executor_config bytea, updated_at timestamptz, rendered_map_index varchar(250),
  external_executor_id varchar(250), trigger_id int, trigger_timeout timestamptz, next_method varchar(1000),
  next_kwargs jsonb, task_display_name varchar(2000), dag_version_id uuid, context_carrier jsonb,
  span_status varchar(250))"""
ROWS = """INSERT INTO task_instance (task_id, dag_id, run_id, start_date, end_date, duration, state, try_number,
  max_tries, hostname, unixname, pool, pool_slots, queue, priority_weight, operator, queued_dttm, scheduled_dttm,
  queued_by_job_id, last_heartbeat_at, pid, executor, executor_config, updated_at, next_kwargs, task_display_name,
  dag_version_id, context_carrier, span_status)
SELECT 'task_' || g, 'dag_' || (g / 20), 'scheduled__2026-12-06T00:00:00+00:00', now(), now(), 1.5, 'queued', 1, 3,
  'worker-1.example', 'airflow', 'default_pool', 1, 'default', 1, 'PythonOperator', now(), now(), 7, now(), 1234,
  'LocalExecutor', decode(repeat('80049505', 60), 'hex'), now(), '{"a": [1, 2, 3]}', 'task ' || g,
  gen_random_uuid(), '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}', 'unset'
FROM generate_series(1, %s) g"""
UPDATE = ("\\set g random(1, {rows})\n"
          "UPDATE task_instance SET state = CASE WHEN state = 'queued' THEN 'running' ELSE 'queued' END, "
          "updated_at = now() WHERE task_id = 'task_' || :g;\n")


def _reader(url: str, binary: bool) -> subprocess.Popen[bytes]:
    u = make_url(url)
    options = ["-o", "proto_version=1", "-o", f"publication_names={PUBLICATION}"]
    if binary:
        options += ["-o", "binary=true"]
    env = dict(os.environ)
    if u.password:
        env["PGPASSWORD"] = str(u.password)
    return subprocess.Popen(["pg_recvlogical", "-h", u.host or "127.0.0.1", "-p", str(u.port or 5432), "-U",
                             u.username or "postgres", "-d", u.database or "", "--slot", SLOT, "--start", "-f",
                             "/dev/null", "-F", "1", *options], env=env)


def _cpu(pid: int, what: str) -> float:
    value = cpu_seconds(pid)
    if value is None:
        raise RuntimeError(f"the {what} (pid {pid}) is gone")
    return value


def _until_confirmed(dsn: str, reader: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Until the reader has confirmed everything written so far (bounded; the reader must stay alive)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        target = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
        while not conn.execute("SELECT confirmed_flush_lsn >= %s FROM pg_replication_slots WHERE slot_name = %s",
                               (target, SLOT)).fetchone()[0]:  # type: ignore[index]
            if reader.poll() is not None:
                raise RuntimeError(f"pg_recvlogical exited ({reader.returncode}) before it caught up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pg_recvlogical did not catch up within {timeout:g} s")
            time.sleep(0.1)


def run(url: str, rounds: int, seconds: int, rows: int) -> dict[str, Any]:
    dsn = _libpq(url)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE)
        conn.execute(ROWS, (rows,))
        conn.execute("CREATE INDEX ON task_instance (task_id)")
        conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE task_instance")
        conn.execute(f"SELECT pg_create_logical_replication_slot('{SLOT}', 'pgoutput')")
        conn.execute("VACUUM ANALYZE task_instance")
    script = Path(tempfile.mkdtemp(prefix="pbbench-tuples-")) / "update.sql"
    script.write_text(UPDATE.format(rows=rows))
    run_pgbench(url, str(script), 8, 2)  # warm-up
    out: dict[str, list[dict[str, float]]] = {"text": [], "binary": []}
    try:
        for round_no in range(rounds):
            for mode in (("text", "binary") if round_no % 2 == 0 else ("binary", "text")):
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(f"SELECT pg_replication_slot_advance('{SLOT}', pg_current_wal_lsn())")
                reader = _reader(url, mode == "binary")
                try:
                    walsender = None
                    deadline = time.monotonic() + 20
                    while walsender is None and time.monotonic() < deadline:
                        with psycopg.connect(dsn, autocommit=True) as conn:
                            row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                               (SLOT,)).fetchone()
                        walsender = row[0] if row and row[0] else None
                        time.sleep(0.1)
                    if walsender is None:
                        raise RuntimeError("pg_recvlogical did not start streaming")
                    before = (_cpu(walsender, "walsender"), _cpu(reader.pid, "reader"))
                    tps = float(run_pgbench(url, str(script), 8, seconds)["tps"])
                    _until_confirmed(dsn, reader)
                    after = (_cpu(walsender, "walsender"), _cpu(reader.pid, "reader"))
                finally:
                    reader.terminate()
                    reader.wait(10)
                changes = tps * seconds
                result = {"tps": round(tps, 1),
                          "walsender_cpu_s_per_1000": round(1000 * (after[0] - before[0]) / changes, 4),
                          "reader_cpu_s_per_1000": round(1000 * (after[1] - before[1]) / changes, 4)}
                out[mode].append(result)
                print(f"round {round_no + 1} {mode:6s} {result}", flush=True)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"SELECT pg_drop_replication_slot('{SLOT}')")
    return {mode: {"runs": runs, "median": {k: statistics.median(r[k] for r in runs) for k in runs[0]}}
            for mode, runs in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wal_tuples", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s on 5,000 rows (CI smoke)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.rows = 1, 2, 5_000
    with scratch_database("pollbridge_bench_wal_tuples") as url:
        results = run(url, args.rounds, args.seconds, args.rows)
    for mode, r in results.items():
        print(f"{mode:6s} median: {r['median']}")
    write_json(args.json_path, {"bench": "wal_tuples", "machine": machine(), "args": vars(args), **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
