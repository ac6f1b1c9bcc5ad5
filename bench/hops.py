"""What one hop between two processes costs on this machine, idle and busy: the floor under a light-load dispatch.

    python -m bench.hops [--rounds 40] [--idle 0.3] [--json F] [--quick]

``--quick`` (CI): 8 rounds.

At 2 completions/s every stage of the event path starts from a sleeping process: the completer's commit wakes
the relay's listening connection (a NOTIFY), the relay's claim wakes its database backend, the publish wakes
Redis and then the scheduler blocked in its read, the scheduler's statement wakes its backend. This measures
each kind of hop alone, with no pollbridge code in it, in two ways: after ``--idle`` seconds of sleep (as at
2 completions/s), and back to back (as under load):

* ``pg_round_trip``: ``SELECT 1`` on an open connection (the client waits, the backend wakes);
* ``pg_notify``: ``NOTIFY`` on one connection until another process's ``LISTEN``ing connection has it;
* ``redis_blocked_read``: ``XADD`` until another process blocked in ``XREAD BLOCK`` on the stream has it.

Times are ``time.perf_counter`` of one host (the two processes share its clock), ms, median and max.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import uuid
from typing import Any

import psycopg
import redis

from bench.common import PG_ADMIN_URL, REDIS_URL, machine, write_json


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(statistics.median(values), 3), "max_ms": round(max(values), 3)}


def _listener(channel: str, ready: Any, out: Any, rounds: int) -> None:
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f"LISTEN {channel}")
        ready.set()
        got = 0
        while got < rounds:  # psycopg's timeout bounds one call, not one notification: a call per notification
            for note in conn.notifies(timeout=30, stop_after=1):
                out.put((time.perf_counter(), float(note.payload)))
                got += 1


def _reader(stream: str, ready: Any, out: Any, rounds: int) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    last = "0"
    ready.set()
    got = 0
    while got < rounds:
        reply = client.xread({stream: last}, block=30_000)
        now = time.perf_counter()
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                out.put((now, float(fields[b"t"])))
                got += 1


def _cross(target: Any, name: str, send: Any, rounds: int, pause: float) -> list[float]:
    """Hops to another process: ``send(t)`` at each round, the receiver puts (received at, sent at)."""
    ctx = multiprocessing.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=target, args=(name, ready, out, rounds), daemon=True)
    proc.start()
    try:
        if not ready.wait(30):
            raise RuntimeError(f"{target.__name__} did not start")
        time.sleep(0.5)
        values = []
        for _ in range(rounds):
            time.sleep(pause)
            send(time.perf_counter())
            received, sent = out.get(timeout=30)
            values.append((received - sent) * 1000)
        return values
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def measure(rounds: int, idle: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        channel = f"pbhops_{uuid.uuid4().hex[:8]}"
        client = redis.Redis.from_url(REDIS_URL)
        streams: list[str] = []
        try:
            for label, pause in (("idle", idle), ("busy", 0.0)):
                stream = f"pbhops:{uuid.uuid4().hex[:8]}"  # a fresh one per phase: its reader starts at 0
                streams.append(stream)
                rt = []
                for _ in range(rounds):
                    time.sleep(pause)
                    t0 = time.perf_counter()
                    conn.execute("SELECT 1").fetchone()
                    rt.append((time.perf_counter() - t0) * 1000)
                notify = _cross(_listener, channel, lambda t: conn.execute(f"NOTIFY {channel}, '{t!r}'"),
                                rounds, pause or 0.005)
                blocked = _cross(_reader, stream, lambda t, key=stream: client.xadd(key, {"t": repr(t)}), rounds,
                                 pause or 0.005)
                results[label] = {"pg_round_trip": _summary(rt), "pg_notify": _summary(notify),
                                  "redis_blocked_read": _summary(blocked)}
        finally:
            if streams:
                client.delete(*streams)
            client.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hops", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--idle", type=float, default=0.3, help="seconds asleep before each idle hop")
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 8
    results = measure(args.rounds, args.idle)
    for label, hops in results.items():
        pause = f"after {args.idle:g} s asleep" if label == "idle" else "back to back (5 ms apart across processes)"
        print(f"{label} ({pause}):")
        for name, s in hops.items():
            print(f"  {name:<20} p50 {s['p50_ms']:.3f} ms   max {s['max_ms']:.3f} ms")
    write_json(args.json, {"machine": machine(), "rounds": args.rounds, "idle_s": args.idle, "hops": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
