"""Helpers shared by the benchmark scripts: a scratch PostgreSQL database, percentiles, output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bridge.reference.oracle import percentile

PG_ADMIN_URL = os.environ.get("POLLBRIDGE_BENCH_PG_URL", "postgresql://root@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("POLLBRIDGE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


#: The simulated workers' way to their work: the queued tasks in id order. A worker fleet has a queue of
#: its own; without this index each completion scanned every queued task of the demo table (about 1 ms and
#: half of PostgreSQL's statement time at 500 completions/s, measured with pg_stat_statements), load that
#: belongs to no scheduler and slowed every path. The minimal pipeline's table has had the same index from
#: the start. It costs the dispatch of every path one more index entry.
WORKER_QUEUE_INDEX = "CREATE INDEX IF NOT EXISTS bench_tasks_queued ON tasks (id) WHERE status = 'queued'"


def db_url(name: str) -> str:
    base, _, _ = PG_ADMIN_URL.rpartition("/")
    return f"{base}/{name}"


@contextmanager
def scratch_database(name: str, keep: bool = False) -> Iterator[str]:
    """A fresh PostgreSQL database for one benchmark run, dropped afterwards unless ``keep``."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield db_url(name)
    finally:
        if not keep:
            with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def latency_summary(values_ms: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "n": len(values_ms),
        "p50_ms": _r(percentile(values_ms, 50)),
        "p90_ms": _r(percentile(values_ms, 90)),
        "p99_ms": _r(percentile(values_ms, 99)),
        "max_ms": _r(max(values_ms) if values_ms else None),
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def command(*args: str, timeout: float = 5.0) -> str:
    """What a command prints (trailing white space removed), or ``?`` when it cannot be run."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "postgresql": command("psql", "--version").strip(),
        "redis": command("redis-server", "--version").strip().split(" sha=")[0],
        "kernel": platform.release(),
    }


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def delete_namespace(namespace: str) -> int:
    """Remove every Redis key a benchmark created under ``namespace``; how many there were."""
    import redis

    from bridge.bus import redis_streams

    client = redis.Redis.from_url(REDIS_URL)
    try:
        return redis_streams.delete_namespace(client, namespace)
    finally:
        client.close()
