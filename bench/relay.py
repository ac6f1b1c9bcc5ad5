"""Relay benchmark: throughput into Redis, and commit → event readable on the bus latency.

    python -m bench.relay [--rows 100000] [--rate 500] [--seconds 20] [--wake adaptive] [--mode trigger|wal]
                          [--quick] [--json FILE]

1. *Throughput*: ``--rows`` tasks are inserted in one statement (the capture trigger writes one outbox
   row each), then the relay drains the outbox into Redis Streams; rows/s over the drain. With ``--mode wal``
   (capture from the write-ahead log) they are inserted in transactions of 1,000 and the capture streams
   them from the slot into the outbox and Redis (``WalCapture.catch_up``); changes/s from the first read.
2. *Latency*: with the relay running as its own process (``pollbridge relay run``), a writer commits
   single-row status updates at ``--rate`` per second; a consumer group reads the streams. For each
   update: the time its event was read minus the time its commit returned (same host, same clock).

Uses a scratch database on the local PostgreSQL and a namespace of its own on the local Redis.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa

from bench.common import REDIS_URL, delete_namespace, latency_summary, machine, scratch_database, write_json
from bridge.app import install
from bridge.bus import open_bus
from bridge.capture.relay import Relay
from bridge.capture.wal import WalCapture
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import CaptureSettings, RelaySettings
from bridge.db.engine import create_engine
from bridge.tasktable.tables import reflect_tables


def _seed(engine: sa.Engine, rows: int, instance_prefix: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) "
                             "SELECT :p || (g / 10), 'bench' FROM generate_series(0, :n - 1) g WHERE g % 10 = 0"),
                     {"p": instance_prefix, "n": rows})
        conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key, depends_on) "
                             "SELECT :p || (g / 10), 't' || g, '[]' FROM generate_series(0, :n - 1) g"),
                     {"p": instance_prefix, "n": rows})


def throughput(url: str, rows: int, batch: int, namespace: str, bus_url: str = REDIS_URL) -> dict[str, Any]:
    engine = create_engine(url)
    bus = open_bus(bus_url, engine=engine, partitions=8, namespace=namespace)
    try:
        _seed(engine, rows, "tp-")
        relay = Relay(engine, bus, RelaySettings(batch_size=batch), statuses=TaskTableMapping().statuses)
        started = time.perf_counter()
        published = 0
        while True:
            n = relay.publish_batch()
            if not n:
                break
            published += n
        seconds = time.perf_counter() - started
        return {"rows": published, "batch_size": batch, "seconds": round(seconds, 3),
                "rows_per_s": round(published / seconds, 1)}
    finally:
        bus.close()
        engine.dispose()


def wal_throughput(url: str, rows: int, namespace: str, bus_url: str = REDIS_URL) -> dict[str, Any]:
    engine = create_engine(url)
    bus = open_bus(bus_url, engine=engine, partitions=8, namespace=namespace)
    try:
        for start in range(0, rows, 1000):
            with engine.begin() as conn:
                conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES (:i, 'bench')"),
                             {"i": f"tp-{start}"})
                conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key, depends_on) "
                                     "SELECT :i, 't' || g, '[]' FROM generate_series(0, :n - 1) g"),
                             {"i": f"tp-{start}", "n": min(1000, rows - start)})
        capture = WalCapture(engine, reflect_tables(engine, TaskTableMapping()), bus)
        started = time.perf_counter()
        published = capture.catch_up(timeout=600)
        seconds = time.perf_counter() - started
        return {"rows": published, "mode": "wal", "seconds": round(seconds, 3),
                "rows_per_s": round(published / seconds, 1)}
    finally:
        bus.close()
        engine.dispose()


def latency(url: str, rate: float, seconds: float, wake: str, namespace: str, mode: str = "trigger",
            bus_url: str = REDIS_URL) -> dict[str, Any]:
    engine = create_engine(url)
    n_updates = int(rate * seconds)
    _seed(engine, n_updates, "lat-")
    with engine.connect() as conn:
        ids = list(conn.execute(sa.text("SELECT id FROM tasks WHERE instance_id LIKE 'lat-%' ORDER BY id")).scalars())
    # Drain the seed rows first so the measurement sees only the updates.
    drain_bus = open_bus(bus_url, engine=engine, partitions=8, namespace=namespace)
    if mode == "wal":
        WalCapture(engine, reflect_tables(engine, TaskTableMapping()), drain_bus).catch_up(timeout=600)
    else:
        relay = Relay(engine, drain_bus, RelaySettings(batch_size=2000), statuses=TaskTableMapping().statuses)
        while relay.publish_batch():
            pass
        relay.leadership.release()
    consumer_bus = open_bus(bus_url, engine=engine, partitions=8, namespace=namespace)
    consumer_bus.ensure_group("bench")
    # Skip what is already on the streams (the seed inserts): read them once and ack.
    while True:
        old = consumer_bus.read("bench", "c", list(range(8)), 5000, 0.05)
        if not old:
            break
        consumer_bus.ack("bench", old)

    workdir = tempfile.mkdtemp()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
           "POLLBRIDGE_DATABASE_URL": url, "POLLBRIDGE_BUS_URL": bus_url}
    with open(os.path.join(workdir, "pollbridge.toml"), "w") as f:
        f.write(f'[bus]\nnamespace = "{namespace}"\n[capture]\nwake = "{wake}"\nmode = "{mode}"\n')
    exe = shutil.which("pollbridge") or sys.exit("pollbridge is not installed")
    proc = subprocess.Popen([exe, "relay", "run"], cwd=workdir, env=env, stderr=subprocess.DEVNULL)
    committed: dict[str, float] = {}
    received: dict[str, float] = {}
    done = threading.Event()

    def consume() -> None:
        while not done.is_set() or len(received) < len(committed):
            batch = consumer_bus.read("bench", "c", list(range(8)), 1000, 0.2)
            now = time.perf_counter()
            for d in batch:
                if d.event is not None and d.event.data.get("change") == "status":
                    received.setdefault(d.event.subject, now)
            if batch:
                consumer_bus.ack("bench", batch)
            if done.is_set() and not batch:
                break

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    time.sleep(1.0 if mode == "trigger" else 3.0)  # the relay starts and takes its partition (and its slot)
    interval = 1.0 / rate
    next_at = time.perf_counter()
    with engine.connect() as conn:
        for task_id in ids:
            next_at += interval
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with conn.begin():
                # 'running', not 'queued': a dispatch is a quiet change (no NOTIFY, held by the WAL capture), whose
                # event waits for the next change that can make a task ready; the latency of a change that wakes
                # the relay is the one to measure.
                conn.execute(sa.text("UPDATE tasks SET status = 'running' WHERE id = :id"), {"id": task_id})
            committed[str(task_id)] = time.perf_counter()
    deadline = time.monotonic() + 30
    while len(received) < len(committed) and time.monotonic() < deadline:
        time.sleep(0.05)
    done.set()
    reader.join(10)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    lat = [(received[k] - committed[k]) * 1000 for k in committed if k in received]
    consumer_bus.close()
    drain_bus.close()
    engine.dispose()
    return {"rate_per_s": rate, "updates": len(committed), "received": len(lat), "wake": wake, "mode": mode,
            **latency_summary(lat)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--rate", type=float, default=500)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--wake", default="adaptive", choices=["poll", "notify", "adaptive"])
    parser.add_argument("--mode", default="trigger", choices=["trigger", "wal"],
                        help="capture: row triggers (default) or the write-ahead log (wal_level = logical)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI (< 1 minute)")
    parser.add_argument("--json", dest="json_path", help="also write the results to this file")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.seconds = 5000, 3
    namespace = f"pbbench{uuid.uuid4().hex[:6]}"
    results: dict[str, Any] = {"machine": machine(), "command": " ".join(["python -m bench.relay", *sys.argv[1:]])}
    try:
        with scratch_database("pollbridge_bench_relay") as url:
            engine = create_engine(url)
            install.init(engine, demo_schema=True, mapping=TaskTableMapping(),
                         capture=CaptureSettings(wake=args.wake, mode=args.mode))
            try:
                results["throughput"] = throughput(url, args.rows, args.batch, namespace) if args.mode == "trigger" \
                    else wal_throughput(url, args.rows, namespace)
                results["latency"] = latency(url, args.rate, args.seconds, args.wake, namespace, args.mode)
            finally:
                install.uninstall(engine, TaskTableMapping())  # the slot goes before the database does
                engine.dispose()
    finally:
        delete_namespace(namespace)
    tp, lat = results["throughput"], results["latency"]
    print(f"relay throughput ({args.mode}): {tp['rows']} rows in {tp['seconds']} s = "
          f"{tp['rows_per_s']} rows/s")
    print(f"commit -> readable on the bus at {lat['rate_per_s']}/s ({args.mode}, {lat['wake']}): "
          f"p50 {lat['p50_ms']} ms, "
          f"p90 {lat['p90_ms']} ms, p99 {lat['p99_ms']} ms, max {lat['max_ms']} ms "
          f"({lat['received']}/{lat['updates']} received)")
    write_json(args.json_path, results)


if __name__ == "__main__":
    main()
