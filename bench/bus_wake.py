"""The embedded bus on PostgreSQL across processes: publish → an idle reader of another process has the entry.

    python -m bench.bus_wake [--rounds 3] [--events 40] [--rate 2] [--idle-seconds 10] [--json F] [--quick]

What ``[bus] listen`` changes (on: a publish NOTIFYs at its commit and a waiting reader's process LISTENs; off:
an idle reader looks every 0.1 s at most). One scratch database; per round, ``listen = on`` then ``off`` (the
order alternating from round to round), each with a reader process of its own (``python -m bench.bus_wake
reader``: one consumer reading with a 5 s block and acknowledging, as the scheduler does) and this process
publishing ``--events`` single-entry batches ``1 / --rate`` seconds apart (light load: the reader idles between
entries, which is when its idle polling shows).

Per configuration:

* **latency**: the publish's return (its commit) → the reader holding the entry, both ``time.time()`` on this
  host, p50/p90/p99/max over every entry of every round;
* **idle transactions per second**: the scratch database's ``pg_stat_database`` ``xact_commit +
  xact_rollback`` delta over ``--idle-seconds`` with the reader running and nothing published, minus the
  bench's own reads of the view (1 per sample); PostgreSQL's statistics are flushed by each backend about
  once a second, so the window is long and read 1.5 s after it ends.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

import psycopg

from bench.common import latency_summary, machine, scratch_database, write_json
from bridge.app import install
from bridge.bus.embedded import EmbeddedBus
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent, new_event_id, new_trace_id
from bridge.db.engine import create_engine

GROUP = "bench"


def _event() -> CloudEvent:
    return CloudEvent(id=new_event_id(), type=TASK_STATUS_CHANGED, subject="i-1", partitionkey="i-1",
                      time=datetime.now(UTC), traceid=new_trace_id(), data={"instance_id": "i-1"})


def reader(url: str, listen: bool) -> None:
    """Read with a 5 s block and acknowledge; one line per entry: ``<event id> <time.time()>``."""
    engine = create_engine(f"{url}?application_name=bench_reader")
    bus = EmbeddedBus(engine, partitions=2, listen=listen)
    print("ready", flush=True)
    while True:
        got = bus.read(GROUP, "c1", [0, 1], 100, block=5.0)
        now = time.time()
        for d in got:
            print(d.event.id if d.event else "?", f"{now:.6f}", flush=True)
        if got:
            bus.ack(GROUP, got)


def _transactions(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])


def _run(url: str, listen: bool, events: int, rate: float, idle_seconds: float) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.bus_wake", "reader", "--url", url,
                             "--listen", "on" if listen else "off"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the reader's first wait (and, with listen, its LISTEN) is under way
        before = _transactions(url)
        time.sleep(idle_seconds)
        time.sleep(1.5)  # statistics are flushed about once a second per backend
        idle = (_transactions(url) - before - 1) / (idle_seconds + 1.5)
        writer = EmbeddedBus(create_engine(f"{url}?application_name=bench_writer"), partitions=2, listen=listen)
        sent: dict[str, float] = {}
        latencies: list[float] = []
        for _ in range(events):
            event = _event()
            writer.publish([event])
            sent[event.id] = time.time()
            line = proc.stdout.readline().split()
            latencies.append((float(line[1]) - sent[line[0]]) * 1000.0)
            time.sleep(1.0 / rate)
        return {"latencies_ms": latencies, "idle_transactions_per_s": idle}
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bus_wake", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    r = sub.add_parser("reader")
    r.add_argument("--url", required=True)
    r.add_argument("--listen", choices=["on", "off"], required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=40)
    parser.add_argument("--rate", type=float, default=2.0, help="entries published per second")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="1 round, 10 events, 3 idle seconds (CI smoke)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    if args.command == "reader":
        reader(args.url, args.listen == "on")
        return 0
    if args.quick:
        args.rounds, args.events, args.idle_seconds = 1, 10, 3.0
    results: dict[str, dict[str, list[float]]] = {"on": {"lat": [], "idle": []}, "off": {"lat": [], "idle": []}}
    with scratch_database("pollbridge_bench_bus_wake") as url:
        engine = create_engine(url)
        install.init(engine)
        EmbeddedBus(engine, partitions=2).ensure_group(GROUP)
        engine.dispose()
        for round_no in range(args.rounds):
            order = ("on", "off") if round_no % 2 == 0 else ("off", "on")
            for config in order:
                run = _run(url, config == "on", args.events, args.rate, args.idle_seconds)
                results[config]["lat"] += run["latencies_ms"]
                results[config]["idle"].append(run["idle_transactions_per_s"])
                print(f"round {round_no + 1} listen={config}: p50 "
                      f"{latency_summary(run['latencies_ms'])['p50_ms']} ms, idle "
                      f"{run['idle_transactions_per_s']:.1f} transactions/s", flush=True)
    summary = {config: {"latency": latency_summary(v["lat"]),
                        "idle_transactions_per_s": [round(x, 1) for x in v["idle"]]}
               for config, v in results.items()}
    payload = {"bench": "bus_wake", "machine": machine(), "args": vars(args), "summary": summary}
    print(json.dumps(summary, indent=2))
    write_json(args.json_path, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
